"""The pass-cost calibration against stalls (calibrate.py) and a cached curve the passes dispute
(planner.Costs, Engine._recalibrate), on fake contexts with a fake clock: every pass costs what the
test scripts, so nothing here depends on how fast or busy this machine is.

The poisoned curve is the issue's: SmolLM2's curve measured during one ordinary `run` was cached with
t(4) = 11,651 ms beside t(32) = 568 ms, and every later run priced 4-token passes out."""
from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from prove_local import calibrate, engine as engine_module
from prove_local.llama import flash_attn_setting
from prove_local.planner import Costs
from tests.fakes import make_engine, run

# what a test module sees at import (test_rpc copies os.environ then, for its `prove-local` subprocesses)
CACHE_AT_IMPORT = os.environ.get("PROVE_LOCAL_CACHE")

# SmolLM2-135M Q4_1, 2 threads: t(n)/t(1) 1.89 at 2, 2.64 at 4, 4.94 at 8 (docs/lookup.md), the rest on
# that shape, at the level the issue's t(32) = 568 ms gives
SHAPE = {1: 1.0, 2: 1.89, 3: 2.3, 4: 2.64, 5: 3.2, 6: 3.8, 7: 4.4, 8: 4.94, 9: 5.4, 10: 5.9, 11: 6.4,
         12: 6.9, 13: 7.4, 14: 7.9, 15: 8.4, 16: 8.9, 20: 11.0, 24: 13.0, 32: 26.0}
T1 = 0.568 / SHAPE[32]
POISONED = {n: T1 * r for n, r in SHAPE.items()} | {4: 11.651}


def line(n: int) -> float:
    """A clean curve: 1 ms a pass plus 0.5 ms a token."""
    return 1e-3 + 0.5e-3 * n


class TimedContext:
    """A context whose pass of n tokens costs cost(n) + stall(n, k) seconds of fake time (k: the
    pass's index among the passes of width n, the warm-up included), which `clock` reads."""

    def __init__(self, cost=line, stall=lambda n, k: 0.0, n_past: int = 0):
        self.cost, self.stall = cost, stall
        self.n_past, self.decode_seconds, self.now = n_past, 0.0, 0.0
        self.calls: Counter = Counter()

    def clock(self) -> float:
        return self.now

    def eval(self, tokens, rows=None):
        n = len(tokens)
        dt = self.cost(n) + self.stall(n, self.calls[n])
        self.calls[n] += 1
        self.decode_seconds += dt
        self.now += dt
        self.n_past += n

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.n_past
        self.n_past = n


def measured(ctx: TimedContext, **kw):
    report: dict = {}
    curve, med, mean = calibrate.measure_context(ctx, list(range(50)), clock=ctx.clock, report=report, **kw)
    return curve, report


# ------------------------------------------------------------------ checking a curve
def test_the_issues_poisoned_curve_is_suspect_at_its_stalled_width_only():
    clean = {n: T1 * r for n, r in SHAPE.items()}
    assert calibrate.suspects(clean) == []
    assert calibrate.suspects(POISONED) == [4]
    fixed = calibrate.repair(POISONED)
    assert calibrate.suspects(fixed) == []
    assert fixed[4] == pytest.approx(clean[5])          # no wider pass is cheaper: the least wider t
    assert {n: t for n, t in fixed.items() if n != 4} == pytest.approx({n: t for n, t in clean.items() if n != 4})


def test_suspects_a_pass_dearer_than_n_one_token_passes_and_a_spike_at_the_widest():
    clean = {n: line(n) for n in calibrate.DEFAULT_NS}
    assert calibrate.suspects(clean) == []
    # rising, but t(32) is 568 ms beside t(1) = 10.9 ms: more than 32 one-token passes
    smol = {n: 10.9e-3 * r for n, r in SHAPE.items()} | {32: 0.568}
    assert calibrate.suspects(smol) == [32]
    # a stall at the widest width breaks no rise: caught against the widths before it
    spike = clean | {32: 8 * clean[32]}
    assert calibrate.suspects(spike) == [32]
    assert calibrate.suspects(calibrate.repair(spike)) == []
    # two widths out of order: both are suspect (which one stalled is not known)
    swapped = clean | {8: clean[9] * 1.3}
    assert set(calibrate.suspects(swapped)) >= {8}
    # noise within RISE_TOL is not
    assert calibrate.suspects(clean | {8: clean[9] * 1.05}) == []
    assert calibrate.suspects({4: float("nan"), 8: 1.0}) == [4]
    assert calibrate.suspects({1: 1.0}) == []


