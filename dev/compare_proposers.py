"""Compare two proposers from two `prove-local bench` folders run on the same prompts with
`--modes ar,lossless --block 4,8,16 --oracle` (issue 21): slot match rates (the oracle's full
proposals at every position of `ar`'s answers, and `lossless` B=16's positional rates), tokens per
lossless cycle per width, lossless tokens per one-token pass on a flat curve (fixed widths and the
per-cycle oracle), exactness, answers right and the share of tokens in loops.

    python dev/compare_proposers.py OLD_BENCH_DIR NEW_BENCH_DIR --out DIR [--names old,new]

Writes DIR/compare.json and DIR/compare.md (atomically) and prints the markdown.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prove_local.bench.results import read_results  # noqa: E402
from prove_local.files import write_atomic  # noqa: E402

WIDTHS = (4, 8, 16)


def load(folder: str) -> dict:
    path = Path(folder) / "results.json"
    res = read_results(folder)
    missing = [r for r in ("ar", *(f"lossless@B{b}" for b in WIDTHS)) if r not in res.get("modes", {})]
    if missing or not res.get("oracle"):
        raise SystemExit(f"{path}: needs a bench run with --modes ar,lossless --block 4,8,16 --oracle "
                         f"(missing: {', '.join(missing) or 'the oracle'})")
    return res


def side(res: dict) -> dict:
    o, m = res["oracle"], res["modes"]
    return {
        "target": res["models"]["target"]["path"],
        "oracle_slot_match": o["slot_match_rate"],
        "conditional_slot_rate": o["conditional_slot_rate"],
        "positional_B16": res["position_match_rate"]["lossless@B16"]["rate"],
        "tokens_per_cycle": {b: m[f"lossless@B{b}"]["tokens_per_cycle"] for b in WIDTHS},
        "flat": o["tokens_per_t1_flat"],
        "exact": {b: m[f"lossless@B{b}"]["exact_match_vs_ar"] for b in WIDTHS},
        "accuracy": m["ar"]["accuracy"],
        "loop_share": m["ar"]["loop_share"],
    }


def compare(old: dict, new: dict) -> dict:
    if [p["id"] for p in old["prompts"]] != [p["id"] for p in new["prompts"]]:
        raise SystemExit("the two bench runs used different prompts; rerun with the same --data/--limit")
    if old["settings"].get("max_new") != new["settings"].get("max_new"):
        raise SystemExit("the two bench runs used different --max-new")
    return {"n_prompts": old["data"]["n_prompts"], "max_new": old["settings"].get("max_new"),
            "old": side(old), "new": side(new)}


def _f(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


def _pct(xs, n=8):
    return ", ".join("–" if x is None else f"{100 * x:.0f}" for x in xs[:n])


def markdown(c: dict, names=("old", "new")) -> str:
    o, n = c["old"], c["new"]
    L = [f"# Proposer comparison ({c['n_prompts']} GSM8K dev questions, ≤ {c['max_new']} new tokens, greedy)", "",
         f"- {names[0]}: `{o['target']}`", f"- {names[1]}: `{n['target']}`", "",
         "| figure | " + " | ".join(names) + " |", "|---|---:|---:|"]
    L.append(f"| slot 2 = greedy token (oracle: a full proposal at every position of `ar`'s answers) | "
             f"{100 * o['oracle_slot_match'][1]:.1f} % | {100 * n['oracle_slot_match'][1]:.1f} % |")
    L.append(f"| slot i given slots 2..i-1 matched, slots 2–9 (%) | {_pct(o['conditional_slot_rate'][1:])} | "
             f"{_pct(n['conditional_slot_rate'][1:])} |")
    L.append(f"| slot i = greedy token at its position, `lossless` B=16, slots 1–8 (%) | {_pct(o['positional_B16'])} | "
             f"{_pct(n['positional_B16'])} |")
    for b in WIDTHS:
        L.append(f"| tokens per `lossless` cycle, B={b} | {_f(o['tokens_per_cycle'][b])} | {_f(n['tokens_per_cycle'][b])} |")
    for b in WIDTHS:
        L.append(f"| flat curve: lossless tokens per one-token pass, fixed B={b} | "
                 f"{_f(o['flat']['fixed_blocks'].get(str(b), o['flat']['fixed_blocks'].get(b)))} | "
                 f"{_f(n['flat']['fixed_blocks'].get(str(b), n['flat']['fixed_blocks'].get(b)))} |")
    L.append(f"| flat curve: per-cycle oracle | {_f(o['flat']['oracle'])} | {_f(n['flat']['oracle'])} |")
    L.append(f"| `lossless` = `ar` output (B = 4 / 8 / 16) | {' / '.join(_f(o['exact'][b], 2) for b in WIDTHS)} | "
             f"{' / '.join(_f(n['exact'][b], 2) for b in WIDTHS)} |")
    L.append(f"| `ar` answers right | {_f(o['accuracy'], 3)} | {_f(n['accuracy'], 3)} |")
    L.append(f"| `ar` tokens inside repeated 8-grams | {_f(o['loop_share'], 3)} | {_f(n['loop_share'], 3)} |")
    return "\n".join(L) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--out", required=True)
    p.add_argument("--names", default="old,new", help="two column names, comma-separated")
    a = p.parse_args(argv)
    names = tuple(a.names.split(","))
    if len(names) != 2:
        raise SystemExit(f"--names {a.names!r}: want two names separated by a comma")
    c = compare(load(a.old), load(a.new))
    md = markdown(c, names)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "compare.json", json.dumps(c, indent=1))
    write_atomic(out / "compare.md", md)
    print(md)
    return c


if __name__ == "__main__":
    main()
