"""results.json and generations.jsonl of a benchmark run: built from its events, written atomically,
and read back (`--report-only`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..engine import Settings, tokens_per_second
from ..files import write_atomic
from ..modes import MODES, draft_counts, proposes
from ..planner import projection as project, widths_histogram
from ..rules import Cycle, Plan
from . import stats
from .data import Prompt, check_answer
from .markdown import summary_markdown
from .plots import make_plots, roc_data
from .runner import Batch, BenchData, Record, Run
from .stats import conditional_slot_rates

SCHEMA_VERSION = 1


def _r(x, d=4):
    return None if x is None else round(float(x), d)


def reference_run(data: BenchData) -> str | None:
    names = [r.name for r in data.runs]
    return "ar" if "ar" in names else ("lossless" if "lossless" in names else None)


def sampled_reference(data: BenchData, temperature: float) -> str | None:
    """The `ar` run at this temperature: the distribution an exact mode's samples must follow."""
    for r in data.runs:
        if r.settings.mode == "ar" and r.settings.temperature == temperature:
            return r.name
    return None


@dataclass
class Index:
    """What every step of `build_results` looks up: the first generation of each (prompt, run), the
    samples of each run, the greedy reference and the answers' correctness."""
    data: BenchData
    runs: dict                    # name -> Run
    by: dict                      # (prompt, run) -> the generation with sample 0
    samples: dict                 # run -> prompt -> [token lists] (every sample)
    ref_name: str | None          # the reference run (ar, else lossless)
    ref: dict                     # prompt -> the reference's tokens
    ar_gens: list                 # per prompt: ar's generation or None
    correct: dict                 # (prompt, run) -> True/False/None (the answer checked)

    @property
    def prompts(self) -> list:
        return self.data.prompts

    def gens(self, name: str) -> list:
        """Per prompt: the run's generation, or None (the prompt was not run)."""
        return [self.by.get((i, name)) for i in range(len(self.prompts))]


def index(data: BenchData) -> Index:
    by = {(g.prompt, g.run): g for g in data.generations if g.sample == 0}   # repeated seeds: samples
    samples: dict[str, dict[int, list[list[int]]]] = {}
    for g in data.generations:
        samples.setdefault(g.run, {}).setdefault(g.prompt, []).append(g.tokens)
    prompts = data.prompts
    ref_name = reference_run(data)
    ref = {i: by[(i, ref_name)].tokens for i in range(len(prompts)) if (i, ref_name) in by} if ref_name else {}
    correct = {}
    for g in data.generations:
        if g.sample:
            continue
        p = prompts[g.prompt]
        correct[(g.prompt, g.run)] = check_answer(p.family, g.text, p.answer)
    return Index(data, {r.name: r for r in data.runs}, by, samples, ref_name, ref,
                 [by.get((i, "ar")) for i in range(len(prompts))], correct)


def build_results(data: BenchData, *, meta: dict) -> dict:
    """results.json: every run's statistics, the paper's analyses, and the comparisons between runs."""
    ix = index(data)
    modes, slot_rates, aucs, by_pos, sweep = {}, {}, {}, {}, []
    for name, run in ix.runs.items():
        entry = mode_entry(ix, name, run)
        modes[name] = entry
        if MODES[run.settings.mode].gate == "theta":            # the θ sweep
            sweep.append(theta_sweep_row(name, run, entry))
        # the paper's analyses, for runs that propose blocks (or drafts)
        if MODES[run.settings.mode].width is not None and ix.ref and run.settings.temperature == 0:   # greedy-path analyses
            slot_rates[name], aucs[name], by_pos[name] = greedy_path_analyses(ix, name, run, entry, meta.get("bins", 5))
    fams: dict[str, int] = {}
    for p in data.prompts:
        fams[p.family] = fams.get(p.family, 0) + 1
    return {
        "schema": SCHEMA_VERSION,
        **{k: v for k, v in meta.items() if k != "bins"},
        "data": {**meta.get("data", {}), "n_prompts": len(data.prompts), "families": fams},
        "reference": ix.ref_name,
        "warmup_seconds": _r(data.warmup_seconds, 2),
        "modes": modes,
        "position_match_rate": slot_rates,
        "matched_tokens_by_position": by_pos,
        "auc": aucs,
        "theta_sweep": sorted(sweep, key=lambda r: r["theta"]),
        "pass_cost": pass_cost_table(data),
        "auto_vs_fixed": auto_vs_fixed(modes),
        "planner": data.planner,
        "oracle": oracle_bound(data),
        "projection": planner_projection(data),
        "external": external_baseline(ix),
        "batched": batched(data),
        "paper": {"position_match_rate_gsm8k": stats.PAPER_SLOT_MATCH_GSM8K, "auc": stats.PAPER_AUC},
        "prompts": per_prompt(ix),
    }


