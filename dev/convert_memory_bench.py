"""Peak memory of `convert_checkpoint` on a synthetic multi-GB BF16 sharded checkpoint.

Writes a Qwen2-shaped checkpoint of random BF16 weights (untied, 151,936-row vocabulary so the
embedding and head are single tensors of ~0.6 GB each) into a temporary directory, converts it
in a child process, and prints JSON with the checkpoint size and the child's peak RSS
(getrusage(RUSAGE_CHILDREN).ru_maxrss).

    python dev/convert_memory_bench.py [--size-gb 2.5] [--outtype f16] [--shard-gb 1.0]
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 2048, 16, 2, 5632, 151936


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    hd = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * hd, HIDDEN), p + "self_attn.q_proj.bias": (HEADS * hd,),
            p + "self_attn.k_proj.weight": (KV_HEADS * hd, HIDDEN), p + "self_attn.k_proj.bias": (KV_HEADS * hd,),
            p + "self_attn.v_proj.weight": (KV_HEADS * hd, HIDDEN), p + "self_attn.v_proj.bias": (KV_HEADS * hd,),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * hd),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def write_checkpoint(d: Path, size_gb: float, shard_gb: float) -> int:
    """A BF16 checkpoint of about size_gb, sharded at shard_gb, written chunk by chunk."""
    from prove_local.train.tokenizer import save_hf_tokenizer, train_byte_bpe

    per_layer = sum(math.prod(s) for s in tensor_shapes(1).values()) - 2 * VOCAB * HIDDEN - HIDDEN
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / per_layer))
    shapes = tensor_shapes(layers)

    # a random block of small BF16 values, tiled (the converter does not care about the values)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 22).astype(np.float32) * 0.02).view(np.uint32) >> 16
    block = block.astype(np.uint16)

    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > shard_gb * 1e9:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for n in names:
            nbytes = math.prod(shapes[n]) * 2
            header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[n] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(d / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for n in names:
                left = math.prod(shapes[n])
                while left:
                    chunk = block[: min(left, block.size)]
                    chunk.tofile(f)
                    left -= chunk.size
        total += offset
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": False, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}))
    texts = ["synthetic checkpoint for a memory benchmark", "def f(x):\n    return x * 2\n", "1234 5678"]
    save_hf_tokenizer(train_byte_bpe(texts * 10, 300), d)
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def read_status(pid: int) -> dict[str, int]:
    """RssAnon / RssFile of a running process in kB (Linux /proc; empty elsewhere or once it exits)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines if ":" in line)
            if k in ("RssAnon", "RssFile")}


CHILD = """
import sys, time
from prove_local.convert import convert_checkpoint
t = time.perf_counter()
convert_checkpoint(sys.argv[1], sys.argv[2], outtype=sys.argv[3], progress=False)
print(time.perf_counter() - t)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.5, help="checkpoint size (default 2.5)")
    ap.add_argument("--shard-gb", type=float, default=1.0, help="shard size (default 1.0)")
    ap.add_argument("--outtype", default="f16", help="f16 (default), bf16, f32, q8_0, ...")
    ap.add_argument("--dir", default=None, help="where to put the temporary files (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and output")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="convert-bench-", dir=args.dir))
    try:
        ckpt = work / "hf"
        ckpt.mkdir()
        t = time.perf_counter()
        ckpt_bytes = write_checkpoint(ckpt, args.size_gb, args.shard_gb)
        write_s = time.perf_counter() - t

        env_cmd = [sys.executable, "-c", "import prove_local.convert, numpy, gguf"]          # import-only baseline
        subprocess.run(env_cmd, check=True, cwd=ROOT)
        baseline_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss

        out = work / f"out-{args.outtype}.gguf"
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ckpt), str(out), args.outtype],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sampled = {"RssAnon": 0, "RssFile": 0}
        while proc.poll() is None:          # anonymous vs file-backed (mmap) resident memory
            for key, kb in read_status(proc.pid).items():
                sampled[key] = max(sampled[key], kb)
            time.sleep(0.05)
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            sys.stderr.write(stderr)
            return 1
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        from prove_local.convert.hf import open_weights
        largest = max(t.nbytes for t in open_weights(ckpt).values())
        print(json.dumps({
            "checkpoint_bytes": ckpt_bytes,
            "checkpoint_shards": len(list(ckpt.glob("*.safetensors"))),
            "largest_tensor_bytes": largest,
            "outtype": args.outtype,
            "output_bytes": out.stat().st_size,
            "peak_rss_bytes": peak_kb * 1024,
            "import_baseline_rss_bytes": baseline_kb * 1024,
            "peak_rss_over_checkpoint": round(peak_kb * 1024 / ckpt_bytes, 4),
            "sampled_peak_rss_anon_bytes": sampled["RssAnon"] * 1024,
            "sampled_peak_rss_file_bytes": sampled["RssFile"] * 1024,
            "convert_seconds": round(float(stdout.strip().splitlines()[-1]), 1),
            "write_checkpoint_seconds": round(write_s, 1),
        }, indent=2))
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
