"""Lookup drafting rules replayed on a model's greedy answers, without timing: which slots a rule
drafts, which of them greedy decoding would accept, and what that is worth on the model's measured
pass-cost curve.

The model decodes each prompt once with `ar` (greedy); then every rule walks the answer as lossless
would: at each cycle it drafts from the n-gram index of the committed tokens, the cycle commits the
leading run that equals the answer plus one token, and it costs t(1 + drafted) from the calibrated
curve (calibrate.py, the planner's own figures). `ar` costs t(1) per token, so "modelled vs ar" is a
ratio of pass costs: no host overhead, no noise. Rules:

  copy@K     the plain copy of the best match, K tokens (`--lookup K`)
  backed@K   the copy cut at its first slot the n-gram statistics do not back (what the planner is
             offered: lookup.NgramIndex.propose_supported), at most K tokens
  vote@K     llama.cpp's common_ngram_cache_draft on the context cache: token by token, the dominant
             follower of the longest n-gram that passes its lax thresholds (a 50 % tie passes)

Also, per slot: over every position of every answer, the 8-token copy's slots split by whether the
statistics back each one (its token is lookup.NgramIndex.follower of the tokens before it), with the
share greedy decoding accepted (a slot counted only if the ones before it were accepted).

    python scripts/lookup_replay.py --out bench-out/lookup-replay

Writes OUT/results.json, OUT/summary.md and OUT/replay.png; the greedy answers are kept in
OUT/answers.json and reused (--fresh to decode again).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", action="append", default=None,
                    help="FILE:raw or FILE:chat (default: scripts/data/copy_raw.jsonl:raw and copy_chat.jsonl:chat)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rules", default="copy@3,copy@8,backed@3,backed@8,backed@16,vote@3,vote@8")
    ap.add_argument("--fresh", action="store_true", help="decode the answers again")
    ap.add_argument("--out", required=True)
    return ap


if __name__ == "__main__":
    build_parser().parse_args()   # --help and bad arguments end here, before llama.cpp is loaded


from prove_local.engine import Engine, Settings  # noqa: E402
from prove_local.llama import Model  # noqa: E402
from prove_local.lookup import NgramIndex  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from lookup_bench import HERE, bar_plot, load_prompts, prompt_tokens, smollm2  # noqa: E402


def rule(name: str, k: int):
    def copy(ix):
        return ix.propose(k)[0]

    def backed(ix):
        return ix.propose_supported(k)[0]

    def voted(ix):
        tail, out = ix.tokens[-ix.n_max:], []
        while len(out) < k and (t := ix.follower(tail, ties=True)) is not None:
            out.append(t)
            tail.append(t)
        return out
    return {"copy": copy, "backed": backed, "vote": voted}[name]


def replay(draft, prompt: list[int], answer: list[int], t) -> dict:
    ix = NgramIndex()
    ix.sync(prompt)
    i = cost = drafted = accepted = cycles = 0
    while i < len(answer):
        d = draft(ix)[:len(answer) - i - 1]
        a = 0
        while a < len(d) and d[a] == answer[i + a]:
            a += 1
        cost += t(1 + len(d))
        drafted, accepted, cycles = drafted + len(d), accepted + a, cycles + 1
        i += a + 1
        ix.sync(prompt + answer[:i])
    return {"vs_ar": len(answer) * t(1) / cost if cost else 1.0, "drafted": drafted, "accepted": accepted,
            "cycles": cycles, "tokens": len(answer)}


def slot_split(prompt: list[int], answer: list[int], k: int = 8) -> dict:
    """At every position: the k-token copy's slots, backed or not, and greedy decoding's verdict."""
    out = {"backed": [0, 0], "unbacked": [0, 0]}
    ix = NgramIndex()
    for i in range(len(answer)):
        ix.sync(prompt + answer[:i])
        m = ix.match()
        if m is None:
            continue
        d = ix.draft(m, min(k, len(answer) - i))
        tail = ix.tokens[-ix.n_max:]
        for j, tok in enumerate(d):
            ok = tok == answer[i + j]
            cell = out["backed" if ix.follower(tail) == tok else "unbacked"]
            cell[0] += ok
            cell[1] += 1
            if not ok:
                break
            tail.append(tok)
    return out


def main() -> int:
    args = build_parser().parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = args.model or smollm2()
    model = Model(model_path)
    engine = Engine.load(model, n_ctx=2048, n_threads=args.threads)
    engine.prepare(Settings(mode="lossless", block="auto"))          # the calibrated curve
    costs = engine.planner.costs
    t = lambda n: float(costs.t("target", n))                        # noqa: E731
    cache = out / "answers.json"
    if cache.exists() and not args.fresh:
        answers = json.loads(cache.read_text())
    else:
        answers = []
        for p in load_prompts(args.data or [str(HERE / "data/copy_raw.jsonl") + ":raw",
                                            str(HERE / "data/copy_chat.jsonl") + ":chat"]):
            toks = prompt_tokens(model, p)
            ids = [x for c in engine.generate(toks, Settings(mode="ar", max_new=args.max_new)) for x in c.committed]
            answers.append({"id": p["id"], "prompt": toks, "answer": ids})
            print(f"decoded {p['id']}: {len(ids)} tokens", file=sys.stderr, flush=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(answers))
        tmp.replace(cache)
    names = [r.strip() for r in args.rules.split(",") if r.strip()]
    rows, split = [], {"backed": [0, 0], "unbacked": [0, 0]}
    for a in answers:
        row = {"id": a["id"], "tokens": len(a["answer"]), "rules": {}}
        for n in names:
            kind, k = n.split("@")
            row["rules"][n] = replay(rule(kind, int(k)), a["prompt"], a["answer"], t)
        for key, (acc, tot) in slot_split(a["prompt"], a["answer"]).items():
            split[key][0] += acc
            split[key][1] += tot
        rows.append(row)
    summary = {n: {"median_vs_ar": statistics.median(r["rules"][n]["vs_ar"] for r in rows),
                   "min_vs_ar": min(r["rules"][n]["vs_ar"] for r in rows),
                   "accepted_share": sum(r["rules"][n]["accepted"] for r in rows)
                   / max(1, sum(r["rules"][n]["drafted"] for r in rows))} for n in names}
    slots = {k: {"accepted": v[0], "slots": v[1], "share": v[0] / v[1] if v[1] else None} for k, v in split.items()}
    res = {"command": " ".join(sys.argv), "model": model_path, "threads": args.threads,
           "curve_t1_ms": 1e3 * t(1), "curve_ratio": {n: t(n) / t(1) for n in (2, 3, 4, 8, 16)},
           "summary": summary, "slots": slots, "prompts": rows}
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["| prompt | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        lines.append(f"| {r['id']} | " + " | ".join(
            f"{x['vs_ar']:.2f}× ({x['accepted']}/{x['drafted']})" for x in (r["rules"][n] for n in names)) + " |")
    lines.append("| **median** | " + " | ".join(f"**{summary[n]['median_vs_ar']:.2f}×**" for n in names) + " |")
    lines.append("| worst | " + " | ".join(f"{summary[n]['min_vs_ar']:.2f}×" for n in names) + " |")
    text = "\n".join(lines) + "\n\nslots of the 8-token copy at every position: " + ", ".join(
        f"{k} {v['accepted']}/{v['slots']} accepted ({100 * (v['share'] or 0):.0f} %)" for k, v in slots.items()) + "\n"
    (out / "summary.md").write_text(text)
    shown = [n for n in ("copy@3", "backed@16", "vote@3") if n in names] or names
    bar_plot([r["id"] for r in rows], {n: [r["rules"][n]["vs_ar"] for r in rows] for n in shown},
             "modelled tokens/s ÷ ar (pass costs)", out / "replay.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