def mode_entry(ix: Index, name: str, run) -> dict:
    """results.json's modes[name]: speed, acceptance, cost, exactness and accuracy of one run."""
    curves = ix.data.pass_cost or None
    gens = ix.gens(name)
    gens_ok = [g for g in gens if g is not None]
    cycles = [c for g in gens_ok for c in g.cycles]
    ar_cycles = [c for g in ix.ar_gens if g for c in g.cycles]
    pairs = [(len(g.tokens), g.seconds) for g in gens_ok]
    if "ar" in ix.runs:
        both = [(g, a) for g, a in zip(gens, ix.ar_gens) if g is not None and a is not None]
        sp = stats.speedups([(len(g.tokens), g.seconds) for g, _ in both], [(len(a.tokens), a.seconds) for _, a in both])
    else:
        sp = {"median": None, "totals": None, "n": 0}
    proj = stats.projected(run.settings.mode, cycles, curves) if curves else {}
    s = run.settings
    exact = stats.exact_match_share([g.tokens for g in gens_ok], [ix.ref.get(g.prompt) for g in gens_ok]) \
        if ix.ref_name == "ar" and s.temperature == 0 else None
    sampled_ref = sampled_reference(ix.data, s.temperature) if s.temperature > 0 else None
    dist = stats.distribution_check(ix.samples.get(sampled_ref, {}), ix.samples.get(name, {})) \
        if sampled_ref and sampled_ref != name and MODES[s.mode].exact else None
    all_cycles = [c for g in ix.data.generations if g.run == name for c in g.cycles]
    checkable = [ix.correct[(g.prompt, name)] for g in gens_ok]
    return {
        "mode": s.mode,
        "temperature": s.temperature,
        "sampling": {"top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
                     "repeat_last_n": s.repeat_last_n, "seed": s.seed, "sampler": s.sampler, "samples": run.samples}
        if s.temperature > 0 or s.repeat_penalty != 1.0 else None,
        "theta": s.theta if MODES[s.mode].gate == "theta" else None,
        "tau": s.tau if MODES[s.mode].gate == "tau" else None,
        "block": s.block, "draft_k": s.draft_k if MODES[s.mode].width == "draft_k" else None,
        "lookup": s.lookup if MODES[s.mode].lookup else None,
        # tokens proposed and accepted per source (mask: MARS slots, lookup: copied from the text, draft)
        "drafts": {src: {"drafted": n, "accepted": a, "rate": _r(a / n) if n else None}
                   for src, (n, a) in draft_counts(cycles).items()},
        "n_prompts": len(gens_ok),
        "tokens": sum(len(g.tokens) for g in gens_ok),
        "seconds": _r(sum(g.seconds for g in gens_ok), 3),
        "n_cycles": len(cycles),
        "tokens_per_second": _r(stats.throughput(pairs), 3),
        "speedup_vs_ar": {"median": _r(sp["median"]), "totals": _r(sp["totals"])},
        "tokens_per_cycle": _r(stats.tokens_per_cycle(cycles)),
        "passes_per_token": {k: _r(v) for k, v in stats.passes_per_token(cycles).items()},
        "cycle_cost": {"measured": _r(stats.measured_cycle_cost(cycles, ar_cycles)),
                       "measured_decode": _r(stats.measured_cycle_cost(cycles, ar_cycles, decode_only=True)),
                       "projected": _r(proj.get("cycle_cost")), "projected_flat": _r(proj.get("cycle_cost_flat"))},
        "projected_speedup": {"curve": _r(proj.get("speedup")), "flat": _r(proj.get("speedup_flat"))},
        "exact_match_vs_ar": _r(exact),
        # sampled exact modes: per-position token distributions against ar's at the same temperature
        "distribution_vs_ar": None if dist is None else {
            "reference": sampled_ref, "p_value": None if dist["p_value"] is None else float(f"{dist['p_value']:.4g}"), "positions": dist["positions"],
            "samples": dist["samples"], "tv_by_position": [_r(x) for x in dist["tv_by_position"]],
            "method": dist["method"]},
        # without the lookup drafts of a mode that has its own proposals (they are in "drafts", by source)
        "acceptance_by_slot": ({k: [_r(x) for x in v] if k != "n" else v
                                for k, v in stats.acceptance_by_slot(
                                    [c for c in all_cycles if not c.plan.lookup or MODES[s.mode].width is None]).items()}
                               if MODES[s.mode].exact and (MODES[s.mode].width is not None or MODES[s.mode].lookup)
                               else None),
        "accuracy": _r(stats.accuracy(checkable)),
        "n_checkable": sum(c is not None for c in checkable),
        **family_stats(ix, name, gens),
        "overhead_share": _r(stats.overhead_share(cycles)),
        "host_ms_per_cycle": _r(stats.host_ms_per_cycle(cycles)),
        "widths": widths_histogram(cycles),
        "loop_share": _r(stats.loop_share([g.tokens for g in gens_ok])),
        "tokens_per_cycle_outside_loops": _r(stats.tokens_per_cycle_outside_loops(
            [(g.tokens, g.cycles) for g in gens_ok])),
    }