# ------------------------------------------------------------------ measuring
def test_one_stalled_sample_does_not_move_a_median():
    # width 8's passes: the warm-up (k = 0), then 2 settling and 2 timed ones per repetition: k = 3 is timed
    ctx = TimedContext(stall=lambda n, k: 10.0 if (n, k) == (8, 3) else 0.0)
    curve, report = measured(ctx, budget_s=1e9)
    assert curve == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS})
    # the one-token warm-up stops once its passes stop getting faster: at once here, where none does
    assert report == {"remeasured": [], "repaired": [], "warm_passes": calibrate.WARM_MIN}
    assert ctx.n_past == 0                                  # the context is left as it was


def test_a_width_stalled_throughout_the_first_measurement_is_measured_again():
    # the four passes of width 4 in the first repetition stall by 10 s each; the budget (25 fake seconds)
    # then stops the repetitions after the first, so width 4 has only its two stalled samples
    ctx = TimedContext(stall=lambda n, k: 10.0 if n == 4 and k < 4 else 0.0)
    curve, report = measured(ctx, budget_s=25.0)
    assert report["remeasured"] == [4] and report["repaired"] == []
    assert curve == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS})
    assert calibrate.suspects(curve) == []


def test_the_first_passes_of_a_fresh_context_are_not_timed():
    """A fresh context's first one-token passes run slow (SmolLM2: 11-12 ms, then 8.2-8.8 after ~20):
    here 40 % dearer for the first 20, easing off. One-token passes run until they stop getting
    faster, and t(1) is the warm context's, not the cold start's."""
    ctx = TimedContext(stall=lambda n, k: 0.4 * line(n) * max(0.0, 1 - k / 20) if n == 1 else 0.0)
    curve, report = measured(ctx, budget_s=1e9)
    assert 20 <= report["warm_passes"] <= calibrate.WARM_MAX
    assert curve[1] == pytest.approx(line(1)) and calibrate.suspects(curve) == []


class SettlingContext(TimedContext):
    """A context whose passes run slow right after a pass of another width, settling over several
    passes: the k-th one-token pass after it costs ONE_AFTER[k] x line(1), then 1x (the embedded
    proposer's after a wide pass, measured in calibration: 622, 434, 397, 386 us and 534, 400, 400, 375
    where a steady one takes ~250: a plateau that two equal timings do not tell from the end), the k-th
    wider one (1 + 0.5 * 0.7^k) x."""
    ONE_AFTER = (2.0, 1.4, 1.4, 1.25, 1.15, 1.05)

    def __init__(self):
        super().__init__()
        self.last, self.k = None, 0

    def eval(self, tokens, rows=None):
        n = len(tokens)
        self.k = self.k + 1 if n == self.last else 0
        self.last = n
        one = self.ONE_AFTER[self.k] - 1.0 if self.k < len(self.ONE_AFTER) else 0.0
        self.stall = lambda n_, k_: line(n) * (one if n == 1 else 0.5 * 0.7 ** self.k)
        super().eval(tokens, rows)


def test_each_width_is_timed_once_its_passes_stop_getting_faster():
    """Right after a pass of another width a pass runs slow and settles over a few passes, a one-token
    pass longest. Two settling passes timed the one-token passes at ~1.3x their steady cost (every
    t(n)/t(1) ~25 % low: wide passes looked cheap); one-token passes now settle over SETTLE_ONE passes,
    and any width while its passes still get SETTLE_TOL faster."""
    ctx = SettlingContext()
    curve, _ = measured(ctx, budget_s=1e9)
    assert curve[1] == pytest.approx(line(1), rel=0.06)           # (2 settling passes: 1.25-1.4x)
    for n in (2, 3, 8, 32):
        assert curve[n] == pytest.approx(line(n), rel=0.09), n    # (2 settling passes: 1.17-1.25x)
    assert curve[2] / curve[1] == pytest.approx(line(2) / line(1), rel=0.12)


