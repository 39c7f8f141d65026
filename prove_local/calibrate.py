"""Pass-cost calibration: t(n), the seconds of one `llama_decode` of n tokens, per model as configured.

One method for the planner, the bench and scripts/gpu_check.py. A pass of n tokens asks logits on
every row (as a proposal or verify pass does), after a context of `n_fill` tokens, in the steady
state: per width untimed passes until they stop getting faster (SETTLE_ONE, SETTLE_TOL), then timed
ones (right after a pass of another width a pass costs up to 2x more and settles over a few passes;
decoding repeats the same shapes). The widths are shuffled per repetition so that drift spreads over
all of them, and the whole measurement stops at a time budget (the target: well under a second for
the embedded pair).

Each width's t is the median of its timed passes (the fastest where it has fewer than MIN_SAMPLES),
and the curve is checked before it is trusted (`suspects`: a pass never gets cheaper with more
tokens, costs at most ~n one-token passes, and the widest width does not jump past what the others
extrapolate to): suspect widths are measured again, and what is still suspect is repaired (`repair`).
A cached curve is checked when it is read, and one that fails is measured again and replaced; so is
one the engine's passes keep disagreeing with (`recalibrate`, from planner.Costs' `flagged`). A curve
during whose measurement the load changed (its t(1) timed again right after it disagrees) is measured
once more, and one still unsettled is used but not cached (`_keep`).

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
from collections import Counter
from statistics import median

from .files import write_atomic
from .llama import Context, default_threads, flash_attn_setting

CACHE_VERSION = 4         # 4: each width timed once its passes stop getting faster (SETTLE_ONE); 3: after a warm-up
                          # (WARM_MIN), with 2 settling passes a width (one-token passes 1.3-1.6x steady)
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
    type_k, type_v = options.get("type_k", "f16"), options.get("type_v", "f16")
    key = {"threads": threads, "n_gpu_layers": getattr(model, "n_gpu_layers", 0),
           "flash_attn": flash_attn_setting(options.get("flash_attn", "auto"), type_k, type_v,
                                            gpu=getattr(model, "n_gpu_layers", 0) != 0),
           "type_k": type_k, "type_v": type_v}
    if getattr(model, "hugepages", {}).get("on"):
        key["hugepages"] = True          # weights on 2 MiB pages decode 3-10 % faster here (hugepages.py)
    return json.dumps(key, sort_keys=True)


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


def _save_cache(path: Path, data: dict, what: str = "calibration cache") -> None:
    _prune(data)
    try:
        text = json.dumps(data, indent=1, sort_keys=True, allow_nan=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except (OSError, TypeError, ValueError) as e:   # a read-only home (or a value JSON cannot hold) must not stop decoding
        print(f"prove-local: note: could not write the {what} {path}: {e}", file=sys.stderr)


# ------------------------------------------------------------------------------- the planner's memory
# What an engine's planner learned (Planner.memory: acceptance statistics, host time per cycle kind, the
# switch's record), kept per models, options and build beside the calibration cache, so that a new
# process starts where the last one on this machine left off instead of from nothing: new engines ran
# the embedded pair's GSM8K questions at 0.947x `ar` per question without it and 0.975x with it
# (dev/planner_ab.py --fresh; as the bench command in fresh processes 0.954x and 0.964x:
# docs/planner.md, "The planner's memory"). llama.cpp's lookup keeps its dynamic n-gram cache across
# runs in a file the same way (--lookup-cache-dynamic).
MEMORY_EVERY_S = 60.0     # an engine writes its memory at the end of a request at most this often (and when closed)


def memory_path() -> Path:
    return cache_path().with_name("planner-memory.json")


def memory_enabled() -> bool:
    """PROVE_LOCAL_MEMORY=0 turns the planner's memory off (every process starts from nothing)."""
    return os.environ.get("PROVE_LOCAL_MEMORY", "1").strip().lower() not in ("0", "off", "no", "false")


def _read_memory(path: Path, quiet: bool = False) -> dict:
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("entries"), dict):
            return data
        why = "not a {\"entries\": {...}} object"
    except FileNotFoundError:
        return {"entries": {}}
    except (OSError, ValueError) as e:
        why = str(e)
    if not quiet:
        print(f"prove-local: note: the planner memory {path} could not be read ({why}); starting without it "
              "(it is written anew)", file=sys.stderr)
    return {"entries": {}}


