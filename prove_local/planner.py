"""The cost-aware planner behind `--block auto`: per cycle, how wide to decode.

Objective: expected committed tokens per second. Per cycle the planner
  * before the proposal pass picks the proposal width B (1 .. the GGUF's block size) of
    lossless/prove/mars, or the draft length k of spec, or a plain `ar` cycle when no width is
    expected to beat one token per one-token pass;
  * after a lossless proposal pass, seeing p̃ of every slot, picks how many proposed tokens to verify
    (the p-min idea of llama.cpp's --spec-draft-p-min, driven by cost instead of a fixed threshold;
    llama.cpp's common/speculative.cpp stops drafting below p_min).

What it knows:
  * pass costs t(n) per role from calibrate.py, rescaled online by what the passes really cost
    (a log-space moving average of measured / predicted seconds), plus the Python overhead of each
    cycle kind measured from the cycles themselves (the planner's own time counts there);
  * acceptance statistics per mode, updated from every Cycle: per slot (accepted given every earlier
    slot was) and a calibration of p̃ (how often a slot with a given p̃ is accepted), both with
    exponential forgetting so that they follow the text.
Like vLLM PR #44336's goodput(K) = E[accepted](K) / cost(K), but with the measured curve of this
machine, per-slot rates, an ε-greedy exploration that keeps the statistics of unused widths fresh
(within a regret budget: what explorations lose stays under 1 % of the time) and hysteresis so that the
choice does not flap. While plain ar is the choice, the planner hands out quiet runs of ar cycles and
does almost no work per cycle. On a CPU a pass of n tokens costs nearly n one-token passes, so narrow
blocks or ar win; on a GPU the curve is flat and the full block wins (measured: docs/planner.md).

The verify choice is a marginal one: the proposal pass is paid, so verify width v maximises
E[tokens committed | p̃, v] - R * t(v), with R the planned rate in tokens per second (the opportunity
cost of time, a renewal-reward argument). Exactness is untouched: the rules commit only tokens the
model itself would commit greedily, whatever the widths (tests/test_planner.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .lookup import MAX_MATCH
from .modes import GATED, LOOKUP, MODES, cycle_cost, filled, label, plan_width, tested
from .rules import AR_PLAN, Plan

N_SLOTS = 64
LOOKUP_K_MAX = 16                               # longest lookup draft the planner considers
LOOKUP_DECAY = 0.995                            # lookup statistics follow the text faster than a model's slots
LOOKUP_REFRESH = 8                              # lookup cycles between recomputations of the lookup table
LOOKUP_LOCAL_WEIGHT = 4.0                       # the engine-wide lookup record counts as this many of the request's own slots
LOOKUP_LOCAL_EAGER = 16                         # the request's first lookup cycles recompute the table:
LOOKUP_EAGER_EVERY = 4                          # after each miss, and after every 4th lookup cycle
LOOKUP_BACKOFF = 4                              # most cycles the index is not asked after offers of no use
BACKOFF_SHARE = 0.05                            # ... where an ar cycle's host time is this share of its pass
EXPLORE_FLOOR = 0.8                             # a lookup exploration's expected rate, at least this x the current choice's
EXPLORE_PRIOR = True                            # lookup explorations judged by the engine-wide record too (_lookup_table)
CLIMB = True                                    # a request whose drafts are accepted whole probes longer ones (observe)
LOOKUP_LOSS_CHECK = True                        # a lookup exploration or probe runs only if its expected loss fits the budget
LOOKUP_START = 2                                # a request's first lookup drafts are at most this long (slow start)
LOOKUP_KEEP = 0.5                               # ... and after a rejection, at least this share of the cap stands


# the lookup table's slots: the score of each of the MAX_MATCH + LOOKUP_K_MAX distinct match lengths
# (lookup.score; 0 for none), and per match length m and draft length k the index of slot k's score
_TABLE_SCORES = np.array([u / (u + 1.0) if u > 0 else 0.0 for u in range(MAX_MATCH + LOOKUP_K_MAX)])
_TABLE_SLOTS = np.arange(0, MAX_MATCH + 1)[:, None] + np.arange(1, LOOKUP_K_MAX + 1)[None, :] - 1

AR_SAMPLE = 8                                   # ar cycles per one whose cost the planner records
AR_SAMPLE_CLEAR = 128                           # ... in a clear run (nothing planned: Planner.quiet_cycle)
SWITCH_AFTER = 4                                # ar cycles after a wider pass whose excess time is the switch's
SWITCH_STEADY = 8                               # steady ar cycles (recorded densely until then) before the switch is priced
SETTLED_SLACK = 0.05                            # a replan keeps ar "clearly" when no width comes within this share of the bar
SETTLED_MAX = 3                                 # ... and the replans then come up to 2**SETTLED_MAX times less often
SWITCH_REPRICE = 0.1                            # a lookup table whose switch price is off by this share of an ar cycle is made again
LANE = True                                     # quiet ar cycles granted in runs the engine counts down (grant)
BACKOFF_LANE = True                             # ... the index's back-off's cycles too (quiet_cycle)
MEMORY_LOOKUP = False                           # the planner's memory holds the lookup drafts' record too (measured: no)
AFTER_EXPLORATION = 8                           # cycles after an exploration whose excess time is charged to it
CATCH_UP = 2                                    # a partner's pending tokens counted in its planned pass
WARM = True                                     # the first plans made at prepare (Planner.warm)
MEMORY_VERSION = 1                              # Planner.memory's format
MEMORY_SWITCH_WEIGHT = 8                        # recalled switch records count as at most this many cycles
LOAD_TOLERANCE = 0.25                           # a step's load must move by more than this share to replan


class Costs:
    """t(n) in seconds per role: the calibrated curve (linear between measured widths, extended past
    the last one along its last segment), times an online scale per role, times an online *shape*
    per role: how much more a pass of width n costs, relative to a one-token pass, than the
    calibration said. The calibration runs on an empty context; at the depths a request reaches,
    wide passes cost more per one-token pass than there (SmolLM2 Q4_1, 2 threads, ~200-token
    contexts: a 14-token pass 8.0 one-token passes, calibrated 6.1; a 3-token pass 2.3, calibrated
    2.4), and a planner that prices a 13-token lookup draft at 6 passes drafts it where 8 does not
    pay. The shape is learned from the passes the cycles run (`observe`): per width, an average of
    log(measured / calibrated) over one-pass cycles (ar, lookup verifies), minus that of width 1, once both have
    SHAPE_MIN observations, less the calibration's noise (SHAPE_NOISE), within [SHAPE_LO, SHAPE_HI]
    (a width is never priced below its calibration); between observed widths it is interpolated
    in log space, past the widest one it stays flat. Width 1 anchors it (its shape is 1), so the
    scale still follows the machine's speed and t(1) is what a one-token pass costs."""

    SHAPE_MIN = 8               # observations of a width (and of width 1) before its shape counts
    SHAPE_ALPHA = 0.2           # weight of a new observation in a width's average
    # the shape's bounds: never below the calibration. A planner that underprices a width drafts
    # where it loses to ar; one that overprices it forgoes a gain. On the embedded proposer (0.3 ms
    # passes, 1 thread) a shape learned down to 0.66 at widths 6-8 from a few dozen noisy lossless
    # cycles sent the planner to B=6 at 40 % acceptance: 0.94x ar, against 0.99x without a shape
    SHAPE_LO, SHAPE_HI = 1.0, 2.0
    # a deviation is believed only past the calibration's own noise, and only the part past it:
    # shape = measured ratio / SHAPE_NOISE where that exceeds 1 (SmolLM2's 1.4-1.8 at widths 9-14
    # are kept at 1.2-1.5; a 1.09 at width 2 is not kept)
    SHAPE_NOISE = 1.2
    # a cached curve the passes keep disagreeing with is measured again, not trusted (the engine does
    # it: `flagged`): a width whose cost relative to width 1 is off its calibration by more than the
    # shape can learn (above DISPUTE_HI, below 1 / DISPUTE_LO: the shape is never below 1), or a scale
    # past DISPUTE_SCALE either way, for DISPUTE_OBSERVATIONS observations in a row. (A calibration that
    # one stall poisoned cached SmolLM2's t(4) at 1,000 one-token passes; priced so, 4-token passes
    # never ran, and nothing the cycles saw could fix it.)
    DISPUTE_HI = SHAPE_HI * SHAPE_NOISE * 1.25          # 3.0
    DISPUTE_LO = 1.5
    DISPUTE_SCALE = 4.0
    DISPUTE_OBSERVATIONS = 32
    # the widths around a step's token count whose curve steps price one more token in it (`marginal`)
    MARGINAL_WINDOW = 2

    def __init__(self, curves: dict[str, dict[int, float]], n_max: int = 160):
        self.n_max = n_max
        self.base: dict[str, np.ndarray] = {}
        self.scale: dict[str, float] = {}
        self.dev: dict[str, dict[int, list]] = {}           # per role, width: [mean log deviation, count]
        self.shape: dict[str, np.ndarray | None] = {}       # per role: the learned shape over 0..n_max
        self._stale: set[str] = set()                       # roles whose shape the last observations moved
        self._off: dict[str, dict[int, float]] = {}         # per role: widths off the calibration beyond the shape's reach
        self._disputes: dict[str, int] = {}                 # per role: observations in a row while disputed
        self.flagged: dict[str, str] = {}                   # per role: why its curve should be measured again
        self.load: dict[str, int] = {}                      # per role: other tokens in the steps its passes join (set_load)
        self.others = 0                                     # the other sequences in those steps
        # seconds a gated lossless cycle spends switching its adapter on and off, on top of its two
        # passes (calibrate.switch_cost: llama.cpp re-plans the graph at each switch; SmolLM2-135M Q4_1,
        # 2 threads: ~10 ms on, ~8 off, where a one-token pass takes ~13); the engine sets it
        self.adapter_switch = 0.0
        for role, curve in curves.items():
            self.set_curve(role, curve)

    def set_curve(self, role: str, curve: dict[int, float]) -> None:
        ns = sorted(int(n) for n in curve)
        ts = [float(curve[n]) for n in ns]
        grid = np.arange(self.n_max + 1, dtype=float)
        t = np.interp(grid, ns, ts)
        if len(ns) == 1:
            # one measured width (a calibration cut short): t(n) proportional to n, a CPU's worst
            # case, rather than flat (which would make every width look free)
            t = ts[0] * grid / max(ns[0], 1)
        elif len(ns) >= 2:
            # past the last measured width: the curve's mean slope (a noisy last segment can fall)
            slope = max(0.0, (ts[-1] - ts[0]) / (ns[-1] - ns[0]))
            past = grid > ns[-1]
            t[past] = ts[-1] + slope * (grid[past] - ns[-1])
        t[0] = 0.0
        self.base[role] = t
        self.scale[role] = 1.0
        self.dev[role] = {}
        self.shape[role] = None
        self._stale.discard(role)
        self._off[role] = {}
        self._disputes[role] = 0
        self.flagged.pop(role, None)

    def solo(self, role: str, n: int) -> float:
        """t(n) of a pass decoded alone: the curve, times the scale and the shape (role GATED: the
        target's adapter pass, priced as the target's pass plus the adapter's switches, `adapter_switch`)."""
        n = int(n)
        extra = 0.0
        if role == GATED:
            role, extra = "target", (self.adapter_switch if n > 0 else 0.0)
        b = self.base[role]
        if n == 1:                            # (the shape is relative to width 1: 1 there)
            return float(b[1]) * self.scale[role] + extra
        sh = self._shape(role)
        if n >= len(b):
            slope = max(0.0, (b[-1] - b[1]) / (len(b) - 2))
            return float(b[-1] + slope * (n - len(b) + 1)) * self.scale[role] * (1.0 if sh is None else float(sh[-1])) + extra
        return float(b[n]) * self.scale[role] * (1.0 if sh is None else float(sh[n])) + extra

    def t(self, role: str, n: int) -> float:
        """What a pass of n tokens costs: alone, t(n); in a batched step that decodes `load[role]` = M
        other tokens (batching.py), what it adds to the step. A one-token pass joins the other
        one-token passes in one graph: t(M + 1) - t(M). A wider pass is a graph of its own: llama.cpp
        splits a batch of several sequences into ubatches of equal widths (`split_equal`, with
        `kv_unified` off), so its step runs t(n) longer, on any backend (on a GPU a whole pass,
        where one more token in a graph is nearly free); so is a gated adapter's pass (role GATED),
        a llama_decode of its own."""
        m = self.load.get(role, 0)
        if m and n == 1:
            return self.marginal(role, m)
        return self.solo(role, n)

    def marginal(self, role: str, m: int) -> float:
        """What one more token adds to a step of m tokens: the median of the curve's steps
        t(k + 1) - t(k) for k within MARGINAL_WINDOW of m, between 0 and t(1). The step at m alone is
        a difference of two noisy timings: SmolLM2's curve calibrated through a stall here (t(1..8)
        40.6, 75.7, 159.3, 207.7 x 4, 329.4 ms, flat where the stall ended) priced the 4th token of a
        step at 48.4 ms, above a pass of its own, and the 5th to 7th at 0; beside 3 other requests
        ar looked dearer than a 1-token lookup draft, and `lossless` drafted one in ~1 of 23 cycles,
        each a second ubatch the whole step waited for (docs/planner.md). A token never costs a step
        more than its own one-token pass would (at worst llama.cpp decodes it apart)."""
        lo = max(1, m - self.MARGINAL_WINDOW)
        steps = [self.solo(role, k + 1) - self.solo(role, k) for k in range(lo, m + self.MARGINAL_WINDOW + 1)]
        return min(max(0.0, float(np.median(steps))), self.solo(role, 1))

    def solo_table(self, role: str) -> np.ndarray:
        if role == GATED:
            out = self.solo_table("target") + self.adapter_switch
            out[0] = 0.0
            return out
        sh = self._shape(role)
        return self.base[role] * self.scale[role] * (1.0 if sh is None else sh)

    def table(self, role: str) -> np.ndarray:
        """t(n) for n = 0 .. n_max (`t`: under a load, a one-token pass at its marginal cost)."""
        solo = self.solo_table(role)
        if not self.load.get(role, 0):
            return solo
        out = solo.copy()
        out[1] = self.t(role, 1)
        return out

    def set_load(self, load: dict[str, int], sequences: int = 0) -> bool:
        """The other tokens per role that the next passes will be decoded with (batching.py: a pool's
        step), and the other sequences they belong to; {} alone. Returns whether it changed (cached
        costs are then stale)."""
        load = {r: int(m) for r, m in load.items() if m > 0 and r in self.base}
        sequences = int(sequences) if load else 0
        if (load, sequences) == (self.load, self.others) or self._near(load, sequences):
            return False
        self.load, self.others = load, sequences
        return True

    def _near(self, load: dict[str, int], sequences: int) -> bool:
        """Whether a load is within LOAD_TOLERANCE of the one priced now (each role's tokens and the
        sequences): then the prices stand. Every replan rebuilds the rate tables (about a millisecond of
        host time each, measured with 8 requests in a pool) and the whole step waits for it, while a
        sequence more or less among several moves G and T of every option's (G + g) / (T + c) alike;
        the median over recent steps walks through every count as requests join and leave, and
        without the tolerance replanned 70 times in 527 cycles (8 requests x 64 tokens on SmolLM2).
        Alone against batched, or a role joining or leaving the load, is always a change."""
        if not load or not self.load or load.keys() != self.load.keys():
            return False
        pairs = [(sequences, self.others)] + [(load[r], self.load[r]) for r in load]
        return all(abs(a - b) <= LOAD_TOLERANCE * max(b, 1) for a, b in pairs)

    def step_rest(self) -> tuple[float, float]:
        """(tokens, seconds) of the rest of the step a pass joins: the other sequences' tokens
        committed per step (one each, at least: an ar request's), and what their decodes cost
        (the solo t(M) of each role's load); (0, 0) alone."""
        if not self.load:
            return 0.0, 0.0
        return float(self.others), sum(self.solo(r, m) for r, m in self.load.items())

    def observe(self, role: str, widths: list[int], seconds: float, alpha: float = 0.1,
                batch: list[tuple[int, int]] | None = None) -> float | None:
        """Fold one cycle's measured decode seconds of `role` into its scale (every cycle) and, when
        the cycle ran one pass (ar, a lookup verify), into the shape at its width; returns measured /
        predicted (before the update), or None when nothing was predicted. A cycle of several passes
        (lossless: proposal and verify back to back; spec's draft passes) teaches the scale only: on
        the embedded proposer two 3-token lossless passes in a row cost 1.5x a calibrated 3-token
        pass each, which priced B=3 out and sent the planner to B=6 (0.92-1.00x ar, 1.04-1.05x without).
        `batch`: (sequences, tokens) of the llama_decode of each pass (Cycle.batch). A cycle with a
        pass batched with other requests' (batching.py) teaches nothing and returns None: its seconds
        are a share by tokens of decodes whose ubatches (llama.cpp's split_equal, by the widths of
        passes it cannot see) this cost model does not know; the scale stays what the passes alone
        taught it."""
        if role not in self.base or seconds <= 0 or not widths:
            return None
        if batch and any(k > 1 for k, _ in batch):
            return None
        predicted = sum(self.solo(role, w) for w in widths)
        if predicted <= 0:
            return None
        ratio = seconds / predicted
        w = widths[0]
        if len(widths) == 1 and 0 < w < len(self.base[role]) and self.base[role][w] > 0:
            self._observe_shape(role, w, math.log(seconds / self.base[role][w]))
        # log space, clipped: one stalled pass must not swing the scale by orders of magnitude
        step = max(-1.0, min(1.0, math.log(ratio)))
        self.scale[role] *= math.exp(alpha * step)
        sc = self.scale[role]
        if self._off[role] or not 1.0 / self.DISPUTE_SCALE <= sc <= self.DISPUTE_SCALE:
            self._disputes[role] += 1
            if self._disputes[role] >= self.DISPUTE_OBSERVATIONS and role not in self.flagged:
                self.flagged[role] = self._dispute_reason(role)
        else:
            self._disputes[role] = 0
        return ratio

    def dismiss(self, role: str) -> None:
        """The caller will not measure `role` again now: its flag goes, and the count starts over."""
        self.flagged.pop(role, None)
        self._disputes[role] = 0

    def _dispute_reason(self, role: str) -> str:
        """Why the passes of `role` disagree with its calibrated curve, in words (for the cache entry and stderr)."""
        n = self.DISPUTE_OBSERVATIONS
        off = self._off[role]
        if off:
            widths = ", ".join(f"t({w}) {r:.2g}x" for w, r in sorted(off.items()))
            return (f"for {n} passes in a row, passes cost other multiples of a one-token pass than the cached "
                    f"curve says (measured / calibrated, relative to width 1: {widths})")
        return f"for {n} passes in a row, passes cost {self.scale[role]:.2g}x the cached curve"

    def _check_off(self, role: str, w: int) -> None:
        """Whether width w (every width, when w is 1) is off its calibration beyond the shape's reach."""
        devs, off = self.dev[role], self._off[role]
        one = devs.get(1)
        if one is None or one[1] < self.SHAPE_MIN:
            off.clear()
            return
        hi, lo = math.log(self.DISPUTE_HI), -math.log(self.DISPUTE_LO)
        for x in (devs if w == 1 else (w,)):
            d = devs.get(x)
            if x == 1 or d is None or d[1] < self.SHAPE_MIN:
                continue
            rel = d[0] - one[0]
            if rel > hi or rel < lo:
                off[x] = math.exp(rel)
            else:
                off.pop(x, None)

    def _observe_shape(self, role: str, w: int, dev: float) -> None:
        """One pass of width w cost exp(dev) times its calibrated t(w). The deviations are kept against
        the calibration alone, never against the scale: the shape is then a difference of two measured
        averages, and the scale (which prices every cycle through the shape) cannot feed back into it.
        (Measured against the scale, a shape below 1 at a width the cycles ran often made those cycles
        look cheap, the scale grew to match them, the rarely observed width 1 stayed behind and the
        shape fell further: on the embedded proposer the scale reached 1,600 and the shape at widths
        2-3 0.001.) Clipped to [SHAPE_LO, SHAPE_HI]."""
        d = self.dev[role].setdefault(w, [dev, 0])
        # clipped around the width's mean: one stalled pass moves it by at most SHAPE_ALPHA
        d[0] += self.SHAPE_ALPHA * (max(d[0] - 1.0, min(d[0] + 1.0, dev)) - d[0])
        d[1] += 1
        self._check_off(role, w)
        self._stale.add(role)

    def _shape(self, role: str) -> np.ndarray | None:
        """The learned shape of `role`, rebuilt from its deviations when observations moved them since
        (an ar cycle's observation moves the deviation at width 1, so every width's; the rebuild is
        done when a price is read, not at each observation: the planner reads prices at a replan)."""
        if role in self._stale:
            self._stale.discard(role)
            self._rebuild_shape(role)
        return self.shape.get(role)

    def _rebuild_shape(self, role: str) -> None:
        one = self.dev[role].get(1)
        seen = sorted(x for x, (_, c) in self.dev[role].items() if c >= self.SHAPE_MIN and x > 1)
        if one is None or one[1] < self.SHAPE_MIN or not seen:
            self.shape[role] = None
            return
        xs = [1] + seen
        noise = math.log(self.SHAPE_NOISE)
        logs = [min(math.log(self.SHAPE_HI), max(math.log(self.SHAPE_LO), self.dev[role][x][0] - one[0] - noise))
                for x in seen]
        logs = [0.0] + logs
        grid = np.arange(len(self.base[role]), dtype=float)
        self.shape[role] = np.exp(np.interp(grid, xs, logs))

    def shape_summary(self, role: str) -> dict[int, float]:
        """The learned shape at the widths observed often enough (for people: planner summary)."""
        sh = self._shape(role)
        if sh is None:
            return {}
        return {w: round(float(sh[w]), 3) for w, (_, c) in sorted(self.dev[role].items()) if c >= self.SHAPE_MIN}


