"""results.json, summary.md and plots from a finished benchmark (all writes atomic)."""
from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

from . import stats
from .data import check_answer
from .runner import BenchData

SCHEMA_VERSION = 1
PLOTS = ("speedup.png", "match_rate_by_slot.png", "matched_by_position.png", "roc.png", "theta_sweep.png", "pass_cost.png")


# ------------------------------------------------------------------------------ atomic files
def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: Path, data: bytes | str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _save_fig(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    write_atomic(path, buf.getvalue())


def _r(x, d=4):
    return None if x is None else round(float(x), d)


def reference_run(data: BenchData) -> str | None:
    names = [r.name for r in data.runs]
    return "ar" if "ar" in names else ("lossless" if "lossless" in names else None)


def build_results(data: BenchData, *, meta: dict) -> dict:
    runs = {r.name: r for r in data.runs}
    by = {(g.prompt, g.run): g for g in data.generations}
    prompts = data.prompts
    ref_name = reference_run(data)
    ref = {i: by[(i, ref_name)].tokens for i in range(len(prompts)) if (i, ref_name) in by} if ref_name else {}
    ar_gens = [by.get((i, "ar")) for i in range(len(prompts))]
    curves = data.pass_cost or None
    ar_cycles = [c for g in ar_gens if g for c in g.cycles]

    correct = {}
    for g in data.generations:
        p = prompts[g.prompt]
        correct[(g.prompt, g.run)] = check_answer(p.family, g.text, p.answer)

    modes, slot_rates, aucs, by_pos, sweep = {}, {}, {}, {}, []
    for name, run in runs.items():
        gens = [by.get((i, name)) for i in range(len(prompts))]
        gens_ok = [g for g in gens if g is not None]
        cycles = [c for g in gens_ok for c in g.cycles]
        pairs = [(len(g.tokens), g.seconds) for g in gens_ok]
        if "ar" in runs:
            both = [(g, a) for g, a in zip(gens, ar_gens) if g is not None and a is not None]
            sp = stats.speedups([(len(g.tokens), g.seconds) for g, _ in both], [(len(a.tokens), a.seconds) for _, a in both])
        else:
            sp = {"median": None, "totals": None, "n": 0}
        families = sorted({prompts[g.prompt].family for g in gens_ok})
        fam_speed, fam_acc, fam_tpc, fam_loop, fam_tpc_nl = {}, {}, {}, {}, {}
        for fam in families:
            fam_gens = [g for g in gens_ok if prompts[g.prompt].family == fam]
            fam_tpc[fam] = _r(stats.tokens_per_cycle([c for g in fam_gens for c in g.cycles]))
            fam_loop[fam] = _r(stats.loop_share([g.tokens for g in fam_gens]))
            fam_tpc_nl[fam] = _r(stats.tokens_per_cycle_outside_loops([(g.tokens, g.cycles) for g in fam_gens]))
            both = [(g, a) for g, a in zip(gens, ar_gens) if g is not None and a is not None and prompts[g.prompt].family == fam]
            if both:
                fam_speed[fam] = _r(stats.speedups([(len(g.tokens), g.seconds) for g, _ in both],
                                                   [(len(a.tokens), a.seconds) for _, a in both])["totals"])
            acc = stats.accuracy([correct[(g.prompt, name)] for g in gens_ok if prompts[g.prompt].family == fam])
            if acc is not None:
                fam_acc[fam] = _r(acc)
        proj = stats.projected(run.settings.mode, cycles, curves) if curves else {}
        exact = stats.exact_match_share([g.tokens for g in gens_ok], [ref.get(g.prompt) for g in gens_ok]) \
            if ref_name == "ar" else None
        checkable = [correct[(g.prompt, name)] for g in gens_ok]
        s = run.settings
        entry = {
            "mode": s.mode,
            "theta": s.theta if s.mode == "prove" else None,
            "tau": s.tau if s.mode == "mars" else None,
            "block": s.block, "draft_k": s.draft_k if s.mode == "spec" else None,
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
            "accuracy": _r(stats.accuracy(checkable)),
            "n_checkable": sum(c is not None for c in checkable),
            "accuracy_by_family": fam_acc,
            "speedup_by_family": fam_speed,
            "tokens_per_cycle_by_family": fam_tpc,
            "loop_share_by_family": fam_loop,
            "tokens_per_cycle_outside_loops_by_family": fam_tpc_nl,
            "overhead_share": _r(stats.overhead_share(cycles)),
            "loop_share": _r(stats.loop_share([g.tokens for g in gens_ok])),
            "tokens_per_cycle_outside_loops": _r(stats.tokens_per_cycle_outside_loops(
                [(g.tokens, g.cycles) for g in gens_ok])),
        }
        modes[name] = entry
        if s.mode == "prove":
            sweep.append({"run": name, "theta": s.theta, "speedup_median": entry["speedup_vs_ar"]["median"],
                          "speedup_totals": entry["speedup_vs_ar"]["totals"], "tokens_per_cycle": entry["tokens_per_cycle"],
                          "accuracy": entry["accuracy"], "exact_match_vs_ar": entry["exact_match_vs_ar"],
                          "projected_speedup_flat": entry["projected_speedup"]["flat"]})
        # the paper's analyses, for runs that propose blocks (or drafts)
        if s.mode != "ar" and ref:
            labels, mruns = [], []
            for g in gens_ok:
                if g.prompt in ref:
                    labels += stats.slot_labels(g.cycles, g.tokens, ref[g.prompt])
                    mruns += stats.matched_runs(g.cycles, g.tokens, ref[g.prompt])
            n_slots = max((len(c.proposed) for c in cycles), default=0)
            rate, counts = stats.match_rate_by_slot(labels, n_slots)
            slot_rates[name] = {"rate": [_r(x) for x in rate], "n": counts}
            a = stats.detector_aucs(labels)
            aucs[name] = {k: (_r(v) if isinstance(v, float) else v) for k, v in a.items()}
            bp = stats.matched_by_position(mruns, meta.get("bins", 5))
            bp["mean"] = [_r(x) for x in bp["mean"]]
            bp["overall"] = _r(bp["overall"])
            bp["committed_per_cycle"] = entry["tokens_per_cycle"]
            by_pos[name] = bp

    per_prompt = []
    for i, p in enumerate(prompts):
        rr = {}
        for name in runs:
            g = by.get((i, name))
            if g is None:
                continue
            rr[name] = {"n_tokens": len(g.tokens), "seconds": _r(g.seconds, 4),
                        "tokens_per_second": _r(len(g.tokens) / g.seconds if g.seconds > 0 else None, 3),
                        "tokens_per_cycle": _r(stats.tokens_per_cycle(g.cycles)),
                        "stop": g.cycles[-1].stop if g.cycles else None,
                        "equal_to_ar": (g.tokens == ref[i]) if ref_name == "ar" and i in ref else None,
                        "first_divergence": (stats.common_prefix(g.tokens, ref[i]) if ref_name == "ar" and i in ref
                                             and g.tokens != ref[i] else None),
                        "correct": correct[(i, name)]}
        per_prompt.append({"id": p.id, "family": p.family, "source": p.source, "answer": p.answer,
                           "n_prompt_tokens": len(data.prompt_tokens[i]), "runs": rr})

    pass_cost = {}
    for role, curve in (data.pass_cost or {}).items():
        ns = sorted(curve)
        pass_cost[role] = {"n": ns, "seconds": [_r(curve[n], 6) for n in ns],
                           "ratio": [_r(curve[n] / curve[ns[0]], 3) for n in ns]}
    fams: dict[str, int] = {}
    for p in prompts:
        fams[p.family] = fams.get(p.family, 0) + 1
    return {
        "schema": SCHEMA_VERSION,
        **{k: v for k, v in meta.items() if k != "bins"},
        "data": {**meta.get("data", {}), "n_prompts": len(prompts), "families": fams},
        "reference": ref_name,
        "warmup_seconds": _r(data.warmup_seconds, 2),
        "modes": modes,
        "position_match_rate": slot_rates,
        "matched_tokens_by_position": by_pos,
        "auc": aucs,
        "theta_sweep": sorted(sweep, key=lambda r: r["theta"]),
        "pass_cost": pass_cost,
        "paper": {"position_match_rate_gsm8k": stats.PAPER_SLOT_MATCH_GSM8K, "auc": stats.PAPER_AUC},
        "prompts": per_prompt,
    }


def generations_jsonl(data: BenchData) -> str:
    lines = []
    for g in data.generations:
        lines.append(json.dumps({
            "prompt": data.prompts[g.prompt].id, "run": g.run, "text": g.text, "tokens": g.tokens,
            "seconds": round(g.seconds, 5), "prefill": [g.prefill_tokens, round(g.prefill_seconds, 5)],
            "cycles": [{"start": c.start, "proposed": c.proposed, "p": [round(x, 5) for x in c.p],
                        "q": None if c.q is None else [round(x, 5) for x in c.q], "n_committed": len(c.committed),
                        "n_accepted": c.n_accepted, "passes": c.passes, "seconds": round(c.seconds, 6),
                        "decode_seconds": {k: round(v, 6) for k, v in c.decode_seconds.items()}} for c in g.cycles],
        }, ensure_ascii=False))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ summary.md
def _table(header: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _pct(x):
    return stats.fmt(None if x is None else 100 * x, 0, " %")


def modes_table(res: dict) -> str:
    rows = []
    for name, m in res["modes"].items():
        passes = ", ".join(f"{k[0]} {v:.2f}" for k, v in m["passes_per_token"].items())
        rows.append([f"`{name}`", stats.fmt(m["tokens_per_second"], 1),
                     stats.fmt(m["speedup_vs_ar"]["median"], 2, "×"), stats.fmt(m["speedup_vs_ar"]["totals"], 2, "×"),
                     stats.fmt(m["tokens_per_cycle"], 2), passes or "–",
                     stats.fmt(m["cycle_cost"]["measured"], 2), stats.fmt(m["cycle_cost"]["projected"], 2),
                     stats.fmt(m["projected_speedup"]["curve"], 2, "×"), stats.fmt(m["projected_speedup"]["flat"], 2, "×"),
                     _pct(m["exact_match_vs_ar"]),
                     _pct(m["accuracy"]) + (f" (n={m['n_checkable']})" if m["n_checkable"] else ""),
                     _pct(m.get("loop_share"))])
    return _table(["run", "tokens/s", "speedup (median)", "speedup (totals)", "tokens/cycle", "passes/token",
                   "cycle cost", "cycle cost (curve)", "projected speedup", "flat-curve speedup",
                   "= ar output", "accuracy", "in loops"], rows)


def summary_markdown(res: dict) -> str:
    L = ["# prove-local bench", ""]
    L.append(f"Command: `{res.get('command', '')}`")
    L.append("")
    models = res.get("models", {})
    for role, m in models.items():
        L.append(f"- {role}: `{Path(m['path']).name}` ({m.get('n_params', 0) / 1e6:.1f} M parameters, vocab {m.get('n_vocab')})")
    mach = res.get("machine", {})
    d = res["data"]
    st = res.get("settings", {})
    L.append(f"- prompts: {d['n_prompts']} ({', '.join(f'{k} {v}' for k, v in d['families'].items())}); "
             f"max new tokens {st.get('max_new')}, block {st.get('block')}, greedy, one request at a time")
    L.append(f"- machine: {mach.get('cpu', '?')}, {mach.get('threads')} thread(s), llama-cpp-python {mach.get('llama_cpp_python', '?')}"
             f"{', GPU offload' if mach.get('gpu_offload') else ''}; runs interleaved per prompt after a warm-up; "
             "times exclude the prompt prefill")
    L += ["", "## Speed and quality per run", "",
          "Speedup vs `ar`: median of per-prompt throughput ratios, and the ratio of total throughputs. "
          "Cycle cost: mean cycle time ÷ mean `ar` cycle time (proposer-pass units); the curve column is the cost "
          "predicted from the pass-cost curve below, and projected speedup = tokens per cycle ÷ that cost. "
          "Flat-curve speedup: the same with every pass costing its model's one-token pass (the regime of a GPU "
          "running a large model, the paper's cost model). `= ar output`: share of prompts whose tokens equal `ar`'s. "
          "Passes/token: p = proposer, v = verifier, d = draft.", "", modes_table(res), ""]
    fam_rows, fams = [], sorted({f for m in res["modes"].values() for f in m["speedup_by_family"]})
    if fams and len(fams) > 1:
        for name, m in res["modes"].items():
            fam_rows.append([f"`{name}`"] + [stats.fmt(m["speedup_by_family"].get(f), 2, "×") for f in fams])
        L += ["Speedup vs `ar` (ratio of totals) by prompt family:", "", _table(["run"] + fams, fam_rows), ""]
    if fams:
        rows = [[f"`{n}`"] + [f"{stats.fmt(m.get('tokens_per_cycle_by_family', {}).get(f), 2)} / "
                              f"{stats.fmt(m.get('tokens_per_cycle_outside_loops_by_family', {}).get(f), 2)} / "
                              f"{_pct(m.get('loop_share_by_family', {}).get(f))}" for f in fams]
                for n, m in res["modes"].items()]
        L += ["Tokens per cycle / the same over cycles that commit no token inside a repeated 8-gram / "
              "share of tokens inside repeated 8-grams, by prompt family:", "", _table(["run"] + fams, rows), ""]
    acc_fams = sorted({f for m in res["modes"].values() for f in m["accuracy_by_family"]})
    if acc_fams:
        rows = [[f"`{n}`"] + [_pct(m["accuracy_by_family"].get(f)) for f in acc_fams] for n, m in res["modes"].items()]
        L += ["Answer accuracy by family (final answer checked against the reference):", "", _table(["run"] + acc_fams, rows), ""]

    if res["position_match_rate"]:
        n = max(len(v["rate"]) for v in res["position_match_rate"].values())
        header = ["run"] + [str(i + 1) for i in range(n)]
        rows = [[f"`{k}`"] + [_pct(x) for x in v["rate"]] + [""] * (n - len(v["rate"]))
                for k, v in res["position_match_rate"].items()]
        rows.append(["paper (GSM8K, 32B)"] + [_pct(x) for x in stats.PAPER_SLOT_MATCH_GSM8K[:n]]
                    + [""] * (n - len(stats.PAPER_SLOT_MATCH_GSM8K[:n])))
        L += ["## How often slot i of a block equals the greedy token", "",
              f"Reference: the `{res['reference']}` output of the same prompt; cycles of lossy runs count only while "
              "their output still equals it. For `spec` the slots are the draft's tokens.", "", _table(header, rows), ""]
    if res["matched_tokens_by_position"]:
        any_bp = next(iter(res["matched_tokens_by_position"].values()))
        edges = any_bp["edges"]
        header = ["run", "mean"] + [f"{edges[k]:.1f}–{edges[k + 1]:.1f}" for k in range(len(edges) - 1)] + ["committed/cycle"]
        rows = [[f"`{k}`", stats.fmt(v["overall"], 2)] + [stats.fmt(x, 2) for x in v["mean"]] + [stats.fmt(v["committed_per_cycle"], 2)]
                for k, v in res["matched_tokens_by_position"].items()]
        L += ["## Matched tokens per block against position in the response", "",
              "Leading proposed tokens equal to the greedy continuation, by the cycle's start as a fraction of the "
              "response length (paper, GSM8K: 6.6 of 16 on average, 4.2 at the start to 8.9 at the end; the τ=0.95 "
              "rule commits 3.0).", "", _table(header, rows), ""]
    if res["auc"]:
        rows = [[f"`{k}`", stats.fmt(v.get("p"), 3), stats.fmt(v.get("q"), 3), stats.fmt(v.get("pq"), 3),
                 str(v.get("n_pos", "")), str(v.get("n_neg", ""))] for k, v in res["auc"].items()]
        rows.append(["paper (GSM8K)", "0.910", "0.960", "0.964", "", ""])
        L += ["## Detecting \"slot i is on the greedy path\" (AUC)", "",
              "p̃: proposer confidence; q: verifier probability (`prove`), the proposer's own verify-pass probability "
              "(`lossless`), the target's probability (`spec`).", "",
              _table(["run", "AUC p̃", "AUC q", "AUC p̃·q", "on path", "off path"], rows), ""]
    if res["theta_sweep"]:
        rows = [[stats.fmt(r["theta"], 3), stats.fmt(r["speedup_median"], 2, "×"), stats.fmt(r["speedup_totals"], 2, "×"),
                 stats.fmt(r["projected_speedup_flat"], 2, "×"), stats.fmt(r["tokens_per_cycle"], 2),
                 _pct(r["accuracy"]), _pct(r["exact_match_vs_ar"])] for r in res["theta_sweep"]]
        ar_acc = res["modes"].get("ar", {}).get("accuracy")
        L += ["## ProVe: speed and accuracy against θ", "", f"`ar` accuracy: {_pct(ar_acc)}.", "",
              _table(["θ", "speedup (median)", "speedup (totals)", "flat-curve speedup", "tokens/cycle", "accuracy",
                      "= ar output"], rows), ""]
    if res["pass_cost"]:
        roles = list(res["pass_cost"])
        ns = res["pass_cost"][roles[0]]["n"]
        rows = []
        for j, n in enumerate(ns):
            rows.append([str(n)] + [f"{res['pass_cost'][r]['seconds'][j] * 1e3:.2f} ms ({res['pass_cost'][r]['ratio'][j]:.1f})"
                                    for r in roles])
        L += ["## Cost of one pass of n tokens, t(n) (ratio to n = 1)", "",
              "Median time inside `llama_decode` after a 256-token context, logits on every row.", "",
              _table(["n"] + roles, rows), ""]
    L += ["Plots: " + ", ".join(f"[{p}]({p})" for p in res.get("plots", [])), ""]
    return "\n".join(L)


# ---------------------------------------------------------------------------------- plots
def make_plots(res: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def finish(fig, name):
        fig.tight_layout()
        _save_fig(fig, out / name)
        plt.close(fig)
        made.append(name)

    modes = res["modes"]
    # speedup per run: measured vs projected
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    names = list(modes)
    x = range(len(names))
    w = 0.27
    for k, (label, get) in enumerate((("measured (median)", lambda m: m["speedup_vs_ar"]["median"]),
                                      ("projected from t(n)", lambda m: m["projected_speedup"]["curve"]),
                                      ("flat t(n)", lambda m: m["projected_speedup"]["flat"]))):
        ax.bar([i + (k - 1) * w for i in x], [get(modes[n]) or 0 for n in names], w, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set_ylabel("speedup vs ar")
    ax.legend(fontsize=7)
    ax.set_title("Speedup per run")
    finish(fig, "speedup.png")

    # match rate by slot
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, v in res["position_match_rate"].items():
        ax.plot(range(1, len(v["rate"]) + 1), [r if r is not None else float("nan") for r in v["rate"]], marker="o", ms=3, label=name)
    ax.plot(range(1, 17), stats.PAPER_SLOT_MATCH_GSM8K, "k--", lw=1, label="paper, GSM8K 32B")
    ax.set_xlabel("slot i of the block")
    ax.set_ylabel("P(slot i = greedy token)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax.set_title("How often slot i equals the greedy token")
    finish(fig, "match_rate_by_slot.png")

    # matched tokens vs position
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, v in res["matched_tokens_by_position"].items():
        e = v["edges"]
        mids = [(e[k] + e[k + 1]) / 2 for k in range(len(e) - 1)]
        ax.plot(mids, [m if m is not None else float("nan") for m in v["mean"]], marker="o", ms=3, label=name)
    ax.set_xlabel("position in the response (fraction)")
    ax.set_ylabel("matched tokens per block")
    ax.legend(fontsize=7)
    ax.set_title("Matched tokens per block along the response")
    finish(fig, "matched_by_position.png")

    # ROC of p, q, pq for one run (the prove run with most labels, else lossless)
    roc = res.get("_roc")
    if roc:
        fig, ax = plt.subplots(figsize=(4.4, 4.0))
        for label, (fpr, tpr) in roc["curves"].items():
            a = res["auc"].get(roc["run"], {}).get(label)
            ax.plot(fpr, tpr, label=f"{label} (AUC {a:.3f})" if a is not None else label)
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        ax.set_title(f"Detecting greedy slots ({roc['run']})", fontsize=9)
        ax.legend(fontsize=7)
        finish(fig, "roc.png")

    # theta sweep
    if res["theta_sweep"]:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        th = [r["theta"] for r in res["theta_sweep"]]
        ax.plot(th, [r["speedup_median"] or float("nan") for r in res["theta_sweep"]], "o-", label="speedup (median)")
        ax.plot(th, [r["projected_speedup_flat"] or float("nan") for r in res["theta_sweep"]], "s--", label="flat-curve projection")
        ax.set_xscale("log")
        ax.set_xlabel("θ")
        ax.set_ylabel("speedup vs ar")
        ax2 = ax.twinx()
        acc = [r["accuracy"] for r in res["theta_sweep"]]
        if any(a is not None for a in acc):
            ax2.plot(th, [a if a is not None else float("nan") for a in acc], "^-", color="tab:red", label="accuracy")
            ar_acc = modes.get("ar", {}).get("accuracy")
            if ar_acc is not None:
                ax2.axhline(ar_acc, color="tab:red", ls=":", lw=1, label="ar accuracy")
        ax2.set_ylabel("accuracy")
        ax2.set_ylim(0, 1.02)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7)
        ax.set_title("ProVe: speedup and accuracy against θ")
        finish(fig, "theta_sweep.png")

    # pass cost
    if res["pass_cost"]:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for role, v in res["pass_cost"].items():
            ax.plot(v["n"], v["ratio"], marker="o", ms=3, label=role)
        n_max = max(max(v["n"]) for v in res["pass_cost"].values())
        ax.plot([1, n_max], [1, n_max], "k:", lw=0.8, label="t(n) = n·t(1)")
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="t(n) = t(1)")
        ax.set_xlabel("tokens in one pass, n")
        ax.set_ylabel("t(n) / t(1)")
        ax.legend(fontsize=7)
        ax.set_title("Cost of one pass of n tokens")
        finish(fig, "pass_cost.png")
    return made


def roc_data(data: BenchData, res: dict) -> dict | None:
    """ROC points for the plot: the first prove run with a q, else lossless."""
    ref_name = res["reference"]
    if not ref_name:
        return None
    candidates = [r.name for r in data.runs if r.settings.mode == "prove"] + [r.name for r in data.runs if r.settings.mode == "lossless"]
    by = {(g.prompt, g.run): g for g in data.generations}
    for name in candidates:
        labels = []
        for i in range(len(data.prompts)):
            g, ref = by.get((i, name)), by.get((i, ref_name))
            if g and ref:
                labels += stats.slot_labels(g.cycles, g.tokens, ref.tokens)
        if not labels:
            continue
        y = [r["match"] for r in labels]
        curves = {"p": stats.roc_curve([r["p"] for r in labels], y)}
        if all(r["q"] is not None for r in labels):
            curves["q"] = stats.roc_curve([r["q"] for r in labels], y)
            curves["pq"] = stats.roc_curve([r["p"] * r["q"] for r in labels], y)
        return {"run": name, "curves": curves}
    return None


def load_outputs(out: Path) -> tuple[BenchData, dict]:
    """Read a finished bench folder back (results.json + generations.jsonl) as the data and meta it
    was written from, so that `write_outputs` can rebuild the report with this version's
    statistics without running anything. Prompt texts and prompt token ids are not stored: only
    their count is kept, which is all the report uses."""
    from ..engine import Settings
    from ..rules import Cycle
    from .data import Prompt
    from .runner import Generation, Run

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
    runs = [Run(name, Settings(mode=m["mode"], max_new=res["settings"]["max_new"], block=m["block"],
                               theta=default.theta if m["theta"] is None else m["theta"],
                               tau=default.tau if m["tau"] is None else m["tau"],
                               draft_k=default.draft_k if m["draft_k"] is None else m["draft_k"]))
            for name, m in res["modes"].items()]
    gens = []
    for line in lines:
        g = json.loads(line)
        toks = g["tokens"]
        cycles = [Cycle(proposed=c["proposed"], p=c["p"], q=c["q"], committed=toks[c["start"]:c["start"] + c["n_committed"]],
                        n_accepted=c["n_accepted"], passes=c["passes"], decode_seconds=c["decode_seconds"],
                        seconds=c["seconds"], index=k, start=c["start"]) for k, c in enumerate(g["cycles"])]
        if cycles:
            cycles[-1].stop = stops.get((g["prompt"], g["run"]))
        gens.append(Generation(index[g["prompt"]], g["run"], toks, cycles, g["seconds"],
                               g["prefill"][0], g["prefill"][1], g["text"]))
    data = BenchData(prompts, [[0] * p["n_prompt_tokens"] for p in res["prompts"]], runs, gens,
                     {role: dict(zip(v["n"], v["seconds"])) for role, v in res.get("pass_cost", {}).items()},
                     res.get("warmup_seconds") or 0.0)
    meta = {k: res[k] for k in ("command", "created", "machine", "models", "settings") if k in res}
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
