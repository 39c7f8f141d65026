"""Benchmark statistics as pure functions over cycle events and token lists.

A cycle is anything with the attributes of `prove_local.rules.Cycle` (proposed, p, q, committed,
n_accepted, passes, seconds, decode_seconds, start). The greedy reference of a prompt is the AR
output on that prompt in the same run: for exact modes the committed sequence equals it, so slot
i of a cycle that started at generated position s is "on the greedy path" when
proposed[i] == reference[s + i]. For lossy modes a cycle is only labelled while everything
generated before it still equals the reference.
"""
from __future__ import annotations

import math
from statistics import median

import numpy as np

from ..engine import summarize, tokens_per_second
from ..modes import cycle_cost, pass_cost
from ..modes import get as get_mode

# The ProVe paper's GSM8K figures (32B MARS proposer), for the reference rows of tables and plots.
PAPER_SLOT_MATCH_GSM8K = [0.96, 0.86, 0.79, 0.71, 0.67, 0.59, 0.53, 0.51, 0.47, 0.44, 0.39, 0.34, 0.34, 0.30, 0.28, 0.27]
PAPER_AUC = {"p": 0.910, "q": 0.960, "pq": 0.964}


# --------------------------------------------------------------------------- basic statistics
def auc(scores, labels) -> float | None:
    """Area under the ROC curve of `scores` as a detector of `labels` (True = positive), by the
    rank statistic (Mann-Whitney U with average ranks for ties). None if a class is empty."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=float)
    sorted_s = s[order]
    i = 0
    while i < len(s):                       # average ranks over runs of equal scores
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def roc_curve(scores, labels) -> tuple[list[float], list[float]]:
    """(false positive rates, true positive rates) over all thresholds, for plotting."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=bool)
    if y.all() or (~y).all():
        return [0.0, 1.0], [0.0, 1.0]
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    distinct = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]
    tps = np.cumsum(y)[distinct]
    fps = (distinct + 1) - tps
    return [0.0] + (fps / (~y).sum()).tolist(), [0.0] + (tps / y.sum()).tolist()


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def loop_mask(ids: list[int], n: int = 8) -> np.ndarray:
    """True for each token inside a repeated n-gram (an n-gram that already occurred earlier in
    the same output)."""
    seen, inside = set(), np.zeros(len(ids), dtype=bool)
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        if gram in seen:
            inside[i:i + n] = True
        seen.add(gram)
    return inside


def loop_share(outputs: list[list[int]], n: int = 8) -> float | None:
    """Share of generated tokens inside a repeated n-gram: how much of the text is the model
    looping. Tokens per cycle earned by looping do not count as proposal quality."""
    masks = [loop_mask(ids, n) for ids in outputs]
    total = sum(len(m) for m in masks)
    return sum(int(m.sum()) for m in masks) / total if total else None


def tokens_per_cycle_outside_loops(gens: list[tuple[list[int], list]], n: int = 8) -> float | None:
    """Tokens per cycle over the cycles that commit no token inside a repeated n-gram, for
    (generated tokens, cycles) pairs: proposal quality with the loops taken out."""
    committed = cycles = 0
    for ids, cs in gens:
        inside = loop_mask(ids, n)
        for c in cs:
            if not inside[c.start:c.start + len(c.committed)].any():
                committed += len(c.committed)
                cycles += 1
    return committed / cycles if cycles else None


# --------------------------------------------------------------------- per-slot greedy labels
def slot_labels(cycles, generated: list[int], reference: list[int]) -> list[dict]:
    """One record per labelled proposal slot: {"slot" (0-based), "p", "q" (or None), "match",
    "on_path", "start", "cycle"}. `match`: the slot's token equals the greedy token at its position
    (the per-slot match rate); `on_path`: the block up to and including this slot is the greedy
    path (every earlier slot of the cycle matches too), the event the detector AUCs score. A cycle
    is labelled only if the output before it equals the reference (always so for exact modes);
    slots past the end of the reference are not labelled."""
    ok_until = common_prefix(generated, reference)
    out = []
    for ci, c in enumerate(cycles):
        if c.start > ok_until:
            break
        on_path = True
        for i, tok in enumerate(c.proposed):
            pos = c.start + i
            if pos >= len(reference):
                break
            match = tok == reference[pos]
            on_path = on_path and match
            # q exists only for the verified slots (the planner may verify a prefix of the proposal)
            out.append({"slot": i, "p": float(c.p[i]), "q": float(c.q[i]) if c.q is not None and i < len(c.q) else None,
                        "match": match, "on_path": on_path, "start": c.start, "cycle": ci})
    return out