@functools.lru_cache(maxsize=8)
def _centers(bins: int) -> np.ndarray:
    """The p̃ bins' centers (read-only: shared by every SlotStats of that many bins)."""
    c = (np.arange(bins) + 0.5) / bins
    c.flags.writeable = False
    return c


class SlotStats:
    """Acceptance of proposal slots for one mode: per slot (accepted given every earlier slot was)
    and per p̃ bin, with forgetting factor `decay` per recorded cycle. Priors: `prior` acceptance
    per slot, and the bin's own p̃ for the calibration, each worth `weight` observations.
    Counts are plain lists (a cycle touches a few entries; numpy pays off only when planning)."""

    def __init__(self, n_slots: int = N_SLOTS, bins: int = 10, prior: float = 0.5, weight: float = 2.0,
                 decay: float = 0.998):
        self.tested = [0.0] * n_slots
        self.accepted = [0.0] * n_slots
        self.bins = bins
        self.bin_tested = [0.0] * bins
        self.bin_accepted = [0.0] * bins
        self.prior, self.weight, self.decay = prior, weight, decay
        self.centers = _centers(bins)           # (shared: a request's own record is made at its start)
        self.n_cycles = 0

    def record(self, p, lo: int, hi: int, run: int) -> None:
        """Slots lo..hi-1 were up for acceptance; slots < run were accepted, slot `run` (if < hi)
        was rejected, later slots were not tested."""
        self.n_cycles += 1
        if self.n_cycles % 16 == 0:             # forgetting, applied every 16 cycles (cheaper)
            f = self.decay ** 16
            for a in (self.tested, self.accepted, self.bin_tested, self.bin_accepted):
                a[:] = [x * f for x in a]
        end = min(hi, run + 1, len(self.tested))
        top, nb = self.bins - 1, self.bins
        tested, accepted, bt, ba = self.tested, self.accepted, self.bin_tested, self.bin_accepted
        for i in range(lo, end):
            b = min(int(p[i] * nb), top)
            tested[i] += 1.0
            bt[b] += 1.0
            if i < run:
                accepted[i] += 1.0
                ba[b] += 1.0

    def _bin(self, p: np.ndarray) -> np.ndarray:
        # (np.minimum/np.maximum, not np.clip: its Python-level checks cost ~30 us a call between passes)
        return np.minimum(np.maximum((p * self.bins).astype(int), 0), self.bins - 1)

    def slot_rates(self, n: int) -> np.ndarray:
        """Acceptance of slots 0..n-1 (smoothed towards the prior)."""
        return (np.asarray(self.accepted[:n]) + self.prior * self.weight) / (np.asarray(self.tested[:n]) + self.weight)

    def p_rates(self, p) -> np.ndarray:
        """Acceptance of slots with confidences p (smoothed towards p̃ itself)."""
        b = self._bin(np.asarray(p, dtype=float))
        return (np.asarray(self.bin_accepted)[b] + self.centers[b] * self.weight) / (np.asarray(self.bin_tested)[b] + self.weight)

    def counts(self) -> dict:
        """The counts, as plain data (Planner.memory): copies, which later cycles do not move."""
        return {"tested": list(self.tested), "accepted": list(self.accepted), "bin_tested": list(self.bin_tested),
                "bin_accepted": list(self.bin_accepted), "n_cycles": self.n_cycles}

    def set_counts(self, d: dict) -> None:
        """Counts from `counts()` (checked by Planner.recall)."""
        self.tested, self.accepted = [float(x) for x in d["tested"]], [float(x) for x in d["accepted"]]
        self.bin_tested, self.bin_accepted = [float(x) for x in d["bin_tested"]], [float(x) for x in d["bin_accepted"]]
        self.n_cycles = int(d["n_cycles"])

    def summary(self, n: int = 16) -> dict:
        return {"slot_rate": [round(float(x), 3) for x in self.slot_rates(n)],
                "slot_tested": [round(float(x), 1) for x in self.tested[:n]],
                "p_calibration": [round(float(x), 3) for x in self.p_rates(self.centers)],
                "p_tested": [round(float(x), 1) for x in self.bin_tested]}


@dataclass
class _Layout:
    """The options of one mode for the planner's rates: width and tested tokens of each plan, where
    each width's plans start, and per role the passes (option index, widths fed)."""
    width: np.ndarray
    tested: np.ndarray
    starts: np.ndarray
    passes: dict
    steps: np.ndarray            # passes per plan, every role's: the batched steps its cycle spans
    seg: np.ndarray | None = None    # per plan, its width's index (0-based): the run of `starts` it is in


