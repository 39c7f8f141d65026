"""`prove-local bench`: the decoding modes side by side on benchmark prompts, plus the ProVe
paper's analyses (slot match rates, matched tokens along a response, detector AUCs, θ sweep,
pass-cost curve). This module is the command line; the work is in

    data.py      prompts from GSM8K / MATH-500 / HumanEval / IFEval / BBH / MMLU-Pro / GPQA files
    stats.py     the statistics, pure functions over cycle events
    runner.py    models, pass-cost curves, interleaved runs
    results.py   results.json and generations.jsonl (and reading them back)
    markdown.py  summary.md;  plots.py  the PNG plots (matplotlib, the `bench` extra, imported there
                 only when plotting)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from .. import sampling as sampling_defaults
from ..chat import Conversation, clean_text
from ..engine import Engine
from ..errors import MissingExtra, UsageError
from ..llama import Adapter, Model, gpu_offload_supported, kv_options
from ..loading import (CTX, EMBEDDED_PROPOSER, EMBEDDED_VERIFIER, GPU_LAYERS, KV_METAVAR, KV_TYPE, MAX_NEW, PARALLEL, TAU, THETA,
                       THREADS, TOKEN_ID, Loaded, add_flash_attn_arg, add_hugepages_arg, add_rpc_args, draft_width_arg, int_in, lookup_arg, placement_note,
                       rpc_devices, width_arg)
from ..modes import MODES
from ..pool import EnginePool
from . import runner
from .data import DataError, load_prompts
from .markdown import batched_table, modes_table
from .results import load_outputs, write_outputs

DEFAULT_MODES = "ar,lossless,prove,mars"


def _width_list(option: str):
    """An argparse type for --block / --draft-k lists: checked at parse time (one argparse line), kept as text."""
    def check(text: str) -> str:
        try:
            _widths(text, option)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{option}: ")) from None
        return text
    check.__name__ = "width list"
    return check


def _widths(text: str, option: str) -> list:
    """--block / --draft-k / --lookup: a comma-separated list of 'auto' and widths (loading's ranges)."""
    parse = {"--draft-k": draft_width_arg, "--lookup": lookup_arg}.get(option, width_arg)
    out = []
    for part in str(text).split(","):
        if part.strip():
            try:
                out.append(parse(part.strip()))
            except argparse.ArgumentTypeError as e:
                raise UsageError(f"{option}: {e}") from None
    if not out:
        raise UsageError(f"{option} needs a value")
    return list(dict.fromkeys(out))


def _floats(text: str) -> list[float]:
    """--theta: comma-separated finite numbers >= 0."""
    try:
        return [THETA(x.strip()) for x in text.split(",") if x.strip()]
    except Exception as e:   # argparse.ArgumentTypeError
        raise UsageError(f"--theta {text!r}: {e}") from None


def canonical_command(args) -> str:
    """The command line that reproduces this run, every option spelled out."""
    parts = ["prove-local", "bench"]
    for opt in ("proposer", "adapter", "verifier", "draft", "modes", "limit", "max_new", "theta", "tau", "block", "draft_k", "lookup",
                "temp", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed", "sampler", "samples",
                "mask_token", "threads", "parallel", "ctx", "n_gpu_layers", "kv_type", "flash_attn", "hugepages", "warmup", "pass_cost_reps", "pass_cost_max",
                "llama_spec",
                "bins", "system", "out"):
        v = getattr(args, opt, None)
        if v is not None:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if getattr(args, "llama_spec", None):
        parts += ["--llama-spec-args", args.llama_spec_args]
    for d in args.data:
        parts += ["--data", str(d)]
    for flag in ("raw", "no_pass_cost", "no_plots", "oracle"):
        if getattr(args, flag, False):
            parts.append("--" + flag.replace("_", "-"))
    return " ".join(shlex.quote(p) for p in parts)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the decoding modes and reproduce the paper's analyses",
                       description="Run the decoding modes interleaved per prompt on benchmark prompts; write "
                                   "DIR/results.json, DIR/summary.md, DIR/generations.jsonl and PNG plots.")
    p.add_argument("--proposer", help=f"proposer GGUF (default: the embedded {EMBEDDED_PROPOSER.name})")
    p.add_argument("--adapter", help="a gated MARS adapter for a stock --proposer (LoRA GGUF; on for proposal passes only)")
    p.add_argument("--verifier", help="verifier GGUF for prove (default with the embedded proposer: the embedded verifier)")
    p.add_argument("--draft", help="draft GGUF for spec (spec is added to the default modes when given)")
    p.add_argument("--modes", help=f"comma-separated runs among {','.join(MODES)} (default {DEFAULT_MODES}[,spec])")
    p.add_argument("--data", action="append", metavar="PATH",
                   help="prompt file or folder (GSM8K/MATH-500/HumanEval/IFEval jsonl, BBH json, MMLU-Pro/GPQA); repeatable")
    p.add_argument("--limit", type=int_in(1), help="at most N prompts per --data path (round-robin over a folder's files)")
    p.add_argument("--max-new", type=MAX_NEW, default=256, help="max new tokens per answer (default 256)")
    p.add_argument("--theta", default="0.01,0.05,0.1", help="ProVe θ values to sweep (default 0.01,0.05,0.1)")
    p.add_argument("--tau", type=TAU, default=0.95, help="MARS rule τ (default 0.95)")
    p.add_argument("--block", default="auto", type=_width_list("--block"),
                   help="block length(s): 'auto' (default: the planner's choice per cycle) or N; a comma-separated "
                        "list (e.g. auto,2,4,16) makes one run per value, side by side")
    p.add_argument("--draft-k", default="auto", type=_width_list("--draft-k"),
                   help="drafts per cycle for spec: 'auto' (default) or N; a comma-separated list makes one run per value")
    p.add_argument("--lookup", default="auto", type=_width_list("--lookup"),
                   help="lookup drafts (lossless, lookup): 'auto' (default: the planner's choice), 0 (off) or K; a "
                        "comma-separated list (e.g. auto,0) makes one run per value, named mode@Lauto, mode@L0")
    p.add_argument("--llama-spec", metavar="BIN",
                   help="also run llama.cpp's llama-speculative-simple at BIN on every prompt (proposer as target, "
                        "--draft as draft, greedy) as an external baseline; skipped with a note when BIN is absent")
    p.add_argument("--llama-spec-args", default="--spec-type draft-simple --spec-draft-n-max 4",
                   help="its speculative options (default: '--spec-type draft-simple --spec-draft-n-max 4')")
    p.add_argument("--oracle", action="store_true",
                   help="also log a full proposal at every position of ar's answers and report lossless's oracle "
                        "bound and fixed-width projections (one extra pass per generated token)")
    p.add_argument("--temp", "--temperature", dest="temp", default="0",
                   help="temperatures to run every mode at, comma-separated (default 0: greedy); runs at T > 0 "
                        "are named mode@T<t>")
    d = sampling_defaults
    p.add_argument("--top-k", type=int, default=d.TOP_K, help=f"sampling: top-k (default {d.TOP_K}; 0: off)")
    p.add_argument("--top-p", type=float, default=d.TOP_P, help=f"sampling: top-p (default {d.TOP_P})")
    p.add_argument("--min-p", type=float, default=d.MIN_P, help=f"sampling: min-p (default {d.MIN_P})")
    p.add_argument("--repeat-penalty", type=float, default=d.REPEAT_PENALTY,
                   help=f"sampling: repeat penalty (default {d.REPEAT_PENALTY}: off)")
    p.add_argument("--repeat-last-n", type=int, default=d.REPEAT_LAST_N,
                   help=f"sampling: penalty window (default {d.REPEAT_LAST_N})")
    p.add_argument("--seed", type=int, default=0,
                   help="base seed; generation j of prompt i in the r-th run uses seed + 1e8 r + 1000 i + j (default 0)")
    p.add_argument("--sampler", choices=sampling_defaults.SAMPLERS, default=sampling_defaults.SAMPLER,
                   help="sampling: 'coupled' (default: noise keyed by position) or 'rejection' (exact speculative sampling)")
    p.add_argument("--samples", type=int, default=4,
                   help="generations per prompt at T > 0 (repeated seeds), for the distribution check (default 4)")
    p.add_argument("--mask-token", type=TOKEN_ID, help="placeholder token id (overrides the GGUF's mask token)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--raw", action="store_true", help="plain prompts, no chat template")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--threads", type=THREADS,
                   help="CPU threads (default: for small models 1 or all cores, whichever calibration measures faster; else all cores)")
    p.add_argument("--ctx", type=CTX, default=4096, help="context size (default 4096; per request with --parallel)")
    p.add_argument("--parallel", type=PARALLEL, default=1,
                   help="requests decoded at once, batched into one llama_decode per step as `serve --parallel N` "
                        "does: every run generates the prompts N at a time, and the report adds each run's "
                        "throughput over its groups (default 1: one request at a time)")
    p.add_argument("--n-gpu-layers", type=GPU_LAYERS, help="layers to offload (default: all when llama.cpp has a GPU backend)")
    add_flash_attn_arg(p)
    add_hugepages_arg(p)
    add_rpc_args(p)     # --rpc, --tensor-split: the proposer on `prove-local rpc-server`s
    p.add_argument("--kv-type", type=KV_TYPE, metavar=KV_METAVAR,
                   help="KV cache type, or K/V apart (default: as run: f32 for an F32 proposer, so the exact modes can match ar exactly; on a GPU f16; on a CPU q8_0/f16, with flash attention on)")
    p.add_argument("--warmup", type=int_in(0), default=16, help="tokens per run generated before measuring (default 16; 0: none)")
    p.add_argument("--pass-cost-reps", type=int_in(1, 100), default=3,
                   help="repetitions per n of the pass-cost curve, each 2 settling + 2 timed passes (calibrate.measure; default 3)")
    p.add_argument("--pass-cost-max", type=int_in(1, 512), default=64, help="largest n of the pass-cost curve (default 64)")
    p.add_argument("--no-pass-cost", action="store_true", help="skip the pass-cost curve (no projected speedups)")
    p.add_argument("--bins", type=int_in(1, 100), default=5, help="position bins for matched tokens along a response (default 5)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild results.json, summary.md and the plots in --out from its results.json "
                        "and generations.jsonl (a report from an older version gains the new statistics)")
    p.set_defaults(func=cmd_bench)