def load_memory(key: str) -> dict | None:
    """The planner memory saved under `key` (None: none, or the file is unreadable: a note says so)."""
    return _read_memory(memory_path())["entries"].get(key)


def save_memory(key: str, memory: dict) -> None:
    """Keep `memory` under `key` (the other entries stay; those of changed or deleted model files go)."""
    path = memory_path()
    data = _read_memory(path, quiet=True)
    data["entries"][key] = {**memory, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _save_cache(path, data, "planner memory")


# ------------------------------------------------------------------------------- checking a curve
# A pass-cost curve is checked before it is trusted (measured now, or read from the cache): one stall
# of the machine during a calibration (a browser, a laptop waking up) once cached SmolLM2's t(4) as
# 11,651 ms beside t(32) = 568 ms, and every later run priced 4-token passes out for good.
RISE_TOL = 0.10       # t(n) may exceed a wider width's t by this share (noise) before one of them is suspect
LINEAR_TOL = 1.5      # a pass of n tokens costs at most n one-token passes (x this share, for noise)
SPIKE = 2.0           # the widest width's t over what the widths before it extrapolate to
MIN_SAMPLES = 3       # timed passes per width before its median is taken (fewer: the fastest)
# A fresh context's first passes run slow: SmolLM2 Q4_1 on 2 threads, one-token passes 11-12 ms at first,
# 8.2-8.8 ms after about 20 of them (~0.2 s; again on each new context of the process). Timed from the
# start, t(1) came out at 10.3 ms where generation runs 8.8, t(2)/t(1) at 1.35 where it is 1.5, and the
# planner drafted 1-token lookups that lose. So one-token passes run first until the median of the
# last WARM_WINDOW stops falling by WARM_TOL against the WARM_WINDOW before, WARM_MIN..WARM_MAX passes
# and at most half the time budget.
WARM_MIN, WARM_MAX, WARM_WINDOW, WARM_TOL = 16, 64, 8, 0.03
REMEASURE_ROUNDS = 2  # rounds of re-measuring the suspect widths before the curve is repaired
# After a wide pass the next passes of another width run slow for a while, the narrow ones longest: on the
# embedded proposer (1 thread, a 0.25 ms one-token pass) the one-token passes after a 32-token one cost
# 2.0x, 1.4x, 1.2x, 1.1x, 1.04x a steady one, settled from the 6th; calibration timed its 3rd and 4th
# (2 settling passes), t(1) came out 344-428 us against ~250 steady, every t(n)/t(1) 25-35 % low
# (t(2)/t(1) 1.14-1.41 cached, 1.9-2.0 measured in a run of passes), and the planner ran MARS blocks
# and short lookup drafts that lost. So one-token passes (the cheapest) get at least SETTLE_ONE
# untimed passes, and past those any width keeps settling while each untimed pass is more than
# SETTLE_TOL faster than the one before it (its times are noisy: that alone stopped early), up to
# SETTLE_MAX untimed passes.
SETTLE_ONE, SETTLE_TOL, SETTLE_MAX = 6, 0.05, 10
# Completing a cached curve (`_complete`) scales the new widths by the anchor's cached t over its t now,
# which holds only if the machine is as loaded now as then, and stayed so while the widths were timed:
# another process decoding beside it slows a narrow pass (threads waiting at ggml's barriers) far more
# than a wide one, and the scaled widths come out flat (SmolLM2 once cached t(4..15) all at 36.8 ms,
# where an idle machine measures 45-126 ms). So the anchor is timed before and after the missing widths;
# a completion is dropped (the next run tries again) when either timing exceeds the cached one by
# BUSY_TOL, or the two differ by DRIFT_TOL; differences under NOISE_S are never load (a tiny model's pass
# is a few hundred microseconds, a scheduler's jitter a sizeable share of it).
BUSY_TOL = 1.5
DRIFT_TOL = 1.3
NOISE_S = 0.5e-3
# A fresh curve is timed the same way: its narrowest width once more right after the others. Where the
# two differ by DRIFT_TOL the load changed while it was measured; it is measured again up to
# UNSETTLED_RETRIES times, and a curve still unsettled is used but not cached (`_keep`).
UNSETTLED_RETRIES = 1
# a curve measured again in a running process whose t(1) is over this x the cached one's: used, not cached (recalibrate)
RECAL_CACHE_TOL = 1.25
# a curve measured again within this of the cached one (t(1), and the median width's t(n) / t(1)): the same
SAME_CURVE = 0.15


def _chain_levels(ns: list[int], ts: list[float]) -> tuple[list[int], list[int]]:
    """Longest weakly rising chains (a step may fall by RISE_TOL): per width, the longest chain
    ending there (f) and starting there (g)."""
    k = len(ns)
    ok = [[ts[i] <= ts[j] * (1.0 + RISE_TOL) for j in range(k)] for i in range(k)]
    f = [1] * k
    for j in range(k):
        f[j] = 1 + max([f[i] for i in range(j) if ok[i][j]], default=0)
    g = [1] * k
    for i in reversed(range(k)):
        g[i] = 1 + max([g[j] for j in range(i + 1, k) if ok[i][j]], default=0)
    return f, g


def _extrapolated(ns: list[int], ts: list[float]) -> float:
    """t at the widest width as the widths before it predict: the last segment's slope or the curve's
    mean slope, whichever is steeper, from the second-widest width on."""
    (n0, t0), (n1, t1), (n2, _) = (ns[0], ts[0]), (ns[-2], ts[-2]), (ns[-1], ts[-1])
    last = (ts[-2] - ts[-3]) / (ns[-2] - ns[-3])
    mean = (t1 - t0) / (n1 - n0) if n1 > n0 else 0.0
    return t1 + max(0.0, last, mean) * (n2 - n1)


def suspects(curve: dict[int, float]) -> list[int]:
    """The widths whose t(n) the rest of the curve contradicts (an empty list: the curve is plausible):
      * not on every longest weakly rising chain of the curve (a pass never gets cheaper with more
        tokens; the widths off the longest chain are the fewest whose removal leaves a rising curve,
        and where two chains tie, both candidates are suspect);
      * above LINEAR_TOL x n x t(1) (n tokens in one pass cost at most n one-token passes);
      * the widest width above SPIKE x what the widths before it extrapolate to (a stall there breaks
        no rise: nothing wider contradicts it)."""
    ns = sorted(int(n) for n in curve)
    ts = [float(curve[n]) for n in ns]
    if any(not (t > 0.0) or t != t or t == float("inf") for t in ts):
        return [n for n, t in zip(ns, ts) if not (0.0 < t < float("inf"))]
    if len(ns) < 2:
        return []
    f, g = _chain_levels(ns, ts)
    longest = max(f)
    on = [i for i in range(len(ns)) if f[i] + g[i] - 1 == longest]
    level_count = Counter(f[i] for i in on)
    bad = {ns[i] for i in range(len(ns)) if i not in on or level_count[f[i]] > 1}
    if ns[0] == 1 and 1 not in bad:
        bad |= {n for n, t in zip(ns, ts) if t > LINEAR_TOL * n * ts[0]}
    if len(ns) >= 3 and ts[-1] > SPIKE * _extrapolated(ns, ts):
        bad.add(ns[-1])
    return sorted(bad)


def repair(curve: dict[int, float]) -> dict[int, float]:
    """The closest curve that passes `suspects`, for what re-measuring could not fix: timings only err
    upwards (a stall adds time, nothing removes it), so each t(n) becomes the least of itself and every
    wider width's t (a measured t(m) bounds the true t(n) <= t(m) from above), then at most LINEAR_TOL x
    n x t(1), and the widest at most SPIKE x its extrapolation."""
    ns = sorted(int(n) for n in curve)
    ts = [float(curve[n]) for n in ns]
    for i in range(len(ts) - 2, -1, -1):
        ts[i] = min(ts[i], ts[i + 1])
    if ns and ns[0] == 1:
        ts = [min(t, LINEAR_TOL * n * ts[0]) for n, t in zip(ns, ts)]
    if len(ns) >= 3:
        ts[-1] = min(ts[-1], SPIKE * _extrapolated(ns, ts))
    return dict(zip(ns, ts))


def _fit_new(curve: dict[int, float], fixed: set[int]) -> dict[int, float]:
    """`curve` with its `fixed` widths as they are and the others moved the least that makes it rise
    with n: each new t(n) at least every narrower t and at most every wider fixed one, then `repair`'s
    bounds (LINEAR_TOL x n x t(1), the widest at most SPIKE x its extrapolation), which lower new widths
    only when t(1) and the extrapolation come from the fixed ones. A new width of a completed curve was
    timed once and scaled by the anchor's cached / current t: one slow anchor timing scales every new
    width low, and `repair` alone would then lower the cached part (the level) to them."""
    ns = sorted(curve)
    out = dict(curve)
    for i, n in enumerate(ns):
        if n in fixed:
            continue
        floor = max((out[m] for m in ns[:i]), default=0.0)
        ceiling = min((curve[m] for m in ns[i + 1:] if m in fixed), default=float("inf"))
        out[n] = min(max(out[n], floor), ceiling)
    bounded = repair(out)
    return {n: (out[n] if n in fixed else bounded[n]) for n in ns}


def _value(samples: list[float]) -> float:
    """A width's t from its timed passes: the median of MIN_SAMPLES or more (one stall cannot move
    it), else the fastest."""
    return median(samples) if len(samples) >= MIN_SAMPLES else min(samples)


# ------------------------------------------------------------------------------- measuring
def measure_context(ctx, fill: list[int], *, ns=DEFAULT_NS, budget_s: float = 0.5, reps: int = 3,
                    settle: int = 2, timed: int = 2, seed: int = 0, clock=time.perf_counter,
                    report: dict | None = None, recheck: bool = False) -> tuple[dict, dict, dict]:
    """(curve, median, mean) seconds inside llama_decode of one pass of n tokens (logits on every row)
    on `ctx` (passes are appended at ctx.n_past and cut back; the context is returned as it was).
    One-token passes run first until they stop getting faster (WARM_MIN: a fresh context's first
    passes run slow). The first repetition goes through the widths in increasing order (the narrow ones matter most on
    a CPU), later ones shuffled; it stops after `budget_s` once every n has a timed sample, and at
    twice the budget in any case (a stalling machine: the widths measured so far are kept).
    Then the curve is checked (`suspects`): the suspect widths are measured again (settling passes,
    then MIN_SAMPLES timed ones that replace their samples), up to REMEASURE_ROUNDS rounds within
    another `budget_s`, and what is still suspect is repaired (`repair`). `curve`: the checked
    curve, each width's median (`_value`); `median`, `mean`: of each width's final samples.
    `clock`: the time budget's clock (tests pass a fake one). `report`, if given, gets the widths
    re-measured ("remeasured") and those repaired ("repaired"), and with `recheck` the narrowest
    width timed once more at the end ("recheck": the median of MIN_SAMPLES passes), which tells
    whether the machine's load changed while the curve was measured."""
    base = ctx.n_past
    tokens = (list(fill) * (max(ns) // max(1, len(fill)) + 2))[:max(ns)] if fill else [0] * max(ns)
    times: dict[int, list[float]] = {n: [] for n in ns}
    rng = random.Random(seed)
    t_warm = clock() + budget_s / 2

    def one(n: int) -> float:
        before = ctx.decode_seconds
        ctx.eval(tokens[:n], rows=list(range(n)))
        ctx.truncate(base)
        return ctx.decode_seconds - before

    def passes(n: int, count: int, keep_from: int) -> list[float]:
        """`count - keep_from` timed passes of n tokens after `keep_from` untimed ones (SETTLE_ONE at
        least for one-token passes, when any), and after more untimed ones while they still get faster
        (SETTLE_TOL, up to SETTLE_MAX in all)."""
        timed = count - keep_from
        seen = [one(n) for _ in range(max(keep_from, SETTLE_ONE) if n == 1 and keep_from else keep_from)]
        while 2 <= len(seen) < SETTLE_MAX and seen[-1] < (1.0 - SETTLE_TOL) * seen[-2]:
            seen.append(one(n))
        return [one(n) for _ in range(timed)]

    remeasured: list[int] = []
    try:
        ctx.eval(tokens[:8], rows=list(range(8)))      # warm-up
        ctx.truncate(base)
        warm: list[float] = []
        while len(warm) < WARM_MAX and clock() < t_warm:
            warm += passes(1, 1, 0)
            w = WARM_WINDOW
            if len(warm) >= max(WARM_MIN, 2 * w) and median(warm[-w:]) >= (1.0 - WARM_TOL) * median(warm[-2 * w:-w]):
                break
        if report is not None:
            report["warm_passes"] = len(warm)
        t_end = clock() + budget_s
        for rep in range(reps):
            order = sorted(ns)
            if rep:
                rng.shuffle(order)
            for n in order:
                now = clock()
                if (rep and now > t_end) or (times[min(ns)] and now > t_end + budget_s):
                    break
                times[n] += passes(n, settle + timed, settle)
        t_fix = clock() + budget_s
        for _ in range(REMEASURE_ROUNDS):
            kept = {n: _value(t) for n, t in times.items() if t}
            bad = suspects(kept)
            if not bad:
                break
            for n in bad:
                if clock() > t_fix:
                    break
                times[n] = passes(n, settle + MIN_SAMPLES, settle)
                remeasured.append(n)
        if recheck and report is not None:
            report["recheck"] = median(passes(min(ns), settle + MIN_SAMPLES, settle))
    finally:
        if ctx.n_past > base:
            ctx.truncate(base)
    kept = {n: t for n, t in times.items() if t}
    raw = {n: _value(t) for n, t in kept.items()}
    bad = suspects(raw)
    curve = repair(raw) if bad else raw
    if report is not None:
        report["remeasured"] = sorted(set(remeasured))
        report["repaired"] = [n for n in bad if curve[n] != raw[n]] if bad else []
    return (curve, {n: median(t) for n, t in kept.items()},
            {n: sum(t) / len(t) for n, t in kept.items()})


def measure(model, options: dict, fill: list[int] | None = None, *, ns=DEFAULT_NS, n_fill: int = 128,
            budget_s: float = 0.5, threads: int | None = None, reps: int = 3, seed: int = 0,
            **check) -> tuple[dict, dict, dict]:
    """(curve, median, mean) t(n) on a fresh context of `model` with the context options of decoding (`Context`'s keyword
    arguments), after a context of `n_fill` tokens: `measure_context` (`check`: its clock and report)."""
    opts = dict(options)
    opts["n_ctx"] = n_fill + max(ns) + 16
    opts["n_batch"] = max(512, max(ns))
    if threads is not None:
        opts["n_threads"] = threads
    with Context(model, **opts) as ctx:
        fill = list(fill) if fill else [int(t) % max(1, min(model.n_vocab, 256)) for t in range(7, 7 + n_fill)]
        fill = (fill * (n_fill // len(fill) + 1))[:n_fill]
        ctx.eval(fill, rows=[])
        return measure_context(ctx, fill, ns=ns, budget_s=budget_s, reps=reps, seed=seed, **check)


def _score(mean: dict[int, float]) -> float:
    """What a thread count is judged by: the mean cost, stalls included, of the narrow passes that
    ar and the planner's CPU choices make (1, 2 and 4 tokens)."""
    return sum(mean.get(n, float("inf")) for n in (1, 2, 4))


def _drifted(before: float, after: float) -> bool:
    """Whether two timings of the same pass, before and after a measurement, say the machine's load
    changed in between (DRIFT_TOL, past NOISE_S)."""
    hi, lo = max(before, after), min(before, after)
    return hi - lo > max((DRIFT_TOL - 1.0) * lo, NOISE_S)


def _loaded(cached: float, before: float, after: float) -> str | None:
    """Why timings of the anchor width `before` and `after` the missing widths, against its `cached`
    t, say the machine's load is not the cached curve's (None: they agree). See BUSY_TOL."""
    hi = max(before, after)
    if _drifted(before, after):
        return (f"the anchor pass cost {before * 1e3:.3g} ms before the new widths and {after * 1e3:.3g} ms "
                "after them (the load changed meanwhile)")
    if hi - cached > max((BUSY_TOL - 1.0) * cached, NOISE_S):
        return f"the anchor pass costs {hi / cached:.2g}x its cached time now (a busier machine)"
    return None


def _complete(entry: dict, model, options: dict, ns, budget_s: float, threads: int,
              report: dict | None = None) -> bool:
    """Measure some of the widths a cached curve lacks (a large model, or a busy machine, runs out of
    the time budget after a few widths), next to its narrowest measured width as an anchor: the new
    times are scaled by anchor (cached) / anchor (now), so that a curve completed over several runs
    keeps one level (the planner rescales the level online anyway; the shape is what it needs). Each
    run adds what its budget allows, so a partial curve becomes whole instead of pricing every wider
    pass from the narrow ones for good. The anchor is timed before and after the new widths, and when
    the machine is busier than the cached part says, or its load changed meanwhile, nothing is kept
    (`_loaded`; `report["dropped"]` says why). Returns whether anything was kept."""
    have = {int(n) for n in entry["curve"]}
    missing = [n for n in ns if n not in have]
    if not missing:
        return False
    anchor = min(have)
    checks: dict = {}
    curve, _, med = measure(model, options, ns=(anchor, *missing), budget_s=budget_s, threads=threads, reps=1,
                            report=checks, recheck=True)
    if anchor not in curve or len(curve) < 2:
        return False
    cached = float(entry["curve"][str(anchor)])
    after = checks.get("recheck", curve[anchor])
    why = _loaded(cached, curve[anchor], after)
    if why is not None:
        if report is not None:
            report["dropped"] = why
        return False
    k = cached / ((curve[anchor] + after) / 2)
    for n in missing:
        if n in curve:
            entry["curve"][str(n)] = curve[n] * k
            entry.setdefault("mean", {})[str(n)] = med[n] * k
    # two measurements side by side, checked together: the cached part was checked when it was read and
    # stays as it is (it holds the level); a new width the cached ones contradict is fitted between them
    whole = {int(n): float(t) for n, t in entry["curve"].items()}
    if suspects(whole):
        entry["curve"] = {str(n): t for n, t in _fit_new(whole, have).items()}
    entry["when"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return True


def _entry(model, options: dict, ns, budget_s: float, threads: int, why: str | None = None) -> dict:
    """A cache entry measured now (`why`: the reason a cached one was replaced, kept in the entry)."""
    t0 = time.perf_counter()
    for attempt in range(1 + UNSETTLED_RETRIES):
        report: dict = {}
        curve, _, mean = measure(model, options, ns=ns, budget_s=budget_s, threads=threads, report=report,
                                 recheck=True)
        first = curve[min(curve)]
        again = report.get("recheck", first)
        unsettled = _drifted(first, again)
        if not unsettled:
            break
    entry = {"curve": {str(n): t for n, t in curve.items()}, "mean": {str(n): t for n, t in mean.items()},
             "seconds": round(time.perf_counter() - t0, 3), "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "model": str(model.path), "threads": threads,
             "remeasured": report.get("remeasured", []), "repaired": report.get("repaired", [])}
    if why:
        entry["replaced"] = why
    if unsettled:
        entry["unsettled"] = (f"t({min(curve)}) was {first * 1e3:.3g} ms while the curve was measured and "
                              f"{again * 1e3:.3g} ms right after it (the load changed meanwhile), "
                              f"{attempt + 1} time(s)")
    return entry


def _keep(cache: dict, key: str, entry: dict, model, threads: int) -> bool:
    """Put a measured `entry` in the cache unless the load changed while it was measured (`_entry`:
    "unsettled"); such a curve is used by this process only, and the next run measures again. (A
    server started here on a loaded minute cached SmolLM2's t(1..8) as 40.6, 75.7, 159.3, 207.7 x 4,
    329.4 ms, t(1) 16-20 ms idle: a stall that ended during the measurement, which the curve's shape
    checks cannot see, and every later run planned with it.) Returns whether it was kept."""
    if "unsettled" in entry:
        print(f"prove-local: note: {Path(model.path).name}'s pass costs ({threads} thread(s)) are not cached: "
              f"{entry['unsettled']}; the next run measures them again", file=sys.stderr)
        return False
    cache["entries"][key] = entry
    return True


def entry_key(model, options: dict, threads: int) -> str:
    """The cache key of `model` with the context `options` and `threads`."""
    return f"{model_key(model)}|{config_key(model, options, threads)}|{build_id()}"


def calibrate(model, options: dict, *, refresh: bool = False, budget_s: float = 0.8, ns=DEFAULT_NS,
              verbose: bool = False) -> dict:
    """The cached calibration of `model` with `options`, measuring it when missing (or `refresh`).
    Returns {"threads": chosen, "curves": {threads: {n: seconds}}, "measured": bool}.
    Threads are chosen by measurement only when options["n_threads"] is None and the model is small
    (llama.default_threads would give it 1 thread); otherwise the configured count is measured.
    A cached curve is checked before it is used (`suspects`: a width that costs more than a wider
    one, more than n one-token passes, or a spike at the widest): one that fails is measured again
    and replaced, not trusted (the entry says why: "replaced")."""
    fixed = options.get("n_threads")
    candidates = [fixed] if fixed else sorted({default_threads(model), cores()} if default_threads(model) == 1
                                              else {default_threads(model)})
    path = cache_path()
    cache = _load_cache(path)
    curves, medians, measured, store = {}, {}, False, False
    for th in candidates:
        key = entry_key(model, options, th)
        entry = cache["entries"].get(key)
        cached = {int(n): float(t) for n, t in entry["curve"].items()} if entry is not None else {}
        bad = suspects(cached)
        if entry is None or refresh or bad:
            why = None if refresh or not bad else (
                "the cached curve failed its check at n = " + ", ".join(map(str, bad)) + " (t(n) in ms: "
                + ", ".join(f"{n}: {cached[n] * 1e3:.1f}" for n in bad) + "; t(1) "
                + (f"{cached[1] * 1e3:.1f}" if 1 in cached else "not measured") + ")")
            entry = _entry(model, options, ns, budget_s / len(candidates), th, why)
            store |= _keep(cache, key, entry, model, th)
            measured = True
            if verbose or why:
                print(f"prove-local: calibrated {Path(model.path).name} with {th} thread(s) in {entry['seconds']} s"
                      + (f": {why}" if why else ""), file=sys.stderr)
        elif len(entry["curve"]) < len(ns):
            report: dict = {}
            completed = _complete(entry, model, options, ns, budget_s / len(candidates), th, report)
            measured |= completed
            store |= completed
            if verbose and "dropped" in report:
                print(f"prove-local: the missing widths of {Path(model.path).name}'s curve ({th} thread(s)) were "
                      f"measured and dropped: {report['dropped']}; the next run measures them again", file=sys.stderr)
        curves[th] = {int(n): float(t) for n, t in entry["curve"].items()}
        medians[th] = {int(n): float(t) for n, t in entry.get("mean", entry["curve"]).items()}
    if store:
        _save_cache(path, cache)
    best = min(curves, key=lambda th: _score(medians[th]))
    return {"threads": best, "curves": curves, "measured": measured}


def same_curve(a: dict, b: dict, tol: float = SAME_CURVE) -> bool:
    """Whether two measured curves (width -> seconds) agree within `tol`: t(1) itself, and the median
    over the other widths both have of how far each t(n) / t(1) is off (a tiny model's calibrations
    differ by up to ~30 % at a width or two from run to run: t(2) 474, 483, 619 us, t(1) 239-263)."""
    common = sorted(n for n in set(a) & set(b) if n > 1 and a[n] > 0)
    if not common or a.get(1, 0) <= 0 or b.get(1, 0) <= 0 or abs(b[1] / a[1] - 1.0) > tol:
        return False
    offs = sorted(abs((b[n] / b[1]) / (a[n] / a[1]) - 1.0) for n in common)
    return offs[len(offs) // 2] <= tol


def _narrowest(curve: dict) -> float:
    """A cached curve's (width as a string -> seconds) narrowest pass: t(1)."""
    return float(curve[str(min(int(n) for n in curve))])


def recalibrate(model, options: dict, threads: int, why: str, *, budget_s: float = 0.8,
                ns=DEFAULT_NS, in_use: float | None = None) -> dict[int, float] | None:
    """Measure the curve of `model` with `options` and `threads` again and replace its cache entry
    (the engine's call when the passes it runs keep disagreeing with the cached curve: planner.Costs'
    `disputed`); `why` is kept in the entry. Returns the new curve, or None where `in_use` (what a
    one-token pass costs in the engine's own passes now, seconds) says it was measured in a busy spell:
    its t(1) over BUSY_TOL x that. A calibration's passes run back to back, warm, and cost at most what
    the same passes cost between the planner's Python; one that finds them dearer caught a stall that
    the engine's passes around it did not (the embedded proposer, measured again in a running process:
    t(1) 605 us where its passes took ~0.3 ms, cached, and the next run's planner priced every wider
    pass at half its cost). Such a curve is neither cached nor used.

    A curve whose t(1) is over RECAL_CACHE_TOL x the cached entry's is used by this process but not
    cached: a slow spell of the host that the engine's passes shared (the in-use check passes) ends, and
    the next run would start from it for good. On this host the embedded proposer's t(1) measures
    233-267 us run to run on a quiet machine; in-process recalibrations during slow spells cached 346 and
    458 us (and 605, 710 before the in-use check). A level the machine keeps is the planner's cost scale
    either way; the cached curve's shape is what a run needs from it."""
    path = cache_path()
    cache = _load_cache(path)
    key = entry_key(model, options, threads)
    entry = _entry(model, options, ns, budget_s, threads, why)
    t1 = _narrowest(entry["curve"])
    if in_use is not None and in_use > 0 and t1 > BUSY_TOL * in_use:
        print(f"prove-local: note: {Path(model.path).name} measured again with {threads} thread(s) at "
              f"{t1 * 1e3:.3g} ms a one-token pass where its passes cost {in_use * 1e3:.3g} ms in use (a busy "
              "spell): neither cached nor used", file=sys.stderr)
        return None
    old = cache["entries"].get(key)
    old_t1 = _narrowest(old["curve"]) if old is not None else 0.0
    if old_t1 > 0 and t1 > RECAL_CACHE_TOL * old_t1:
        print(f"prove-local: note: {Path(model.path).name} measured again with {threads} thread(s) at "
              f"{t1 * 1e3:.3g} ms a one-token pass, {t1 / old_t1:.2g}x the cached curve's (a slow spell): used "
              "now, not cached", file=sys.stderr)
    elif _keep(cache, key, entry, model, threads):
        _save_cache(path, cache)
    print(f"prove-local: calibrated {Path(model.path).name} again with {threads} thread(s) in {entry['seconds']} s: {why}",
          file=sys.stderr)
    return {int(n): float(t) for n, t in entry["curve"].items()}


# ------------------------------------------------------------------------------- the adapter's switch
SWITCH_REPS = 7           # rounds of measure_switch (each: a stock pass, two adapter passes, two stock passes)


def measure_switch(ctx, fill: list[int], *, reps: int = SWITCH_REPS) -> dict:
    """What switching a gated adapter on and off adds to the passes of `ctx` (a context with its
    adapter), in seconds inside llama_decode. llama.cpp re-plans the whole graph at each switch
    (`llama_set_adapters_lora` sets `sched_need_reserve`; the next llama_decode rebuilds the scheduler
    and reserves the worst-case graphs), and a gated lossless cycle switches twice: on for its
    proposal pass, off for its verify pass. Per round: a 3-token stock pass (settling), a 2-token
    adapter pass (switched on) and another (not switched), a 3-token stock pass (switched off) and
    another (not switched); `on` and `off` are the medians of the differences, `switch` their sum
    (each at least 0). Every pass is removed again."""
    base = ctx.n_past
    toks = (list(fill) or [0]) * 3

    def timed(width: int, adapter: bool) -> float:
        before = ctx.decode_seconds
        ctx.eval(toks[:width], rows=list(range(width)), adapter=adapter)
        ctx.truncate(base)
        return ctx.decode_seconds - before

    on, off = [], []
    try:
        for _ in range(reps):
            timed(3, False)
            switched, same = timed(2, True), timed(2, True)
            on.append(switched - same)
            switched, same = timed(3, False), timed(3, False)
            off.append(switched - same)
    finally:
        if ctx.n_past > base:
            ctx.truncate(base)
    out = {"on": max(0.0, median(on)), "off": max(0.0, median(off))}
    out["switch"] = out["on"] + out["off"]
    return out


def switch_cost(model, adapter, options: dict, threads: int, *, refresh: bool = False, n_fill: int = 128) -> float:
    """The cached seconds a gated lossless cycle of `model` with `adapter` spends switching it
    (`measure_switch`, on a fresh context with the decoding options and `threads`; ~1 s on SmolLM2-135M
    and 2 CPU threads, once per model, adapter and options)."""
    path = cache_path()
    cache = _load_cache(path)
    a = Path(adapter.path).resolve()
    st = a.stat()
    key = f"{model_key(model)}|switch|{a}|{st.st_size}|{st.st_mtime_ns}|{config_key(model, options, threads)}|{build_id()}"
    entry = cache["entries"].get(key)
    if entry is None or refresh or not isinstance(entry.get("switch"), (int, float)):
        t0 = time.perf_counter()
        opts = {**options, "n_ctx": n_fill + 16, "n_threads": threads}
        with Context(model, adapter=adapter, **opts) as ctx:
            fill = [int(t) % max(1, min(model.n_vocab, 256)) for t in range(7, 7 + n_fill)]
            ctx.eval(fill, rows=[])
            ctx.eval(fill[:2], rows=[0, 1], adapter=True)       # (a first adapter pass warms its weights)
            ctx.truncate(n_fill)
            entry = measure_switch(ctx, fill)
        entry.update(seconds=round(time.perf_counter() - t0, 3), when=time.strftime("%Y-%m-%dT%H:%M:%S"),
                     model=str(model.path), adapter=str(a), threads=threads)
        cache["entries"][key] = entry
        _save_cache(path, cache)
    return float(entry["switch"])


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
