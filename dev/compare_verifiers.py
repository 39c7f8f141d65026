"""Compare two verifiers from two `prove-local bench` folders (same proposer, prompts and θ sweep;
modes ar,prove): AUC of p̃ / q / p̃·q per θ, and the ProVe paper's comparison at equal error
(tokens per cycle of `prove` at the divergence from `ar`, or the accuracy loss, of the old
verifier's θ points; prove_local.bench.stats.at_equal_error), and each verifier's cost ratio
ρ = t_v(1) / t_p(1) from the bench's pass-cost curves.

    python dev/compare_verifiers.py OLD_BENCH_DIR NEW_BENCH_DIR --out DIR

Writes DIR/compare.json and DIR/compare.md (atomically) and prints the markdown.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prove_local.bench import stats  # noqa: E402
from prove_local.bench.results import read_results  # noqa: E402
from prove_local.files import write_atomic  # noqa: E402


def load(folder: str) -> dict:
    path = Path(folder) / "results.json"
    res = read_results(folder)
    if not res.get("theta_sweep") or "ar" not in res.get("modes", {}):
        raise SystemExit(f"{path}: needs a bench run with modes ar and prove (a θ sweep)")
    return res


def rho(res: dict) -> float | None:
    pc = res.get("pass_cost") or {}
    if "target" not in pc or "verifier" not in pc:
        return None
    return pc["verifier"]["seconds"][0] / pc["target"]["seconds"][0]


def compare(old: dict, new: dict) -> dict:
    if [p["id"] for p in old["prompts"]] != [p["id"] for p in new["prompts"]]:
        raise SystemExit("the two bench runs used different prompts; rerun with the same --data/--limit")
    if old["settings"].get("max_new") != new["settings"].get("max_new"):
        raise SystemExit("the two bench runs used different --max-new")
    out = {"old": {"verifier": old["models"].get("verifier", {}).get("path"), "rho": rho(old)},
           "new": {"verifier": new["models"].get("verifier", {}).get("path"), "rho": rho(new)},
           "n_prompts": old["data"]["n_prompts"], "max_new": old["settings"].get("max_new"),
           "ar_accuracy": old["modes"]["ar"]["accuracy"], "auc": [], "sweep": [], "equal_error": {}}
    by_theta = {side: {r["theta"]: r for r in res["theta_sweep"]} for side, res in (("old", old), ("new", new))}
    for theta in sorted(set(by_theta["old"]) & set(by_theta["new"])):
        o, n = by_theta["old"][theta], by_theta["new"][theta]
        ao, an = old["auc"].get(o["run"], {}), new["auc"].get(n["run"], {})
        keys = ("p", "q", "pq", "n_pos", "n_neg")
        out["auc"].append({"theta": theta, "old": {k: ao.get(k) for k in keys}, "new": {k: an.get(k) for k in keys},
                           "old_positional": {k: ao.get("positional", {}).get(k) for k in keys},
                           "new_positional": {k: an.get("positional", {}).get(k) for k in keys}})
        out["sweep"].append({"theta": theta, **{f"{k}_{side}": r.get(k) for side, r in (("old", o), ("new", n))
                                                 for k in ("tokens_per_cycle", "exact_match_vs_ar", "accuracy")}})
    for kind in ("divergence", "accuracy"):
        pts = {side: stats.error_points(res["theta_sweep"], kind, res["modes"]["ar"]["accuracy"])
               for side, res in (("old", old), ("new", new))}
        out["equal_error"][kind] = stats.at_equal_error(pts["new"], pts["old"])
    return out


def _f(x, d=3):
    return "–" if x is None else f"{x:.{d}f}"


def markdown(c: dict) -> str:
    L = ["# Verifier comparison (same proposer, prompts and θ sweep)", "",
         f"- old: `{c['old']['verifier']}`, ρ = t_v(1)/t_p(1) = {_f(c['old']['rho'], 2)}",
         f"- new: `{c['new']['verifier']}`, ρ = {_f(c['new']['rho'], 2)}",
         f"- {c['n_prompts']} prompts, ≤ {c['max_new']} new tokens; `ar` accuracy {_f(c['ar_accuracy'])}", "",
         "## AUC as detectors of \"slot i is on the greedy path\"", "",
         "On path: the proposed block up to and including slot i is the greedy path (what the gate decides).", "",
         "| θ | p̃ (old) | q (old) | p̃·q (old) | p̃ (new) | q (new) | p̃·q (new) | slots on / off path (new) |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in c["auc"]:
        o, n = r["old"], r["new"]
        L.append(f"| {r['theta']:g} | {_f(o['p'])} | {_f(o['q'])} | {_f(o['pq'])} | {_f(n['p'])} | {_f(n['q'])} | "
                 f"{_f(n['pq'])} | {n['n_pos']} / {n['n_neg']} |")
    L += ["", "Positional event (slot i's token equals the greedy token at its position, whatever came before it):", "",
          "| θ | p̃ (old) | q (old) | p̃·q (old) | p̃ (new) | q (new) | p̃·q (new) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in c["auc"]:
        o, n = r.get("old_positional") or {}, r.get("new_positional") or {}
        L.append(f"| {r['theta']:g} | {_f(o.get('p'))} | {_f(o.get('q'))} | {_f(o.get('pq'))} | {_f(n.get('p'))} | "
                 f"{_f(n.get('q'))} | {_f(n.get('pq'))} |")
    L += ["", "## θ sweep", "", "| θ | tokens/cycle old | new | = ar output old | new | accuracy old | new |",
          "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in c["sweep"]:
        L.append(f"| {r['theta']:g} | {_f(r['tokens_per_cycle_old'], 2)} | {_f(r['tokens_per_cycle_new'], 2)} | "
                 f"{_f(r['exact_match_vs_ar_old'], 3)} | {_f(r['exact_match_vs_ar_new'], 3)} | "
                 f"{_f(r['accuracy_old'], 3)} | {_f(r['accuracy_new'], 3)} |")
    for kind, title in (("divergence", "share of prompts whose output differs from `ar`"),
                        ("accuracy", "accuracy lost against `ar`")):
        e = c["equal_error"][kind]
        L += ["", f"## Tokens per cycle at equal error: {title}", "",
              "At the error of each θ of the old verifier: tokens per cycle on each sweep's upper envelope "
              "(most tokens per cycle at that error or less, linear between θ points; no extrapolation).", "",
              "| θ (old) | error | tokens/cycle old | new | new / old |", "|---:|---:|---:|---:|---:|"]
        for p in e["points"]:
            L.append(f"| {p['theta_old']:g} | {_f(p['error'])} | {_f(p['tokens_per_cycle_old'], 3)} | "
                     f"{_f(p['tokens_per_cycle_new'], 3)} | {_f(p['ratio'], 3)} |")
        L += ["", f"Mean ratio over {e['n']} comparable points: **{_f(e['mean_ratio'], 3)}**"]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    c = compare(load(a.old), load(a.new))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(c)
    write_atomic(out / "compare.json", json.dumps(c, indent=1) + "\n")
    write_atomic(out / "compare.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