def family_stats(ix: Index, name: str, gens: list) -> dict:
    """A run's accuracy, speedup, tokens per cycle and loop share per prompt family."""
    prompts = ix.prompts
    gens_ok = [g for g in gens if g is not None]
    fam_speed, fam_acc, fam_tpc, fam_loop, fam_tpc_nl = {}, {}, {}, {}, {}
    for fam in sorted({prompts[g.prompt].family for g in gens_ok}):
        fam_gens = [g for g in gens_ok if prompts[g.prompt].family == fam]
        fam_tpc[fam] = _r(stats.tokens_per_cycle([c for g in fam_gens for c in g.cycles]))
        fam_loop[fam] = _r(stats.loop_share([g.tokens for g in fam_gens]))
        fam_tpc_nl[fam] = _r(stats.tokens_per_cycle_outside_loops([(g.tokens, g.cycles) for g in fam_gens]))
        both = [(g, a) for g, a in zip(gens, ix.ar_gens) if g is not None and a is not None and prompts[g.prompt].family == fam]
        if both:
            fam_speed[fam] = _r(stats.speedups([(len(g.tokens), g.seconds) for g, _ in both],
                                               [(len(a.tokens), a.seconds) for _, a in both])["totals"])
        acc = stats.accuracy([ix.correct[(g.prompt, name)] for g in gens_ok if prompts[g.prompt].family == fam])
        if acc is not None:
            fam_acc[fam] = _r(acc)
    return {"accuracy_by_family": fam_acc, "speedup_by_family": fam_speed, "tokens_per_cycle_by_family": fam_tpc,
            "loop_share_by_family": fam_loop, "tokens_per_cycle_outside_loops_by_family": fam_tpc_nl}


def theta_sweep_row(name: str, run, entry: dict) -> dict:
    return {"run": name, "theta": run.settings.theta, "speedup_median": entry["speedup_vs_ar"]["median"],
            "speedup_totals": entry["speedup_vs_ar"]["totals"], "tokens_per_cycle": entry["tokens_per_cycle"],
            "accuracy": entry["accuracy"], "exact_match_vs_ar": entry["exact_match_vs_ar"],
            "projected_speedup_flat": entry["projected_speedup"]["flat"]}


