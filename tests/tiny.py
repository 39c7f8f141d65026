"""Tiny Qwen2 / Qwen3 Hugging Face checkpoints for tests, a numpy reference forward pass, and F32 GGUFs.

Stable API (runtime tests import it too):
    make_checkpoint(out_dir, arch="qwen2", tied=True, shards=1, mask=True, seed=0, dtype="f32", ...) -> Path
    reference_logits(ckpt_dir, ids) -> np.ndarray [len(ids), vocab_rows]
    tiny_gguf(tmp_dir, **make_checkpoint_kwargs) -> Path   (F32 GGUF)

Checkpoints are written without torch (safetensors written by hand, BF16 rounded to nearest
even), and the reference reads them back with its own reader, independent of convert/.
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a sentence with every letter.",
    "Speculative decoding drafts several tokens and lets a larger model verify them in one pass.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    "for (int i = 0; i < n; ++i) { total += values[i]; }",
    "import numpy as np\nx = np.zeros((4, 4), dtype=np.float32)\n",
    "In 2024, 1,234 people paid $56.78 each; that's 70,069.52 in total.",
    "Question: what is 12 + 30? Answer: 42. Question: and 7 * 6? Also 42.",
    "She said: \"we'll see, they're sure it's done, I'm not, you've been told.\"",
    "Lists:\n- apples\n- oranges\n\t- nested item\n",
    "The proposer guesses a block of masked tokens; the verifier keeps the longest agreeing prefix.",
    "Numbers 0123456789 and versions v1.2.3, 3.14159, 2.71828, 1e-6.",
    "HTML <div class=\"box\">hello</div> and JSON {\"key\": [1, 2, 3]}",
    "Once upon a time there was a small model that wanted to speak faster than it could think.",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z a b c d e f g h i j k l m n o p q r s t u v w x y z",
]
TOKENIZER_SIZE = 320          # BPE + added tokens; embedding rows default to 384 (64 [PAD] rows)

_TOKENIZER = None


def tokenizer():
    """The shared tiny byte-level BPE (trained once per process)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from prove_local.train.tokenizer import train_byte_bpe
        _TOKENIZER = train_byte_bpe(CORPUS * 4, TOKENIZER_SIZE)
    return _TOKENIZER


# ------------------------------------------------------------------ safetensors without torch
_ST_DTYPES = {"f32": ("F32", np.float32), "f16": ("F16", np.float16), "bf16": ("BF16", np.uint16)}