def match_rate_by_slot(labels: list[dict], n_slots: int | None = None) -> tuple[list[float | None], list[int]]:
    """How often slot i equals the greedy token: (rate per slot, labelled count per slot)."""
    n_slots = n_slots or (max((r["slot"] for r in labels), default=-1) + 1)
    hits, counts = [0] * n_slots, [0] * n_slots
    for r in labels:
        if r["slot"] < n_slots:
            counts[r["slot"]] += 1
            hits[r["slot"]] += bool(r["match"])
    return [h / c if c else None for h, c in zip(hits, counts)], counts


def matched_runs(cycles, generated: list[int], reference: list[int]) -> list[dict]:
    """Per labelled cycle: how many leading proposed tokens equal the greedy continuation
    ("matched tokens per block"), where the cycle started (`start`) and the response length
    (`length` = len(reference)). A run that reaches the end of the reference before a mismatch or
    the end of the block is censored and left out."""
    ok_until = common_prefix(generated, reference)
    out = []
    for c in cycles:
        if c.start > ok_until:
            break
        run = 0
        for i, tok in enumerate(c.proposed):
            pos = c.start + i
            if pos >= len(reference):
                run = None
                break
            if tok != reference[pos]:
                break
            run += 1
        if run is not None:
            out.append({"start": c.start, "matched": run, "block": len(c.proposed), "length": len(reference)})
    return out


