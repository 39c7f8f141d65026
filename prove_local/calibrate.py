"""Pass-cost calibration: t(n), the seconds of one `llama_decode` of n tokens, per model as configured.

One method for the planner, the bench and scripts/gpu_check.py. A pass of n tokens asks logits on
every row (as a proposal or verify pass does), after a context of `n_fill` tokens, in the steady
state: per width a few untimed passes, then timed ones (right after a pass of another width a pass
costs up to 2x more and settles over a few passes; decoding repeats the same shapes). The widths are
shuffled per repetition so that drift spreads over all of them, and the whole measurement stops at a
time budget (the target: well under a second for the embedded pair).

The planner needs the *shape* of the curve, t(n)/t(1), more than its scale (it rescales online from
the passes it sees), so a short, noisy measurement is enough; it is cached on disk keyed by the model
file (path, size, mtime), the context configuration (threads, GPU layers, flash attention, KV types)
and the llama.cpp build (llama_cpp.__version__ + llama_print_system_info), in
$PROVE_LOCAL_CACHE/calibration.json (default ~/.cache/prove-local/; XDG_CACHE_HOME is honoured).

Threads by measurement: for a small model whose thread count the user did not fix, both
1 thread and all cores are measured and the faster t(1)+t(4) wins; `recheck_threads` repeats that
choice on a live context when passes suddenly cost many times their t(n) (a loaded machine).

The `prove-local calibrate` command is in cli.py: it reads the embedded models and the KV cache types
of loading.py, a layer above this one (the engine imports this module; loading imports the engine).
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from statistics import median

from .files import write_atomic
from .llama import Context, default_threads

CACHE_VERSION = 2
DEFAULT_NS = tuple(range(1, 17)) + (20, 24, 32)


def cache_path() -> Path:
    root = os.environ.get("PROVE_LOCAL_CACHE")
    if root:
        return Path(root) / "calibration.json"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "prove-local" / "calibration.json"


def build_id() -> str:
    import llama_cpp as ll
    try:
        info = ll.llama_print_system_info().decode("utf-8", "replace").strip()
    except Exception:  # pragma: no cover - older bindings
        info = ""
    return f"llama-cpp-python {ll.__version__}; {info}"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def model_key(model) -> str:
    p = Path(model.path).resolve()
    st = p.stat()
    return f"{p}|{st.st_size}|{st.st_mtime_ns}"


def config_key(model, options: dict, threads: int) -> str:
    return json.dumps({"threads": threads, "n_gpu_layers": getattr(model, "n_gpu_layers", 0),
                       "flash_attn": bool(options.get("flash_attn", False)),
                       "type_k": options.get("type_k", "f16"), "type_v": options.get("type_v", "f16")},
                      sort_keys=True)


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if data.get("version") == CACHE_VERSION else {"version": CACHE_VERSION, "entries": {}}
    except (OSError, ValueError):
        return {"version": CACHE_VERSION, "entries": {}}


def _prune(data: dict) -> None:
    """Drop the entries of model files that are gone or changed (a deleted download, a test's temporary
    model): the key starts with the file's path, size and mtime, so such entries can never be read again."""
    def current(key: str) -> bool:
        path, size, mtime = (key.split("|") + ["", "", ""])[:3]
        try:
            st = Path(path).stat()
        except OSError:
            return False
        return f"{st.st_size}" == size and f"{st.st_mtime_ns}" == mtime
    data["entries"] = {k: v for k, v in data["entries"].items() if current(k)}