def greedy_path_analyses(ix: Index, name: str, run, entry: dict, bins: int) -> tuple[dict, dict, dict]:
    """The paper's analyses of a greedy run that proposes: match rate per slot, detector AUCs, and
    matched tokens along a response. Returns (slot rates, AUCs, by position)."""
    s = run.settings
    gens_ok = [g for g in ix.gens(name) if g is not None]
    cycles = [c for g in gens_ok for c in g.cycles]
    labels, mruns = [], []
    for g in gens_ok:
        if g.prompt in ix.ref:
            # the planner's plain ar cycles propose nothing, and lookup drafts are not MARS slots
            # (their record is the run's "drafts"): both are left out of these analyses
            proposing = [c for c in g.cycles if proposes(c.plan) and not c.plan.lookup]
            labels += stats.slot_labels(proposing, g.tokens, ix.ref[g.prompt])
            mruns += stats.matched_runs(proposing, g.tokens, ix.ref[g.prompt])
    n_slots = max((len(c.proposed) for c in cycles if not c.plan.lookup), default=0)
    rate, counts = stats.match_rate_by_slot(labels, n_slots)
    a = stats.detector_aucs(labels)
    a["positional"] = {k: (_r(v) if isinstance(v, float) else v)
                       for k, v in stats.detector_aucs(labels, "match").items()}
    bp = stats.matched_by_position(mruns, bins)
    bp["mean"] = [_r(x) for x in bp["mean"]]
    bp["overall"] = _r(bp["overall"])
    bp["committed_per_cycle"] = entry["tokens_per_cycle"]
    return ({"rate": [_r(x) for x in rate], "n": counts},
            {k: (_r(v) if isinstance(v, float) else v) for k, v in a.items()}, bp)


def per_prompt(ix: Index) -> list[dict]:
    """results.json's prompts: each run's answer to each prompt, against the reference."""
    out = []
    for i, p in enumerate(ix.prompts):
        rr = {}
        for name in ix.runs:
            sampled = ix.runs[name].settings.temperature > 0
            g = ix.by.get((i, name))
            if g is None:
                continue
            rr[name] = {"n_tokens": len(g.tokens), "seconds": _r(g.seconds, 4),
                        "tokens_per_second": _r(tokens_per_second(len(g.tokens), g.seconds) if g.seconds > 0 else None, 3),
                        "tokens_per_cycle": _r(stats.tokens_per_cycle(g.cycles)),
                        "stop": g.cycles[-1].stop if g.cycles else None,
                        "equal_to_ar": (g.tokens == ix.ref[i]) if ix.ref_name == "ar" and i in ix.ref and not sampled else None,
                        "first_divergence": (stats.common_prefix(g.tokens, ix.ref[i]) if ix.ref_name == "ar" and i in ix.ref
                                             and g.tokens != ix.ref[i] and not sampled else None),
                        "correct": ix.correct[(i, name)]}
        out.append({"id": p.id, "family": p.family, "source": p.source, "answer": p.answer,
                    "n_prompt_tokens": len(ix.data.prompt_tokens[i]), "runs": rr})
    return out


def auto_vs_fixed(modes: dict) -> dict:
    """Each auto run against the fixed widths of the same mode (and θ), side by side in this run."""
    out = {}
    for name, m in modes.items():
        if m[MODES[m["mode"]].width or "block"] != "auto":
            continue
        same = {n: e for n, e in modes.items() if e["mode"] == m["mode"] and e["theta"] == m["theta"] and n != name}
        fixed = {n: e for n, e in same.items() if e[MODES[m["mode"]].width or "block"] != "auto"}
        best = max(fixed, key=lambda n: fixed[n]["tokens_per_second"] or 0.0, default=None)
        out[name] = {
            "tokens_per_second": m["tokens_per_second"], "speedup_vs_ar": m["speedup_vs_ar"]["median"],
            "fixed": {n: {"tokens_per_second": e["tokens_per_second"], "speedup_vs_ar": e["speedup_vs_ar"]["median"]}
                      for n, e in fixed.items()},
            "best_fixed": best,
            "auto_over_best_fixed": _r(m["tokens_per_second"] / fixed[best]["tokens_per_second"])
            if best and m["tokens_per_second"] and fixed[best]["tokens_per_second"] else None,
            "widths": m["widths"]}
    return out