def binned_means(xs, ys, edges) -> tuple[list[float | None], list[int]]:
    """Mean of ys over the bins [edges[k], edges[k+1]) of xs (the last bin includes its right edge)."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    means, counts = [], []
    for k in range(len(edges) - 1):
        lo, hi = edges[k], edges[k + 1]
        sel = (xs >= lo) & ((xs < hi) if k < len(edges) - 2 else (xs <= hi))
        counts.append(int(sel.sum()))
        means.append(float(ys[sel].mean()) if sel.any() else None)
    return means, counts


def matched_by_position(runs: list[dict], n_bins: int = 5) -> dict:
    """Mean matched tokens per block against the relative position in the response
    (start / response length) in `n_bins` equal bins, plus the overall mean."""
    edges = [k / n_bins for k in range(n_bins + 1)]
    rel = [r["start"] / r["length"] if r["length"] else 0.0 for r in runs]
    means, counts = binned_means(rel, [r["matched"] for r in runs], edges)
    return {"edges": edges, "mean": means, "n": counts,
            "overall": float(np.mean([r["matched"] for r in runs])) if runs else None}


def detector_aucs(labels: list[dict], label: str = "on_path") -> dict:
    """AUC of p̃, q and p̃·q as detectors of "slot i is on the greedy path" over all labelled slots
    (q and p̃·q over the slots that have a q: a planner may verify only a prefix).

    The label (`on_path`, the default) is the paper's event read literally: the proposed block up to
    slot i is the greedy path. It is what a gate decides on (the rules commit a leading run: a slot
    after a wrong one can never be committed correctly) and what q can judge (the verifier reads the
    proposed tokens before slot i, so after a wrong one it scores a continuation of text that is not
    on the path). `label="match"` scores the positional event instead (the slot's token equals the
    greedy token at its position, whatever came before it): reported too, as `positional`."""
    y = [r[label] for r in labels]
    out = {"p": auc([r["p"] for r in labels], y), "n_pos": sum(map(bool, y)), "n_neg": len(y) - sum(map(bool, y))}
    with_q = [r for r in labels if r["q"] is not None]
    if with_q:                                # over the slots that have a q (verified ones)
        yq = [r[label] for r in with_q]
        out["q"] = auc([r["q"] for r in with_q], yq)
        out["pq"] = auc([r["p"] * r["q"] for r in with_q], yq)
    else:
        out["q"] = out["pq"] = None
    return out


# --------------------------------------------------------------------------- speed and cost
def speedups(mode_runs: list[tuple[int, float]], ar_runs: list[tuple[int, float]]) -> dict:
    """Speedup vs AR from per-prompt (tokens, seconds) pairs, same prompts in the same order:
    the median of per-prompt throughput ratios, and the ratio of total throughputs."""
    ratios = []
    for (nm, sm), (na, sa) in zip(mode_runs, ar_runs):
        if nm and sm > 0 and na and sa > 0:
            ratios.append((nm / sm) / (na / sa))
    tm, sm = sum(n for n, _ in mode_runs), sum(s for _, s in mode_runs)
    ta, sa = sum(n for n, _ in ar_runs), sum(s for _, s in ar_runs)
    totals = (tm / sm) / (ta / sa) if sm > 0 and sa > 0 and ta and tm else None
    return {"median": median(ratios) if ratios else None, "totals": totals, "n": len(ratios)}


def throughput(runs: list[tuple[int, float]]) -> float | None:
    """Tokens/s over several generations (engine.tokens_per_second of the totals); None without time."""
    tokens, seconds = sum(n for n, _ in runs), sum(s for _, s in runs)
    return tokens_per_second(tokens, seconds) if seconds > 0 else None


def passes_per_token(cycles) -> dict:
    """Forward passes per generated token, per model (engine.summarize's: one definition)."""
    return summarize(cycles, 0.0)["passes_per_token"]


def tokens_per_cycle(cycles) -> float | None:
    """Tokens committed per cycle (engine.summarize's); None without cycles."""
    return summarize(cycles, 0.0)["tokens_per_cycle"] if cycles else None


def measured_cycle_cost(cycles, ar_cycles, decode_only: bool = False) -> float | None:
    """Mean cycle time of a mode in target-pass units: ÷ the mean AR cycle (one 1-token pass).
    decode_only: count only the time inside llama_decode."""
    def mean_time(cs):
        if not cs:
            return None
        t = [sum(c.decode_seconds.values()) if decode_only else c.seconds for c in cs]
        return sum(t) / len(t)
    m, a = mean_time(cycles), mean_time(ar_cycles)
    return m / a if m is not None and a else None


def overhead_share(cycles) -> float | None:
    """Share of cycle wall time spent outside llama_decode."""
    total = sum(c.seconds for c in cycles)
    return 1.0 - sum(sum(c.decode_seconds.values()) for c in cycles) / total if total > 0 else None


def host_ms_per_cycle(cycles) -> float | None:
    """Milliseconds per cycle outside llama_decode (Python and numpy: the host's work)."""
    if not cycles:
        return None
    return 1e3 * sum(c.seconds - sum(c.decode_seconds.values()) for c in cycles) / len(cycles)


# ------------------------------------------------------------------- pass cost and projection
def curve_ratio(curve: dict, n: float) -> float:
    """t(n)/t(1) from a measured curve {n: seconds}, linear interpolation (and extrapolation past
    the last point along the curve's mean slope per token)."""
    ns = sorted(curve)
    t1 = curve[1] if 1 in curve else np.interp(1, ns, [curve[k] for k in ns])
    if n in curve:
        return curve[n] / t1
    if n > ns[-1]:
        # past the last measured width: the curve's mean slope, never negative (a noisy last
        # segment can fall; a catch-up pass after ar cycles can be far wider than the curve)
        a, b = ns[0], ns[-1]
        slope = max(0.0, (curve[b] - curve[a]) / (b - a)) if b > a else curve[b] / b
        return (curve[b] + slope * (n - b)) / t1
    return float(np.interp(n, ns, [curve[k] for k in ns])) / t1


def _unit_cost(curves: dict | None, flat: bool = False):
    """t(role, n) in units of the target's 1-token pass, from pass-cost curves
    {"target"|"verifier"|"draft": {n: seconds}}: the curve's t(n)/t(1), times the role's t(1)
    relative to the target's (the paper's ρ) when those curves exist. flat=True: every pass of n
    tokens costs what its model's 1-token pass costs (the GPU-like regime of the paper's cost model)."""
    def rho(role):
        if not curves or role not in curves or "target" not in curves or role == "target":
            return 1.0
        return curves[role][min(curves[role])] / curves["target"][min(curves["target"])]

    def t(role, n):
        return rho(role) * (1.0 if flat or not curves or role not in curves else curve_ratio(curves[role], n))
    return t


def cycle_cost_units(mode: str, n_proposed: int, curves: dict | None, flat: bool = False) -> float:
    """Cost of one cycle of `mode` proposing n tokens (B slots, or k drafts), nothing pending, in
    units of the target's 1-token pass: modes.cycle_cost (the planner's cost model) over the curves."""
    m = get_mode(mode)                  # (an unknown mode: ModeError, a ValueError)
    return cycle_cost(_unit_cost(curves, flat), {r: 1 for r in m.roles}, m.plan(n_proposed, n_proposed))


def cycle_cost_widths(widths: dict, curves: dict | None, flat: bool = False) -> float:
    """Cost of one cycle in units of the target's 1-token pass from the widths actually fed
    (`Cycle.widths`: {role: [tokens per pass]}; a prove/mars proposal pass is pending + B - 1 wide,
    spec's first draft pass catches up on the pending tokens)."""
    return pass_cost(_unit_cost(curves, flat), widths)


def _cycle_cost(mode: str, c, curves, flat: bool = False) -> float:
    if getattr(c, "widths", None):
        return cycle_cost_widths(c.widths, curves, flat)
    return cycle_cost_units(mode, len(c.proposed), curves, flat)    # an old report without widths


def projected(mode: str, cycles, curves: dict | None) -> dict:
    """Projected cycle cost (target-pass units) and speedup = tokens per cycle ÷ cycle cost:
    from the measured curves, and for a flat curve (`_flat`); from each cycle's own widths."""
    if not cycles:
        return {"cycle_cost": None, "speedup": None, "cycle_cost_flat": None, "speedup_flat": None}
    tokens = sum(len(c.committed) for c in cycles)
    cost = sum(_cycle_cost(mode, c, curves) for c in cycles)
    flat = sum(_cycle_cost(mode, c, curves, flat=True) for c in cycles)
    n = len(cycles)
    return {"cycle_cost": cost / n, "speedup": tokens / cost, "cycle_cost_flat": flat / n, "speedup_flat": tokens / flat}


def oracle_cost(match_runs: list[int], curve: dict | None, max_width: int = 16) -> float:
    """The least total cost (target one-token passes) of lossless decoding along one greedy answer
    knowing the outcome: `match_runs[s]` is how many leading slots of a full proposal at generated
    position s equal the greedy continuation (>= 1: slot 1 is the AR token). At s the best cycle is
    ar (1 token for t(1)) or a block of width v <= max_width verified whole (min(match_runs[s], v) + 1
    tokens for t(v) + t(v)); a shortest path over positions. Widths past the match run count too: on a
    measured curve that is not increasing (noise, or a machine under load), a wider pass can cost
    less, and the oracle must be at least as good as every fixed block. curve None: flat (every
    pass costs t(1))."""
    n = len(match_runs)
    cost = [2 * (curve_ratio(curve, v) if curve else 1.0) for v in range(max_width + 1)]
    inf = float("inf")
    best = [inf] * (n + 1)
    best[0] = 0.0
    for s in range(n):
        if best[s] + 1.0 < best[s + 1]:
            best[s + 1] = best[s] + 1.0
        for v in range(1, max_width + 1):
            e = min(n, s + min(max(1, match_runs[s]), v) + 1)
            c = best[s] + cost[v]
            if c < best[e]:
                best[e] = c
    return best[n]


def oracle_lossless(match_runs: list[int], curve: dict | None, max_width: int = 16) -> float | None:
    """Tokens per one-token pass cost of the oracle along one answer (see oracle_cost)."""
    return len(match_runs) / oracle_cost(match_runs, curve, max_width) if match_runs else None


def fixed_block_cost(match_runs: list[int], block: int, curve: dict | None) -> float:
    """Total cost of lossless with a fixed block verified whole at every cycle along one answer."""
    per = 2 * (curve_ratio(curve, block) if curve else 1.0)
    s = cost = 0
    while s < len(match_runs):
        s += min(match_runs[s], block) + 1
        cost += per
    return cost


def lossless_policies(match: dict, curve: dict | None, blocks=(1, 2, 3, 4, 8, 16)) -> dict:
    """Tokens per one-token pass cost, pooled over answers (`match`: answer -> match runs), of ar,
    fixed blocks and the oracle, on `curve` (None: flat)."""
    n = sum(len(m) for m in match.values())
    if not n:
        return {}
    fixed = {b: n / sum(fixed_block_cost(m, b, curve) for m in match.values()) for b in blocks}
    oracle = n / sum(oracle_cost(m, curve, max(blocks)) for m in match.values())
    return {"ar": 1.0, "fixed_blocks": fixed, "oracle": oracle}


def conditional_slot_rates(runs: list[int], n_slots: int = 16) -> list[float | None]:
    """P(slot i matches | slots before it matched), from match runs of full proposals."""
    out = []
    for i in range(n_slots):
        reach = sum(m >= i for m in runs)
        out.append(sum(m >= i + 1 for m in runs) / reach if reach else None)
    return out


# ---------------------------------------------------------------------------- exactness
def exact_match_share(outputs: list[list[int]], references: list[list[int]]) -> float | None:
    """Share of prompts whose output equals the reference token for token."""
    pairs = [(o, r) for o, r in zip(outputs, references) if r is not None and o is not None]
    return sum(o == r for o, r in pairs) / len(pairs) if pairs else None


def accuracy(flags) -> float | None:
    flags = [f for f in flags if f is not None]
    return sum(map(bool, flags)) / len(flags) if flags else None


def fmt(x, digits: int = 2, suffix: str = "") -> str:
    """Table cell: a number or '–'."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}{suffix}"


# ------------------------------------------------------------------------------- sampling
def acceptance_by_slot(cycles) -> dict:
    """Exact modes: per proposed slot i, how often it was accepted among the cycles that tested it
    (every slot before it accepted, and it was verified), and where the cycle sampled, the mean
    acceptance probability min(1, q/p̃) it was tested with. Cycles cut by a stop are left out (the
    cut, not the rule, ended their run)."""
    tested: list[int] = []
    accepted: list[int] = []
    probs: list[list[float]] = []
    for c in cycles:
        if c.stop:
            continue
        ap = getattr(c, "accept_prob", None)
        n_ver = len(ap) if ap is not None else (len(c.q) if c.q is not None else len(c.proposed))
        for i in range(min(n_ver, c.n_accepted + 1)):
            if i >= len(tested):
                tested.append(0), accepted.append(0), probs.append([])
            tested[i] += 1
            accepted[i] += i < c.n_accepted
            if ap is not None:
                probs[i].append(float(ap[i]))
    return {"rate": [a / t for a, t in zip(accepted, tested)], "n": tested,
            "mean_accept_prob": [sum(p) / len(p) if p else None for p in probs]}


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: the regularized upper incomplete gamma
    Q(df/2, x/2), by its series or continued fraction (Numerical Recipes, gammp/gammq)."""
    if x <= 0 or df <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    lg = math.lgamma(a)
    if z < a + 1:                              # series for P, Q = 1 - P
        term = total = 1.0 / a
        n = a
        for _ in range(10000):
            n += 1
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - lg))
    b = z + 1 - a                              # continued fraction for Q (modified Lentz)
    c, d = 1.0 / 1e-300, 1.0 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - lg) * h


