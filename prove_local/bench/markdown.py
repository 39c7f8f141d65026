"""summary.md and the terminal table of a bench run, from its results.json dict."""
from __future__ import annotations

from pathlib import Path

from . import stats

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
                     _pct(m.get("loop_share")), stats.fmt(m.get("host_ms_per_cycle"), 3),
                     _pct(m.get("overhead_share")), _drafts(m.get("drafts"))])
    return _table(["run", "tokens/s", "speedup (median)", "speedup (totals)", "tokens/cycle", "passes/token",
                   "cycle cost", "cycle cost (curve)", "projected speedup", "flat-curve speedup",
                   "= ar output", "accuracy", "in loops", "host ms/cycle", "host share", "accepted / drafted"], rows)


def batched_table(res: dict) -> str | None:
    """bench --parallel: each run's throughput over its groups of requests decoded together."""
    b = res.get("batched")
    if not b:
        return None
    rows = [[f"`{name}`", r["requests"], stats.fmt(r["tokens_per_second"], 1), stats.fmt(r["vs_ar"], 2, "×"),
             r["steps"], stats.fmt(r["tokens_per_step"], 2)] for name, r in b["runs"].items()]
    return _table(["run", "requests", "tokens/s", "vs ar", "steps", "tokens/step"], rows)


def _drafts(d: dict | None) -> str:
    """Accepted / drafted tokens per source (mask, lookup, draft)."""
    return ", ".join(f"{src} {v['accepted']}/{v['drafted']}" for src, v in sorted((d or {}).items())) or "–"


