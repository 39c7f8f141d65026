"""The bench's PNG plots (matplotlib, written atomically)."""
from __future__ import annotations

import io
from pathlib import Path

from ..files import write_atomic
from ..modes import MODES, proposes
from . import stats
from .runner import BenchData

PLOTS = ("speedup.png", "match_rate_by_slot.png", "matched_by_position.png", "roc.png", "theta_sweep.png", "pass_cost.png")


def _save_fig(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    write_atomic(path, buf.getvalue())



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
    # a verifier's q first (the paper's detector), else the self-verifying mode's own q
    candidates = ([r.name for r in data.runs if MODES[r.settings.mode].gate == "theta"]
                  + [r.name for r in data.runs if MODES[r.settings.mode].verify_choice])
    by = {(g.prompt, g.run): g for g in data.generations}
    for name in candidates:
        labels = []
        mode = next(r.settings.mode for r in data.runs if r.name == name)
        for i in range(len(data.prompts)):
            g, ref = by.get((i, name)), by.get((i, ref_name))
            if g and ref:
                labels += stats.slot_labels([c for c in g.cycles if proposes(c.plan) and not c.plan.lookup],
                                            g.tokens, ref.tokens)
        if not labels:
            continue
        y = [r["on_path"] for r in labels]
        curves = {"p": stats.roc_curve([r["p"] for r in labels], y)}
        if all(r["q"] is not None for r in labels):
            curves["q"] = stats.roc_curve([r["q"] for r in labels], y)
            curves["pq"] = stats.roc_curve([r["p"] * r["q"] for r in labels], y)
        return {"run": name, "curves": curves}
    return None