def distribution_check(reference: dict, outputs: dict, positions: int = 8, min_count: int = 5) -> dict | None:
    """Sampled outputs cannot be compared token for token: compare distributions instead.
    `reference` / `outputs`: prompt -> list of sampled token lists (repeated seeds). For each
    position k < positions and each prompt, a two-sample chi-square of the token at k (tokens seen
    fewer than min_count times in both together pooled); the statistics of different prompts are
    independent and are summed, giving one p-value per position; `p_value` is the smallest times
    the number of positions (Bonferroni). Also the mean total variation distance per position
    between the two frequency tables (it shrinks with more samples when the modes agree)."""
    per_pos, tv = [], []
    for k in range(positions):
        stat, df, tvs = 0.0, 0, []
        for prompt, outs in outputs.items():
            a = [o[k] for o in reference.get(prompt, []) if len(o) > k]
            b = [o[k] for o in outs if len(o) > k]
            if len(a) < 2 or len(b) < 2:
                continue
            ca, cb = {}, {}
            for t in a:
                ca[t] = ca.get(t, 0) + 1
            for t in b:
                cb[t] = cb.get(t, 0) + 1
            keys = set(ca) | set(cb)
            tvs.append(0.5 * sum(abs(ca.get(t, 0) / len(a) - cb.get(t, 0) / len(b)) for t in keys))
            big = [t for t in keys if ca.get(t, 0) + cb.get(t, 0) >= min_count]
            cols = [(ca.get(t, 0), cb.get(t, 0)) for t in big]
            rest = (len(a) - sum(x for x, _ in cols), len(b) - sum(y for _, y in cols))
            if rest[0] + rest[1] > 0:
                cols.append(rest)
            if len(cols) < 2:
                continue
            n = len(a) + len(b)
            for x, y in cols:
                tot = x + y
                for obs, size in ((x, len(a)), (y, len(b))):
                    e = tot * size / n
                    stat += (obs - e) ** 2 / e
            df += len(cols) - 1
        if df:
            per_pos.append(chi2_sf(stat, df))
            tv.append(sum(tvs) / len(tvs))
    if not outputs:
        return None
    return {"p_value": min(1.0, min(per_pos) * len(per_pos)) if per_pos else None,   # None: too few samples
            "p_by_position": per_pos, "tv_by_position": tv,
            "positions": len(per_pos), "samples": sum(len(v) for v in outputs.values()),
            "method": "Per-position two-sample chi-square of token frequencies over repeated seeds, "
                      "summed over prompts, Bonferroni over positions"}