def test_a_width_that_keeps_stalling_is_repaired_not_kept():
    ctx = TimedContext(stall=lambda n, k: 10.0 if n == 4 else 0.0)
    curve, report = measured(ctx, budget_s=1e9)
    assert report["remeasured"] == [4] and report["repaired"] == [4]
    assert curve[4] == pytest.approx(line(5))
    assert calibrate.suspects(curve) == []
    assert ctx.calls[4] == 3 * (2 + 2) + calibrate.REMEASURE_ROUNDS * (2 + calibrate.MIN_SAMPLES)   # 3 reps, 2 rounds


# ------------------------------------------------------------------ the cache
class FakeModel:
    n_vocab, n_params, n_gpu_layers = 256, 1_000_000, 0

    def __init__(self, path):
        self.path = path


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """calibrate() on a fake model file whose contexts' passes cost `line(n)`."""
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "build_id", lambda: "fake build")
    made: list = []
    contexts_costing(monkeypatch, line, made=made)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return FakeModel(path), made


def test_a_cached_poisoned_curve_is_measured_again_not_trusted(fake_llama, capsys):
    model, made = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    key = calibrate.entry_key(model, opts, 2)
    cache = {"version": calibrate.CACHE_VERSION,
             "entries": {key: {"curve": {str(n): t for n, t in POISONED.items()}, "threads": 2}}}
    calibrate.cache_path().parent.mkdir(parents=True)
    calibrate.cache_path().write_text(json.dumps(cache))
    cal = calibrate.calibrate(model, opts)
    assert cal["measured"] and len(made) == 1
    assert cal["curves"][2] == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS})
    entry = json.loads(calibrate.cache_path().read_text())["entries"][key]
    assert "n = 4" in entry["replaced"] and "11651.0" in entry["replaced"]
    assert "11651.0" in capsys.readouterr().err              # said once, on stderr
    again = calibrate.calibrate(model, opts)                  # the new entry passes its check
    assert not again["measured"] and len(made) == 1


def contexts_stalled(monkeypatch, passes: int, contexts: int, made: list):
    """calibrate's contexts from now on: in each of the first `contexts` made, the first `passes` passes
    cost 3 x line(n) (a stall that ends while the curve is measured), the rest line(n)."""
    class Ctx(TimedContext):
        def __init__(self, model, **opts):
            stalled = len(made) < contexts
            made.append(opts)
            self.count = 0
            super().__init__(cost=lambda n: (3 if stalled and self.count <= passes else 1) * line(n))

        def eval(self, tokens, rows=None):
            self.count += 1
            super().eval(tokens, rows)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass
    monkeypatch.setattr(calibrate, "Context", Ctx)


# the context's fill, the warm-up pass, the warm one-token passes and the 3 repetitions over every width
# (settle 2 + timed 2 each, SETTLE_ONE + 2 for width 1; the fake passes take no real time, so all 3 fit
# the budget): every width is timed in the stall, the curve has a plausible shape 3x too high, and its
# t(1) timed again at the end is line(1)
STALL = 2 + calibrate.WARM_MIN + 3 * (4 * len(calibrate.DEFAULT_NS) + calibrate.SETTLE_ONE - 2)


def test_a_curve_measured_while_a_stall_ended_is_measured_again_and_never_cached(fake_llama, monkeypatch, capsys):
    model, _ = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    made: list = []
    contexts_stalled(monkeypatch, STALL, contexts=1, made=made)          # the stall ends during the first try
    cal = calibrate.calibrate(model, opts)
    assert len(made) == 2 and cal["measured"]
    assert cal["curves"][2] == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS})
    assert calibrate.calibrate(model, opts)["curves"][2] == cal["curves"][2]     # cached: no third context
    assert len(made) == 2
    # a stall in both tries: the curve serves this run and is not cached (said on stderr)
    calibrate.cache_path().unlink()
    made.clear()
    contexts_stalled(monkeypatch, STALL, contexts=2, made=made)
    capsys.readouterr()
    cal = calibrate.calibrate(model, opts)
    assert len(made) == 2 and cal["curves"][2][1] == pytest.approx(3 * line(1))
    assert "not cached" in capsys.readouterr().err and not calibrate.cache_path().exists()
    contexts_stalled(monkeypatch, STALL, contexts=0, made=made)          # quiet: measured and cached
    cal = calibrate.calibrate(model, opts)
    assert len(made) == 3 and cal["curves"][2] == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS})
    assert calibrate.cache_path().exists()
    # recalibrate (the engine's, on disputed passes) keeps an unsettled curve out of the cache too
    contexts_stalled(monkeypatch, STALL, contexts=2, made=made)
    made.clear()
    curve = calibrate.recalibrate(model, opts, 2, "passes disagreed")
    assert curve[1] == pytest.approx(3 * line(1)) and len(made) == 2
    entry = json.loads(calibrate.cache_path().read_text())["entries"][calibrate.entry_key(model, opts, 2)]
    assert "replaced" not in entry and float(entry["curve"]["1"]) == pytest.approx(line(1))