def oracle_bound(data: BenchData) -> dict | None:
    """The oracle bound of lossless (full proposals logged at every position of ar's answers), or None."""
    if not data.oracle_match:
        return None
    prompts = data.prompts
    curve = (data.pass_cost or {}).get("target")
    match = {i: data.oracle_match[i] for i in sorted(data.oracle_match)}
    runs_all = [m for ms in match.values() for m in ms]
    cond = conditional_slot_rates(runs_all) if runs_all else []

    def rounded(pol):
        return {"ar": 1.0, "fixed_blocks": {b: _r(v) for b, v in pol["fixed_blocks"].items()},
                "oracle": _r(pol["oracle"])} if pol else None

    def planner_choice(c):
        rows = project(c, [x if x is not None else 0.0 for x in cond], len(cond))
        best = next(r for r in rows if r["chosen"])
        return "ar" if best["kind"] == "ar" else best["width"]

    return {"tokens_per_t1": rounded(stats.lossless_policies(match, curve)) if curve else None,
            "tokens_per_t1_flat": rounded(stats.lossless_policies(match, None)),
            "planner_choice": {"curve": planner_choice(curve) if curve and cond else None,
                               "flat": planner_choice({1: 1.0, 64: 1.0}) if cond else None},
            "n_positions": len(runs_all),
            "slot_match_rate": [_r(sum(m > j for m in runs_all) / len(runs_all)) for j in range(16)] if runs_all else [],
            "conditional_slot_rate": [_r(x) for x in cond],
            "match_runs": {prompts[i].id: m for i, m in match.items()}}


def planner_projection(data: BenchData) -> dict | None:
    """Projection from the planner's acceptance statistics: this machine's curve and a flat one."""
    lossless_stats = (data.planner or {}).get("stats", {}).get("lossless")
    if not (lossless_stats and data.pass_cost and "target" in data.pass_cost):
        return None
    rates = lossless_stats["slot_rate"]
    return {"slot_rate": rates,
            "curve": project(data.pass_cost["target"], rates, len(rates)),
            "flat": project({1: 1.0, 64: 1.0}, rates, len(rates))}