def report_only(args) -> int:
    try:
        data, meta = load_outputs(Path(args.out))
    except ValueError as e:
        raise UsageError(str(e)) from None
    meta["rebuilt"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    res = write_outputs(data, Path(args.out), meta=meta, plots=not args.no_plots)
    print(modes_table(res))
    print(f"\nrebuilt {Path(args.out) / 'results.json'}, summary.md"
          + (f" and {len(res['plots'])} plots" if res["plots"] else ""), file=sys.stderr)
    return 0


def check_out(out: Path) -> None:
    """Refuse an output folder that cannot be written before anything runs (not after an hour of runs)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder (bench writes results.json, summary.md, "
                         "generations.jsonl and plots into a folder)")
    parent = out if out.exists() else next((q for q in out.absolute().parents if q.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot write into {parent}")


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtra("bench", "matplotlib")


def cmd_bench(args) -> int:
    if not args.no_plots:
        require_matplotlib()
    if args.report_only:
        return report_only(args)
    check_out(Path(args.out))
    modes, thetas, temps = _runs_asked(args)
    proposer_path, verifier_path = _model_paths(args, modes)
    prompts = _prompts(args)
    models, ngl = _load_models(args, modes, proposer_path, verifier_path)
    kv = args.kv_type or models["target"].default_kv_type
    context_options = dict(n_ctx=args.ctx, n_threads=args.threads, flash_attn=args.flash_attn, **kv_options(kv))
    adapter = Adapter(models["target"], args.adapter) if args.adapter else None
    with _engines(args, models, context_options, adapter) as (engine, batch):
        sampling = dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                        repeat_last_n=args.repeat_last_n, seed=args.seed, sampler=args.sampler)
        blocks, draft_ks = _widths(args.block, "--block"), _widths(args.draft_k, "--draft-k")
        lookups = _widths(args.lookup, "--lookup")
        runs = runner.make_runs(modes, max_new=args.max_new, block=blocks, thetas=thetas, tau=args.tau, draft_k=draft_ks,
                                temps=temps, sampling=sampling, samples=args.samples, lookup=lookups)
        for r in runs:
            engine.check(r.settings)
        kept, prompt_tokens = _prompt_tokens(args, prompts, models["target"], engine.n_ctx)
        external = _external_baseline(args, proposer_path, ngl)
        try:
            data = runner.run_bench(engine, models, kept, prompt_tokens, runs, context_options=context_options,
                                    warmup=args.warmup, pass_cost=not args.no_pass_cost,
                                    pass_cost_reps=args.pass_cost_reps, pass_cost_max=args.pass_cost_max,
                                    progress=not args.quiet, oracle=args.oracle and "ar" in modes, external=external,
                                    batch=batch)
        except KeyboardInterrupt:       # during the warm-up or the pass-cost curve: no prompt finished
            print("prove-local bench: interrupted before any prompt finished; nothing written", file=sys.stderr)
            return 130
        if data.interrupted and not data.prompts:
            print("prove-local bench: interrupted before any prompt finished; nothing written", file=sys.stderr)
            return 130
        # the target's threads as decoded (without --threads, calibration may have chosen them)
        threads = getattr(engine.contexts["target"], "n_threads", None) or args.threads
        meta = {
            "command": canonical_command(args),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": runner.machine_info(threads),
            "models": {role: {"path": str(m.path), "n_params": m.n_params, "n_vocab": m.n_vocab,
                              "mask_token": (engine.mask_token if role == "target" else m.mask_token),
                              "block_size": m.block_size, "hugepages": m.hugepages,
                              **({"adapter": str(args.adapter)} if role == "target" and args.adapter else {})}
                       for role, m in models.items()},
            "settings": {"modes": modes, "max_new": args.max_new, "block": ",".join(map(str, blocks)), "theta": thetas,
                         "tau": args.tau, "draft_k": ",".join(map(str, draft_ks)), "lookup": ",".join(map(str, lookups)),
                         "temperature": temps, **sampling,
                         "samples": args.samples, "ctx": args.ctx, "kv_type": kv, "threads": threads,
                         "parallel": args.parallel,
                         "n_gpu_layers": ngl, "warmup": args.warmup, "chat_template": not args.raw},
            "data": {"paths": [str(p) for p in args.data], "limit": args.limit},
            "bins": args.bins,
        }
        if data.interrupted:    # Ctrl-C: the prompts whose runs all finished, marked partial
            meta["partial"] = True
        res = write_outputs(data, Path(args.out), meta=meta, plots=not args.no_plots)
        print(modes_table(res))
        if batched_table(res):
            print(f"\nbatched, {args.parallel} requests at a time:\n" + batched_table(res))
        print(f"\nwrote {Path(args.out) / 'results.json'}, summary.md, generations.jsonl"
              + (f" and {len(res['plots'])} plots" if res["plots"] else "")
              + (f" (interrupted: partial, {len(data.prompts)} of {len(kept)} prompts)" if data.interrupted else ""),
              file=sys.stderr)
        return 130 if data.interrupted else 0


@contextlib.contextmanager
def _engines(args, models: dict, context_options: dict, adapter):
    """(engine, batch) for run_bench: one engine, or with --parallel N a batched pool's N engines
    (pool.py, all held for the whole run; batch = (engines, their Batcher)), closed at the end."""
    if args.parallel <= 1:
        engine = Engine.load(models["target"], models.get("verifier"), models.get("draft"), mask_token=args.mask_token,
                             adapter=adapter, **context_options)
        try:
            yield engine, None
        finally:
            engine.close()      # (the planner's memory written: what the whole run taught it)
        return
    loaded = Loaded(models["target"], models.get("verifier"), models.get("draft"), context_options,
                    args.mask_token, adapter)
    with EnginePool(loaded, args.parallel) as pool, contextlib.ExitStack() as held:
        engines = [held.enter_context(pool.engine())[1] for _ in range(args.parallel)]
        yield engines[0], (engines, pool.shared.batcher)


def _runs_asked(args) -> tuple[list[str], list[float], list[float]]:
    """The modes, θ values and temperatures to run, checked (one line naming the option)."""
    if not args.data:
        raise UsageError("--data PATH is required (a prompt file or folder; repeatable)")
    modes = [m.strip() for m in (args.modes or DEFAULT_MODES + (",spec" if args.draft else "")).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}")
    modes = list(dict.fromkeys(modes))
    thetas = _floats(args.theta)
    temps = sorted(set(sampling_defaults.temperature_of(t) for t in _floats(args.temp)))     # (a tiny T is greedy: sampling.py)
    if not temps or any(t < 0 for t in temps) or args.samples < 1:
        raise UsageError("--temp needs values >= 0 and --samples must be >= 1")
    if any(MODES[m].gate == "theta" for m in modes) and not thetas:
        raise UsageError("--theta needs at least one value")
    return modes, thetas, temps


def _model_paths(args, modes: list[str]) -> tuple[Path, Path | None]:
    """The proposer and verifier files (the embedded pair by default); the models the modes need."""
    partners = {MODES[m].partner: m for m in modes if MODES[m].partner}     # role -> a mode that needs it
    proposer_path = Path(args.proposer) if args.proposer else EMBEDDED_PROPOSER
    verifier_path = Path(args.verifier) if args.verifier else (
        EMBEDDED_VERIFIER if not args.proposer and "verifier" in partners else None)
    if "verifier" in partners and verifier_path is None:
        raise UsageError(f"mode {partners['verifier']} needs --verifier V.gguf (or leave it out of --modes)")
    if "draft" in partners and not args.draft:
        raise UsageError(f"mode {partners['draft']} needs --draft D.gguf (or leave it out of --modes)")
    return proposer_path, verifier_path


def _prompts(args) -> list:
    if args.max_new < 1 or (args.limit is not None and args.limit < 1):
        raise UsageError("--max-new and --limit must be >= 1")
    try:
        prompts = [p for path in args.data for p in load_prompts(path, args.limit)]
    except DataError as e:
        raise UsageError(str(e)) from None
    if not prompts:
        raise UsageError("no prompts")
    return prompts


def _load_models(args, modes: list[str], proposer_path: Path, verifier_path: Path | None) -> tuple[dict, int]:
    """{role: Model} for the runs (a file given twice is loaded once; the proposer on the --rpc
    servers if any), and the GPU layers of the local models."""
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (-1 if gpu_offload_supported() else 0)
    loaded: dict[Path, Model] = {}
    devices, split = rpc_devices(args)
    remote = dict(n_gpu_layers=-1 if args.n_gpu_layers is None else ngl, devices=devices, tensor_split=split)

    def model(path: Path, **where) -> Model:
        key = Path(path).resolve() if Path(path).exists() else Path(path)
        if key not in loaded:
            loaded[key] = Model(path, hugepages=args.hugepages, **(where or {"n_gpu_layers": ngl}))
        return loaded[key]

    models = {"target": model(proposer_path, **(remote if devices else {}))}
    if devices:
        placement_note(models["target"])
    partners = {MODES[m].partner for m in modes}
    if "verifier" in partners:
        models["verifier"] = model(verifier_path)
    if "draft" in partners:
        models["draft"] = model(Path(args.draft))
    return models, ngl


def _prompt_tokens(args, prompts: list, prop: Model, n_ctx: int) -> tuple[list, list[list[int]]]:
    """The prompts that fit the context (the others skipped with a note) and their tokens."""
    prompt_tokens, kept = [], []
    for p in prompts:
        text = clean_text(p.text)         # a lone surrogate (JSON "\\ud800") becomes U+FFFD
        system = clean_text(args.system) if args.system is not None else None
        toks = prop.tokenize(text, add_special=True) if args.raw else Conversation(prop, system=system).prompt_tokens(text)
        if len(toks) + 2 > n_ctx:
            print(f"prove-local bench: skipping {p.id}: {len(toks)} prompt tokens do not fit --ctx {n_ctx}", file=sys.stderr)
            continue
        prompt_tokens.append(toks)
        kept.append(p)
    if not kept:
        raise UsageError("no prompt fits the context")
    return kept, prompt_tokens


def _external_baseline(args, proposer_path: Path, ngl: int) -> "runner.LlamaSpec | None":
    """--llama-spec: llama-speculative-simple on the same prompts, or None (a missing binary: a note)."""
    if not args.llama_spec:
        return None
    if not args.draft:
        raise UsageError("--llama-spec needs --draft D.gguf (its draft model)")
    if not (Path(args.llama_spec).is_file() and os.access(args.llama_spec, os.X_OK)):
        print(f"prove-local bench: note: {args.llama_spec} is not an executable file; the llama-speculative-simple "
              "baseline is skipped", file=sys.stderr)
        return None
    return runner.LlamaSpec(str(Path(args.llama_spec).resolve()), str(proposer_path), str(args.draft), args.max_new,
                            threads=args.threads, ctx=args.ctx, n_gpu_layers=max(ngl, 0) if ngl >= 0 else 999,
                            extra=tuple(shlex.split(args.llama_spec_args)))