def summary_markdown(res: dict) -> str:
    L = ["# prove-local bench", ""]
    L.append(f"Command: `{res.get('command', '')}`")
    L.append("")
    if res.get("partial"):
        L += ["**Partial: interrupted (Ctrl-C); only the prompts whose runs all finished are counted.**", ""]
    models = res.get("models", {})
    for role, m in models.items():
        L.append(f"- {role}: `{Path(m['path']).name}` ({m.get('n_params', 0) / 1e6:.1f} M parameters, vocab {m.get('n_vocab')})")
    mach = res.get("machine", {})
    d = res["data"]
    st = res.get("settings", {})
    L.append(f"- prompts: {d['n_prompts']} ({', '.join(f'{k} {v}' for k, v in d['families'].items())}); "
             f"max new tokens {st.get('max_new')}, block {st.get('block')}, "
             + (f"temperatures {', '.join(f'{t:g}' for t in st['temperature'])} (top-k {st.get('top_k')}, top-p "
                f"{st.get('top_p')}, min-p {st.get('min_p')}, repeat penalty {st.get('repeat_penalty')}, "
                f"{st.get('samples')} seeds per prompt at T > 0)" if any(st.get("temperature") or [])
                else "greedy") + (f", {st['parallel']} requests at a time (batched: one llama_decode per step)"
                                  if (st.get("parallel") or 1) > 1 else ", one request at a time"))
    L.append(f"- machine: {mach.get('cpu', '?')}, {mach.get('threads')} thread(s), llama-cpp-python {mach.get('llama_cpp_python', '?')}"
             f"{', GPU offload' if mach.get('gpu_offload') else ''}; runs interleaved per prompt after a warm-up; "
             "times exclude the prompt prefill")
    L += ["", "## Speed and quality per run", "",
          "Speedup vs `ar`: median of per-prompt throughput ratios, and the ratio of total throughputs. "
          "Cycle cost: mean cycle time ÷ mean `ar` cycle time (target-pass units); the curve column is the cost "
          "predicted from the pass-cost curve below, and projected speedup = tokens per cycle ÷ that cost. "
          "Flat-curve speedup: the same with every pass costing its model's one-token pass (the regime of a GPU "
          "running a large model, the paper's cost model). `= ar output`: share of prompts whose tokens equal `ar`'s. "
          "Passes/token: t = target, v = verifier, d = draft.", "", modes_table(res), ""]
    bt = batched_table(res)
    if bt:
        L += [f"## Batched: {res['batched']['parallel']} requests at a time", "",
              "Every run generated the prompts in groups, one request per engine of a batched pool (`serve "
              "--parallel` runs the same): each step of the group's requests is one llama_decode per model. "
              "Per-run figures above are each request's own (its decode time includes its waits in the shared "
              "steps); here, the group's throughput: generated tokens ÷ the groups' decode windows (first decode "
              "start to last decode end; the prompts were prefilled before, untimed). vs ar: on the same groups.", "", bt, ""]
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

    acc = {k: m for k, m in res["modes"].items() if m.get("acceptance_by_slot")}
    if acc:
        n = max(len(m["acceptance_by_slot"]["rate"]) for m in acc.values())
        rows = []
        for k, m in acc.items():
            a = m["acceptance_by_slot"]
            cells = []
            for i in range(n):
                if i >= len(a["rate"]):
                    cells.append("")
                    continue
                e = a["mean_accept_prob"][i] if a.get("mean_accept_prob") else None
                cells.append(_pct(a["rate"][i]) + (f" ({_pct(e)})" if e is not None else ""))
            rows.append([f"`{k}`", stats.fmt(m.get("temperature") or 0.0, 2), stats.fmt(m["tokens_per_cycle"], 2)] + cells)
        L += ["## Acceptance per slot (exact modes)", "",
              "Share of cycles that accepted slot i among those that tested it (all earlier slots accepted); "
              "in parentheses, at temperature > 0, the mean acceptance probability min(1, q/p̃) of exact "
              "speculative sampling. `lossless` slot 1 is the target's own next-token sample: always accepted.", "",
              _table(["run", "T", "tokens/cycle"] + [str(i + 1) for i in range(n)], rows), ""]
    dist = {k: m["distribution_vs_ar"] for k, m in res["modes"].items() if m.get("distribution_vs_ar")}
    if dist:
        rows = [[f"`{k}`", f"`{d['reference']}`", str(d["samples"]), str(d["positions"]), f"{d['p_value']:.3g}" if d["p_value"] is not None else "– (too few samples)",
                 ", ".join(stats.fmt(x, 3) for x in d["tv_by_position"])] for k, d in dist.items()]
        L += ["## Exactness at temperature > 0: distributions, not tokens", "",
              "Each run samples with seeds of its own (so that the runs are independent samples; with one seed the "
              "coupled sampler gives `ar`'s text token for token), so the outputs must be equal in distribution. " + next(iter(dist.values()))["method"]
              + ". A small p-value would show a difference. TV: mean total variation distance between the two "
              "frequency tables per prompt, by position (sampling noise alone keeps it well above 0 with few seeds).", "",
              _table(["run", "reference", "samples", "positions", "p-value", "TV by position"], rows), ""]
    L += planner_sections(res)
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
        def trio(v):
            return [stats.fmt(v.get(k), 3) for k in ("p", "q", "pq")]
        rows = [[f"`{k}`"] + trio(v) + [str(v.get("n_pos", "")), str(v.get("n_neg", ""))] + trio(v.get("positional", {}))
                for k, v in res["auc"].items()]
        rows.append(["paper (GSM8K)", "0.910", "0.960", "0.964", "", "", "", "", ""])
        L += ["## Detecting \"slot i is on the greedy path\" (AUC)", "",
              "p̃: the proposal's confidence; q: the verifier's probability (`prove`), the target's own verify-pass probability "
              "(`lossless`), the target's probability (`spec`). On path: the block up to and including slot i is the "
              "greedy path (what a gate decides; q reads the proposed tokens before slot i). Positional: slot i's token "
              "equals the greedy token at its position, whatever came before it.", "",
              _table(["run", "AUC p̃", "AUC q", "AUC p̃·q", "on path", "off path",
                      "positional p̃", "positional q", "positional p̃·q"], rows), ""]
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