def external_baseline(ix: Index) -> dict | None:
    """The external baseline (llama-speculative-simple), per prompt and against every run."""
    data = ix.data
    if not data.external:
        return None
    by, prompts = ix.by, ix.prompts
    ext_runs = {int(i): r for i, r in (data.external.get("runs") or {}).items()}
    ok = {i: r for i, r in ext_runs.items() if "error" not in r and r.get("seconds")}
    tps = stats.throughput([(r["tokens"], r["seconds"]) for r in ok.values()]) if ok else None
    vs = {}
    for name in ix.runs:
        pairs = [(by[(i, name)], r) for i, r in ok.items() if (i, name) in by and by[(i, name)].seconds > 0]
        ratios = sorted((len(g.tokens) / g.seconds) / (r["tokens"] / r["seconds"]) for g, r in pairs if r["tokens"])
        vs[name] = _r(ratios[len(ratios) // 2]) if ratios else None
    return {**{k: v for k, v in data.external.items() if k != "runs"},
            "tokens_per_second": _r(tps, 3), "n_ok": len(ok), "n_failed": len(ext_runs) - len(ok),
            "errors": sorted({r["error"] for r in ext_runs.values() if "error" in r})[:3],
            "run_over_external_median": vs,
            "runs": {prompts[i].id: r for i, r in sorted(ext_runs.items()) if i < len(prompts)}}


def batched(data: BenchData) -> dict | None:
    """bench --parallel N: every run's throughput over its groups of N requests decoded together:
    generated tokens / the groups' decode windows (first decode start to last decode end; the
    prompts were prefilled before, untimed), vs_ar: that over ar's on the same groups; steps: the
    batched steps (one llama_decode per model each) the groups took."""
    if data.parallel <= 1 or not data.batches:
        return None
    runs = {}
    for r in data.runs:
        bs = [b for b in data.batches if b.run == r.name]
        if not bs:
            continue
        tokens, seconds = sum(b.tokens for b in bs), sum(b.seconds for b in bs)
        steps = sum(b.steps for b in bs)
        runs[r.name] = {"groups": len(bs), "requests": sum(len(b.prompts) for b in bs), "tokens": tokens,
                        "seconds": _r(seconds, 4), "tokens_per_second": _r(tokens / seconds if seconds > 0 else None, 3),
                        "steps": steps, "decodes": sum(b.decodes for b in bs),
                        "tokens_per_step": _r(tokens / steps if steps else None, 3)}
    ar = runs.get("ar")
    for entry in runs.values():
        entry["vs_ar"] = _r(entry["tokens_per_second"] / ar["tokens_per_second"]) \
            if ar and ar["tokens_per_second"] and entry["tokens_per_second"] else None
    return {"parallel": data.parallel, "runs": runs,
            "groups": [{"run": b.run, "prompts": [data.prompts[i].id for i in b.prompts], "sample": b.sample,
                        "tokens": b.tokens, "seconds": _r(b.seconds, 5), "steps": b.steps, "decodes": b.decodes} for b in data.batches]}


def pass_cost_table(data: BenchData) -> dict:
    out = {}
    for role, curve in (data.pass_cost or {}).items():
        ns = sorted(curve)
        # (to the nanosecond: a tiny model's one-token pass is ~26 us, and the report rebuilt from these
        # files prices the oracle and the fixed blocks on them: to the microsecond it drifted by 1-2 %)
        out[role] = {"n": ns, "seconds": [_r(curve[n], 9) for n in ns],
                     "ratio": [_r(curve[n] / curve[ns[0]], 3) for n in ns]}
    return out


def generations_jsonl(data: BenchData) -> str:
    lines = []
    for g in data.generations:
        lines.append(json.dumps({
            "prompt": data.prompts[g.prompt].id, "run": g.run, "text": g.text, "tokens": g.tokens,
            "seconds": round(g.seconds, 5), "prefill": [g.prefill_tokens, round(g.prefill_seconds, 5)],
            "sample": g.sample, "seed": g.seed, "stop": g.cycles[-1].stop if g.cycles else None,
            "cycles": [{"start": c.start, "proposed": c.proposed, "p": [round(x, 5) for x in c.p],
                        "q": None if c.q is None else [round(x, 5) for x in c.q], "n_committed": len(c.committed),
                        "accept_prob": None if c.accept_prob is None else [round(x, 5) for x in c.accept_prob],
                        "residual": c.residual,
                        "n_accepted": c.n_accepted, "passes": c.passes, "seconds": round(c.seconds, 6),
                        "decode_seconds": {k: round(v, 6) for k, v in c.decode_seconds.items()},
                        "widths": c.widths, "plan": c.plan.as_dict(), "gate": c.gate, "source": c.source}
                       for c in g.cycles],
        }, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def _plan_of_old_report(mode: str, c: dict) -> Plan:
    """The plan of a cycle stored before cycles recorded theirs, from the widths it fed: a planner's
    plain ar cycle made no proposal pass (lossless: one pass; prove: no verifier pass; spec: no draft;
    mars: one slot)."""
    m, w, n = MODES[mode], _roles(c.get("widths") or {}), len(c["proposed"])
    if m.width is None:
        return Plan(mode)
    if m.width == "draft_k":
        k = len(w.get("draft", [])) if w else n
        return Plan(mode, draft_k=k) if k else Plan()
    if m.verify_choice:
        passes = w.get("target", [])
        verify = passes[1] if len(passes) > 1 else (len(c["q"]) if not w and c.get("q") else None)
        return Plan(mode, n, verify=verify) if verify is not None else Plan()
    if m.partner:
        return Plan(mode, n) if not w or m.partner in w else Plan()
    return Plan(mode, n) if n > 1 else Plan()


# Roles as folders written before the target model's role was named "target" call them.
OLD_ROLES = {"proposer": "target"}


def _roles(d):
    """A {role: ...} mapping with the old role names read as today's (None stays None)."""
    return None if d is None else {OLD_ROLES.get(r, r): v for r, v in d.items()}


def read_results(folder) -> dict:
    """A bench folder's results.json (older folders' role names read as today's: OLD_ROLES); a
    one-line SystemExit naming the file when it cannot be read (for the scripts that tabulate several
    runs)."""
    path = Path(folder) / "results.json"
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read bench results ({type(e).__name__}: {e})") from None
    for key in ("models", "pass_cost"):
        if isinstance(res.get(key), dict):
            res[key] = _roles(res[key])
    return res


def load_outputs(out: Path) -> tuple[BenchData, dict]:
    """Read a finished bench folder back (results.json + generations.jsonl) as the data and meta it
    was written from, so that `write_outputs` can rebuild the report with this version's
    statistics without running anything. Prompt texts and prompt token ids are not stored: only
    their count is kept, which is all the report uses."""
    out = Path(out)
    try:
        res = json.loads((out / "results.json").read_text())
        lines = (out / "generations.jsonl").read_text().splitlines()
    except (OSError, ValueError) as e:
        raise ValueError(f"{out}: not a readable bench folder ({type(e).__name__}: {e})") from None
    if res.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{out / 'results.json'}: schema {res.get('schema')!r}, expected {SCHEMA_VERSION}")
    prompts = [Prompt(p["id"], p["family"], "", p.get("answer"), p.get("source", "")) for p in res["prompts"]]
    index = {p.id: i for i, p in enumerate(prompts)}
    stops = {(p["id"], run): r.get("stop") for p in res["prompts"] for run, r in p["runs"].items()}
    default = Settings()
    def sampling(m):
        sm = m.get("sampling") or {}
        return {k: sm[k] for k in ("top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed", "sampler")
                if k in sm}
    runs = [Run(name, Settings(mode=m["mode"], max_new=res["settings"]["max_new"], block=m["block"],
                               theta=default.theta if m["theta"] is None else m["theta"],
                               tau=default.tau if m["tau"] is None else m["tau"],
                               draft_k=default.draft_k if m["draft_k"] is None else m["draft_k"],
                               lookup=default.lookup if m.get("lookup") is None else m["lookup"],
                               temperature=m.get("temperature") or 0.0, **sampling(m)),
                (m.get("sampling") or {}).get("samples", 1))
            for name, m in res["modes"].items()]
    modes_of = {r.name: r.settings.mode for r in runs}
    gens = []
    for line in lines:
        g = json.loads(line)
        toks = g["tokens"]
        cycles = [Cycle(proposed=c["proposed"], p=c["p"], q=c["q"], committed=toks[c["start"]:c["start"] + c["n_committed"]],
                        n_accepted=c["n_accepted"], passes=_roles(c["passes"]), decode_seconds=_roles(c["decode_seconds"]),
                        seconds=c["seconds"], index=k, start=c["start"], accept_prob=c.get("accept_prob"),
                        residual=c.get("residual", False), widths=_roles(c.get("widths") or {}),
                        plan=Plan(**c["plan"]) if c.get("plan") else _plan_of_old_report(modes_of[g["run"]], c),
                        gate=c.get("gate"), source=c.get("source"))
                  for k, c in enumerate(g["cycles"])]
        if cycles:
            cycles[-1].stop = g["stop"] if "stop" in g else stops.get((g["prompt"], g["run"]))
        gens.append(Record(index[g["prompt"]], g["run"], toks, cycles, g["seconds"],
                               g["prefill"][0], g["prefill"][1], g["text"], g.get("sample", 0), g.get("seed")))
    data = BenchData(prompts, [[0] * p["n_prompt_tokens"] for p in res["prompts"]], runs, gens,
                     {role: dict(zip(v["n"], v["seconds"])) for role, v in _roles(res.get("pass_cost", {})).items()},
                     res.get("warmup_seconds") or 0.0)
    data.planner = res.get("planner") or {}
    ext = res.get("external")
    if ext:
        data.external = {**{k: v for k, v in ext.items() if k in ("name", "binary", "target", "draft", "args", "threads")},
                         "runs": {index[k]: v for k, v in (ext.get("runs") or {}).items() if k in index}}
    data.oracle_match = {index[k]: v for k, v in ((res.get("oracle") or {}).get("match_runs") or {}).items() if k in index}
    b = res.get("batched")
    if b:
        data.parallel = b["parallel"]
        data.batches = [Batch(g["run"], [index[i] for i in g["prompts"]], g["sample"], g["tokens"], g["seconds"],
                              g["steps"], g["decodes"]) for g in b["groups"]]
    meta = {k: res[k] for k in ("command", "created", "machine", "models", "settings") if k in res}
    if isinstance(meta.get("models"), dict):
        meta["models"] = _roles(meta["models"])
    meta["data"] = {k: v for k, v in res.get("data", {}).items() if k in ("paths", "limit")}
    meta["bins"] = max(len(next(iter(res["matched_tokens_by_position"].values()))["edges"]) - 1, 1) \
        if res.get("matched_tokens_by_position") else 5
    return data, meta


def write_outputs(data: BenchData, out: Path, *, meta: dict, plots: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    res = build_results(data, meta=meta)
    res["plots"] = []
    if plots:
        res["_roc"] = roc_data(data, res)
        res["plots"] = make_plots(res, out)
        res.pop("_roc", None)
    write_atomic(out / "generations.jsonl", generations_jsonl(data))
    write_atomic(out / "results.json", json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    write_atomic(out / "summary.md", summary_markdown(res))
    return res
