"""What llama.cpp's experimental backend sampling (llama-cpp-python 0.3.36's vendored llama.cpp) gives
for a 16-row verify-style pass, and what it costs on this machine (issue 20; docs/bench.md, "Host cost per
cycle").

    python dev/backend_sampling_probe.py [--vocab 151936] [--rows 16] [--reps 15] [--threads 2]

A sampler chain attached to sequence 0 (`llama_context_params.samplers`, with
`n_outputs_max_per_seq` = rows) runs inside the graph of every pass; per output row i,
`llama_get_sampled_token_ith(ctx, i)` is its token and `llama_get_sampled_{probs,logits,candidates}_ith`
the arrays the chain left (with their counts). For each chain this prints, on random Q8_0 models with
the given vocabulary (scripts/overhead_bench.py's): whether the token (or, for a chain that picks none, the
first candidate) equals the argmax of the same pass's raw logits (a second context without
samplers), the counts per row (what is copied out), whether the raw logits are still written out,
and the median time inside llama_decode against the plain pass.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))   # overhead_bench

import llama_cpp as ll  # noqa: E402

from prove_local.llama import Context  # noqa: E402


def chain(*samplers):
    c = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    for s in samplers:
        ll.llama_sampler_chain_add(c, s)
    return c


CHAINS = {
    "greedy": lambda: chain(ll.llama_sampler_init_greedy()),
    "top_k(1)": lambda: chain(ll.llama_sampler_init_top_k(1)),
    "dist": lambda: chain(ll.llama_sampler_init_dist(1)),
    "top_k(40), temp(0.8), dist": lambda: chain(ll.llama_sampler_init_top_k(40), ll.llama_sampler_init_temp(0.8),
                                                ll.llama_sampler_init_dist(1)),
}


def sampled_context(model, smpl, rows: int, threads: int):
    p = ll.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = 512, 512, 512, 1
    p.n_threads = p.n_threads_batch = threads
    p.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.n_outputs_max_per_seq = rows
    cfg = (ll.llama_sampler_seq_config * 1)()
    cfg[0].seq_id, cfg[0].sampler = 0, ctypes.cast(smpl, ctypes.c_void_p)
    p.samplers, p.n_samplers = cfg, 1
    ctx = ll.llama_init_from_model(model._model, p)
    if not ctx:
        raise SystemExit("llama_init_from_model refused the sampler configuration")
    return ctx, cfg


def decode(ctx, tokens: list[int], start: int, outputs: bool = True) -> float:
    n = len(tokens)
    batch = ll.llama_batch_init(n, 0, 1)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, start + i, 1, int(outputs)
        batch.seq_id[i][0] = 0
    batch.n_tokens = n
    t0 = time.perf_counter()
    rc = ll.llama_decode(ctx, batch)
    dt = time.perf_counter() - t0
    ll.llama_batch_free(batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from overhead_bench import vocab_models
    with tempfile.TemporaryDirectory() as tmp:
        model, _, _ = vocab_models(Path(tmp), a.vocab)
        toks = model.tokenize("Natalia sold clips to 48 of her friends in April, and then")
        feed = (toks * 4)[:a.rows]
        plain = Context(model, n_ctx=512, n_threads=a.threads)
        plain.eval(toks, rows=[])
        times = []
        for _ in range(a.reps):
            plain.truncate(len(toks))
            t0 = plain.decode_seconds
            ref = plain.eval(feed, rows=list(range(a.rows)))
            times.append(plain.decode_seconds - t0)
        base = statistics.median(times)
        print(f"{a.vocab:,}-token vocabulary, {a.rows} output rows, {a.threads} threads; plain pass "
              f"{1e3 * base:.2f} ms inside llama_decode (logits copied out)")
        print("| chain | token = argmax | per row: probs / logits / candidates copied out | raw logits written | pass (ms) |")
        print("|---|---|---|---|---:|")
        for name, make in CHAINS.items():
            smpl = make()
            ctx, cfg = sampled_context(model, smpl, a.rows, a.threads)
            decode(ctx, toks, 0, outputs=False)
            times = []
            for _ in range(a.reps):
                ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), 0, len(toks), -1)
                times.append(decode(ctx, feed, len(toks)))
            got = [ll.llama_get_sampled_token_ith(ctx, i) for i in range(a.rows)]
            if got[0] == ll.LLAMA_TOKEN_NULL:        # no sampler chose a token (top-k only): its best candidate
                got = [ll.llama_get_sampled_candidates_ith(ctx, i)[0] for i in range(a.rows)]
            argmax = ref.argmax(axis=1).tolist()
            counts = {(ll.llama_get_sampled_probs_count_ith(ctx, i), ll.llama_get_sampled_logits_count_ith(ctx, i),
                       ll.llama_get_sampled_candidates_count_ith(ctx, i)) for i in range(a.rows)}
            ptr = ll.llama_get_logits(ctx)           # are the raw logits of this pass still written out?
            raw = bool(ptr) and np.array_equal(np.ctypeslib.as_array(ptr, shape=(a.rows, a.vocab)), ref)
            same = "yes" if got == argmax else f"no ({sum(x == y for x, y in zip(got, argmax))}/{a.rows})"
            if name == "dist":            # the full-vocabulary softmax of the argmax (p̃), if the probs are a whole row
                probs = ll.llama_get_sampled_probs_ith(ctx, 0)
                n = ll.llama_get_sampled_probs_count_ith(ctx, 0)
                if probs and n == a.vocab:
                    row = np.ctypeslib.as_array(probs, shape=(n,))
                    z = np.exp(ref[0].astype(np.float64) - ref[0].max())
                    same += f"; probs[argmax] / p̃ - 1 = {row[argmax[0]] / (1 / z.sum()) - 1:.1e}"
            print(f"| {name} | {same} | {sorted(counts)} | {'yes' if raw else 'no'} | {1e3 * statistics.median(times):.2f} |")
            ll.llama_free(ctx)
            ll.llama_sampler_free(smpl)
            del cfg
        plain.close()
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
