"""Where does a `lossless` run with lookup drafts lose time against `ar`? Reads a finished
`prove-local bench` output (its generations.jsonl: every cycle of every run, with its seconds,
decode seconds, widths and plan) and splits each run's decode time into

  * the passes of its `ar` cycles, of its lookup cycles (one verify pass) and of its MARS cycles;
  * host time inside the cycles (cycle seconds - decode seconds: the planner's plan, the rule's numpy);
  * host time between the cycles (the request's decode seconds - the sum of its cycles' seconds:
    the planner's observe, the index, the engine's bookkeeping);
  * the *after-switch* excess: the one-token passes right after a wider pass cost more than in a run of
    one-token passes (the CPU's caches and llama.cpp's threads settle); per distance d = 1..8 from the
    last wider pass, the median decode time of an `ar` cycle over that of the ar cycles 9+ cycles away.

and, for the lookup cycles, what they committed against what `ar` cycles would have cost for the same
tokens (the run's own steady `ar` cycle cost).

    python dev/lookup_loss.py BENCH_OUT [--runs ar,lossless@Lauto,lossless@L0]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import median

AFTER = 8


def kind(c: dict) -> str:
    plan = c.get("plan") or {}
    if plan.get("lookup") and plan.get("kind") == "lookup":
        return "lookup"
    if plan.get("lookup"):
        return "filled"
    return "ar" if plan.get("kind", "ar") == "ar" else "mars"


def analyse(gens: list[dict]) -> dict:
    out = defaultdict(float)
    counts = defaultdict(int)
    after: dict[int, list[float]] = defaultdict(list)
    lookup_tokens = lookup_drafted = lookup_accepted = 0
    for g in gens:
        cycles = g["cycles"]
        out["seconds"] += g["seconds"]
        out["tokens"] += len(g["tokens"])
        inside = 0.0
        since = 10 ** 6
        for c in cycles:
            k = kind(c)
            dec = sum(c["decode_seconds"].values())
            out[f"decode_{k}"] += dec
            out[f"host_{k}"] += c["seconds"] - dec
            counts[k] += 1
            inside += c["seconds"]
            if k == "ar":
                after[min(since, AFTER + 1)].append(dec)
                since += 1
            else:
                since = 1
            if k in ("lookup", "filled"):
                n = c["plan"]["lookup"]
                lookup_drafted += n
                lookup_accepted += min(c["n_accepted"], n)
                lookup_tokens += c["n_committed"]
        out["between"] += g["seconds"] - inside
    steady = median(after[AFTER + 1]) if after.get(AFTER + 1) else None
    res = {"tokens_per_second": out["tokens"] / out["seconds"] if out["seconds"] else 0.0,
           "tokens": int(out["tokens"]), "seconds": out["seconds"], "cycles": dict(counts),
           "time_share": {k: round(v / out["seconds"], 4) for k, v in sorted(out.items())
                          if k not in ("seconds", "tokens")},
           "us_per_cycle": {"between": round(1e6 * out["between"] / max(1, sum(counts.values())), 1),
                            **{f"host_{k}": round(1e6 * out[f"host_{k}"] / n, 1) for k, n in counts.items()},
                            **{f"decode_{k}": round(1e6 * out[f"decode_{k}"] / n, 1) for k, n in counts.items()}}}
    if steady:
        res["ar_after_switch"] = {d: round(median(v) / steady, 3) for d, v in sorted(after.items()) if d <= AFTER and v}
        res["ar_after_switch_n"] = {d: len(v) for d, v in sorted(after.items())}
        excess = sum(sum(v) - steady * len(v) for d, v in after.items() if d <= AFTER)
        res["after_switch_excess_share"] = round(excess / out["seconds"], 4)
    if lookup_drafted:
        res["lookup"] = {"drafted": lookup_drafted, "accepted": lookup_accepted, "committed": lookup_tokens}
        if steady:
            ar_cost = steady + out["host_ar"] / max(1, counts["ar"]) + out["between"] / max(1, sum(counts.values()))
            spent = sum(out[f"{p}_{k}"] for p in ("decode", "host") for k in ("lookup", "filled"))
            res["lookup"]["seconds"] = round(spent, 4)
            res["lookup"]["ar_seconds_for_same_tokens"] = round(lookup_tokens * ar_cost, 4)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="a prove-local bench output folder (generations.jsonl)")
    ap.add_argument("--runs", help="comma-separated run names (default: every run)")
    a = ap.parse_args()
    path = Path(a.out) / "generations.jsonl"
    if not path.is_file():
        print(f"{path}: no such file (a finished prove-local bench --out folder?)", file=sys.stderr)
        return 1
    by_run: dict[str, list] = defaultdict(list)
    for line in path.read_text().splitlines():
        g = json.loads(line)
        by_run[g["run"]].append(g)
    names = a.runs.split(",") if a.runs else sorted(by_run)
    report = {name: analyse(by_run[name]) for name in names if name in by_run}
    if "ar" in report:
        ar = report["ar"]["tokens_per_second"]
        for name, r in report.items():
            r["vs_ar_totals"] = round(r["tokens_per_second"] / ar, 3) if ar else None
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
