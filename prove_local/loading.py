"""From a command line to loaded models and an engine: the embedded defaults, the options every front
end shares (`run`, `ui`, `bench`, `serve`), and one loader for all of them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

EMBEDDED = Path(__file__).parent / "models"
EMBEDDED_PROPOSER = EMBEDDED / "mars-gsm8k-proposer.gguf"
EMBEDDED_VERIFIER = EMBEDDED / "gsm8k-verifier.gguf"
KV_TYPES = ("f32", "f16", "q8_0", "q4_0")


def add_model_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """Which models, and how llama.cpp runs them."""
    if positional:
        p.add_argument("model", nargs="?", metavar="MODEL.gguf",
                       help=f"proposer GGUF (default: the embedded {EMBEDDED_PROPOSER.name})")
    p.add_argument("--verifier", metavar="V.gguf",
                   help="verifier GGUF for --mode prove (default with the embedded proposer: the embedded verifier)")
    p.add_argument("--draft", metavar="D.gguf", help="draft GGUF for --mode spec")
    p.add_argument("--mask-token", type=int, help="placeholder token id (overrides the GGUF's mask token)")
    p.add_argument("--threads", type=int,
                   help="CPU threads (default: for models under 30M parameters 1 or all cores, whichever `prove-local calibrate` measures faster; else all cores)")
    p.add_argument("--ctx", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--n-gpu-layers", type=int,
                   help="layers to offload (default: all when llama.cpp has a GPU backend, else 0)")
    p.add_argument("--flash-attn", action="store_true", help="use flash attention")
    p.add_argument("--kv-type", choices=KV_TYPES,
                   help="KV cache type (default: f32 for F32 models, so that batched and one-token "
                        "evaluation agree exactly; f16 otherwise)")


def width_arg(text: str):
    """--block / --draft-k: 'auto' (the planner's choice per cycle) or a positive integer."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or >= 1, got {value}")
    return value


def add_width_args(p: argparse.ArgumentParser) -> None:
    """--block and --draft-k, 'auto' by default (planner.py); every front end (run, ui, serve) shares them
    and passes them on as Settings(block=..., draft_k=...)."""
    p.add_argument("--block", type=width_arg, default="auto",
                   help="proposal block length: 'auto' (default: a planner picks it per cycle from measured pass "
                        "costs and acceptance, up to the GGUF's prove.block_size) or a fixed N")
    p.add_argument("--draft-k", type=width_arg, default="auto",
                   help="drafts per cycle for --mode spec: 'auto' (default: chosen per cycle) or a fixed N")


@dataclass
class Loaded:
    """Models loaded once (a model given twice is loaded once) and the options of their contexts."""
    proposer: object
    verifier: object | None = None
    draft: object | None = None
    context_options: dict = field(default_factory=dict)
    mask_token: int | None = None

    def engine(self):
        from .engine import Engine
        return Engine.load(self.proposer, self.verifier, self.draft, mask_token=self.mask_token,
                           **self.context_options)


def model_paths(args, *, want_verifier: bool | None = None) -> tuple[Path, Path | None, Path | None]:
    """Proposer, verifier and draft paths. Without a model: the embedded proposer, and the embedded
    verifier when `want_verifier` (None: when it is installed)."""
    model = getattr(args, "model", None) or getattr(args, "proposer", None)
    proposer = Path(model) if model else EMBEDDED_PROPOSER
    verifier = Path(args.verifier) if args.verifier else None
    if verifier is None and not model and (want_verifier or (want_verifier is None and EMBEDDED_VERIFIER.is_file())):
        verifier = EMBEDDED_VERIFIER
    draft = Path(args.draft) if args.draft else None
    return proposer, verifier, draft


def load_models(args, *, parallel: int = 1, want_verifier: bool | None = None,
                verifier_required: bool = False, draft_required: bool = False) -> Loaded:
    """Check that the models fit in memory (`parallel` contexts each), then load them."""
    from .llama import Model, gpu_offload_supported
    from .memory import check_fits

    proposer, verifier, draft = model_paths(args, want_verifier=want_verifier)
    if verifier_required and verifier is None:
        raise UsageError("--mode prove needs --verifier V.gguf")
    if draft_required and draft is None:
        raise UsageError("--mode spec needs --draft D.gguf")
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (-1 if gpu_offload_supported() else 0)
    check_fits([proposer, verifier, draft] * max(1, parallel), args.ctx, args.kv_type, ngl, flash_attn=args.flash_attn)
    loaded: dict[Path, Model] = {}

    def load(path: Path | None):
        if path is None:
            return None
        key = path.resolve() if path.exists() else path
        if key not in loaded:
            loaded[key] = Model(path, n_gpu_layers=ngl)
        return loaded[key]

    prop = load(proposer)
    ver, drf = load(verifier), load(draft)
    kv = args.kv_type or ("f32" if prop.meta("general.file_type") == "0" else "f16")
    opts = dict(n_ctx=args.ctx, n_threads=args.threads, flash_attn=args.flash_attn, type_k=kv, type_v=kv)
    return Loaded(prop, ver, drf, opts, getattr(args, "mask_token", None))


def load_engine(args):
    """The engine for one command line (`run`): (engine, proposer model)."""
    mode = getattr(args, "mode", None)
    loaded = load_models(args, want_verifier=mode == "prove", verifier_required=mode == "prove",
                         draft_required=mode == "spec")
    return loaded.engine(), loaded.proposer
