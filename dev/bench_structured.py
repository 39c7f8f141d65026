"""Tokens per cycle and speed of `lossless` against `ar` under a JSON schema (issue 25), on the
embedded pair: a small extraction task, greedy, answers decoded to the end of the JSON.

    flock -x /tmp/cpu.lock python dev/bench_structured.py [--threads 1] [--repeats 3]

Prints one line per (constraint, mode, block): tokens, cycles, tokens per cycle, tokens/s (the
median of the repeats; engine.tokens_per_second's definition), and whether the text equals ar's."""
from __future__ import annotations

import argparse
import json
import statistics
import time

from prove_local.chat import Conversation
from prove_local.engine import Engine, Settings, tokens_per_second
from prove_local.grammar import Grammar
from prove_local.llama import Model
from prove_local.loading import EMBEDDED_PROPOSER

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 16},
    "paid": {"type": "number"},
    "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "city", "paid", "items"]}
TEXTS = [
    "Extract as JSON: Maria, 34, from Lisbon, paid $12.50 for apples and pears.",
    "Extract as JSON: Tom is 51 and lives in Leeds; he paid 7 dollars for 3 pens.",
    "Extract as JSON: Aiko (28, Osaka) bought tea and rice for 1200 yen.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=160)
    args = ap.parse_args()
    model = Model(EMBEDDED_PROPOSER)
    engine = Engine.load(model, n_ctx=2048, n_threads=args.threads, type_k="f32", type_v="f32")
    grammar = Grammar.from_schema(model, SCHEMA)
    prompts = [Conversation(model).prompt_tokens(t) for t in TEXTS]
    rows = []
    for label, g in (("schema", grammar), ("none", None)):
        ref = None
        for mode, block in (("ar", None), ("lossless", 4), ("lossless", 8), ("lossless", 16)):
            runs, texts = [], []
            for _ in range(args.repeats):
                n = cycles = 0
                seconds = 0.0
                out = []
                for prompt in prompts:
                    engine.tokens = []         # no KV reuse between runs: every run prefills alike
                    engine._sync()
                    gen = engine.generate(prompt, Settings(mode=mode, block=block, lookup=0, max_new=args.max_new,
                                                           grammar=g))
                    cs = list(gen)
                    toks = [t for c in cs for t in c.committed]
                    n, cycles, seconds = n + len(toks), cycles + len(cs), seconds + gen.request.decode_seconds
                    out.append(toks)
                runs.append(tokens_per_second(n, seconds))
                texts.append(out)
            if mode == "ar":
                ref = texts[0]
            valid = all(_valid(model, t) for t in texts[0]) if g is not None else None
            rows.append({"constraint": label, "mode": mode, "block": block, "tokens": n, "cycles": cycles,
                         "tokens_per_cycle": round(n / cycles, 2), "tokens_per_second": round(statistics.median(runs), 1),
                         "equals_ar": texts[0] == ref, "valid_json": valid})
            print(json.dumps(rows[-1]), flush=True)


def _valid(model, tokens) -> bool:
    try:
        json.loads(model.detokenize([t for t in tokens if not model.is_eog(t)]))
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"# {time.perf_counter() - t0:.1f} s")