def test_recalibrate_replaces_the_entry_and_keeps_why(fake_llama):
    model, made = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    calibrate.calibrate(model, opts)
    curve = calibrate.recalibrate(model, opts, 2, "passes disagreed")
    assert curve == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS}) and len(made) == 2
    entry = json.loads(calibrate.cache_path().read_text())["entries"][calibrate.entry_key(model, opts, 2)]
    assert entry["replaced"] == "passes disagreed"


def test_a_curve_measured_again_in_a_busy_spell_is_neither_cached_nor_used(fake_llama, capsys):
    """recalibrate measures t(1) at line(1); the engine's own one-token passes cost 0.6 x that in use:
    the new curve caught a stall the engine's passes did not (over BUSY_TOL x theirs), so it is not
    cached and None says to keep the curve there is. Where the passes in use cost as much or more, it
    replaces the entry."""
    model, made = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    calibrate.calibrate(model, opts)
    key = calibrate.entry_key(model, opts, 2)
    assert calibrate.BUSY_TOL * 0.6 < 1.0
    assert calibrate.recalibrate(model, opts, 2, "passes disagreed", in_use=0.6 * line(1)) is None
    assert "a busy spell" in capsys.readouterr().err
    assert "replaced" not in json.loads(calibrate.cache_path().read_text())["entries"][key]
    curve = calibrate.recalibrate(model, opts, 2, "passes disagreed", in_use=1.2 * line(1))
    assert curve == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS})
    assert json.loads(calibrate.cache_path().read_text())["entries"][key]["replaced"] == "passes disagreed"


def test_a_curve_measured_again_in_a_slow_spell_the_engine_shared_is_used_not_cached(fake_llama, monkeypatch, capsys):
    """The host runs every pass 1.4x slower for a while, the engine's passes too (the in-use check
    passes): the curve measured again then is the engine's for now, but the cache keeps the curve a
    quiet machine measured (RECAL_CACHE_TOL), or the next run would start from the slow spell. A level
    within the tolerance replaces the entry."""
    model, _ = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    calibrate.calibrate(model, opts)
    key = calibrate.entry_key(model, opts, 2)
    cached = lambda: json.loads(calibrate.cache_path().read_text())["entries"][key]
    assert 1.4 > calibrate.RECAL_CACHE_TOL and 1.4 < calibrate.BUSY_TOL
    contexts_costing(monkeypatch, lambda n: 1.4 * line(n))
    curve = calibrate.recalibrate(model, opts, 2, "passes disagreed", in_use=1.4 * line(1))
    assert curve == pytest.approx({n: 1.4 * line(n) for n in calibrate.DEFAULT_NS})    # used
    assert "not cached" in capsys.readouterr().err
    assert "replaced" not in cached() and float(cached()["curve"]["1"]) == pytest.approx(line(1))
    contexts_costing(monkeypatch, lambda n: 1.1 * line(n))
    calibrate.recalibrate(model, opts, 2, "passes disagreed", in_use=1.1 * line(1))
    assert cached()["replaced"] == "passes disagreed" and float(cached()["curve"]["1"]) == pytest.approx(1.1 * line(1))


def contexts_costing(monkeypatch, cost, slower_after: int | None = None, made: list | None = None):
    """calibrate's contexts from now on: a pass of n tokens costs cost(n), and twice that from the
    `slower_after`-th pass of a context on (another process starts decoding beside it); `made` gets
    each context's options."""
    class Ctx(TimedContext):
        def __init__(self, model, **opts):
            super().__init__(cost=cost)
            self.count = 0
            if made is not None:
                made.append(opts)

        def eval(self, tokens, rows=None):
            self.count += 1
            if slower_after is not None and self.count > slower_after:
                self.cost = lambda n: 2 * cost(n)
            super().eval(tokens, rows)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass
    monkeypatch.setattr(calibrate, "Context", Ctx)


