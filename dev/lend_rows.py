"""What lending rows saves a batched pool (batching.Batcher._step: a rule's `eval_view` in a generation
gets a view into llama.cpp's output buffer instead of a copy), at a real vocabulary size.

    python dev/lend_rows.py [--vocab 151936] [--cycles 40] [--rounds 2] [--threads 2] [--clients 1]

Random-weight Qwen2-architecture Q8_0 models with `vocab` tokens (scripts/overhead_bench.py's
vocab_models: the rows, not the answers, are what this measures), an EnginePool of 2 engines on shared
contexts with `clients` requests in flight, per run (`ar`, `lossless` B=16 without lookup drafts) the
host milliseconds per cycle (cycle time outside the request's share of llama_decode, the step's copies
included) with rows lent (the code as it is) and with every row copied (SeqView.eval_view made to
copy, as before the change), rounds interleaved, and whether both gave the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from overhead_bench import cycles_of, vocab_models  # noqa: E402
from prove_local.batching import SeqView  # noqa: E402
from prove_local.loading import Loaded  # noqa: E402
from prove_local.pool import EnginePool  # noqa: E402

RUNS = [("ar", dict(mode="ar", p_tilde=False)), ("lossless B=16", dict(mode="lossless", block=16, lookup=0))]
TEXTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
         "A robe takes 2 bolts of blue fiber and half that much white fiber."]


def cycles(pool: EnginePool, prompt: list[int], n: int, kw: dict) -> list:
    """n cycles of one engine of the pool (overhead_bench.cycles_of on it)."""
    with pool.engine() as (_, engine):
        return cycles_of(engine, prompt, n, **kw)


def measure(pool: EnginePool, prompts: list[list[int]], n: int, kw: dict) -> tuple[float, list]:
    """Host ms per cycle over every client's n cycles, and each client's tokens."""
    got: list = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, cycles(pool, prompts[i], n, kw)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cs = [c for g in got for c in g]
    host = sum(c.seconds - sum(c.decode_seconds.values()) for c in cs)
    return 1e3 * host / len(cs), [[t for c in g for t in c.committed] for g in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=1, choices=(1, 2))
    a = ap.parse_args()
    lend = SeqView.eval_view

    def copy(self, tokens, rows=None, adapter=False):
        return self._eval(tokens, rows, adapter, lend=False)

    with tempfile.TemporaryDirectory() as tmp:
        prop, _, mask = vocab_models(Path(tmp), a.vocab)
        opts = dict(n_ctx=4096, n_threads=a.threads, type_k="f16", type_v="f16", flash_attn="off")
        pool = EnginePool(Loaded(prop, None, None, opts, mask, None), parallel=2)
        prompts = [prop.tokenize(t) for t in TEXTS[:a.clients]]
        try:
            for label, kw in RUNS:
                res: dict[str, list] = {"lent": [], "copied": []}
                tokens = {}
                for _ in range(a.rounds):
                    for name, fn in (("lent", lend), ("copied", copy)):
                        SeqView.eval_view = fn
                        measure(pool, prompts, 4, kw)                  # warm-up
                        ms, toks = measure(pool, prompts, a.cycles, kw)
                        res[name].append(ms)
                        tokens[name] = toks
                SeqView.eval_view = lend
                print(f"{label}, {a.clients} request(s) in flight, {a.vocab:,} tokens: host ms per cycle, rows lent "
                      f"{statistics.median(res['lent']):.3f} ({', '.join(f'{x:.3f}' for x in res['lent'])}), copied "
                      f"{statistics.median(res['copied']):.3f} ({', '.join(f'{x:.3f}' for x in res['copied'])}); "
                      f"same tokens: {tokens['lent'] == tokens['copied']}", flush=True)
        finally:
            SeqView.eval_view = lend
            pool.close()
            prop.close()


if __name__ == "__main__":
    main()
