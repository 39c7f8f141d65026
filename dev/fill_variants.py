"""How to combine a MARS proposal with lookup drafts: the variants side by side at the same positions.

Along each prompt's greedy answer (the embedded F32 proposer: lossless commits exactly these tokens),
at every position every variant proposes from the same committed prefix and is scored by the tokens
its cycle would commit (the leading run of proposals equal to the greedy answer, plus the model's own
token after it), and by the widths of the passes it makes; the expected tokens per one-token-pass cost
then follow from a pass-cost curve t(n)/t(1) (this CPU's steep one from `prove-local calibrate`, and a
flat one as on a GPU). No timing is involved: the figures hold on a loaded machine.

Variants, at block B and lookup length k (where the lookup index has a match; elsewhere MARS alone):
  mars      [pending, mask x (B-1)], then verify B                      (lossless_cycle)
  lookup    [pending, x_1..x_k]: one pass                               (lookup_cycle)
  prefix    [pending, x_1..x_k, mask x (B-1)], then verify B if all x hold (lossless_fill_cycle)
  subst     [pending, mask x (B-1)]; slots 2..B replaced by the lookup's continuation after slot 1
            (the exact AR token), then verify B                          (tried here only)

    python dev/fill_variants.py --limit 30 --block 4 --k 4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from prove_local.chat import Conversation
from prove_local.llama import Context, Model
from prove_local.loading import EMBEDDED_PROPOSER
from prove_local.lookup import NgramIndex
from prove_local.rules import top1

ROOT = Path(__file__).resolve().parents[1]


def run_len(proposed, ref, start) -> int:
    """Leading proposed tokens equal to the reference from `start` on."""
    n = 0
    while n < len(proposed) and start + n < len(ref) and proposed[n] == ref[start + n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared/datasets/gsm8k/test_dev.jsonl"))
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--curve", default="1:1,2:1.6,3:2.2,4:2.8,5:3.3,6:3.8,8:5.5,12:7.6,16:9.8,24:14,32:20",
                    help="t(n)/t(1) of the CPU curve (n:ratio; default: the embedded proposer on a 2-core CPU, docs/lookup.md)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = Model(EMBEDDED_PROPOSER)
    ctx = Context(model, n_ctx=1024, n_threads=1, type_k="f32", type_v="f32")
    mask, B, K = model.mask_token, args.block, args.k
    pts = sorted((int(a), float(b)) for a, b in (x.split(":") for x in args.curve.split(",")))
    steep = lambda n: float(np.interp(n, [p[0] for p in pts], [p[1] for p in pts]))  # noqa: E731
    flat = lambda n: 1.0 + 0.005 * (n - 1)                                             # noqa: E731
    names = ("ar", "mars", "lookup", "prefix", "subst")
    buckets = ("none", "m=1", "m=2-3", "m=4-7", "m>=8")
    tot = {v: {"tokens": 0, "steep": 0.0, "flat": 0.0, "cycles": 0} for v in names}
    by = {(b, v): {"tokens": 0, "steep": 0.0, "flat": 0.0, "cycles": 0} for b in buckets for v in names}
    matched = 0
    questions = [json.loads(x)["question"] for x in Path(args.data).read_text().splitlines()[:args.limit]]
    for q in questions:
        prompt = Conversation(model).prompt_tokens(q)
        ctx.truncate(0)
        ref, logits = [], ctx.eval(prompt)[0]
        while len(ref) < args.max_new:                      # the greedy answer, one token per pass
            t = int(np.argmax(logits))
            ref.append(t)
            if model.is_eog(t):
                break
            logits = ctx.eval([t])[0]
        ix = NgramIndex()
        for s in range(len(ref)):
            seq = prompt + ref[:s]
            ix.sync(seq)
            if ctx.n_past < len(seq) - 1:                    # the cache: the prefix but its last token
                ctx.eval(seq[ctx.n_past:len(seq) - 1], rows=[])
            ctx.truncate(len(seq) - 1)

            def passes(feed, rows):
                out = ctx.eval(feed, rows=rows)
                ctx.truncate(len(seq) - 1)
                return out

            m = ix.match()
            bucket = ("none" if m is None else "m=1" if m.length == 1 else "m=2-3" if m.length < 4
                      else "m=4-7" if m.length < 8 else "m>=8")

            def score(name, tokens, widths):
                for t in (tot[name], by[(bucket, name)]):
                    t["tokens"] += tokens
                    t["steep"] += sum(steep(w) for w in widths)
                    t["flat"] += sum(flat(w) for w in widths)
                    t["cycles"] += 1

            score("ar", 1, [1])
            d, _ = top1(passes([seq[-1]] + [mask] * (B - 1), list(range(B))))
            d = d.tolist()
            n_mars = max(1, run_len(d, ref, s))
            score("mars", n_mars + 1, [B, B])
            if m is None:                                    # no match: the others are MARS (lookup: ar)
                score("lookup", 1, [1]), score("prefix", n_mars + 1, [B, B]), score("subst", n_mars + 1, [B, B])
                continue
            matched += 1
            x = ix.draft(m, K)
            n_x = run_len(x, ref, s)
            score("lookup", n_x + 1, [1 + K])
            if n_x == K:                                     # all copied tokens hold: the masks after them
                rows = passes([seq[-1]] + x + [mask] * (B - 1), list(range(K, K + B)))
                dd, _ = top1(rows)
                n_after = max(1, run_len(dd.tolist(), ref, s + K))
                score("prefix", K + n_after + 1, [1 + K + B - 1, B])
            else:
                score("prefix", n_x + 1, [1 + K + B - 1])
            ix2 = NgramIndex()
            ix2.sync(seq + [d[0]])                           # slot 1 is the exact AR token
            cont = ix2.propose(B - 1)[0]
            sub = [d[0]] + (cont if len(cont) == B - 1 else d[1:])
            score("subst", max(1, run_len(sub, ref, s)) + 1, [B, B])
    res = {"prompts": len(questions), "block": B, "k": K, "positions": tot["ar"]["cycles"], "with_match": matched,
           "variants": {v: {"tokens_per_cycle": round(t["tokens"] / t["cycles"], 3),
                            "tokens_per_pass_cost_steep": round(t["tokens"] / t["steep"], 3),
                            "tokens_per_pass_cost_flat": round(t["tokens"] / t["flat"], 3)} for v, t in tot.items()},
           "by_match": {b: {"positions": by[(b, "ar")]["cycles"],
                            **{v: [round(t["tokens"] / t["cycles"], 2), round(t["tokens"] / t["steep"], 3),
                                   round(t["tokens"] / t["flat"], 3)]
                               for v in names for t in [by[(b, v)]] if t["cycles"]}} for b in buckets}}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
