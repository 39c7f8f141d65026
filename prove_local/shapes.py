"""Model shapes and tensor sizes: known architectures (`SHAPES`), ggml block layouts, the weight and
KV-cache bytes of a model, from a shape and a quantization name or from a GGUF header (`ModelInfo`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1024 ** 3
MiB = 1024 ** 2

# bytes per element of the KV cache types the CLI offers (q8_0 / q4_0: blocks of 32 with an f16 scale)
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

# ggml block layouts: type -> (elements per block, bytes per block)
BLOCKS = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q5_0": (32, 22),
          "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}

@dataclass(frozen=True)
class Shape:
    """The numbers of an architecture that decide its memory."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int                  # embedding rows
    tied: bool
    qk_norm: bool = False       # Qwen3: per-head q/k norms; Qwen2: q/k/v biases

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in _tensor_shapes(self))


# Hugging Face config.json numbers of the models in models.txt
SHAPES = {
    "qwen2.5-0.5b": Shape(24, 896, 14, 2, 64, 4864, 151936, tied=True),
    "qwen2.5-1.5b": Shape(28, 1536, 12, 2, 128, 8960, 151936, tied=True),
    "qwen2.5-3b": Shape(36, 2048, 16, 2, 128, 11008, 151936, tied=True),
    "qwen2.5-7b": Shape(28, 3584, 28, 4, 128, 18944, 152064, tied=False),
    "qwen2.5-14b": Shape(48, 5120, 40, 8, 128, 13824, 152064, tied=False),
    "qwen2.5-32b": Shape(64, 5120, 40, 8, 128, 27648, 152064, tied=False),
    "qwen3-0.6b": Shape(28, 1024, 16, 8, 128, 3072, 151936, tied=True, qk_norm=True),
    "qwen3-1.7b": Shape(28, 2048, 16, 8, 128, 6144, 151936, tied=True, qk_norm=True),
    "qwen3-4b": Shape(36, 2560, 32, 8, 128, 9728, 151936, tied=True, qk_norm=True),
    "qwen3-8b": Shape(36, 4096, 32, 8, 128, 12288, 151936, tied=False, qk_norm=True),
    "qwen3-14b": Shape(40, 5120, 40, 8, 128, 17408, 151936, tied=False, qk_norm=True),
    "qwen3-32b": Shape(64, 5120, 64, 8, 128, 25600, 151936, tied=False, qk_norm=True),
}


def _tensor_shapes(s: Shape):
    """(GGUF name, shape as [rows, row width]) of every tensor, in the converter's order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield "token_embd.weight", (s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (s.hidden,)
        yield p + "attn_q.weight", (q, s.hidden)
        yield p + "attn_k.weight", (kv, s.hidden)
        yield p + "attn_v.weight", (kv, s.hidden)
        if s.qk_norm:
            yield p + "attn_q_norm.weight", (s.head_dim,)
            yield p + "attn_k_norm.weight", (s.head_dim,)
        else:
            yield p + "attn_q.bias", (q,)
            yield p + "attn_k.bias", (kv,)
            yield p + "attn_v.bias", (kv,)
        yield p + "attn_output.weight", (s.hidden, q)
        yield p + "ffn_norm.weight", (s.hidden,)
        yield p + "ffn_gate.weight", (s.intermediate, s.hidden)
        yield p + "ffn_up.weight", (s.intermediate, s.hidden)
        yield p + "ffn_down.weight", (s.hidden, s.intermediate)
    yield "output_norm.weight", (s.hidden,)
    if not s.tied:
        yield "output.weight", (s.vocab, s.hidden)


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get Q6_K in Q4_K_M and Q5_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], quant: str, layers: int, tied: bool) -> str:
    """The ggml type a tensor gets in a file of `quant` (as the converter and llama.cpp's quantizer choose)."""
    if len(shape) == 1:
        return "f32"
    is_head = name == "output.weight" or (tied and name == "token_embd.weight")
    if quant in ("f32", "f16", "bf16", "q8_0"):
        t = quant
    elif quant == "q4_0":
        t = "q8_0" if is_head else "q4_0"
    elif quant in ("q4_k_m", "q5_k_m", "q6_k"):
        base = {"q4_k_m": "q4_k", "q5_k_m": "q5_k", "q6_k": "q6_k"}[quant]
        t = base
        if is_head:
            t = "q6_k"
        elif quant != "q6_k" and (".attn_v." in name or ".ffn_down." in name):
            if _use_more_bits(int(name.split(".")[1]), layers):
                t = "q6_k"
    else:
        raise ValueError(f"unknown quantization {quant!r}")
    if shape[-1] % BLOCKS[t][0]:            # row width does not fit the block: llama.cpp falls back
        t = {"q4_k": "q5_0", "q5_k": "q5_0", "q6_k": "q8_0"}.get(t, "f16")
        if shape[-1] % BLOCKS[t][0]:
            t = "f16"
    return t


def tensor_bytes(shape: tuple[int, ...], ggml_type: str) -> int:
    per, nbytes = BLOCKS[ggml_type]
    return math.prod(shape) // per * nbytes


# --------------------------------------------------------------------------------- model info
@dataclass
class ModelInfo:
    """What the estimate needs to know about one model."""
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    layer_bytes: list[int]          # weights of blk.i
    embd_bytes: int                 # token_embd (stays in RAM: llama.cpp runs the input layer on the CPU)
    output_bytes: int               # output head and final norm (offloaded with n_gpu_layers > layers)
    file_bytes: int = 0
    file_type: int | None = None    # general.file_type (0: all F32)

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embd_bytes + self.output_bytes

    def kv_bytes_per_token(self, kv_type: str = "f16") -> float:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, kv_type)


def kv_pair(kv_type: str, types=KV_BYTES) -> tuple[str, str]:
    """(K type, V type) of a KV cache type as the options give it: one type for both ("q8_0") or K and
    V apart ("q8_0/f16", llama.cpp's -ctk q8_0 -ctv f16). ValueError names a type not in `types`."""
    k, slash, v = str(kv_type).partition("/")
    v = v if slash else k
    for t in (k, v):
        if t not in types:
            raise ValueError(f"{t!r} in {kv_type!r} is not a KV cache type: choose from {', '.join(types)}, "
                             "or K/V apart (e.g. q8_0/f16)")
    return k, v


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_type: str = "f16") -> float:
    """K and V of one token in every layer (`kv_type`: one type, or K/V apart: kv_pair)."""
    k, v = kv_pair(kv_type)
    return layers * kv_heads * head_dim * (KV_BYTES[k] + KV_BYTES[v])


def shape_info(shape: Shape | str, quant: str, name: str | None = None) -> ModelInfo:
    """ModelInfo of a known architecture at a quantization (no file needed)."""
    if isinstance(shape, str):
        name = name or shape
        shape = SHAPES[shape]
    layer = [0] * shape.layers
    embd = out = 0
    for tname, tshape in _tensor_shapes(shape):
        b = tensor_bytes(tshape, tensor_type(tname, tshape, quant, shape.layers, shape.tied))
        if tname.startswith("blk."):
            layer[int(tname.split(".")[1])] += b
        elif tname == "token_embd.weight":
            embd += b
        else:
            out += b
    return ModelInfo(name or "model", shape.layers, shape.kv_heads, shape.head_dim, shape.heads, shape.hidden,
                     shape.intermediate, shape.vocab, layer, embd, out, file_bytes=sum(layer) + embd + out)


def shape_weight_bytes(shape: Shape | str, quant: str) -> int:
    """Approximate size of the GGUF file's tensor data."""
    return shape_info(shape, quant).weight_bytes


