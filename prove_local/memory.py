"""Memory estimate before loading: weights + KV cache + compute buffers, for every context.

Two sources of numbers:
- a GGUF file on disk (`read_gguf_info`): tensor sizes and hyperparameters read from its header;
- a known architecture (`SHAPES`) and a quantization name (`shape_weight_bytes`), for the registry's
  size/memory columns and the README's table, before anything is downloaded.

The KV cache of one context is 2 (K and V) x layers x n_ctx x kv_heads x head_dim x bytes per element.
Compute buffers follow llama.cpp's graph reserve for one micro-batch of `n_batch` rows: the logits
(n_batch x n_vocab floats), the attention scores when flash attention is off (n_batch x n_ctx x heads
floats), and the feed-forward activations. These are estimates (a little high on purpose), not llama.cpp's
own accounting.

`check_fits(paths, n_ctx, kv_type, n_gpu_layers)` raises `WontFit` (a LlamaError, so the CLI prints one
line) when the estimate exceeds the free GPU memory (nvidia-smi) or the available RAM. Set
PROVE_NO_MEMORY_CHECK=1 to skip it.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .llama import LlamaError

GiB = 1024 ** 3
MiB = 1024 ** 2

# bytes per element of the KV cache types the CLI offers (q8_0 / q4_0: blocks of 32 with an f16 scale)
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

# ggml block layouts: type -> (elements per block, bytes per block)
BLOCKS = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q5_0": (32, 22),
          "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}

CUDA_OVERHEAD = 512 * MiB        # CUDA context, cuBLAS workspace and the like, once per process


class WontFit(LlamaError):
    """The models will not fit the memory that is free."""


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


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_type: str = "f16") -> float:
    """K and V of one token in every layer."""
    if kv_type not in KV_BYTES:
        raise ValueError(f"unknown KV cache type {kv_type!r}; choose from {', '.join(KV_BYTES)}")
    return 2 * layers * kv_heads * head_dim * KV_BYTES[kv_type]


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


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_header(path: str | os.PathLike) -> tuple[dict, list[tuple[str, tuple[int, ...], int]]]:
    """Scalar metadata and (name, dims, ggml type) of every tensor, from a GGUF header.

    A direct reader: gguf.GGUFReader builds an object per array element and takes seconds on a
    Qwen vocabulary (152k tokens and merges); this walks arrays without keeping them."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", mm, pos)
            pos += 8 + n
            return bytes(mm[pos - n:pos]).decode("utf-8", "replace")

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype == 8:
                (n,) = struct.unpack_from("<Q", mm, pos)
                pos += 8 + n
            elif vtype == 9:
                etype, count = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if etype in _SCALAR:
                    pos += struct.calcsize(_SCALAR[etype]) * count
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                pos += struct.calcsize(_SCALAR[vtype])

        meta: dict = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", mm, pos)
            pos += 4
            if vtype == 8:
                meta[key] = string()
            elif vtype in _SCALAR:
                (meta[key],) = struct.unpack_from(_SCALAR[vtype], mm, pos)
                pos += struct.calcsize(_SCALAR[vtype])
            else:
                skip(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", mm, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            ttype, _offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors.append((name, tuple(int(d) for d in dims), int(ttype)))
    return meta, tensors


def read_gguf_info(path: str | os.PathLike) -> ModelInfo:
    """Hyperparameters and tensor sizes from a GGUF header (no weights are read)."""
    import gguf

    path = Path(path)
    meta, tensors = read_gguf_header(path)
    arch = meta.get("general.architecture", "")

    def num(key: str, default=None):
        v = meta.get(f"{arch}.{key}")
        return default if v is None else int(v)

    layers = num("block_count", 0)
    hidden = num("embedding_length", 0)
    heads = num("attention.head_count", 1) or 1
    kv_heads = num("attention.head_count_kv", heads)
    head_dim = num("attention.key_length", hidden // heads)
    intermediate = num("feed_forward_length", 4 * hidden)
    layer = [0] * layers
    embd = out = vocab = 0
    for name, dims, ttype in tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        n = math.prod(dims) // block * type_size
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if i < layers:
                layer[i] += n
            else:
                out += n
        elif name == "token_embd.weight":
            embd += n
            vocab = dims[-1]                    # GGUF dims are [row width, rows]
        else:
            out += n
    ftype = meta.get("general.file_type")
    return ModelInfo(path.name, layers, kv_heads, head_dim, heads, hidden, intermediate, vocab, layer, embd, out,
                     file_bytes=path.stat().st_size, file_type=None if ftype is None else int(ftype))


# ---------------------------------------------------------------------------------- estimate
@dataclass
class Part:
    """One model's share of an estimate, in bytes, by device."""
    name: str
    weights_gpu: float = 0
    weights_cpu: float = 0
    kv_gpu: float = 0
    kv_cpu: float = 0
    compute_gpu: float = 0
    compute_cpu: float = 0


@dataclass
class Estimate:
    n_ctx: int
    kv_type: str
    parts: list[Part] = field(default_factory=list)
    gpu_overhead: float = 0

    @property
    def gpu(self) -> float:
        return sum(p.weights_gpu + p.kv_gpu + p.compute_gpu for p in self.parts) + self.gpu_overhead

    @property
    def cpu(self) -> float:
        return sum(p.weights_cpu + p.kv_cpu + p.compute_cpu for p in self.parts)

    @property
    def total(self) -> float:
        return self.gpu + self.cpu

    def _sum(self, what: str) -> float:
        return sum(getattr(p, f"{what}_gpu") + getattr(p, f"{what}_cpu") for p in self.parts)

    def breakdown(self) -> str:
        return (f"weights {gib(self._sum('weights'))}, KV cache {gib(self._sum('kv'))} "
                f"({len(self.parts)} context{'s' if len(self.parts) != 1 else ''} x {self.n_ctx} tokens, "
                f"{self.kv_type}), compute buffers {gib(self._sum('compute'))}"
                + (f", CUDA overhead {gib(self.gpu_overhead)}" if self.gpu_overhead else ""))

    def as_dict(self) -> dict:
        return {"n_ctx": self.n_ctx, "kv_type": self.kv_type, "gpu_bytes": int(self.gpu), "cpu_bytes": int(self.cpu),
                "parts": [vars(p) for p in self.parts]}


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / MiB:.0f} MiB"


def compute_bytes(m: ModelInfo, n_ctx: int, n_batch: int = 512, flash_attn: bool = False) -> float:
    """Compute buffer of one context for one micro-batch of n_batch rows (see the module docstring)."""
    rows = min(n_batch, n_ctx)
    scores = 0 if flash_attn else n_ctx * m.heads
    return 4.0 * rows * (max(m.vocab, scores) + 2 * m.intermediate + 4 * m.hidden)


def estimate(models: list[ModelInfo], n_ctx: int, kv_type: str = "f16", n_gpu_layers: int = 0, *,
             n_batch: int = 512, flash_attn: bool = False, shared: list[bool] | None = None) -> Estimate:
    """Memory by device for one context on each of `models` (weights counted once where shared[i]:
    a model that serves two contexts appears twice, the second time with shared=True).
    n_gpu_layers: 0 CPU only; k offloads the last k layers (llama.cpp's rule), > layers also the
    output head; negative: everything."""
    est = Estimate(n_ctx, kv_type)
    shared = shared or [False] * len(models)
    for m, again in zip(models, shared):
        k = m.layers + 1 if n_gpu_layers < 0 else min(n_gpu_layers, m.layers + 1)
        on_gpu = [i >= m.layers - k for i in range(m.layers)]
        p = Part(m.name)
        if not again:
            p.weights_gpu = sum(b for b, g in zip(m.layer_bytes, on_gpu) if g) + (m.output_bytes if k > m.layers else 0)
            p.weights_cpu = m.weight_bytes - p.weights_gpu
        per_layer_kv = m.kv_bytes_per_token(kv_type) / max(1, m.layers) * n_ctx
        n_gpu = sum(on_gpu)
        p.kv_gpu, p.kv_cpu = per_layer_kv * n_gpu, per_layer_kv * (m.layers - n_gpu)
        c = compute_bytes(m, n_ctx, n_batch, flash_attn)
        if k > 0:
            p.compute_gpu, p.compute_cpu = c, 4.0 * 64 * m.vocab     # host copy of up to 64 rows of logits
        else:
            p.compute_cpu = c
        est.parts.append(p)
    if n_gpu_layers != 0 and models:
        est.gpu_overhead = CUDA_OVERHEAD
    return est


# ------------------------------------------------------------------------------ free memory
def nvidia_smi_rows(fields: str, timeout: float = 20) -> list[list[str]] | None:
    """`nvidia-smi --query-gpu=FIELDS` as one list of stripped values per GPU, or None when
    nvidia-smi is not there or does not answer."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def free_gpu_bytes() -> int | None:
    """Free memory of the visible NVIDIA GPUs together (llama.cpp splits layers across them), or None
    when nvidia-smi is not there or does not answer."""
    rows = nvidia_smi_rows("index,memory.free", timeout=10)
    if rows is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = None
    if visible is not None and all(x.strip().isdigit() for x in visible.split(",") if x.strip()):
        wanted = {int(x) for x in visible.split(",") if x.strip()}
    total, seen = 0, False
    for row in rows:
        try:
            index, free = (int(float(x)) for x in row)
        except ValueError:
            continue
        if wanted is None or index in wanted:
            total += free * MiB
            seen = True
    return total if seen else None


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (free + reclaimable cache), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------------- check
def _gguf_paths(paths) -> list[Path]:
    out = []
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        try:
            with open(p, "rb") as f:
                if f.read(4) != b"GGUF":
                    continue
        except OSError:
            continue            # the loader reports missing or unreadable files with its own message
        out.append(p)
    return out


def _fitting_layers(models, shared, n_ctx, kv_type, n_batch, flash_attn, gpu_free) -> int:
    """The largest n_gpu_layers whose GPU share fits (0 if none)."""
    best = 0
    for k in range(1, max(m.layers for m in models) + 2):
        if estimate(models, n_ctx, kv_type, k, n_batch=n_batch, flash_attn=flash_attn, shared=shared).gpu <= gpu_free:
            best = k
        else:
            break
    return best


def check_fits(paths, n_ctx: int, kv_type: str | None = "f16", n_gpu_layers: int = 0, *, n_batch: int = 512,
               flash_attn: bool = False, gpu_free: int | None = None, ram_free: int | None = None,
               gpu: bool | None = None) -> Estimate | None:
    """Estimate the memory of one context per path (a path given twice: one model, two contexts) and
    raise WontFit with a one-line explanation when it exceeds what is free. Missing or non-GGUF paths
    are skipped (loading reports them). kv_type None: as `prove-local run` chooses, f32 when the first
    model is an all-F32 file, else f16. gpu: whether llama.cpp can offload (default: ask it);
    gpu_free / ram_free override the measured free memory (tests). Returns the estimate, or None
    when the check is switched off (PROVE_NO_MEMORY_CHECK=1)."""
    if os.environ.get("PROVE_NO_MEMORY_CHECK", "") not in ("", "0"):
        return None
    files = _gguf_paths(paths)
    if not files:
        return None
    infos, shared, seen = [], [], {}
    for p in files:
        key = p.resolve()
        if key not in seen:
            seen[key] = read_gguf_info(p)
            shared.append(False)
        else:
            shared.append(True)
        infos.append(seen[key])
    if kv_type is None:
        kv_type = "f32" if infos[0].file_type == 0 else "f16"
    if gpu is None:
        from .llama import gpu_offload_supported
        gpu = gpu_offload_supported()
    ngl = n_gpu_layers if gpu else 0
    est = estimate(infos, n_ctx, kv_type, ngl, n_batch=n_batch, flash_attn=flash_attn, shared=shared)
    hint = "set PROVE_NO_MEMORY_CHECK=1 to load anyway"
    if ngl != 0:
        free = free_gpu_bytes() if gpu_free is None else gpu_free
        if free is not None and est.gpu > free:
            k = _fitting_layers(infos, shared, n_ctx, kv_type, n_batch, flash_attn, free)
            layers = max(m.layers for m in infos)
            raise WontFit(
                f"the models need about {gib(est.gpu)} of GPU memory ({est.breakdown()}), but the GPU has "
                f"{gib(free)} free; use a smaller quantization, a smaller --ctx, --kv-type q8_0, or "
                f"--n-gpu-layers {k} to keep {layers - min(k, layers)} of {layers} layers in RAM ({hint})")
    ram = available_ram_bytes() if ram_free is None else ram_free
    if ram is not None and est.cpu > ram:
        raise WontFit(
            f"the models need about {gib(est.cpu)} of RAM ({est.breakdown()}), but only {gib(ram)} is "
            f"available; use a smaller quantization or a smaller --ctx"
            + (", or offload layers to a GPU with --n-gpu-layers" if gpu and ngl == 0 else "") + f" ({hint})")
    return est