@dataclass
class _LookupTable:
    """Per match length m (1..MAX_MATCH): the plan a lookup offer of that match gets (None: the current
    choice is expected to do better) and the best lookup draft's (k, rate) (for exploration), computed
    against `rate`, the current choice's expected tokens per second."""
    rows: list
    best: list
    rate: float
    made_at: int
    cur: object
    pend: int
    any: bool = False            # some match length gets a plan
    local: int = 0               # the request's lookup cycles when it was made
    rates: object = None         # [match length, k - 1]: expected tokens per second of a k-token draft
    costs: object = None         # the plans' costs it was made with (reused while only acceptance moved)
    min_match: int = MAX_MATCH + 1   # the shortest match length that gets a plan (MAX_MATCH + 1: none)
    switch: float = 0.0          # the switch price in those costs (Planner.switch_cost), and an ar cycle's cost
    t_ar: float = 0.0
    cand: list | None = None     # per match length: the best plan and its rate, before the comparison with `rate`
    cand_r: list | None = None
    ceilings: list | None = None     # per k - 1: a k-token draft's rate with every token accepted
    ar_rate: float = 0.0             # ar's rate in the same prices
    priced: int = 0                  # the planner's load generation it was priced at (Planner.set_load)

    def __post_init__(self):
        self.min_match = next((m for m, r in enumerate(self.rows) if m and r is not None), MAX_MATCH + 1)
        self._capped: dict = {}      # (cap, climb) -> its _Capped; ("explore", floor) -> its explore_min

    def explore_min(self, floor: float) -> int:
        """The shortest match length whose best lookup draft is worth exploring: its expected rate at
        least `floor` x the current choice's, and its rate with every token accepted above ar's
        (MAX_MATCH + 1: none). Cached per floor."""
        got = self._capped.get(("explore", floor))
        if got is None:
            bar = floor * self.rate
            got = next((m for m, (k, r) in enumerate(self.best) if m and r >= bar and (
                self.ceilings is None or self.ceilings[k - 1] >= self.ar_rate)), MAX_MATCH + 1)
            self._capped[("explore", floor)] = got
        return got

    def capped(self, cap: int, margin: float, climb: bool = False) -> "_Capped":
        """The plans a request whose lookup drafts are capped at `cap` tokens (the slow start: Planner.observe)
        gets from this table, per match length: a plan of at most `cap` lookup tokens stands; a longer
        MARS proposal filled by lookup tokens is cut to `cap` of them; a longer lookup draft is cut to
        `cap` tokens where that draft still beats the current choice's rate by `margin`, else the row
        has none, or, while the request climbs (`climb`: its last draft was accepted whole), the
        `cap`-token draft as a probe (`_Capped.probes`: run as an exploration). Cached per cap (the cap
        moves after a lookup cycle and at a request's start)."""
        got = self._capped.get((cap, climb))
        if got is None:
            bar = self.rate * (1.0 + margin)
            at_cap = self.rates[:, cap - 1].tolist() if self.rates is not None and cap <= self.rates.shape[1] else None
            rows, probes = [], set()
            for m, plan in enumerate(self.rows):
                if plan is not None and plan.lookup > cap:
                    pays = filled(plan) or (at_cap is not None and at_cap[m] > bar)
                    if not pays and climb:
                        probes.add(m)
                    plan = Plan(plan.kind, plan.block, verify=plan.verify, lookup=cap) if pays or climb else None
                rows.append(plan)
            got = self._capped[(cap, climb)] = _Capped(rows, probes=probes)
        return got


@dataclass
class _Capped:
    """A lookup table's plans under a draft cap (_LookupTable.capped): per match length, the plan or None."""
    rows: list
    min_match: int = MAX_MATCH + 1   # the shortest match length that gets a plan (MAX_MATCH + 1: none)
    any: bool = False
    probes: set = dataclasses.field(default_factory=set)   # match lengths whose plan is a climb's probe

    def __post_init__(self):
        self.min_match = next((m for m, r in enumerate(self.rows) if m and r is not None), MAX_MATCH + 1)
        self.any = self.min_match <= MAX_MATCH


def _same_ar(a, b) -> bool:
    """Whether two current choices (Choice, or None) are both `ar`."""
    return a is not None and b is not None and a.kind == "ar" and b.kind == "ar"


@dataclass
class Choice:
    kind: str          # "ar" or the mode
    width: int         # B, or k for spec
    rate: float        # expected tokens per second
    tokens: float = 1.0          # expected tokens committed per cycle
    seconds: float = 0.0         # expected seconds per cycle (passes + Python overhead)
    verify: int | None = None    # the best verify width of a block (lossless)
    ceiling: float = math.inf    # its rate were every proposed token accepted (what exploring it can find; ar: inf)
    # seconds of the steps its cycle spans: P T + c beside other requests (rates(): P passes, each a step
    # of their T seconds), its own `seconds` alone (0: not known, taken as `seconds`)
    span: float = 0.0