def _save_cache(path: Path, data: dict) -> None:
    _prune(data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:   # a read-only home must not stop decoding
        print(f"prove-local: note: could not write the calibration cache {path}: {e}", file=sys.stderr)


# ------------------------------------------------------------------------------- measuring
def measure_context(ctx, fill: list[int], *, ns=DEFAULT_NS, budget_s: float = 0.5, reps: int = 3,
                    settle: int = 2, timed: int = 2, seed: int = 0) -> tuple[dict, dict, dict]:
    """(fastest, median, mean) seconds inside llama_decode of one pass of n tokens (logits on every row) on
    `ctx` (passes are appended at ctx.n_past and cut back; the context is returned as it was). The
    first repetition goes through the widths in increasing order (the narrow ones matter most on a
    CPU), later ones shuffled; it stops after `budget_s` once every n has a timed sample, and at twice
    the budget in any case (a stalling machine: the widths measured so far are kept)."""
    base = ctx.n_past
    tokens = (list(fill) * (max(ns) // max(1, len(fill)) + 2))[:max(ns)] if fill else [0] * max(ns)
    times: dict[int, list[float]] = {n: [] for n in ns}
    rng = random.Random(seed)
    t_end = time.perf_counter() + budget_s
    try:
        ctx.eval(tokens[:8], rows=list(range(8)))      # warm-up
        ctx.truncate(base)
        for rep in range(reps):
            order = sorted(ns)
            if rep:
                rng.shuffle(order)
            for n in order:
                now = time.perf_counter()
                if (rep and now > t_end) or (times[min(ns)] and now > t_end + budget_s):
                    break
                for k in range(settle + timed):
                    before = ctx.decode_seconds
                    ctx.eval(tokens[:n], rows=list(range(n)))
                    if k >= settle:
                        times[n].append(ctx.decode_seconds - before)
                    ctx.truncate(base)
    finally:
        if ctx.n_past > base:
            ctx.truncate(base)
    # the fastest sample gives the curve's shape with the least noise from other processes; the
    # mean keeps what stalls cost (it judges the thread count)
    kept = {n: t for n, t in times.items() if t}
    return ({n: min(t) for n, t in kept.items()}, {n: median(t) for n, t in kept.items()},
            {n: sum(t) / len(t) for n, t in kept.items()})


def measure(model, options: dict, fill: list[int] | None = None, *, ns=DEFAULT_NS, n_fill: int = 128,
            budget_s: float = 0.5, threads: int | None = None, reps: int = 3, seed: int = 0) -> tuple[dict, dict, dict]:
    """(fastest, median, mean) t(n) on a fresh context of `model` with the context options of decoding (`Context`'s keyword
    arguments), after a context of `n_fill` tokens."""
    opts = dict(options)
    opts["n_ctx"] = n_fill + max(ns) + 16
    opts["n_batch"] = max(512, max(ns))
    if threads is not None:
        opts["n_threads"] = threads
    with Context(model, **opts) as ctx:
        fill = list(fill) if fill else [int(t) % max(1, min(model.n_vocab, 256)) for t in range(7, 7 + n_fill)]
        fill = (fill * (n_fill // len(fill) + 1))[:n_fill]
        ctx.eval(fill, rows=[])
        return measure_context(ctx, fill, ns=ns, budget_s=budget_s, reps=reps, seed=seed)


def _score(mean: dict[int, float]) -> float:
    """What a thread count is judged by: the mean cost, stalls included, of the narrow passes that
    ar and the planner's CPU choices make (1, 2 and 4 tokens)."""
    return sum(mean.get(n, float("inf")) for n in (1, 2, 4))


def _complete(entry: dict, model, options: dict, ns, budget_s: float, threads: int) -> bool:
    """Measure some of the widths a cached curve lacks (a large model, or a busy machine, runs out of
    the time budget after a few widths), next to its narrowest measured width as an anchor: the new
    times are scaled by anchor (cached) / anchor (now), so that a curve completed over several runs
    keeps one level (the planner rescales the level online anyway; the shape is what it needs). Each
    run adds what its budget allows, so a partial curve becomes whole instead of pricing every wider
    pass from the narrow ones for good. Returns whether anything was measured."""
    have = {int(n) for n in entry["curve"]}
    missing = [n for n in ns if n not in have]
    if not missing:
        return False
    anchor = min(have)
    curve, _, med = measure(model, options, ns=(anchor, *missing), budget_s=budget_s, threads=threads, reps=1)
    if anchor not in curve or len(curve) < 2:
        return False
    k = float(entry["curve"][str(anchor)]) / curve[anchor]
    for n in missing:
        if n in curve:
            entry["curve"][str(n)] = curve[n] * k
            entry.setdefault("mean", {})[str(n)] = med[n] * k
    entry["when"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return True


def calibrate(model, options: dict, *, refresh: bool = False, budget_s: float = 0.8, ns=DEFAULT_NS,
              verbose: bool = False) -> dict:
    """The cached calibration of `model` with `options`, measuring it when missing (or `refresh`).
    Returns {"threads": chosen, "curves": {threads: {n: seconds}}, "measured": bool}.
    Threads are chosen by measurement only when options["n_threads"] is None and the model is small
    (llama.default_threads would give it 1 thread); otherwise the configured count is measured."""
    fixed = options.get("n_threads")
    candidates = [fixed] if fixed else sorted({default_threads(model), cores()} if default_threads(model) == 1
                                              else {default_threads(model)})
    path = cache_path()
    cache = _load_cache(path)
    mkey = model_key(model)
    build = build_id()
    curves, medians, measured = {}, {}, False
    for th in candidates:
        key = f"{mkey}|{config_key(model, options, th)}|{build}"
        entry = cache["entries"].get(key)
        if entry is None or refresh:
            t0 = time.perf_counter()
            curve, _, med = measure(model, options, ns=ns, budget_s=budget_s / len(candidates), threads=th)
            entry = {"curve": {str(n): t for n, t in curve.items()}, "mean": {str(n): t for n, t in med.items()}, "seconds": round(time.perf_counter() - t0, 3),
                     "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": str(model.path), "threads": th}
            cache["entries"][key] = entry
            measured = True
            if verbose:
                print(f"calibrated {Path(model.path).name} with {th} thread(s) in {entry['seconds']} s", file=sys.stderr)
        elif len(entry["curve"]) < len(ns):
            measured |= _complete(entry, model, options, ns, budget_s / len(candidates), th)
        curves[th] = {int(n): float(t) for n, t in entry["curve"].items()}
        medians[th] = {int(n): float(t) for n, t in entry.get("mean", entry["curve"]).items()}
    if measured:
        _save_cache(path, cache)
    best = min(curves, key=lambda th: _score(medians[th]))
    return {"threads": best, "curves": curves, "measured": measured}


def recheck_threads(ctx, candidates: list[int], *, reps: int = 5) -> int:
    """On a live context, time one-token passes with each thread count and keep the fastest (it is
    set on the context). The cache is left as it was."""
    best, best_t = None, float("inf")
    base = ctx.n_past
    tok = [0]
    for th in candidates:
        ctx.set_threads(th)
        samples = []
        for _ in range(reps + 1):
            before = ctx.decode_seconds
            ctx.eval(tok, rows=[0])
            samples.append(ctx.decode_seconds - before)
            ctx.truncate(base)
        t = median(samples[1:])
        if t < best_t:
            best, best_t = th, t
    ctx.set_threads(best)
    return best