# ------------------------------------------------------------ comparison at equal error
def error_points(sweep: list[dict], kind: str = "divergence", ar_accuracy: float | None = None) -> list[dict]:
    """(θ, error, tokens per cycle) of each `prove` run of a θ sweep (results.json "theta_sweep").
    kind "divergence": share of prompts whose output differs from `ar`'s (1 − exact_match_vs_ar);
    kind "accuracy": the accuracy lost against `ar` (ar_accuracy − accuracy). Runs lacking the figure are left out."""
    pts = []
    for r in sweep:
        tpc = r.get("tokens_per_cycle")
        if kind == "divergence":
            err = None if r.get("exact_match_vs_ar") is None else 1.0 - r["exact_match_vs_ar"]
        elif kind == "accuracy":
            err = None if r.get("accuracy") is None or ar_accuracy is None else ar_accuracy - r["accuracy"]
        else:
            raise ValueError(f"unknown error kind {kind!r} (divergence, accuracy)")
        if err is not None and tpc is not None:
            pts.append({"theta": r.get("theta"), "error": float(err), "tokens_per_cycle": float(tpc)})
    return pts


def frontier_at(points: list[dict], error: float) -> float | None:
    """Tokens per cycle reachable at `error` along a θ sweep: the upper envelope (the most tokens per
    cycle at an error ≤ e, over the sweep's points), linear between its corners; None outside the
    sweep's error range (no extrapolation)."""
    if not points:
        return None
    pts = sorted((p["error"], p["tokens_per_cycle"]) for p in points)
    lo, hi = pts[0][0], pts[-1][0]
    if error < lo - 1e-12 or error > hi + 1e-12:
        return None
    corners: list[tuple[float, float]] = []       # error increasing, tokens per cycle increasing
    for e, t in pts:
        if corners and t <= corners[-1][1]:
            continue                               # dominated: more error, no more tokens
        if corners and e == corners[-1][0]:
            corners[-1] = (e, t)
        else:
            corners.append((e, t))
    es, ts = [c[0] for c in corners], [c[1] for c in corners]
    if error >= es[-1]:
        return ts[-1]
    return float(np.interp(error, es, ts))


def at_equal_error(new: list[dict], old: list[dict]) -> dict:
    """The ProVe paper's comparison (a verifier fine-tuned on the proposer's outputs commits 6–10 %
    more tokens per cycle at the same error rate): at the error of each point of the `old` sweep,
    the tokens per cycle on the envelope of each sweep (`frontier_at`) and their ratio new/old.
    Points at error 0 or 1 of `old` (nothing to trade, or everything diverged) and errors outside the
    new sweep's range are listed with ratio None and left out of the mean."""
    rows = []
    for p in sorted(old, key=lambda p: p["error"]):
        t_new, t_old = frontier_at(new, p["error"]), frontier_at(old, p["error"])
        ok = t_new is not None and t_old and 0.0 < p["error"] < 1.0
        rows.append({"theta_old": p["theta"], "error": p["error"], "tokens_per_cycle_old": t_old,
                     "tokens_per_cycle_new": t_new, "ratio": t_new / t_old if ok else None})
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return {"points": rows, "mean_ratio": float(np.mean(ratios)) if ratios else None, "n": len(ratios)}