def partial_cache(model, opts) -> str:
    """A cached curve of widths 1, 2 and 4 only (a run whose budget ran out), at line(n)."""
    key = calibrate.entry_key(model, opts, 2)
    cache = {"version": calibrate.CACHE_VERSION,
             "entries": {key: {"curve": {str(n): line(n) for n in (1, 2, 4)}, "threads": 2}}}
    calibrate.cache_path().parent.mkdir(parents=True, exist_ok=True)
    calibrate.cache_path().write_text(json.dumps(cache))
    return key


def test_a_partial_curve_is_not_completed_on_a_busier_machine(fake_llama, monkeypatch, capsys):
    """Completing a cached curve scales the new widths by the anchor's cached / current t. Beside
    another decoding process a narrow pass slows far more than a wide one (here t(n) = line(n) x (1 + 3/n):
    4x at width 1, 1.1x at 32), and the scaled widths would come out flat, far below what they cost: so
    nothing is kept, and a later run on a quiet machine completes the curve at the cached level."""
    model, _ = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    key = partial_cache(model, opts)
    contexts_costing(monkeypatch, lambda n: line(n) * (1 + 3 / n))
    cal = calibrate.calibrate(model, opts, verbose=True)
    assert not cal["measured"] and set(cal["curves"][2]) == {1, 2, 4}
    assert "4x its cached time now (a busier machine)" in capsys.readouterr().err
    assert set(json.loads(calibrate.cache_path().read_text())["entries"][key]["curve"]) == {"1", "2", "4"}
    contexts_costing(monkeypatch, line)                          # quiet again
    cal = calibrate.calibrate(model, opts, verbose=True)
    assert cal["measured"] and cal["curves"][2] == pytest.approx({n: line(n) for n in calibrate.DEFAULT_NS})


def test_a_partial_curve_is_not_completed_when_the_load_changes_meanwhile(fake_llama, monkeypatch, capsys):
    """The anchor is timed before and after the missing widths: a load that starts in between (every
    pass twice as dear once the warm-up and the anchor's first passes, SETTLE_ONE settling and 2 timed,
    are over: its first timings are quiet, the rest are not) drops the completion, though the first
    anchor timing matches the cache."""
    model, _ = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    partial_cache(model, opts)
    contexts_costing(monkeypatch, line, slower_after=1 + calibrate.WARM_MIN + calibrate.SETTLE_ONE + 2)
    cal = calibrate.calibrate(model, opts, verbose=True)
    assert not cal["measured"] and set(cal["curves"][2]) == {1, 2, 4}
    assert "the load changed meanwhile" in capsys.readouterr().err
    # what the rule lets through: a quiet machine's scheduler jitter on a tiny model's pass (under NOISE_S),
    # and a machine uniformly faster or slower than the cached curve's within BUSY_TOL
    assert calibrate._loaded(0.2e-3, 0.5e-3, 0.3e-3) is None
    assert calibrate._loaded(10e-3, 14e-3, 13e-3) is None and calibrate._loaded(10e-3, 4e-3, 4.2e-3) is None
    assert calibrate._loaded(10e-3, 16e-3, 16e-3) and calibrate._loaded(10e-3, 10e-3, 14e-3)


