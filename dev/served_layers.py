"""What each layer between llama_decode and a served answer adds to one client's time per `ar` token.

    python dev/served_layers.py [--rounds 10] [--tokens 64]

`serve`'s own state in one process (ServerState.load: SmolLM2-135M Q4_1, `--parallel 4`, 2 threads, the
CLI defaults, greedy, p̃ off as the server's jobs run), one request at a time on the pool (so each pass
is a step of its own: `Batcher._alone`), the 4 prompts of scripts/load_test.py. Each arm takes an
engine, lets the engine evaluate the prompt and commit the first token, then times the next TOKENS - 1
tokens, adding one layer at a time:

- `compute`: the whole loop on the process's compute thread (`llama.on_compute_thread`): the shared
  context's `decode_batch` of one token and numpy's argmax, no thread hand-off;
- `direct`: the same calls from the engine's thread (each decode handed to the compute thread and back);
- `seqview`: `SeqView.eval_view` and argmax (the batcher's pass, `_alone`, `_step`, the bookkeeping);
- `generate`: `Engine.generate`'s cycles (planner, `rules.ar_cycle`, `Cycle`, the lookup index);
- `answer`: `Answer` over it, as a server job runs it (detokenizing, stop strings, statistics).

Per round, arms in rotating order, each the median over the 4 prompts; prints each arm's median ms per
token, its ratio to `compute` paired within rounds, and the `llama_decode` time per token (the
arms' passes are the same one-token passes). The HTTP layer (`serve` against the same pool in process)
is docs/server.md's v19 item; the served gap to llama-server is serve_bench's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import load_test  # noqa: E402
from prove_local import llama  # noqa: E402
from prove_local.answer import Answer  # noqa: E402
from prove_local.chat import chat_tokens  # noqa: E402
from prove_local.cli import Parser  # noqa: E402
from prove_local.loading import smollm2_path  # noqa: E402
from prove_local.server import add_parser as add_serve  # noqa: E402
from prove_local.server.state import State  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    p = Parser(prog="prove-local")
    add_serve(p.add_subparsers(dest="command"))
    state = State()
    state.load(p.parse_args(["serve", str(smollm2_path()), "--parallel", "4", "--threads", "2"]))
    pool, model = state.pool, state.pool.loaded.target
    prompts = [chat_tokens(model, model.chat_template, [{"role": "user", "content": t}]) for t in load_test.PROMPTS]
    settings = replace(state.defaults, mode="ar", max_new=a.tokens, temperature=0.0, p_tilde=False)
    n = a.tokens - 1
    decode = {}                                         # arm -> llama_decode seconds per token, per request

    def raw(i: int, arm: str) -> float:
        """compute / direct / seqview: the engine commits the first token, then n passes by hand."""
        with pool.engine() as (_, engine):
            g = engine.generate(prompts[i % 4], settings)
            x = next(iter(g)).committed[-1]
            ctx = engine.contexts["target"]
            shared, seq, pos = ctx.shared, ctx.seq, ctx.n_past
            d0 = shared.decode_seconds

            def loop(x: int) -> None:
                for k in range(n):
                    x = int(np.argmax(shared.decode_batch([(seq, pos + k, [x], [0])], False, [True])[0][-1]))
            t0 = time.perf_counter()
            if arm == "compute":
                llama.on_compute_thread(loop, x)
            elif arm == "direct":
                loop(x)
            else:
                for _ in range(n):
                    x = int(np.argmax(ctx.eval_view([x])[-1]))
            dt = time.perf_counter() - t0
            decode.setdefault(arm, []).append((shared.decode_seconds - d0) / n)
            if arm != "seqview":                        # (the view's counts of what its sequence holds)
                ctx.n_past = ctx.n_stock = pos + n
            ctx.truncate(len(engine.tokens))            # back to the committed tokens, as the engine left them
            g.close()
            return dt / n

    def generate(i: int) -> float:
        with pool.engine() as (_, engine):
            ctx = engine.contexts["target"]
            g = engine.generate(prompts[i % 4], settings)
            t0, got, d0 = None, 0, 0.0
            for c in g:
                if t0 is None:                          # (after the first cycle: the prompt's pass)
                    t0, d0 = time.perf_counter(), ctx.shared.decode_seconds
                    continue
                got += len(c.committed)
            dt = time.perf_counter() - t0
            decode.setdefault("generate", []).append((ctx.shared.decode_seconds - d0) / got)
            return dt / got

    def answer(i: int) -> float:
        with pool.engine() as (_, engine):
            ctx = engine.contexts["target"]
            with Answer(engine, model, prompts[i % 4], settings) as ans:
                t0, d0 = None, 0.0
                for _ in ans:
                    if t0 is None:
                        t0, d0 = time.perf_counter(), ctx.shared.decode_seconds
                dt = time.perf_counter() - t0
                got = len(ans.tokens) - 1
            decode.setdefault("answer", []).append((ctx.shared.decode_seconds - d0) / got)
            return dt / got

    arms = {"compute": lambda i: raw(i, "compute"), "direct": lambda i: raw(i, "direct"),
            "seqview": lambda i: raw(i, "seqview"), "generate": generate, "answer": answer}
    names = list(arms)
    for f in arms.values():                             # warm-up: every prompt cached and every path run
        for i in range(4):
            f(i)
    decode.clear()
    res: dict[str, list[float]] = {k: [] for k in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            res[k].append(statistics.median(arms[k](i) for i in range(4)) * 1e3)
        print(f"round {r}: " + " ".join(f"{k} {res[k][-1]:.2f}" for k in names), flush=True)
    print(f"\nms per token, medians of {a.rounds} rounds (paired: the median over rounds of arm / compute):")
    for k in names:
        ratio = statistics.median(x / y for x, y in zip(res[k], res["compute"]))
        print(f"  {k:9s} {statistics.median(res[k]):7.3f}   x compute {ratio:.4f}   llama_decode "
              f"{statistics.median(decode[k]) * 1e3:.3f}")
    state.close()


if __name__ == "__main__":
    main()
