"""Tokens per cycle of the coupled sampler against exact rejection sampling (issue 23), on the
embedded pair: `lossless` at fixed blocks and `spec` with the embedded verifier as draft, lookup
drafts off, at the given temperatures, over GSM8K dev prompts and several seeds each (the same
prompts and seeds for both samplers). Tokens per cycle depend on the logits only, not on the
machine's speed; run it under `flock -x /tmp/cpu.lock` anyway on a shared machine.

    python dev/coupled_bench.py --data shared/datasets/gsm8k/test_dev.jsonl --limit 20 --seeds 3
"""
from __future__ import annotations

import argparse
import json
import math
import time

from prove_local.chat import Conversation
from prove_local.engine import Engine, Settings
from prove_local.llama import Model
from prove_local.loading import EMBEDDED_PROPOSER, EMBEDDED_VERIFIER
from prove_local.modes import proposes


def ratio_se(pairs) -> float:
    """Standard error of sum(t) / sum(c) over independent (t, c) pairs (the ratio estimator's delta
    method): tokens per cycle over generations."""
    n = len(pairs)
    r = sum(t for t, _ in pairs) / sum(c for _, c in pairs)
    mc = sum(c for _, c in pairs) / n
    var = sum((t - r * c) ** 2 for t, c in pairs) / (n - 1)
    return math.sqrt(var / n) / mc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a JSONL file with a 'question' per line")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--configs", default="lossless:4,lossless:8,lossless:16,spec:4")
    ap.add_argument("--json", help="write the table here too")
    a = ap.parse_args()
    prop, ver = Model(EMBEDDED_PROPOSER), Model(EMBEDDED_VERIFIER)
    engine = Engine.load(prop, ver, ver, n_ctx=1024, n_threads=1, type_k="f32", type_v="f32")
    with open(a.data) as f:
        questions = [json.loads(line)["question"] for line in f][:a.limit]
    prompts = [Conversation(prop).prompt_tokens(q) for q in questions]
    rows = []
    t0 = time.time()
    for T in (float(x) for x in a.temps.split(",")):
        for cfg in a.configs.split(","):
            mode, width = cfg.split(":")
            widths = dict(block=int(width)) if mode == "lossless" else dict(draft_k=int(width))
            res = {}
            for sampler in ("coupled", "rejection"):
                toks = cycles = accepted = proposed_cycles = 0
                per_gen = []
                for p in prompts:
                    for seed in range(a.seeds):
                        t_before, c_before = toks, cycles
                        s = Settings(mode=mode, max_new=a.max_new, temperature=T, seed=seed, sampler=sampler,
                                     lookup=0, **widths)
                        for c in engine.generate(p, s):
                            if c.stop:          # a cut cycle commits what is left, not what the rule accepted
                                continue
                            toks += len(c.committed)
                            cycles += 1
                            accepted += c.n_accepted
                            proposed_cycles += proposes(c.plan)
                        if cycles > c_before:
                            per_gen.append((toks - t_before, cycles - c_before))
                res[sampler] = {"tokens_per_cycle": toks / cycles, "cycles": cycles, "se": ratio_se(per_gen),
                                "accepted_per_cycle": accepted / max(proposed_cycles, 1)}
            loss = 1 - res["coupled"]["tokens_per_cycle"] / res["rejection"]["tokens_per_cycle"]
            rows.append({"T": T, "config": cfg, **{k: v["tokens_per_cycle"] for k, v in res.items()},
                         "se": {k: v["se"] for k, v in res.items()},
                         "cycles": {k: v["cycles"] for k, v in res.items()}, "coupled_loss": loss})
            print(f"T={T:g} {cfg:12s} coupled {res['coupled']['tokens_per_cycle']:.3f} ± {res['coupled']['se']:.3f}  "
                  f"rejection {res['rejection']['tokens_per_cycle']:.3f} ± {res['rejection']['se']:.3f}  "
                  f"coupled loses {100 * loss:+.1f} %  "
                  f"({res['coupled']['cycles']}/{res['rejection']['cycles']} cycles)", flush=True)
    print(f"{time.time() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