def test_completing_a_curve_never_moves_its_cached_part(fake_llama, monkeypatch):
    """The new widths are scaled by the anchor's cached / current t: an anchor timed 1.4x slow now
    (within BUSY_TOL) scales them 0.71x, and t(3) comes out below the cached t(2). The completed curve
    keeps the cached widths as they were (its level: CI once saw t(1) lowered from 5.9 to 3.2 by a
    completion whose scaled widths fell below it) and fits the low new width between them."""
    model, _ = fake_llama
    opts = dict(n_threads=2, type_k="f16", type_v="f16")
    key = partial_cache(model, opts)
    contexts_costing(monkeypatch, lambda n: 1.4 * line(n) if n == 1 else line(n))
    cal = calibrate.calibrate(model, opts)
    curve = cal["curves"][2]
    assert cal["measured"] and set(curve) == set(calibrate.DEFAULT_NS)
    assert [curve[n] for n in (1, 2, 4)] == pytest.approx([line(1), line(2), line(4)], rel=1e-12)
    assert line(3) / 1.4 < line(2) and curve[3] == pytest.approx(line(2))      # raised to the cached t(2)
    assert curve[5] == curve[6] == pytest.approx(line(4))                      # so are 5 and 6 (to t(4))
    assert curve[8] == pytest.approx(line(8) / 1.4)                             # the rest scaled as they were
    ns = sorted(curve)
    assert all(curve[a] <= curve[b] for a, b in zip(ns, ns[1:])) and not calibrate.suspects(curve)
    entry = json.loads(calibrate.cache_path().read_text())["entries"][key]
    assert {int(n): t for n, t in entry["curve"].items()} == pytest.approx(curve)


def test_flash_attention_auto_is_keyed_as_what_it_comes_to(fake_llama):
    model, _ = fake_llama
    key = lambda **o: calibrate.config_key(model, o, 2)      # noqa: E731
    assert key(flash_attn="auto", type_k="f32", type_v="f32") == key(flash_attn="off", type_k="f32", type_v="f32")
    assert key(flash_attn=False, type_k="f32", type_v="f32") == key(type_k="f32", type_v="f32")
    assert key(flash_attn="auto") == key() == key(flash_attn="off") != key(flash_attn=True)   # a CPU model
    model.n_gpu_layers = -1                                  # offloaded: auto is llama.cpp's own
    assert key(flash_attn="auto") == key() != key(flash_attn="off") != key(flash_attn=True)
    assert key(flash_attn="on") == key(flash_attn=True)


def test_flash_attention_setting():
    assert flash_attn_setting("auto", "f16", "f16", gpu=True) == "auto"
    assert flash_attn_setting("auto", "q8_0", "q8_0", gpu=True) == "auto"
    assert flash_attn_setting("auto", "f32", "f32", gpu=True) == "off"
    assert flash_attn_setting("auto", "f16", "f32", gpu=True) == "off"
    for kv in ("f16", "f32"):                  # on a CPU over F16/F32: off (not exact across pass widths)
        assert flash_attn_setting("auto", kv, kv) == "off"
    assert flash_attn_setting("auto", "f16", "f32") == "off"      # llama.cpp casts F32 to F16 for it
    for k, v in (("q8_0", "q8_0"), ("f16", "q8_0"), ("q4_0", "f16")):   # a quantized K or V: row-wise, on
        assert flash_attn_setting("auto", k, v) == "on"
    assert flash_attn_setting(True, "f32", "f32") == "on" and flash_attn_setting("on") == "on"
    assert flash_attn_setting(False) == "off" and flash_attn_setting("off", "q8_0", "q8_0") == "off"
    with pytest.raises(Exception, match="flash attention must be one of auto, on, off, not 'yes'"):
        flash_attn_setting("yes")


def test_default_kv_type():
    from prove_local.llama import default_kv_type
    assert default_kv_type("0", gpu=False) == default_kv_type(0, gpu=True) == "f32"    # an all-F32 file
    assert default_kv_type("3", gpu=False) == default_kv_type(None, gpu=False) == "q8_0/f16"   # a CPU: exact FA
    assert default_kv_type(3, gpu=False, head_dims=(64, 64)) == "q8_0/f16"
    assert default_kv_type(3, gpu=False, head_dims=(48, 48)) == "f16"                    # 32 does not divide 48
    assert default_kv_type(3, gpu=True) == "f16"                                         # llama.cpp's


def test_kv_type_option_takes_one_type_or_k_and_v_apart():
    import argparse

    from prove_local.llama import LlamaError, kv_options
    from prove_local.loading import KV_TYPE
    assert kv_options("q8_0/f16") == {"type_k": "q8_0", "type_v": "f16"}
    assert kv_options("f32") == {"type_k": "f32", "type_v": "f32"}
    with pytest.raises(LlamaError, match="'q5' in 'f16/q5' is not a KV cache type"):
        kv_options("f16/q5")
    p = argparse.ArgumentParser()
    p.add_argument("--kv-type", type=KV_TYPE)
    assert p.parse_args(["--kv-type", "q8_0/f16"]).kv_type == "q8_0/f16"
    assert p.parse_args(["--kv-type", "q8_0/q8_0"]).kv_type == "q8_0"               # one type, said twice
    assert p.parse_args(["--kv-type", "f16"]).kv_type == "f16"
    for bad in ("q8", "q8_0/", "bf16", "f16/f16/f16"):
        with pytest.raises(SystemExit):
            p.parse_args(["--kv-type", bad])