class Planner:
    """Per-engine planner: statistics from every cycle (`observe`), a plan per cycle (`plan`).
    `costs` is None until calibrated (the engine calibrates at the first `--block auto` request).
    explore: probability of an exploratory cycle (to keep statistics fresh; see _explore);
    hysteresis: a new width must beat the current one's expected rate by this share;
    ar_margin: a width must beat plain ar by this share (estimates are noisy; ar is the safe side);
    replan_every: the best width is recomputed every so many cycles (the planner's own time);
    explore_budget: explorations may cost at most this share of the decoding time (see _budget_left)."""

    def __init__(self, costs: Costs | None = None, *, explore: float = 0.02, explore_wide: float = 0.1,
                 hysteresis: float = 0.03, ar_margin: float = 0.05, replan_every: int = 16, k_max: int = 8,
                 seed: int = 0, explore_by_rate: bool = True, explore_budget: float = 0.01):
        self.costs = costs
        # the regret budget: an exploration's regret is the time it took beyond what the choice it
        # displaced would have taken for the tokens it committed (a draft's catch-up pass after a run
        # of ar cycles included), plus the same excess of the AFTER_EXPLORATION cycles after it (passes
        # right after a change of width run slower for a few passes: measured on the embedded pair, the
        # exploration cycles alone accounted for 1.0 % of the time while exploring cost 2.7 %);
        # explorations stop while the summed regret exceeds explore_budget x the decoding time seen,
        # so that where ar wins by far, auto loses at most ~1 % to it
        self.explore_budget = explore_budget
        self.elapsed = 0.0                            # seconds of every observed cycle
        self.regret = 0.0                             # seconds lost to explorations and their draws (>= 0)
        # the next observed cycle followed an exploration draw (MARS or lookup) that did not explore: its host time beyond
        # an ar cycle's (the index caught up and asked, the tables read or made again: ~90-180 us between
        # the embedded pair's ~0.45 ms passes, where that code runs from cold caches) is regret, so that
        # the budget bounds what exploring costs, draws included (4 % of the cycles drew there, ~1.5 % of
        # the time, beside the budget's 1 %)
        self._drew = False
        self._displaced: float | None = None          # expected rate of the choice the pending exploration displaced
        self._after = 0                               # cycles after an exploration still charged to it
        self._quiet: dict[str, int] = {}              # ar cycles left before the next draw or replan, per key
        self._draw: dict[str, bool] = {}              # the next cycle attempts an exploration, per key
        self._lookup_draw: dict[str, bool] = {}       # the lookup exploration draw quiet_cycle made, per key
        self._lookup_due: dict[str, bool] = {}        # a lane ended where quiet_cycle's next lookup draw succeeds, per key
        # a lane (`_grant`): the next `lane` cycles are ar cycles that quiet_cycle would pass with nothing
        # else to do and `observe` would only count; the engine runs them without calling either (it counts
        # `lane` down and adds their seconds to `elapsed`), and the next call that reads the counters
        # settles them (`_settle`). `_lane`: (key, cycles granted, ended by a lookup draw, cycles of the
        # index's back-off) while one is out
        self.lane = 0
        self._lane: tuple[str, int, bool, bool] | None = None
        self._clear: dict[str, int] = {}              # a quiet run whose lookup table has no plan: its pending count, per key
        self._settled: dict[str, tuple[int, int]] = {}  # replans in a row that kept a clear ar, and the statistics' count then
        self._lookup_wait: dict[str, int] = {}        # cycles left before the index is asked again, per key
        self._fresh: dict[str, _LookupTable] = {}     # the last lookup table made from an empty request record, per key
        self._lookup_back: dict[str, int] = {}        # the back-off's current gap, per key
        # an exploration is carried out with probability rate(its width) / rate(best) (from the last
        # replan): widths the model already expects to be far worse are explored rarely, so that on a
        # steep curve exploring costs at most explore / 4 of the time (x(1-x) <= 1/4) instead of the
        # ~10 % measured on the embedded pair with uniform exploration; off in tests that need every branch
        self.explore_by_rate = explore_by_rate
        self._options: dict = {}
        self._hopeless: dict[str, bool] = {}         # per key: no option's ceiling reaches ar's rate x (1 + ar_margin) (last replan)
        self._ar_seen = 0
        # the switch: the one-token passes right after a wider one cost more than in a run of them (the
        # CPU's caches and llama.cpp's threads settle). Per distance d = 1..SWITCH_AFTER from the last
        # wider pass, an average of the ar cycles' decode seconds, and of the ar cycles further away
        self._since_wide = SWITCH_AFTER + 1
        self._after_wide = [[0.0, 0] for _ in range(SWITCH_AFTER + 1)]    # [0]: the steady ar cycles
        self._after_start = [[0.0, 0] for _ in range(SWITCH_AFTER + 1)]   # after the prefill ([0] unused)
        self._since_start = SWITCH_AFTER              # cycles since the request's start (outside one: settled)
        self.explore, self.explore_wide, self.ar_margin = explore, explore_wide, ar_margin
        self.hysteresis, self.replan_every, self.k_max = hysteresis, replan_every, k_max
        self.rng = random.Random(seed)
        self.stats: dict[str, SlotStats] = {}
        self.overhead: dict = {}                      # seconds outside llama_decode: per kind, per (kind, width)
        self.current: dict[str, Choice] = {}
        self.age: dict[str, int] = {}
        self._bin_rates: list | None = None           # p̃-bin acceptance, cached between replans
        self._layouts: dict = {}                      # the options' passes per (mode, pending, width cap)
        self._vcosts: dict = {}                       # cycle costs per verify width, between replans
        self.slow_streak = 0                          # consecutive cycles far slower than predicted
        self._ltables: dict[str, _LookupTable] = {}   # lookup plans per match length, per key
        self._priced = 0                              # the load generation: moves with each batched load change
        # the lookup's track record in the current request (the text at hand: a list turned into JSON
        # copies badly where a repeated listing copies well), next to the engine-wide one
        self._lookup_local = SlotStats(decay=1.0)
        self.lookup_margin = 0.02                     # a lookup plan must beat the current choice by this share
        # the longest lookup draft the request's own record allows (slow start, see observe): none
        # outside a request; start_request sets LOOKUP_START
        self._lookup_cap = LOOKUP_K_MAX
        self._lookup_missed = False                   # a lookup draft missed since the table was made
        self._climb = False                           # the request's last lookup draft was accepted whole
        self.lookup_need = 1                          # the shortest lookup match the next offer may use
        self.recalled: str | None = None              # when the memory it started from was written (recall)

    # ---------------------------------------------------------------------- statistics
    def start_request(self) -> None:
        """A new request: its own lookup track record starts empty (the engine-wide one is its prior),
        and its lookup drafts start short; the lookup tables made from the previous request's record
        go, and the last ones made from an empty record (as the new request's) stand, for
        `_table_stale` to judge as any other (a request used to start by making one, ~0.4 ms)."""
        if self._lane is not None:
            self._settle()
        self._lookup_local = SlotStats(decay=1.0)
        self._lookup_cap = LOOKUP_START
        self._climb = False
        self._ltables = dict(self._fresh)
        self._lookup_missed = False
        self._lookup_wait.clear()                 # (a prompt may copy from its first cycle)
        self._lookup_back.clear()
        self._clear.clear()
        self._since_wide = 1                      # the prompt's prefill was a wide pass
        self._since_start = 0

    def warm(self, mode: str, pending: dict, block_max: int, key: str | None = None, lookup: bool = False) -> None:
        """Make now what a fresh planner's first request would make before its first plans (Engine.prepare
        calls it, before anything is timed, as it calibrates): the options and the current choice at the
        prefill's pending tokens (`_replan`, and the layouts it caches) and, for a request with lookup
        drafts, the lookup table of an empty request record (`_fresh`: where every request starts). A
        fresh engine's first request spent ~1.2 ms of its planner time on these (embedded pair, first of
        the 8 GSM8K questions, ~40 ms of decoding); made at prepare, that question ran 0.981 and 1.010x
        `ar` against 0.956 and 0.918x in two runs (dev/planner_ab.py --fresh, variant memory-cold), the
        other questions within noise. A no-op once made (each request's prepare calls it)."""
        key = key or mode
        if self.costs is None or not WARM:
            return
        if MODES[mode].width is not None and block_max >= 1 and key not in self.current:
            self._replan(mode, pending, min(block_max, N_SLOTS), key, None)
        if lookup and key not in self._fresh and self._lookup_local.n_cycles == 0:
            self._ltables[key] = self._lookup_table(mode, key, pending, block_max)

    # ---------------------------------------------------------------------- memory
    def memory(self) -> dict:
        """What this planner learned that a later process on the same models, options and machine may
        start from (engine.py keeps it beside the calibration cache): the acceptance statistics of the
        model's proposal slots (per mode key), the host time per cycle kind, and the ar passes' record
        after wider passes and after the prefill (the switch). Not the lookup drafts' record (unless
        MEMORY_LOOKUP): their acceptance is the text's more than the model's (it forgets ~40x faster,
        LOOKUP_DECAY); in fresh processes, with it, a record left by answers that did not copy kept the next
        process's copying answer from drafting (the embedded pair: 9 against 12 of 24 runs drafted,
        docs/planner.md "The planner's memory"). Not the regret
        budget's account, the choices or anything of a request: a new process still explores within its
        own budget. Plain JSON data."""
        return {"version": MEMORY_VERSION,
                "stats": {k: st.counts() for k, st in self.stats.items() if k != LOOKUP or MEMORY_LOOKUP},
                "overhead": [[k, v] if isinstance(k, str) else [list(k), v] for k, v in self.overhead.items()],
                "after_wide": [list(r) for r in self._after_wide],
                "after_start": [list(r) for r in self._after_start]}

    def recall(self, data) -> str | None:
        """Start from `data` (a `memory()`, read back): nothing is taken unless all of it checks out.
        Returns None, or why it was not taken. The switch records count as at most MEMORY_SWITCH_WEIGHT
        cycles, so that this process's own passes take over within a few cycles where the machine's
        speed moved since (the statistics forget as they always do)."""
        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

        def records(rs) -> bool:
            return isinstance(rs, list) and len(rs) == SWITCH_AFTER + 1 and all(
                isinstance(r, list) and len(r) == 2 and number(r[0]) and number(r[1]) for r in rs)

        if not isinstance(data, dict) or data.get("version") != MEMORY_VERSION:
            return f"version {data.get('version') if isinstance(data, dict) else None!r}, not {MEMORY_VERSION}"
        stats, overhead = data.get("stats"), data.get("overhead")
        if not isinstance(stats, dict) or not isinstance(overhead, list):
            return "no 'stats' object or 'overhead' list"
        lens = {"tested": N_SLOTS, "accepted": N_SLOTS, "bin_tested": None, "bin_accepted": None}
        for key, d in stats.items():
            if not isinstance(d, dict) or not all(isinstance(d.get(f), list) and all(map(number, d[f]))
                                                  and (n is None or len(d[f]) == n) for f, n in lens.items()) \
                    or len(d["bin_tested"]) != len(d["bin_accepted"]) or not number(d.get("n_cycles")) \
                    or any(a > t + 1e-9 for a, t in zip(d["accepted"] + d["bin_accepted"], d["tested"] + d["bin_tested"])):
                return f"stats[{key!r}] is not a slot record"
        for item in overhead:
            ok = isinstance(item, list) and len(item) == 2 and number(item[1]) and (
                isinstance(item[0], str) or isinstance(item[0], list) and len(item[0]) == 2
                and isinstance(item[0][0], str) and isinstance(item[0][1], int))
            if not ok:
                return f"overhead entry {item!r} is not [kind or [kind, width], seconds]"
        if not records(data.get("after_wide")) or not records(data.get("after_start")):
            return "the switch records are not [seconds, count] pairs"
        for key, d in stats.items():
            if key == LOOKUP and not MEMORY_LOOKUP:
                continue                        # (left out: see memory)
            st = self.stats_for(key)
            if len(d["bin_tested"]) != st.bins:
                continue                        # (a record of another binning: this process learns it anew)
            st.set_counts(d)
        self.overhead.update({(k if isinstance(k, str) else (k[0], k[1])): float(v) for k, v in overhead})
        for name in ("after_wide", "after_start"):
            setattr(self, "_" + name, [[float(m), int(min(n, MEMORY_SWITCH_WEIGHT))] for m, n in data[name]])
        self._bin_rates = None
        self._vcosts.clear()
        self._ltables.clear()
        self._fresh.clear()
        self.recalled = str(data.get("when") or "unknown")
        return None

    def stats_for(self, mode: str) -> SlotStats:
        if mode not in self.stats:
            self.stats[mode] = SlotStats(decay=LOOKUP_DECAY) if mode == LOOKUP else SlotStats()
        return self.stats[mode]

    def observe(self, cycle, key: str | None = None, planned: bool = True) -> bool:
        """Update the statistics from one cycle (any mode, fixed or planned widths; `cycle.plan` says
        what it ran). `key` names the statistics and choice when a mode's acceptance depends on a
        setting (prove@θ, mars@τ: Mode.key); `planned`: the planner chose its widths (only those
        cycles count for the regret budget). Returns True when passes have been costing many times
        their calibrated t(n) for a while (a loaded machine): the caller may re-check its threads
        and hand the planner new curves (`set_curve`). (A lane granted at this cycle's quiet_cycle is for
        the cycles after it: settled by the next call that plans.)"""
        if planned:
            self.elapsed += cycle.seconds
            if self._displaced is not None:
                self._account(cycle)
        plan = cycle.plan
        kind = plan.kind
        if self._drew:
            self._drew = False
            if kind == "ar":
                self.regret += max(0.0, cycle.seconds - sum(cycle.decode_seconds.values())
                                   - getattr(cycle, "waited", 0.0) - self._oh("ar"))
        i = self._since_start                     # the cycle's index in its request
        self._since_start = i + 1
        if kind != "ar":
            self._since_wide = 1                  # (a wider pass: the switch_cost of the ar cycles after it)
            self._clear.clear()                   # (its statistics may make a lookup table stale)
            if self._lane is not None:            # (a lane is for the ar cycles after a quiet one: none now)
                self._settle()
        if kind == "ar":
            # an ar cycle has no acceptance to learn; its cost and overhead are sampled (1 in
            # AR_SAMPLE), which keeps the planner's own time per ar cycle near nothing (a 0.35 ms
            # pass of the embedded proposer leaves no room for ~20 us of bookkeeping on every cycle);
            # the few right after a wider pass are all recorded for the switch's cost
            self._ar_seen += 1
            d = self._since_wide
            if d <= SWITCH_AFTER:
                # after the prefill (no wider pass since the request's start: d = i + 1): the start's
                # records (switch_cost's prior); after a wider pass of the request: the switch's own,
                # once the start's slow passes are over (a wider pass in the request's first cycles is
                # not recorded: its switch and the start's are one)
                if d == i + 1:
                    self._record_switch(d, sum(cycle.decode_seconds.values()), self._after_start)
                elif i >= SWITCH_AFTER:
                    self._record_switch(d, sum(cycle.decode_seconds.values()))
            # (in a clear run, where no lookup or MARS plan is in reach, 1 in AR_SAMPLE_CLEAR: a sampled
            # cycle's bookkeeping took ~40-55 us between the embedded pair's ~0.4 ms passes, where it runs
            # from cold caches, against ~3 us in a loop, and the next pass ran ~20 us slower; the scale it
            # feeds is read at the replans, which come every 64-512 cycles there. At 1 in 32 that was
            # ~4 samples in a 100-token answer, ~0.4 % of its time)
            every = AR_SAMPLE_CLEAR if self._clear else AR_SAMPLE
            if d > SWITCH_AFTER and (not self._ar_seen % every or self._after_wide[0][1] < SWITCH_STEADY):
                # (the steady ones every cycle until there are SWITCH_STEADY: the switch is priced from
                # the request's first dozen cycles)
                self._record_switch(0, sum(cycle.decode_seconds.values()))
            self._since_wide = d + 1
            if self._ar_seen % every:
                return False
        elif plan.lookup:
            # lookup drafts have statistics of their own (whatever the request's mode): p holds their
            # scores, calibrated by the p̃ bins; a filled proposal's MARS slots count for the mode
            n_l = plan.lookup
            self.stats_for(LOOKUP).record(cycle.p, 0, n_l, min(cycle.n_accepted, n_l))
            self._lookup_local.record(cycle.p, 0, n_l, min(cycle.n_accepted, n_l))
            # slow start: the request's drafts may be twice as long as the longest draft it has had
            # accepted whole, and fall back to what was accepted (+1) after a rejection. The engine-wide
            # record can say a 9-token draft pays where this request's text has not copied yet; on a
            # short answer that does not copy, two such misses cost more than lookup ever wins back
            # (Ollama's DFlash runner grows and shrinks its depth from acceptance the same way). A
            # one-token draft accepted says nothing about eight: the cap grows from the draft's length,
            # not from the cap (which let a run of accepted one-token drafts reach 16, then a 9-token
            # draft miss at its first token on a text the model rewrites)
            ok = min(cycle.n_accepted, n_l)
            self._lookup_cap = min(LOOKUP_K_MAX, max(self._lookup_cap, 2 * n_l)) if ok == n_l \
                else max(LOOKUP_START, ok + 1, int(LOOKUP_KEEP * self._lookup_cap))
            self._lookup_missed |= ok < n_l
            # the climb: while its drafts are accepted whole, a request whose cap is below the drafts the
            # table plans gets the capped draft as a probe at each such match (`_Capped.probes`), not at
            # the next exploration draw (~50 cycles apart at `explore` = 0.02): on a host where only long
            # drafts pay (the embedded pair: t(16) ~ 13 t(1)), a text that copies took 2 -> 4 -> 8 one
            # draw at a time, 100+ tokens, before its first paying draft
            self._climb = CLIMB and ok == n_l
            if filled(plan) and plan.verify:
                self.stats_for(key or kind).record(cycle.p[n_l:], 1, plan.verify, cycle.n_accepted - n_l)
        else:
            # a free first slot teaches nothing; a gated adapter's slot 1 is tested like the others
            lo = 1 if MODES[kind].free_first and not (cycle.source and cycle.source[0] == "adapter") else 0
            self.stats_for(key or kind).record(cycle.p, lo, tested(plan), cycle.n_accepted)
        decode = sum(cycle.decode_seconds.values())
        # the request's own host time: in a batched step, not the time it waited for the others
        # (Cycle.waited; the step's cost is priced through the load, set_load)
        over = max(0.0, cycle.seconds - decode - getattr(cycle, "waited", 0.0))
        b = plan_width(plan)
        for key in (kind, (kind, b)):      # per kind, and per kind and width (wider blocks cost more Python)
            old = self.overhead.get(key)
            self.overhead[key] = over if old is None else 0.9 * old + 0.1 * min(over, 4 * old + 1e-4)
        if self.costs is None:
            return False
        worst = 0.0
        batch = getattr(cycle, "batch", None) or {}
        gated = kind == "lossless" and bool(cycle.source) and cycle.source[-1] == "adapter"
        for role, secs in cycle.decode_seconds.items():
            if gated and role == "target":        # (its passes' seconds: the adapter's switches are priced apart)
                secs -= self.costs.adapter_switch
                if secs <= 0:
                    continue
            r = self.costs.observe(role, cycle.widths.get(role, []), secs, batch=batch.get(role))
            worst = max(worst, r or 0.0)
        # a pass that suddenly costs many times its t(n): a loaded machine, re-check the threads
        self.slow_streak = self.slow_streak + 1 if worst > 4.0 else 0
        if self.slow_streak >= 8:
            self.slow_streak = 0
            return True
        return False

    def _record_switch(self, d: int, seconds: float, records: list | None = None) -> None:
        """An ar cycle's decode seconds, d cycles after a wider pass (0: further away), into `records`
        (the switch's own, `_after_wide`, or the request start's, `_after_start`)."""
        rec = (self._after_wide if records is None else records)[d]
        rec[1] += 1
        if rec[1] > 1:
            seconds = min(seconds, 3.0 * rec[0])               # one stalled pass moves it by little
        rec[0] += (seconds - rec[0]) / min(rec[1], 32)         # the mean, then a moving average

    def switch_cost(self) -> float:
        """Seconds a cycle that is not ar costs the ar cycles after it, beyond what they cost in a run
        of ar cycles: the sum over d = 1..SWITCH_AFTER of (mean decode seconds d cycles after a wider
        pass - the steady mean), where it is above it; the steady mean is the calibrated t(1) (as the
        costs scale it) until SWITCH_STEADY cycles further from a wider pass are seen. Each d counts
        from its first cycle. The records are the wider passes of a request (a lookup verify, a MARS
        proposal) from its SWITCH_AFTER-th cycle on; until there is one, those after the prompt's
        prefill stand for them (a prior that errs on the side of ar: a fresh engine prices the switch
        from its first request's second cycle on). Measured: the first ar pass after a lookup verify
        1.10-1.17x the steady one on the embedded target (1 thread), 1.22, 1.14, 1.12x on SmolLM2 (2
        threads); after the prefill, in plain ar as much as in any mode, 2.5, 1.7, 1.15x on the
        embedded target (2 threads, the bench's 60 GSM8K-style questions): the first cycles of every
        request run slow whatever came before. Priced from those, the switch came out at ~1.2 ms,
        2.5 ar cycles, where the passes after a lookup or MARS pass later in a request cost 0.15 ms
        more (the median of the first), and lookup drafts that the text would have taken (76 % of a
        one-token draft's) were declined. (Before the prefill counted, a fresh SmolLM2 engine with a
        cached curve that underpriced a 2-token pass drafted 10-11 one- and two-token lookups into its
        first 64-token answer at zero switch cost: the chat template repeats.)"""
        steady = self._after_wide[0]
        if steady[1] >= SWITCH_STEADY:
            ref = steady[0]
        elif self.costs is not None and "target" in self.costs.base:
            ref = self.costs.solo("target", 1)      # (the calibrated one-token pass, until runs of them are seen)
        else:
            return 0.0
        records = self._after_wide if self._after_wide[1][1] else self._after_start
        return sum(max(0.0, m - ref) for m, n in records[1:] if n >= 1)

    def set_curve(self, role: str, curve: dict[int, float]) -> None:
        """New calibrated t(n) of a role (after the caller changed its thread count)."""
        if self._lane is not None:
            self._settle()
        self.costs.set_curve(role, curve)
        self._vcosts.clear()
        self._ltables.clear()                     # (priced on the old curve)
        self._fresh.clear()
        self._clear.clear()
        self._settled.clear()

    def set_load(self, load: dict[str, int], sequences: int = 0) -> None:
        """The other requests' tokens per role in the steps the next passes join, and their number
        (a batched pool: the engine's estimate from its recent steps, batching.SeqView.others; {}
        alone). The planner then maximises the step's throughput, not the request's own: an option
        committing g tokens in P passes that add c seconds to the steps (Costs.t: a one-token pass
        t(M + 1) - t(M), a wider one t(n), a graph of its own) is rated (P G + g) / (P T + c), with G
        the other sequences' tokens per step (one each) and T what their decodes cost
        (Costs.step_rest): each pass of the cycle is a step of the pool. Alone that is g / c. Beside
        G requests a proposal must pay for holding up all of them: the choice narrows as the load
        grows, on any backend. A changed load makes the next
        cycle replan (and ends a lane: a load within LOAD_TOLERANCE of the last leaves it)."""
        if self.costs is not None and self.costs.set_load(load, sequences):
            if self._lane is not None:
                self._settle()
            self._vcosts.clear()
            if self.costs.load:
                # another batched load: the lookup tables are priced at the old one, and are made again
                # when a match may use them (`_table_stale`, `_candidate`), as after a replan. Dropped,
                # every engine of a pool made its table again at the next cycle whatever the index offered,
                # and loads move as requests join and leave (4 requests x 64 tokens on SmolLM2: ~16
                # tables at ~0.5-0.9 ms of CPU each, half the planner's host time in the pool)
                self._priced += 1
            else:                                  # alone again: priced afresh, as a single stream is
                self._ltables.clear()
                self._fresh.clear()
            for key in self.age:
                self.age[key] = 1 << 30                # replan at the next cycle
            self._quiet.clear()
            self._clear.clear()
            self._settled.clear()

    def _account(self, cycle) -> None:
        """The regret budget's books for an exploration, or one of the cycles after it: what it lost."""
        lost = cycle.seconds - len(cycle.committed) / self._displaced
        self.regret = max(0.0, self.regret + lost)
        if self._after:
            self._after -= 1
        else:                                     # the exploration itself: charge the next cycles too
            self._after = AFTER_EXPLORATION
        if not self._after:
            self._displaced = None

    # ---------------------------------------------------------------------- expected rates
    def _oh(self, kind: str, width: int | None = None) -> float:
        if width is not None and (kind, width) in self.overhead:
            return self.overhead[(kind, width)]
        return self.overhead.get(kind, 0.0)

    def rates(self, mode: str, pending: dict, block_max: int, key: str | None = None) -> list[Choice]:
        """Expected tokens per second of ar and of every width of `mode`: expected tokens committed
        (Mode.expected_tokens, from the per-slot acceptance) over the cycle's cost (modes.cycle_cost:
        t(n) of every pass the mode's widths make, over the measured curves) plus the measured Python
        overhead of that kind and width. Where the mode chooses its verify width (lossless), a
        block's rate is that of its best verify width."""
        m = MODES[mode]
        t = self.costs.t
        # a partner that fell behind during ar cycles catches up once, in its next pass: a one-off,
        # not the steady cost of proposing with it, or ar would never be left again
        pend = {r: (pending.get(r, 1) if r == "target" else min(pending.get(r, 1), CATCH_UP)) for r in m.roles}
        if pending.get(GATED):
            pend[GATED] = 1
        g0, t0 = self.costs.step_rest()                     # (0, 0) alone: the request's own rate
        t_ar = max(1e-12, cycle_cost(t, pend, AR_PLAN) + self._oh("ar"))
        out = [Choice("ar", 1, (g0 + 1.0) / (t0 + t_ar), 1.0, t_ar, span=t0 + t_ar)]
        n_max = self.k_max if m.width == "draft_k" else block_max
        lay = self._layout(mode, pend, n_max)
        cost = np.zeros(len(lay.tested))
        for role, (idx, ns, inv) in lay.passes.items():      # modes.cycle_cost of every option at once
            table = self.costs.table(role)
            ts = table[ns] if ns[-1] < len(table) else np.array([t(role, n) for n in ns])
            cost += np.bincount(idx, weights=ts[inv], minlength=len(cost))
        s = self.stats_for(key or mode).slot_rates(n_max).tolist()
        gain = np.array(m.expected_tokens(s, n_max, gated=bool(pending.get(GATED))))[lay.tested]
        oh = np.array([self._oh(mode, w) for w in range(1, n_max + 1)])[lay.width - 1]
        # while ar is the choice, a cycle of this mode among ar cycles also pays the switch (the one-token
        # passes right after a wider one run slower: `switch_cost`), as a lookup draft does (_lookup_table).
        # Without it, on the embedded pair at 1 thread, a B=2 cycle was priced at 1.25 ms for 2.4 tokens
        # where it took 1.43 ms and its ar cycles after it 0.30 ms more, and B=2 at 0.91-0.96x ar drew
        # explorations that lost ~half of their time
        cur = self.current.get(key or mode)
        switch = self.switch_cost() if cur is None or cur.kind == "ar" else 0.0
        secs = np.maximum(1e-12, cost + oh + switch)
        # a cycle of P passes spans P steps, in each of which the others commit G tokens for T seconds
        # (alone G = T = 0: g / c); ar is one step
        rate = (lay.steps * g0 + gain) / (lay.steps * t0 + secs)
        whole = np.array(m.expected_tokens([1.0] * n_max, n_max, gated=bool(pending.get(GATED))))[lay.tested]
        ceiling = (lay.steps * g0 + whole) / (lay.steps * t0 + secs)
        # per width (a run of options from lay.starts): its best verify width, the first of the highest
        # rates, and the highest ceiling, in a few array calls (a loop of argmax calls per width was most
        # of a replan's ~75 us, ~0.37 ms between the embedded pair's passes)
        top = np.maximum.reduceat(rate, lay.starts)
        first = np.flatnonzero(rate == top[lay.seg])
        best = first[np.unique(lay.seg[first], return_index=True)[1]]
        span = lay.steps[best] * t0 + secs[best]
        verify = lay.tested[best].tolist() if m.verify_choice else [None] * len(best)
        for w, (r, g, c, v, ceil, sp) in enumerate(zip(rate[best].tolist(), gain[best].tolist(), secs[best].tolist(),
                                                       verify, np.maximum.reduceat(ceiling, lay.starts).tolist(),
                                                       span.tolist())):
            out.append(Choice(mode, w + 1, r, g, c, v, ceil, span=sp))
        return out

    def _layout(self, mode: str, pend: dict, n_max: int) -> "_Layout":
        """The passes of every option of `mode` up to width n_max (Mode.widths), grouped by role so
        that their costs add up in one step; they depend on the pending counts only, not on timings,
        and are cached."""
        key = (mode, tuple(sorted(pend.items())), n_max)
        lay = self._layouts.get(key)
        if lay is None:
            m = MODES[mode]
            plans, starts = [], []
            for w in range(1, n_max + 1):
                starts.append(len(plans))
                plans += [Plan(mode, block=w, verify=v) for v in range(1, w + 1)] if m.verify_choice else [m.plan(w, w)]
            by_role: dict[str, tuple[list, list]] = {}
            for i, plan in enumerate(plans):
                for role, ws in m.widths(pend, plan).items():
                    idx, ns = by_role.setdefault(role, ([], []))
                    idx += [i] * len(ws)
                    ns += ws
            passes = {}
            for role, (idx, ns) in by_role.items():
                uniq, inv = np.unique(np.asarray(ns, dtype=int), return_inverse=True)
                passes[role] = (np.asarray(idx, dtype=int), uniq, inv)
            steps = np.zeros(len(plans))
            for idx, _, _ in passes.values():
                steps += np.bincount(idx, minlength=len(plans))
            lay = _Layout(np.array([plan_width(p) for p in plans]), np.array([tested(p) for p in plans]),
                          np.array(starts), passes, steps,
                          np.repeat(np.arange(len(starts)), np.diff(starts + [len(plans)])))
            if len(self._layouts) > 64:
                self._layouts.clear()
            self._layouts[key] = lay
        return lay

    # ---------------------------------------------------------------------- the plan
    def plan(self, mode: str, pending: dict, block_max: int, room: int, key: str | None = None,
             lookup=None) -> Plan:
        """The plan of the next cycle of `mode` (`plan_cycle`'s plan)."""
        return self.plan_cycle(mode, pending, block_max, room, key, lookup)[0]

    def plan_cycle(self, mode: str, pending: dict, block_max: int, room: int, key: str | None = None,
                   lookup=None) -> tuple[Plan, Callable | None]:
        """The plan of the next cycle of `mode` (pending: committed tokens not yet in each context;
        key: as for `observe`; lookup: the lookup index's match at the end of the committed tokens
        (lookup.Match), offered where the mode takes lookup drafts), and its verify width chooser: p̃
        -> v, for the cycle to call between its two passes (`verify_width` at the rate of the choice
        it runs: modes.Hooks.choose_verify), or None where the plan's own verify width holds. While ar
        is the choice, runs of ar cycles up to the next exploration draw or replan are returned
        without any other work (a quiet run: ~0.3 us per cycle instead of ~3). A lookup offer is
        judged first, every cycle, from a table per match length (`_lookup_plan`); a MARS proposal it
        fills chooses its verify width at the table's rate."""
        key = key or mode
        if self._lane is not None:
            self._settle()
        self._clear.pop(key, None)
        if lookup is not None:
            lp = self._lookup_plan(mode, key, pending, block_max, room, lookup)
            if lp is not None:
                return lp, (self._chooser(mode, pending, lp.block, self._ltables[key].rate, key) if filled(lp) else None)
        if MODES[mode].width is None or block_max < 1:
            return AR_PLAN, None   # the lookup mode, or lossless without a mask token: ar where no lookup draft pays
        q = self._quiet.get(key)
        if q:
            self._quiet[key] = q - 1
            return AR_PLAN, None
        block_max = min(block_max, N_SLOTS)
        cap = max(1, min(block_max, room))
        kcap = max(0, min(self.k_max, room - 1))
        cur = self.current.get(key)
        draw = self._draw.pop(key, False) or self.rng.random() < self.explore
        self._drew |= draw
        age = self.age.get(key, 0)
        if draw and cur is not None and age >= self._replan_after(cur, key):
            # a replan is due (a changed load sets it): the exploration is judged at the new prices,
            # not at those of the options from before (priced beside other requests' prefills, a B=3
            # exploration looked nearly as good as ar beside their one-token passes)
            cur = self._replan(mode, pending, block_max, key, cur)
            age = 0
        if draw and self._budget_left():
            ex = self._explore(mode, cap, kcap, key)
            if self._worth_exploring(ex, mode, key):
                self._drew = False
                self._displaced = cur.rate if cur is not None else None
                self._after = 0                    # (its own window starts when it is observed)
                return ex, None
        if cur is None or age >= self._replan_after(cur, key):
            cur = self._replan(mode, pending, block_max, key, cur)
        age = self.age[key] = self.age.get(key, 0) + 1
        if cur.kind == "ar":
            self._quiet_run(key, age)
            return AR_PLAN, None
        m = MODES[mode]
        plan = m.plan(min(cur.width, cap), min(cur.width, kcap))
        if m.verify_choice and plan.block > 1:
            return plan, self._chooser(mode, pending, plan.block, cur.rate, key)
        return plan, None

    def _replan(self, mode: str, pending: dict, block_max: int, key: str, cur: Choice | None) -> Choice:
        """The options again (`rates`), and the current choice among them: the best that beats plain ar
        by ar_margin, or the current one where it is within `hysteresis` of the best."""
        self._bin_rates = None                     # refreshed by the next verify_width
        self._vcosts.clear()
        options = self.rates(mode, pending, block_max, key)
        self._options[key] = options
        ar = options[0]
        # no width could beat ar by ar_margin were every slot it proposes accepted (`_worth_exploring` turns
        # every such exploration down): the quiet runs then draw no exploration before the next replan (on the
        # embedded pair at 1 thread, where t(2) ~ 2 t(1), each draw was a plan_cycle, ~90-180 us, for nothing)
        self._hopeless[key] = all(o.ceiling < ar.rate * (1.0 + self.ar_margin) for o in options[1:])
        # a width must beat plain ar clearly; a one-slot block is ar with more work (lossless: two
        # one-token passes for two tokens; prove: an extra verifier pass): explored, never chosen
        free = MODES[mode].free_first
        eligible = [ar] + [o for o in options[1:] if (o.width > 1 or not free)
                           and o.rate >= ar.rate * (1.0 + self.ar_margin)]
        best = max(eligible, key=lambda ch: ch.rate)
        if cur is not None:
            now = next((o for o in eligible if (o.kind, o.width) == (cur.kind, cur.width)), None)
            if now is not None and now.rate >= best.rate * (1.0 - self.hysteresis):
                best = now                             # hysteresis: keep the current choice
        self.current[key] = best
        self.age[key] = 0
        # the replans of a settled ar back off (`_replan_after`): while each one keeps ar with no width
        # within SETTLED_SLACK of beating it, and no cycle taught the statistics anything in between,
        # the next comes twice as late (up to 2**SETTLED_MAX). Only the cost scale and the host times
        # move meanwhile, by a few per cent; a replan was ~0.2 ms of host time every 64 cycles between
        # the embedded pair's ~0.4 ms cycles (~1 %), and came out ar nearly every time there
        n = self.stats_for(key).n_cycles
        runs, seen = self._settled.get(key, (0, -1))
        bar = ar.rate * (1.0 + self.ar_margin) * (1.0 - SETTLED_SLACK)
        clear = best is ar and all(o.rate < bar for o in options[1:] if o.width > 1 or not free)
        self._settled[key] = (min(SETTLED_MAX, runs + 1) if clear and seen == n else 0, n)
        return best

    def _chooser(self, mode: str, pending: dict, block: int, rate: float, key: str) -> Callable:
        """The verify width chooser of a `block`-slot proposal run at `rate` (tokens/s of the choice
        it runs): p̃ -> `verify_width`, priced by this cycle's costs per verify width."""
        costs = self._verify_costs(mode, pending, block)
        return lambda p: self.verify_width(p, rate, costs, key)

    # ---------------------------------------------------------------------- lookup drafts
    def _lookup_plan(self, mode: str, key: str, pending: dict, block_max: int, room: int, lookup) -> Plan | None:
        """The plan for a lookup offer (`lookup()` -> the index's lookup.Match, or None), from the lookup
        table (made again every LOOKUP_REFRESH lookup cycles and at a replan that changes the choice,
        once a match may use it: `_table_stale`, `_candidate`): per match length m, a
        lookup draft of k tokens, a MARS proposal filled by k lookup tokens, or None (the current choice
        runs). Where the table has no plan, an exploration (the lookup's best k for m) with probability
        `explore`, within the regret budget. The match is only looked up when the table or an exploration
        draw may use it (a text whose lookup drafts do not pay costs ~1 us a cycle), and not while the
        index's checks back off (`_lookup_found`)."""
        tab = self._ltables.get(key)
        cur = self.current.get(key)
        stale = self._table_stale(tab, key, pending.get("target", 1))
        explore = self._lookup_draw.pop(key, None)
        if explore is None:
            explore = self._lookup_due.pop(key, False) or self.explore > 0.0 and self.rng.random() < self.explore
        self._drew |= explore
        if not explore and self._lookup_waits(key):
            return None                          # (backing off: the index is not asked this cycle)
        asked = []

        def ask():
            asked.append(True)
            return lookup()
        plan = self._lookup_decide(mode, key, pending, block_max, room, ask, tab, cur, stale, explore)
        if asked:                                # the back-off: a draft, or an offer of no use
            self._lookup_found(key, plan is not None)
        return plan

    def _lookup_decide(self, mode: str, key: str, pending: dict, block_max: int, room: int, lookup, tab, cur,
                       stale: str | None, explore: bool) -> Plan | None:
        """_lookup_plan's decision, once the index may be asked (`lookup`)."""
        if stale == "remake" and not explore and not self._candidate(tab, lookup):
            return None                          # (the table is made again once a match may use it)
        if stale == "remake":
            tab = self._ltables[key] = self._lookup_table(mode, key, pending, block_max)
            self._lookup_missed = False
        elif stale == "acceptance":
            # the request's own record moved (its first lookup cycles; a miss at once, so that a text that
            # does not copy stops drafting fast): the acceptance again, at the same costs
            self._lookup_missed = False
            made_at = tab.made_at
            tab = self._ltables[key] = self._lookup_table(mode, key, pending, block_max, costs=tab.costs)
            tab.made_at = made_at
        # the exploration draw comes first: without one, only the match lengths the table has a plan for
        # (within the request's draft cap: the slow start) can matter, and the index is asked for those
        # alone (`lookup_need`: a text without a repeated n-gram of that length costs one dict lookup a
        # cycle instead of a search)
        # an exploration draw asks only for the matches worth exploring (`explore_min`): one whose best draft
        # is expected at under EXPLORE_FLOOR x the current choice's rate could hardly change the table (on the
        # embedded pair, 1-3 token drafts at 1-7 token matches, ~0.6x `ar`, explored at ~60 % of the draws that
        # found one), and a draw that needs 2+ tokens of match costs a search of the tokens where there is none
        ex_min = self._explore_need(tab) if explore else MAX_MATCH + 1
        eff = self._capped(tab)
        if not eff.any and ex_min > MAX_MATCH:
            return None
        self.lookup_need = min(eff.min_match, ex_min)
        match = lookup()
        if match is None:
            return None
        m = min(max(1, match.length), MAX_MATCH)
        plan = eff.rows[m]
        if plan is not None and self._switch_moved(tab, cur):
            # the switch's price moved since the table's costs were made (a fresh engine learns it from
            # its first request's first cycles; an eager refresh keeps the costs): made again first
            tab = self._ltables[key] = self._lookup_table(mode, key, pending, block_max)
            eff = self._capped(tab)
            plan = eff.rows[m]
            if plan is None:
                return None
        if plan is not None and m in eff.probes:
            # a climb's probe is an exploration: within the regret budget, its regret against the choice it displaces
            if not self._budget_left() or not self._lookup_loss_fits(tab, m, plan.lookup):
                return None
            self._displaced, self._after = tab.rate, 0
            self._drew = False
        if plan is None:
            if not explore:
                return None
            k, rate = tab.best[m]
            if not self._budget_left() or (self.explore_by_rate and (
                    rate < EXPLORE_FLOOR * tab.rate or self.rng.random() * tab.rate >= rate)):
                return None
            if self.explore_by_rate and tab.ceilings is not None and tab.ceilings[k - 1] < tab.ar_rate:
                return None                      # it could not beat ar with every token accepted (_worth_exploring)
            k = min(k, self._lookup_cap)         # (no longer than the slow start allows)
            if self.explore_by_rate and not self._lookup_loss_fits(tab, m, k):
                return None
            self._displaced, self._after = tab.rate, 0
            self._drew = False
            plan = Plan(LOOKUP, lookup=k)
        if plan.lookup + plan.block > room:      # near the end of the context: what still fits
            k = room - plan.block
            if k < 1:
                return None
            plan = Plan(plan.kind, plan.block, verify=plan.verify, lookup=k)
        return plan

    def _lookup_loss_fits(self, tab: _LookupTable, m: int, k: int) -> bool:
        """Whether a k-token lookup draft at a match of m tokens, run as an exploration or a climb's probe,
        is expected to lose no more than the regret budget has left: its cycle's seconds (the steps it
        spans; its passes, host time and switch, as the table prices them) less its expected tokens at the
        current choice's rate, as `_worth_exploring` asks of a MARS exploration. Without it a lookup
        exploration was judged by the budget already spent alone, so a fresh engine's first requests drew
        probes that the budget could only refuse afterwards (the embedded pair: a 4-token probe at an
        8-token match, ~5.6 t(1) for ~1-5 tokens, in the second question of each fresh process)."""
        if not LOOKUP_LOSS_CHECK or tab.rates is None or tab.costs is None or tab.rate <= 0:
            return True
        cost, *_, (l_steps, _, _) = tab.costs           # (per k: the plan's seconds, the steps it spans)
        _, t0 = self.costs.step_rest()
        span = float(l_steps[k - 1]) * t0 + max(float(cost[k - 1]), 1e-12)
        loss = max(0.0, span * (1.0 - float(tab.rates[m, k - 1]) / tab.rate))
        return self.regret + loss <= self._allowance()

    def _table_stale(self, tab: _LookupTable | None, key: str, pend: int) -> str | None:
        """Whether the lookup table of `key` must be made again before it is read: "remake" (none yet,
        LOOKUP_REFRESH lookup cycles since, other pending counts, a new request, a replan that changed
        the choice, another batched load), "acceptance" (the request's first lookup cycles moved its
        own record: the rates again at the same costs), or None. A replan that kept `ar` is caught up with here at once
        (`_rebased`: no numpy work)."""
        local = self._lookup_local.n_cycles
        if (tab is None or self.stats_for(LOOKUP).n_cycles - tab.made_at >= LOOKUP_REFRESH
                or tab.pend != pend or tab.local > local or tab.priced != self._priced):
            return "remake"
        cur = self.current.get(key)
        if tab.cur is not cur:
            if tab.cand is None or not _same_ar(tab.cur, cur):
                return "remake"
            self._ltables[key] = tab = self._rebased(tab, cur)
        if local < LOOKUP_LOCAL_EAGER and local != tab.local and (
                self._lookup_missed or local - tab.local >= LOOKUP_EAGER_EVERY):
            return "acceptance"
        return None

    def _rebased(self, tab: _LookupTable, cur) -> _LookupTable:
        """`tab` compared with the rate of a new current choice that is `ar` again (a replan that kept
        it): the same plans and rates per match length, each kept where it beats the new rate by
        lookup_margin. Its costs stay those it was made with (made again every LOOKUP_REFRESH lookup
        cycles, at each request, and when the switch's price moves): a replan used to remake the
        table, ~0.4 ms between the embedded pair's ~0.5 ms passes, ~2 times a request."""
        bar = cur.rate * (1.0 + self.lookup_margin)          # (Python floats: no numpy call between passes)
        rows = [r if m and rate > bar else None for m, (r, rate) in enumerate(zip(tab.cand, tab.cand_r))]
        return dataclasses.replace(tab, rows=rows, rate=cur.rate, cur=cur, any=any(r is not None for r in rows))

    def quiet_cycle(self, key: str, pend: int, lookup=None) -> bool:
        """Whether the next cycle of `key` is an ar cycle of a quiet run (`_quiet_run`) that plan_cycle
        would return as AR_PLAN without anything else (the caller then runs ar and skips it): no
        replan or exploration due, and where lookup drafts are offered (`lookup`: as plan_cycle's), a
        current lookup table and no match it has a plan for. On a text with nothing to copy this is
        the planner's whole work per cycle: its counters, one random draw and the index's one dict
        lookup (the full plan_cycle took ~30 us a cycle between the embedded pair's ~0.5 ms passes).
        `pend`: the committed tokens the target has not been fed (1 after an ar cycle). A cycle it
        declines is planned by plan_cycle as if this had not been asked (the same random draws).
        A quiet cycle of a clear run (or without lookup) may grant a lane of the cycles after it (`_grant`)."""
        if self._lane is not None:
            self._settle()
        q = self._quiet.get(key)
        if not q:
            return False
        if lookup is not None:
            if self._lookup_due.pop(key, False) or self.explore > 0.0 and self.rng.random() < self.explore:
                clear = self._clear.get(key) == pend
                if not clear or self._budget_left() and self._explorable(key, lookup):
                    self._lookup_draw[key] = True    # (plan_cycle's exploration draw, drawn here)
                    self._clear.pop(key, None)
                    return False
                # a clear run whose regret budget is spent, or whose index offers no match worth exploring:
                # the draw could only come out ar, after a plan that the budget would pay for (`_drew`); its
                # lasting effects, the index's back-off and the charge (its host time beyond an ar cycle's)
                self._lookup_found(key, False)
                self._drew = True
                self._quiet[key] = q - 1
                if pend == 1 and LANE:
                    self._grant(key, q - 1, True)
                return True
            if self._clear.get(key) == pend:
                # a clear run: the lookup table was current and had no plan at the run's start, and
                # nothing that could change that has happened since (start_request, set_curve, set_load,
                # a cycle other than ar and plan_cycle end it): `_table_stale` would say the same (~3 us)
                self._quiet[key] = q - 1
                if pend == 1 and LANE:
                    self._grant(key, q - 1, True)
                return True
            # a cycle of the index's back-off is quiet whatever the table: plan_cycle would not read it
            # (nor make it again) before the index may be asked; so are the back-off's cycles after it,
            # a lane (on text that does not copy, where the table still has plans for matches it never
            # offers, the back-off's were most cycles: each one planned and observed, ~10 us of a
            # ~0.45 ms pass on the embedded pair)
            if self._lookup_waits(key):
                if pend == 1 and LANE and BACKOFF_LANE and self._lookup_wait.get(key, 0):
                    self._grant(key, min(q - 1, self._lookup_wait[key]), True, waits=True)
            else:
                tab = self._ltables.get(key)
                stale = self._table_stale(tab, key, pend)
                # (a table whose plans are all longer than the request's draft cap, and do not pay cut to
                # it, has none: plan_cycle would return ar after a full plan, ~90 us a time)
                some = stale is None and self._capped(tab).any
                if stale == "acceptance" or ((stale or some) and (
                        self._candidate(tab, lookup) if stale else self._planned(tab, lookup))):
                    self._lookup_draw[key] = False
                    return False
                if stale or some:
                    self._lookup_found(key, False)
                else:
                    self._clear[key] = pend
        elif pend == 1 and LANE:
            self._grant(key, q - 1, False)
        self._quiet[key] = q - 1
        return True

    def _explorable(self, key: str, lookup) -> bool:
        """Whether an exploration draw in a clear run of `key` may explore: the index offers a match at
        least as long as the shortest worth exploring (`_LookupTable.explore_min`; plan_cycle would ask
        it for the same). Where it does not, the draw is ar without plan_cycle: on the embedded pair
        each such draw was a plan_cycle from cold caches (~115 us) that ended the clear run, and its
        lane, for the few cycles of the index's back-off."""
        need = self._explore_need(self._ltables[key])
        return need <= MAX_MATCH and self._offered(need, lookup)

    def _explore_need(self, tab: _LookupTable) -> int:
        """The shortest match an exploration draw could explore at (`explore_min`; any without `explore_by_rate`)."""
        return tab.explore_min(EXPLORE_FLOOR) if self.explore_by_rate else 1

    def _grant(self, key: str, left: int, draws: bool, waits: bool = False) -> None:
        """A lane of the cycles after this quiet one (`lane`): as many as quiet_cycle would pass with
        nothing else to do and `observe` would only count. Not while an exploration is charged
        (`_displaced`: the cycles after it are) or the switch's records are taken (within
        SWITCH_AFTER cycles of a wider pass; the first SWITCH_STEADY steady cycles). It ends before
        the quiet run's `left` cycles end, before the next sampled ar cycle (AR_SAMPLE,
        AR_SAMPLE_CLEAR), within the index's back-off where it is one of its cycles (`waits`: the lane's
        cycles count the back-off down), and, where quiet_cycle draws lookup explorations (`draws`), before the first
        draw that succeeds: the lane's draws are made here, in a loop (the same random numbers in the
        same order), the one that succeeded then due (`_lookup_due`), so that a planner with lanes
        plans what one without them does. On a text with nothing to copy, quiet_cycle and `observe`
        then run about once in 50 cycles instead of every cycle (without lookup drafts, once in 8):
        on the embedded pair, where they run from cold caches between ~0.35 ms passes, lossless went
        from 0.976 to 0.986 x `ar` on the seven answers that do not copy (dev/planner_ab.py, 60 rounds)."""
        if self._displaced is not None or self._since_wide < SWITCH_AFTER \
                or self._after_wide[0][1] < SWITCH_STEADY:
            return
        every = AR_SAMPLE_CLEAR if self._clear else AR_SAMPLE
        seen = self._ar_seen + 1                         # (this cycle's, once observed)
        n = min(left, (seen // every + 1) * every - seen - 1)
        gap = False
        if draws and self.explore > 0.0:
            # quiet_cycle's draws of the lane's cycles, made now (the same random stream: a lane changes no plan)
            rnd, p = self.rng.random, self.explore
            for j in range(n):
                if rnd() < p:
                    n, gap = j, True
                    break
        if n > 0 or gap:
            self.lane, self._lane = n, (key, n, gap, waits)

    def _settle(self) -> None:
        """The counters of the lane's cycles the engine ran (granted less `lane` left), as quiet_cycle and
        `observe` would have moved them one at a time; the rest of it dropped (a request that ended, a
        new load or curve). A lane that ran to its lookup draw leaves that draw due."""
        key, n, gap, waits = self._lane
        used = n - self.lane
        self.lane, self._lane = 0, None
        if used:
            self._quiet[key] = max(0, self._quiet.get(key, 0) - used)
            if waits:
                self._lookup_wait[key] = max(0, self._lookup_wait.get(key, 0) - used)
            self._since_start += used
            self._ar_seen += used
            self._since_wide += used
        if gap and used == n:
            self._lookup_due[key] = True

    def _lookup_waits(self, key: str) -> bool:
        """Whether the index is not asked this cycle (one of the cycles of a back-off)."""
        left = self._lookup_wait.get(key, 0)
        if left:
            self._lookup_wait[key] = left - 1
        return bool(left)

    def _lookup_found(self, key: str, usable: bool) -> None:
        """The back-off of the index's checks, where host time is a share of a cycle (`_host_bound`):
        after an offer the table has no use for (none, or too short), the index is not asked for the
        next 1, 2, 4, ... LOOKUP_BACKOFF cycles; after a usable one it is asked every cycle again. A
        match is found at most LOOKUP_BACKOFF cycles after it starts (a repeat that is copied goes on
        far longer), and a text with nothing to copy pays for the index's sync and offer (~16 us
        between the embedded pair's passes) one cycle in five."""
        if usable or not self._host_bound():
            self._lookup_back[key] = 0
            return
        back = min(LOOKUP_BACKOFF, 2 * self._lookup_back.get(key, 0) or 1)
        self._lookup_back[key] = self._lookup_wait[key] = back

    def _host_bound(self) -> bool:
        """Whether an ar cycle's own host time (measured: `overhead`) is at least BACKOFF_SHARE of its
        pass (the embedded pair: ~0.1 of ~0.45 ms), where the index's checks are worth skipping. On
        SmolLM2 (~0.1 of 6 ms) the back-off saved nothing measurable and cost drafts: a repeat found up
        to 4 cycles late at every restart, the copy-heavy prompts' median 1.59 -> 1.57x `ar`, 5-10 % on
        six of 16 prompts."""
        if self.costs is None or "target" not in self.costs.base:
            return False
        return self._oh("ar") >= BACKOFF_SHARE * self.costs.solo("target", 1)

    def _offered(self, need: int, lookup) -> bool:
        """Whether the index offers a match of at least `need` tokens."""
        self.lookup_need = need
        match = lookup()
        return match is not None and match.length >= need

    def _capped(self, tab: _LookupTable) -> "_Capped":
        """`tab` as the request's slow start reads it: under its draft cap, with probes while it climbs."""
        return tab.capped(self._lookup_cap, self.lookup_margin, self._climb)

    def _planned(self, tab: _LookupTable, lookup) -> bool:
        """Whether the index offers a match that the (current) table `tab` has a plan for (within the draft cap)."""
        eff = self._capped(tab)
        self.lookup_need = eff.min_match
        match = lookup()
        return match is not None and eff.rows[min(max(1, match.length), MAX_MATCH)] is not None

    def _candidate(self, tab: _LookupTable | None, lookup) -> bool:
        """Whether a lookup table that must be made again (`_table_stale`: "remake") may have a use
        now: none yet, or the index offers a match one token shorter than the shortest the stale
        table planned (its rates move little between replans; with no plan at all, a match of the
        index's longest key). Until then it is not made: a replan used to remake it at ~0.4 ms
        between the embedded pair's ~0.5 ms passes, ~3 times a request, mostly on text that never
        offered a match it could use."""
        if tab is None:
            return True
        return self._offered(max(1, min(tab.min_match, MAX_MATCH + 1) - 1), lookup)

    def _switch_moved(self, tab: _LookupTable, cur) -> bool:
        """Whether the switch price (what a lookup draft among ar cycles costs the ar passes after it)
        moved by more than SWITCH_REPRICE of an ar cycle since `tab` was priced with it."""
        now = self.switch_cost() if cur is None or cur.kind == "ar" else 0.0
        return abs(now - tab.switch) > SWITCH_REPRICE * tab.t_ar

    def _plan_costs(self, pend: dict, plans: list[Plan]) -> tuple[np.ndarray, np.ndarray]:
        """modes.cycle_cost of each plan, the passes from Mode.widths (cached per pending counts, as
        _layout does) and their t(n) from the curves' tables in one step; and each plan's passes (the
        batched steps its cycle spans, as _Layout.steps)."""
        key = ("plans", tuple(sorted(pend.items())), tuple((p.kind, p.block, p.verify, p.lookup) for p in plans))
        lay = self._layouts.get(key)
        if lay is None:
            by_role: dict[str, tuple[list, list]] = {}
            for i, plan in enumerate(plans):
                for role, ws in MODES[plan.kind].widths(pend, plan).items():
                    idx, ns = by_role.setdefault(role, ([], []))
                    idx += [i] * len(ws)
                    ns += ws
            lay = self._layouts[key] = {r: (np.asarray(i, dtype=int), np.asarray(n, dtype=int))
                                        for r, (i, n) in by_role.items()}
        out, steps = np.zeros(len(plans)), np.zeros(len(plans))
        for role, (idx, ns) in lay.items():       # the curves' tables, one lookup per role (t() past their end)
            table = self.costs.table(role)
            ts = table[ns] if ns.max() < len(table) else np.array([self.costs.t(role, int(n)) for n in ns])
            out += np.bincount(idx, weights=ts, minlength=len(plans))
            steps += np.bincount(idx, minlength=len(plans))
        return out, steps

    def _lookup_table(self, mode: str, key: str, pending: dict, block_max: int, costs=None) -> _LookupTable:
        """For every match length m: the expected tokens per second of a lookup draft of k = 1..LOOKUP_K_MAX
        tokens, E(m, k) / (cost(k) + overhead), with E(m, k) = 1 + sum over j <= k of the product of the
        calibrated acceptance of slots 1..j (slot j's score: lookup.score(m + j - 1)) and cost(k) modes.cycle_cost
        of the lookup plan; where the mode proposes with masks, also a MARS proposal of the current best
        block B (verify v) filled by k lookup tokens: E = E(m, k) + P(all k accepted) x (E_B - 1), its cost the
        filled plan's when all k are accepted (proposal and verify pass), else the proposal pass alone
        (verify = 0). A row gets the best plan if its rate beats the current choice's by lookup_margin.
        While ar is the choice, a lookup cycle among ar cycles also pays the switch (`switch_cost`: the
        one-token passes right after a wider one run slower). `costs`: the costs of a table made since
        the last refresh (only the request's acceptance record moved), reused."""
        st = self.stats_for(LOOKUP)
        pend = {"target": pending.get("target", 1)}
        if pending.get(GATED):
            pend[GATED] = 1
        cur = self.current.get(key)
        g0, t0 = self.costs.step_rest()                     # (as in rates: the step's throughput)
        t_ar = max(1e-12, cycle_cost(self.costs.t, pend, AR_PLAN) + self._oh("ar"))
        base = cur.rate if cur is not None else (g0 + 1.0) / (t0 + t_ar)
        # slot j of a match of m extends a match of m + j - 1 tokens: its score lookup.score(m + j - 1);
        # the acceptance of the MAX_MATCH + LOOKUP_K_MAX distinct scores, then spread over the table
        a = self._lookup_rates(_TABLE_SCORES)[_TABLE_SLOTS]
        run = np.cumprod(a, axis=1)                              # P(slots 1..j all accepted)
        gain = 1.0 + np.cumsum(run, axis=1)                      # E(m, k)
        plans = self._lookup_plans(LOOKUP)
        options = self._options.get(key) or []
        mars = [o for o in options[1:] if o.kind == mode and o.width > 1] \
            if MODES[mode].source == "mask" and block_max > 1 else []
        best = max(mars, key=lambda o: o.rate) if mars else None
        if costs is None:
            switch = self.switch_cost() if cur is None or cur.kind == "ar" else 0.0
            oh = np.array([self._oh(LOOKUP, k) for k in range(1, LOOKUP_K_MAX + 1)])
            cost, l_steps = self._plan_costs(pend, plans)
            cost = cost + oh + switch
            full = short = f_steps = s_steps = None
            if best is not None:
                B, v = best.width, best.verify if best.verify is not None else best.width
                full, f_steps = self._plan_costs(pend, self._lookup_plans(mode, B, v))
                short, s_steps = self._plan_costs(pend, self._lookup_plans(mode, B, 0))
                full, short = full + self._oh(mode, B) + switch, short + self._oh(mode, B) + switch
            costs = (cost, full, short, best, switch, (l_steps, f_steps, s_steps))
        cost, full, short, was, switch, (l_steps, f_steps, s_steps) = costs
        if was is not best:                      # (the MARS options changed: a replan, which rebuilds the costs)
            best, full = None, None
        # (as in rates: a cycle of P passes spans P steps of the others' G tokens and T seconds)
        span = l_steps * t0 + np.maximum(cost, 1e-12)[None, :]
        rate = (l_steps * g0 + gain) / span
        # (Python lists from here: between two passes a numpy call costs microseconds, a list item little)
        best_i, best_r = rate.argmax(axis=1).tolist(), rate.max(axis=1)
        # what exploring goes by (`best`, `explore_min`): the better of the rates from the request's record and
        # from the engine-wide one alone. The request's own few slots decide its plans, but they are what an
        # exploration gathers: one early miss (1 of 3 slots, a repeated line's end) put every draft under the
        # floor, and the request never explored again (the embedded pair's copying answer, 1 round in 4)
        if EXPLORE_PRIOR and self._lookup_local.n_cycles:
            a0 = st.p_rates(_TABLE_SCORES)[_TABLE_SLOTS]
            ex = np.maximum(rate, (l_steps * g0 + 1.0 + np.cumsum(np.cumprod(a0, axis=1), axis=1)) / span)
            bests = [(i + 1, r) for i, r in zip(ex.argmax(axis=1).tolist(), ex.max(axis=1).tolist())]
        else:
            bests = [(i + 1, r) for i, r in zip(best_i, best_r.tolist())]     # (k, its rate) per match length
        # a k-token draft's rate were every token accepted (what exploring it can find: Choice.ceiling)
        ceilings = ((l_steps * g0 + 2.0 + np.arange(LOOKUP_K_MAX)) / (l_steps * t0 + np.maximum(cost, 1e-12))).tolist()
        rows = [plans[i] for i in best_i]
        # a MARS proposal filled by k lookup tokens (only where the mode proposes with masks)
        if best is not None and full is not None:
            B = best.width
            n_steps = run * f_steps[None, :] + (1.0 - run) * s_steps[None, :]
            f_rate = (n_steps * g0 + gain + run * (best.tokens - 1.0)) / (n_steps * t0 + np.maximum(
                run * full[None, :] + (1.0 - run) * short[None, :], 1e-12))
            f_i, f_r = f_rate.argmax(axis=1), f_rate.max(axis=1)
            for m in np.flatnonzero(f_r > best_r).tolist():
                rows[m] = Plan(mode, B, lookup=int(f_i[m]) + 1)
            best_r = np.maximum(best_r, f_r)
        cand, cand_r = rows, best_r.tolist()
        bar = base * (1.0 + self.lookup_margin)
        rows = [r if m and r_m > bar else None for m, (r, r_m) in enumerate(zip(cand, cand_r))]
        tab = _LookupTable(rows, bests, base, st.n_cycles, cur, pend["target"], any(r is not None for r in rows),
                            self._lookup_local.n_cycles, rate, costs, switch=switch, t_ar=t_ar,
                            cand=cand, cand_r=cand_r, ceilings=ceilings, ar_rate=(g0 + 1.0) / (t0 + t_ar),
                            priced=self._priced)
        if tab.local == 0:                       # (what the next request starts from: start_request)
            self._fresh[key] = tab
        return tab

    def _lookup_plans(self, kind: str, block: int = 1, verify: int | None = None) -> list[Plan]:
        """The plans of k = 1..LOOKUP_K_MAX lookup tokens (a lookup verify, or a `block`-slot proposal
        filled by them), made once: the lookup table is recomputed often in a request's first cycles."""
        key = ("lookup plans", kind, block, verify)
        plans = self._layouts.get(key)
        if plans is None:
            plans = self._layouts[key] = [Plan(kind, block, verify=verify, lookup=k) if kind != LOOKUP
                                          else Plan(LOOKUP, lookup=k) for k in range(1, LOOKUP_K_MAX + 1)]
        return plans

    def _lookup_rates(self, scores: np.ndarray) -> np.ndarray:
        """Acceptance of lookup slots with these scores: this request's record per score bin, with the
        engine-wide calibration as its prior worth LOOKUP_LOCAL_WEIGHT slots, that prior scaled down
        by the request's record pooled over all bins where it falls short: (slots the request
        accepted + W) / (what the engine-wide calibration expected of them + W), at most 1. A text
        the model rewrites instead of copying (SmolLM2 dropping tags from the XML it was asked to
        repeat: 11 of 26 lookup tokens accepted, spread over four bins) then stops drafting at match
        lengths it has not tried yet, instead of relearning the same lesson in every bin."""
        st, loc, w = self.stats_for(LOOKUP), self._lookup_local, LOOKUP_LOCAL_WEIGHT
        bin_acc, bin_tested = np.asarray(loc.bin_accepted), np.asarray(loc.bin_tested)
        prior = st.p_rates(loc.centers)            # per bin (the same bins: a bin's center lies in it)
        expected = float(bin_tested @ prior)
        shortfall = min(1.0, (float(bin_acc.sum()) + w) / (expected + w))
        return ((bin_acc + w * shortfall * prior) / (bin_tested + w))[loc._bin(scores)]

    def lookup_summary(self, key: str) -> dict | None:
        """The lookup table of `key` for people and the bench: per match length, the plan it gets."""
        tab = self._ltables.get(key)
        if tab is None:
            return None
        return {"rate": round(tab.rate, 2),
                "plans": {m: (label(p) if p is not None else "no") for m, p in enumerate(tab.rows) if m},
                "best_k": {m: k for m, (k, _) in enumerate(tab.best) if m}}

    def _verify_costs(self, mode: str, pending: dict, block: int) -> list[float]:
        """The cycle's cost when verifying v = 1..block of a block (modes.cycle_cost), cached until
        the next replan (the cost scale moves slowly; this runs before every planned cycle)."""
        key = (mode, block, tuple(sorted(pending.items())))
        costs = self._vcosts.get(key)
        if costs is None:
            costs = self._vcosts[key] = [cycle_cost(self.costs.t, pending, Plan(mode, block, verify=v))
                                         for v in range(1, block + 1)]
        return costs

    def _replan_after(self, cur: Choice, key: str) -> int:
        """Cycles between replans: ar cycles teach the statistics nothing (only the cost scale moves, 1
        in AR_SAMPLE), so while ar is the choice the options are recomputed 4x less often, and up to
        2**SETTLED_MAX times less again while replans keep finding it clearly best (`_replan`)."""
        if cur.kind != "ar":
            return self.replan_every
        return (self.replan_every * 4) << self._settled.get(key, (0, 0))[0]

    def _quiet_run(self, key: str, age: int) -> None:
        """Set the ar cycles that follow without an exploration draw or a replan: the cycles until the
        next exploration draw would succeed (a geometric gap: the same chance per cycle as drawing every
        cycle; that cycle then explores if the budget allows) or until the replan, whichever is first;
        no draw where the last replan found no width that could beat ar (`_hopeless`)."""
        left = self._replan_after(self.current[key], key) - age
        if left <= 0:
            return
        if self.explore <= 0.0 or (self.explore_by_rate and self._hopeless.get(key)):
            gap = left
        elif self.explore >= 1.0:
            gap = 0
        else:
            gap = int(math.log(1.0 - self.rng.random()) / math.log(1.0 - self.explore))
        if gap < left:
            self._draw[key] = True                 # the cycle after the run attempts an exploration
        n = min(gap, left)
        self._quiet[key] = n
        self.age[key] = age + n

    def verify_width(self, p, rate: float, costs: list[float], key: str = "lossless") -> int:
        """After the proposal pass: the verify width v maximising E[committed | p̃, v] - rate * cost(v)
        (E[committed] = 2 + sum over j < v of the product of the acceptance of slots 1..j given p̃;
        costs[v-1]: the cycle's cost when verifying v, from modes.cycle_cost; the proposal pass is the
        same in every term). Plain Python over a few slots: it runs between the two passes of every cycle."""
        st = self.stats_for(key)
        if self._bin_rates is None:
            self._bin_rates = st.p_rates(st.centers).tolist()
        rates_by_bin, top = self._bin_rates, st.bins - 1
        best_v, best = 1, 2.0 - rate * costs[0]
        gain, prod = 2.0, 1.0
        for v, pi in enumerate(p.tolist()[1:len(costs)], 2):
            prod *= rates_by_bin[min(int(pi * st.bins), top)]
            gain += prod
            value = gain - rate * costs[v - 1]
            if value > best:
                best_v, best = v, value
        return best_v

    def _budget_left(self) -> bool:
        """Whether the explorations' summed regret is within the budget (`_allowance`)."""
        return self.regret <= self._allowance()

    def _allowance(self) -> float:
        """explore_budget x the time seen, shared by the requests of a batched step: an exploration
        there holds up the step, so every request in it loses what the explorer loses, and each engine
        (one planner each) may lose only 1 / (1 + the others) of the budget for the step's requests to
        lose explore_budget of their time in all. (SmolLM2 + adapter, 4 requests a step, 16 GSM8K
        prompts: explorations of a MARS block or a lookup draft cost the steps they joined, and
        `lossless` ran 0.96-1.01x `ar` in two runs where, without exploring, it was `ar`, 0.99-1.00x.)"""
        others = self.costs.others if self.costs is not None else 0
        return self.explore_budget * self.elapsed / (1 + others)

    def _worth_exploring(self, ex: Plan, mode: str, key: str) -> bool:
        """Carry out an exploration with probability rate(its width) / rate(best choice), and only if
        it could beat `ar` by ar_margin (what `_replan` asks of a choice) were every slot it proposes
        accepted (`Choice.ceiling`): else no acceptance it could find would ever make it the choice, and
        it can only lose (a one-slot lossless block, two one-token passes for at most two tokens, ties
        `ar` at best) (SmolLM2 + adapter, 2
        threads: a B=2 gated cycle costs ~80 ms for at most 3 tokens that `ar` makes in ~40, and such
        explorations took ~0.7 % of the time). Against `ar`'s rate, which rests on pass costs alone, not
        against the best choice's: that is an acceptance estimate, and an optimistic one would bar the
        narrower explorations that correct it. And only if
        what it is expected to lose (the seconds of the steps it spans beyond what they would commit at
        the best rate; alone, its seconds beyond its tokens at that rate) fits the regret budget now:
        the budget is judged before the exploration as well as after it, or the first cycles of a fresh
        engine, with nothing spent and little time seen, would explore as
        freely as a long-running one (SmolLM2 on 2 threads: a B=2 exploration in a 64-token answer took
        41 ms where ar takes 18 for its two tokens, 4 % of the answer)."""
        options = self._options.get(key)
        if not self.explore_by_rate or not options:
            return True
        best = max(o.rate for o in options)
        want = (ex.kind, plan_width(ex))           # (an ar plan: width 1)
        o = next((o for o in options if (o.kind, o.width) == want), None)
        ar = options[0].rate                       # (rates(): ar first)
        if o is not None and o.ceiling < ar * (1.0 + self.ar_margin):
            return False                           # it could not be chosen with every slot accepted
        rate = o.rate if o is not None else best
        if o is not None and best > 0:
            # the steps it spans, less what they would commit at the best rate: alone its seconds less
            # its tokens at that rate; beside other requests the steps' seconds and all their tokens
            # (its own at a step's rate, which counts every request's tokens, made any loss look nil:
            # beside 3 others a B=3 exploration of ~39 ms passed as free where it holds up two steps)
            span = o.span or o.seconds
            loss = max(0.0, span * (1.0 - o.rate / best))
            if self.regret + loss > self._allowance():
                return False
        return self.rng.random() * best < rate

    def _explore(self, mode: str, cap: int, kcap: int, key: str | None = None) -> Plan:
        """An exploratory plan. Mostly local and cheap: one or two slots (drafts) wider than the current
        choice, so that the statistics just past it stay fresh where a steep curve makes wide passes
        dear; a share `explore_wide` of explorations picks any width (or ar) uniformly. For lossless,
        half of the time a random verify width (else the whole block, which refreshes every slot)."""
        cur = self.current.get(key or mode)
        base = cur.width if cur is not None and cur.kind != "ar" else (0 if MODES[mode].width == "draft_k" else 1)
        wide = self.rng.random() < self.explore_wide
        m = MODES[mode]
        if m.width == "draft_k":
            k = self.rng.randint(0, kcap) if wide else min(kcap, base + self.rng.randint(1, 2))
            return AR_PLAN if k == 0 else m.plan(1, k)
        if wide and self.rng.random() < 1.0 / (cap + 1):
            return AR_PLAN
        b = self.rng.randint(1, cap) if wide else min(cap, base + self.rng.randint(1, 2))
        if m.verify_choice and self.rng.random() < 0.5:
            return Plan(mode, block=b, verify=self.rng.randint(1, b))
        return m.plan(b, 0)

    def explain(self, mode: str, key: str | None = None, fix: str = "{flag} {width}") -> str | None:
        """One line for people: why the planner runs plain ar cycles for `mode` (from the options of its
        last replan: the best width's cycle cost in one-token passes against its expected tokens), and
        the fixed width that shows the mode's cycles anyway, with its expected speed. None unless ar
        is the current choice. `fix` says how to fix the width ({flag}: --block or --draft-k, {width})."""
        key = key or mode
        cur, options = self.current.get(key), self._options.get(key)
        if cur is None or cur.kind != "ar" or not options:
            return None
        m = MODES[mode]
        ar = options[0]
        props = [o for o in options[1:] if o.width > 1 or not m.free_first]
        if not props:
            return None
        best = max(props, key=lambda o: o.rate)
        plan = Plan(mode, best.width, verify=best.verify) if m.verify_choice else m.plan(best.width, best.width)
        how = fix.format(flag="--block" if m.width == "block" else "--draft-k", width=best.width)
        speed = best.rate / ar.rate
        why = (f"{speed:.2f}x ar's speed" if speed < 1.0 else
               f"{speed:.2f}x ar's speed, short of the {self.ar_margin:.0%} a width must win by")
        return (f"auto chose ar: on this machine a {label(plan)} {m.title} cycle costs {best.seconds / ar.seconds:.1f} "
                f"one-token passes and is expected to commit {best.tokens:.1f} tokens, {why}. To watch {m.title} "
                f"cycles anyway, fix the width ({how}: about {speed:.2f}x ar's tokens/s)")

    def summary(self) -> dict:
        return {"current": {m: {"kind": c.kind, "width": c.width, "tokens_per_second": round(c.rate, 1)}
                            for m, c in self.current.items()},
                "scale": dict(self.costs.scale) if self.costs else {},
                "adapter_switch_ms": round(self.costs.adapter_switch * 1e3, 2) if self.costs else 0.0,
                "shape": {r: self.costs.shape_summary(r) for r in self.costs.base} if self.costs else {},
                "exploration_regret_share": round(self.regret / self.elapsed, 4) if self.elapsed else 0.0,
                "memory_from": self.recalled,             # (None: this engine started from nothing)
                "overhead_us": {k if isinstance(k, str) else f"{k[0]}@{k[1]}": round(v * 1e6, 1)
                                for k, v in sorted(self.overhead.items(), key=str)},
                "stats": {m: s.summary() for m, s in self.stats.items()}}


def _planner_at(curve: dict[int, float], slot_rates, n_max: int = 160) -> Planner:
    """A planner on this curve whose lossless statistics are these per-slot rates, as if from endless
    data, and that never explores (the projections' planner)."""
    planner = Planner(Costs({"target": curve}, n_max=n_max), explore=0.0)
    st = planner.stats_for("lossless")
    rates = np.asarray(list(slot_rates) + [0.0] * N_SLOTS, dtype=float)[:N_SLOTS]
    st.tested[:] = [1e12] * N_SLOTS
    st.accepted[:] = (rates * 1e12).tolist()
    return planner


def projection(curve: dict[int, float], slot_rates, block_max: int = 16, overhead: float = 0.0) -> list[dict]:
    """Expected lossless tokens per one-token pass cost for every block width B (verify = B) and
    the planner's prior choice, from a pass-cost curve and per-slot acceptance rates: the projection
    table of the bench (a flat curve, as on a GPU, must make the planner pick the full block)."""
    planner = _planner_at(curve, slot_rates)
    planner.overhead = {"ar": overhead, "lossless": overhead}
    t1 = planner.costs.t("target", 1)
    options = planner.rates("lossless", {"target": 1}, block_max)
    best = max(options, key=lambda ch: ch.rate)
    return [{"kind": o.kind, "width": o.width, "tokens_per_t1": round(o.rate * t1, 4),
             "chosen": (o.kind, o.width) == (best.kind, best.width)} for o in options]


def batch_projection(curve: dict[int, float], slot_rates, concurrency=(1, 2, 4, 8, 16, 32),
                     block_max: int = 16) -> list[dict]:
    """What batching does to lossless, on paper, from a pass-cost curve t(n) (seconds of one
    llama_decode of n tokens) and per-slot acceptance; no timing. Per concurrency c:
    - `ar_batch_gain`: an all-ar step's throughput over one request's, (c / t(c)) / (1 / t(1));
    - `choice`, `step_gain`: the batch-aware planner's choice for one lossless request beside c - 1
      ar requests (`Planner.rates` under `set_load`, the rule the engine runs) and the step's
      throughput it expects from it over the all-ar step's;
    - `in_phase`: per width, if all c requests ran it at once — every pass one ubatch of c times its
      tokens (llama.cpp's split_equal puts sequences of equal widths into one ubatch) — the step's
      tokens per second over the all-ar step's; `best_in_phase` the best of those (ar: 1.0), and
      `choice_in_phase` the planner's choice there.
    The acceptance is the same at every concurrency (batching changes what a pass costs, not what a
    proposal gets right)."""
    n_top = max(concurrency) * (block_max + 1) + 1
    solo = Costs({"target": curve}, n_max=n_top)
    mode, pend = MODES["lossless"], {"target": 1}
    gain = mode.expected_tokens(_planner_at(curve, slot_rates).stats_for("lossless").slot_rates(block_max).tolist(),
                                block_max)
    plans = {(w, v): gain[v] for w in range(1, block_max + 1) for v in range(1, w + 1)}
    out = []
    for c in concurrency:
        planner = _planner_at(curve, slot_rates, n_top)
        if c > 1:
            planner.set_load({"target": c - 1}, c - 1)
        options = planner.rates("lossless", pend, block_max)
        plan = planner.plan("lossless", pend, block_max, room=1 << 20)    # (its margins and all)
        ar = options[0]
        best = ar if plan.kind == "ar" else next(o for o in options[1:] if o.width == plan.block)
        t_ar = solo.solo("target", c)
        in_phase = {}                            # per width, at its best verify width in phase
        for (w, v), g in plans.items():
            secs = sum(solo.solo("target", c * n) for n in mode.widths(pend, Plan("lossless", w, verify=v))["target"])
            in_phase[w] = max(in_phase.get(w, 0.0), round(g * t_ar / secs, 4))
        top = max(in_phase, key=in_phase.get)
        out.append({
            "concurrency": c,
            "ar_batch_gain": round(c * solo.solo("target", 1) / t_ar, 4),
            "choice": label(plan),
            "tokens_per_cycle": round(best.tokens, 4),
            "step_gain": round(best.rate / ar.rate, 4),
            "in_phase": in_phase,
            "best_in_phase": {"width": top if in_phase[top] > 1.0 else 1, "gain": max(1.0, in_phase[top])},
            "choice_in_phase": 1.0 if best.kind == "ar" else in_phase[best.width],
        })
    return out


def widths_histogram(cycles) -> dict:
    """How often each plan was run (`Plan.label`: 'ar', 'B=4 v=2', 'k=3'), most frequent first."""
    return dict(Counter(label(c.plan) for c in cycles).most_common())