def planner_sections(res: dict) -> list[str]:
    """--block auto against fixed widths, the widths the planner chose, the oracle bound and the
    projection for this machine's curve and a flat one."""
    L = []
    avf = res.get("auto_vs_fixed") or {}
    if avf:
        rows = []
        for name, a in avf.items():
            rows.append([f"`{name}`", stats.fmt(a["tokens_per_second"], 1), stats.fmt(a["speedup_vs_ar"], 2, "×"),
                         f"`{a['best_fixed']}`" if a["best_fixed"] else "–",
                         stats.fmt(a["fixed"][a["best_fixed"]]["tokens_per_second"], 1) if a["best_fixed"] else "–",
                         stats.fmt(a["auto_over_best_fixed"], 2, "×"),
                         ", ".join(f"{k} {v}" for k, v in list(a["widths"].items())[:6])])
        L += ["## `--block auto` against fixed widths", "",
              "Same prompts, interleaved. Widths: cycles per choice (`ar`: a plain ar cycle; `B=4 v=2`: a 4-slot "
              "proposal of which 2 were verified; `k=3`: 3 drafts).", "",
              _table(["auto run", "tokens/s", "speedup vs ar (median)", "best fixed", "its tokens/s", "auto ÷ best fixed",
                      "widths chosen (cycles)"], rows, "lrrlrrl"), ""]
    orc = res.get("oracle")
    if orc:
        cur, flat = orc.get("tokens_per_t1"), orc["tokens_per_t1_flat"]
        rows = [["ar", "1.00", "1.00"]]
        for b, v in flat["fixed_blocks"].items():
            rows.append([f"fixed B={b}", stats.fmt(cur["fixed_blocks"][b], 2) if cur else "–", stats.fmt(v, 2)])
        rows.append(["oracle (per cycle, knowing the outcome)", stats.fmt(cur["oracle"], 2) if cur else "–",
                     stats.fmt(flat["oracle"], 2)])
        ch = orc.get("planner_choice", {})
        fmt_ch = lambda c: "–" if c is None else ("ar" if c == "ar" else f"B={c}")
        L += ["## Lossless: fixed blocks, the oracle bound and the planner's choice", "",
              f"A full proposal logged at each of {orc['n_positions']} positions of `ar`'s answers; tokens per "
              "one-token pass cost of the proposer (pooled over answers; Python overhead ignored), on this run's "
              "measured curve and on a flat one (a GPU). The oracle picks ar or a verify width per cycle knowing "
              "how many slots match. Slot match given the earlier slots matched: "
              + ", ".join(stats.fmt(x, 2) for x in orc["conditional_slot_rate"][:8]) + " … "
              f"The planner's choice from these rates: **{fmt_ch(ch.get('curve'))}** on this curve, "
              f"**{fmt_ch(ch.get('flat'))}** on a flat one.", "",
              _table(["policy", "this curve", "flat curve"], rows), ""]
    ext = res.get("external")
    if ext:
        rows = [[f"`{n}`", stats.fmt(v, 2, "×")] for n, v in ext["run_over_external_median"].items()]
        L += [f"## Against llama.cpp's `{ext.get('name')}`", "",
              f"`{ext.get('binary')}` {' '.join(ext.get('args', []))}, target = the proposer, draft = `--draft`, greedy, "
              f"on the same prompts: {stats.fmt(ext['tokens_per_second'], 1)} tokens/s over {ext['n_ok']} prompts"
              + (f" ({ext['n_failed']} failed: {'; '.join(ext['errors'])})" if ext["n_failed"] else "")
              + ". Median over prompts of each run's throughput ÷ its:", "", _table(["run", "÷ llama-speculative-simple"], rows), ""]
    proj = res.get("projection")
    if proj:
        def best(rows):
            b = next(r for r in rows if r["chosen"])
            return "ar" if b["kind"] == "ar" else f"B={b['width']}"
        rows = [[r["kind"] if r["kind"] == "ar" else f"B={r['width']}", stats.fmt(c["tokens_per_t1"], 2),
                 stats.fmt(f["tokens_per_t1"], 2)] for r, c, f in zip(proj["curve"], proj["curve"], proj["flat"])]
        L += ["## Planner projection: this machine's curve and a flat curve (GPU)", "",
              "Expected lossless tokens per one-token pass cost per block width from the planner's acceptance "
              f"statistics after the run (slot rates {', '.join(stats.fmt(x, 2) for x in proj['slot_rate'][:8])} …). "
              f"The planner's choice: **{best(proj['curve'])}** on this curve, **{best(proj['flat'])}** on a flat one.", "",
              _table(["width", "this curve", "flat curve"], rows), ""]
    return L