def test_flash_attention_option_on_the_command_lines():
    import argparse

    from prove_local.loading import add_flash_attn_arg
    p = argparse.ArgumentParser()
    add_flash_attn_arg(p)
    assert p.parse_args([]).flash_attn == "auto"
    assert p.parse_args(["--flash-attn"]).flash_attn == "on"
    assert p.parse_args(["--flash-attn", "off"]).flash_attn == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--flash-attn", "maybe"])


# ------------------------------------------------------------------ the passes dispute a cached curve
def test_costs_flag_a_curve_whose_passes_keep_disagreeing():
    """Width 4 calibrated at 10x what it costs (relative to width 1: beyond the shape's reach, which never
    prices a width below its calibration): after DISPUTE_OBSERVATIONS passes in a row, flagged."""
    curve = {n: line(n) for n in (1, 2, 4, 8, 16)}
    costs = Costs({"target": curve | {4: 10 * line(4)}})
    for i in range(200):
        costs.observe("target", [1], line(1))
        costs.observe("target", [4], line(4))
        if costs.flagged:
            break
    assert "t(4) 0.1x" in costs.flagged["target"]
    # what the shape can learn (a width 1.5x dearer than calibrated) is no dispute
    calm = Costs({"target": curve})
    for _ in range(500):
        calm.observe("target", [1], line(1))
        calm.observe("target", [4], 1.5 * line(4))
    assert not calm.flagged
    # the whole curve 6x off its level: the scale leaves [1/4, 4], then 32 passes later it is flagged
    slow = Costs({"target": curve})
    n = next(i for i in range(1000) if slow.observe("target", [2], 6 * line(2)) and slow.flagged)
    assert 32 <= n <= 80 and "x the cached curve" in slow.flagged["target"]
    slow.set_curve("target", curve)                      # a new curve: nothing flagged, counts start over
    assert not slow.flagged and slow._disputes["target"] == 0


def test_engine_measures_a_disputed_curve_again_at_most_twice(monkeypatch):
    eng = make_engine(n_ctx=256)
    eng.calibrate()                                        # fakes: t(n) proportional to n
    calls = []

    def fake_recalibrate(model, options, threads, why, in_use=None):
        calls.append(why)
        return {1: 2e-3, 64: 64e-3}

    monkeypatch.setattr(engine_module, "recalibrate", fake_recalibrate)
    eng.context_options = {}
    role, ctx = next(iter(eng.contexts.items()))           # the model that proposes and verifies
    ctx.model, ctx.n_threads = object(), 1
    for k in range(4):
        eng.planner.costs.flagged[role] = f"dispute {k}"
        run(eng, [1, 2, 3], mode="lossless", block="auto", max_new=4)
    assert calls == ["dispute 0", "dispute 1"]             # then dismissed: MAX_RECALIBRATIONS
    assert eng.planner.costs.base[role][1] == pytest.approx(2e-3) and not eng.planner.costs.flagged