def _to_stored(a: np.ndarray, dtype: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "bf16":                               # round to nearest even
        u = a.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return a.astype(_ST_DTYPES[dtype][1])


def save_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        data = _to_stored(a, dtype).tobytes()
        header[name] = {"dtype": _ST_DTYPES[dtype][0], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for b in blobs:
            f.write(b)


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    blob = Path(path).read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, stop = (8 + n + o for o in meta["data_offsets"])
        raw = np.frombuffer(blob[start:stop], dtype={"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[meta["dtype"]])
        if meta["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float32).reshape(meta["shape"])
    return out


def load_weights(ckpt_dir: Path) -> dict[str, np.ndarray]:
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    weights = {}
    for f in files:
        weights.update(load_safetensors(ckpt_dir / f))
    return weights


# ------------------------------------------------------------------------- checkpoint builder
ARCHS = {  # arch -> (architectures[0], model_type, family)
    "qwen2": ("Qwen2ForCausalLM", "qwen2", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", "qwen3"),
    "a2d-qwen2": ("A2DQwen2LMHeadModel", "a2d-qwen2", "qwen2"),
    "a2d-qwen3": ("A2DQwen3LMHeadModel", "a2d-qwen3", "qwen3"),
}


def make_checkpoint(out_dir, arch: str = "qwen2", tied: bool = True, shards: int = 1, mask: bool = True,
                    seed: int = 0, dtype: str = "f32", hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, head_dim: int | None = None, intermediate: int = 128,
                    vocab_rows: int | None = None) -> Path:
    """Write a random-weight Hugging Face checkpoint (config, tokenizer, safetensors) to `out_dir`.

    qwen2: q/k/v biases. qwen3: q/k norms, and head_dim defaults to 2*hidden/heads so that
    heads*head_dim != hidden. vocab_rows (embedding rows) defaults to 384, 64 more than the tokenizer.
    """
    from prove_local.train.tokenizer import save_hf_tokenizer

    architecture, model_type, family = ARCHS[arch]
    if head_dim is None:
        head_dim = hidden // heads * (2 if family == "qwen3" else 1)
    tok = tokenizer()
    rows = vocab_rows if vocab_rows is not None else 384
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_tokenizer(tok, out, mask_token="<|mask|>" if mask else None)

    rng = np.random.default_rng(seed)

    def w(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / math.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    q, kv = heads * head_dim, kv_heads * head_dim
    t = {"model.embed_tokens.weight": (rng.standard_normal((rows, hidden)) * 0.5).astype(np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = w(q, hidden, scale=2.0)
        t[p + "self_attn.k_proj.weight"] = w(kv, hidden, scale=2.0)
        t[p + "self_attn.v_proj.weight"] = w(kv, hidden)
        if family == "qwen2":
            t[p + "self_attn.q_proj.bias"] = (0.2 * rng.standard_normal(q)).astype(np.float32)
            t[p + "self_attn.k_proj.bias"] = (0.2 * rng.standard_normal(kv)).astype(np.float32)
            t[p + "self_attn.v_proj.bias"] = (0.2 * rng.standard_normal(kv)).astype(np.float32)
        else:
            t[p + "self_attn.q_norm.weight"] = norm(head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        t[p + "self_attn.o_proj.weight"] = w(hidden, q, scale=2.0)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden, scale=2.0)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden, scale=2.0)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate, scale=2.0)
    t["model.norm.weight"] = norm(hidden)
    if not tied:
        t["lm_head.weight"] = w(rows, hidden, scale=6.0)
    # Padding rows past the tokenizer stay zero (untrained), so greedy decoding never picks them.
    n_tok = tok.get_vocab_size()
    t["model.embed_tokens.weight"][n_tok:] = 0.0
    if not tied:
        t["lm_head.weight"][n_tok:] = 0.0

    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": tied,
        "vocab_size": rows,
        "hidden_act": "silu",
        "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "use_sliding_window": False,
    }
    if family == "qwen3":
        config.update(head_dim=head_dim, attention_bias=False)
    (out / "config.json").write_text(json.dumps(config, indent=2))

    names = list(t)
    if shards == 1:
        save_safetensors(out / "model.safetensors", t, dtype)
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: t[n] for n in names[s::shards]}
            save_safetensors(out / fname, part, dtype)
            weight_map.update({n: fname for n in part})
        size = sum(a.size for a in t.values()) * np.dtype(_ST_DTYPES[dtype][1]).itemsize
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": int(size)}, "weight_map": weight_map}, indent=2))
    return out


# --------------------------------------------------------------------------- reference forward
def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def reference_logits(ckpt_dir, ids) -> np.ndarray:
    """float64 numpy forward pass of a tiny checkpoint: logits [len(ids), vocab_rows]."""
    ckpt_dir = Path(ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    W = {k: v.astype(np.float64) for k, v in load_weights(ckpt_dir).items()}
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    ids = np.asarray(ids, dtype=np.int64)
    T = len(ids)

    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]          # [T, 1, hd]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]

    def rope(x):                                                           # NEOX: rotate_half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + np.concatenate([-x2, x1], axis=-1) * sin

    causal = np.triu(np.full((T, T), -np.inf), k=1)
    x = W["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, W[p + "input_layernorm.weight"], eps)
        q = h @ W[p + "self_attn.q_proj.weight"].T + W.get(p + "self_attn.q_proj.bias", 0.0)
        k = h @ W[p + "self_attn.k_proj.weight"].T + W.get(p + "self_attn.k_proj.bias", 0.0)
        v = h @ W[p + "self_attn.v_proj.weight"].T + W.get(p + "self_attn.v_proj.bias", 0.0)
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if p + "self_attn.q_norm.weight" in W:
            q = _rms(q, W[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, W[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        group = nh // nkv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # GQA
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + causal
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(T, nh * hd)
        x = x + attn @ W[p + "self_attn.o_proj.weight"].T
        h = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        gate = h @ W[p + "mlp.gate_proj.weight"].T
        up = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
    x = _rms(x, W["model.norm.weight"], eps)
    head = W["lm_head.weight"] if not cfg.get("tie_word_embeddings") else W["model.embed_tokens.weight"]
    return x @ head.T


def reference_greedy(ckpt_dir, ids, n_new: int) -> list[int]:
    """Greedy continuation with the reference forward (recomputed from scratch each step)."""
    ids = list(ids)
    for _ in range(n_new):
        ids.append(int(np.argmax(reference_logits(ckpt_dir, ids)[-1])))
    return ids


# ---------------------------------------------------------------------------------- GGUF
def tiny_gguf(tmp_dir, *, outtype: str = "f32", role: str | None = None, block_size: int = 16,
              **make_checkpoint_kwargs) -> Path:
    """Make a tiny checkpoint under `tmp_dir` and convert it (F32 by default); returns the GGUF path."""
    from prove_local.convert import convert_checkpoint

    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiny-", dir=tmp_dir))
    ckpt = make_checkpoint(work / "hf", **make_checkpoint_kwargs)
    return convert_checkpoint(ckpt, work / f"model-{outtype}.gguf", outtype=outtype, role=role,
                              block_size=block_size, progress=False)


def checkpoint_of(gguf_path) -> Path:
    """The checkpoint directory a tiny_gguf() file was made from (for reference_logits)."""
    return Path(gguf_path).parent / "hf"


__all__ = ["make_checkpoint", "reference_logits", "reference_greedy", "tiny_gguf", "checkpoint_of",
           "tokenizer", "load_weights", "save_safetensors", "CORPUS"]