def test_a_curve_measured_again_the_same_is_not_measured_a_third_time(monkeypatch, capsys):
    """A recalibration that finds the cached curve again (level and every t(n) / t(1) within
    SAME_CURVE) says the passes differ in use, not the cache: the engine does not measure it again
    (~0.9 s each on the embedded proposer), whatever the passes go on saying."""
    from prove_local.calibrate import SAME_CURVE, same_curve
    assert same_curve({1: 1.0, 4: 3.0}, {1: 1.1, 4: 3.2}) and not same_curve({1: 1.0, 4: 3.0}, {1: 1.0, 4: 2.0})
    assert not same_curve({1: 1.0, 4: 3.0}, {1: 1.0 + 2 * SAME_CURVE, 4: 3.0 + 6 * SAME_CURVE})   # (the level)
    cached = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert same_curve(cached, {1: 1.0, 2: 2.6, 3: 3.0, 4: 4.1})          # one width off by 30 %: noise
    assert not same_curve(cached, {1: 1.0, 2: 1.4, 3: 2.1, 4: 2.8})      # every width off: another shape
    eng = make_engine(n_ctx=256)
    eng.calibrate()
    calls = []

    def fake_recalibrate(model, options, threads, why, in_use=None):
        calls.append(why)
        return {1: 1.05e-3, 64: 66e-3}                     # the fakes' curve (1 ms, 64 ms) again, within 5 %

    monkeypatch.setattr(engine_module, "recalibrate", fake_recalibrate)
    eng.context_options = {}
    role, ctx = next(iter(eng.contexts.items()))
    ctx.model, ctx.n_threads = object(), 1
    eng._thread_curves[role] = {1: {1: 1e-3, 64: 64e-3}}
    for k in range(4):
        eng.planner.costs.flagged[role] = f"dispute {k}"
        run(eng, [1, 2, 3], mode="lossless", block="auto", max_new=4)
    assert calls == ["dispute 0"] and not eng.planner.costs.flagged
    assert "matches the cached one" in capsys.readouterr().err


def test_a_curve_measured_again_in_a_busy_spell_leaves_the_engine_its_curve(monkeypatch):
    """The engine hands recalibrate what its one-token passes cost in use (the calibrated t(1) x the
    scale); where recalibrate says the new curve caught a busy spell (None), the engine keeps the curve
    it has and drops the flag; the attempt counts towards MAX_RECALIBRATIONS."""
    eng = make_engine(n_ctx=256)
    eng.calibrate()
    seen = []

    def fake_recalibrate(model, options, threads, why, in_use=None):
        seen.append(in_use)
        return None

    monkeypatch.setattr(engine_module, "recalibrate", fake_recalibrate)
    eng.context_options = {}
    role, ctx = next(iter(eng.contexts.items()))
    ctx.model, ctx.n_threads = object(), 1
    eng.planner.costs.scale[role] = 1.5
    base = eng.planner.costs.base[role].copy()
    eng.planner.costs.flagged[role] = "dispute"
    eng._recalibrate()
    assert seen == [pytest.approx(1.5e-3)] and not eng.planner.costs.flagged
    assert (eng.planner.costs.base[role] == base).all() and eng._recalibrated[role] == 1


class SwitchingContext(TimedContext):
    """A TimedContext with a gated adapter: a pass whose adapter setting differs from the last pass's
    costs `on` (switched on) or `off` (switched off) more, as llama.cpp's graph re-plan does."""

    def __init__(self, on: float, off: float, **kw):
        super().__init__(**kw)
        self.on, self.off, self.adapter_on = on, off, False

    def eval(self, tokens, rows=None, adapter: bool = False):
        if adapter != self.adapter_on:
            extra = self.on if adapter else self.off
            self.decode_seconds += extra
            self.now += extra
            self.adapter_on = adapter
        super().eval(tokens, rows)


def test_the_adapters_switches_are_measured_apart_from_its_passes():
    ctx = SwitchingContext(10e-3, 8e-3, n_past=40)
    got = calibrate.measure_switch(ctx, list(range(50)))
    assert got["on"] == pytest.approx(10e-3) and got["off"] == pytest.approx(8e-3)
    assert got["switch"] == pytest.approx(18e-3) and ctx.n_past == 40
    # a stall on one round moves no median; a context without switches measures 0
    stalled = SwitchingContext(10e-3, 8e-3, n_past=40, stall=lambda n, k: 0.5 if (n, k) == (2, 4) else 0.0)
    assert calibrate.measure_switch(stalled, list(range(50)))["switch"] == pytest.approx(18e-3)
    assert calibrate.measure_switch(SwitchingContext(0.0, 0.0), [1, 2])["switch"] == 0.0


def test_the_tests_calibrations_never_reach_the_users_cache():
    """conftest points PROVE_LOCAL_CACHE at a temporary folder before any test module is imported, so
    an environment copied at import (test_rpc's ENV) keeps the tests' models out of ~/.cache too."""
    assert CACHE_AT_IMPORT is not None
    assert calibrate.cache_path() == Path(CACHE_AT_IMPORT) / "calibration.json"
    assert Path(CACHE_AT_IMPORT).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
