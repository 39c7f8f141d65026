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

import os
from dataclasses import dataclass, field
from pathlib import Path

from .gguf_info import read_gguf_info
from .llama import LlamaError, default_kv_type, gpu_offload_supported
from .shapes import GiB, MiB, ModelInfo
from .system import available_ram_bytes, free_gpu_bytes

CUDA_OVERHEAD = 512 * MiB        # CUDA context, cuBLAS workspace and the like, once per process


class WontFit(LlamaError):
    """The models will not fit the memory that is free."""


@dataclass
class Offload:
    """A model whose offloaded layers go to explicit devices (RPC servers, then local GPUs):
    `contexts` contexts on it, `n_gpu_layers` as llama.cpp takes it, `devices` [(label, free bytes)]
    (free as `ggml_backend_rpc_get_device_memory` reports it), `split` the share per device
    (None: proportional to free memory, llama.cpp's default)."""
    path: Path
    contexts: int
    n_gpu_layers: int
    devices: list[tuple[str, int]]
    split: list[float] | None = None
    local: list[bool] | None = None        # which devices are this machine's GPUs

    def shares(self) -> list[float]:
        w = list(self.split or [free for _, free in self.devices])
        w += [0.0] * (len(self.devices) - len(w))
        total = sum(w) or 1.0
        return [x / total for x in w]


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
    n_gpu_layers: 0 CPU only; k >= 1 offloads the output head and the last k-1 layers (llama.cpp's
    rule); negative or > layers: everything."""
    est = Estimate(n_ctx, kv_type)
    shared = shared or [False] * len(models)
    for m, again in zip(models, shared):
        k = m.layers + 1 if n_gpu_layers < 0 else min(n_gpu_layers, m.layers + 1)
        # llama.cpp 0.3.36 (load_tensors) offloads the output head first, then the last k-1 layers:
        # its log says "offloading output layer ... offloading k-1 repeating layers" for k <= layers
        on_gpu = [i >= m.layers - (k - 1) for i in range(m.layers)] if k > 0 else [False] * m.layers
        p = Part(m.name)
        if not again:
            p.weights_gpu = sum(b for b, g in zip(m.layer_bytes, on_gpu) if g) + (m.output_bytes if k > 0 else 0)
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



# ----------------------------------------------------------------------------------- check
def _gguf_paths(paths) -> list[Path]:
    out = []
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        if not p.is_file():     # (stat only: opening a FIFO would wait for a writer forever)
            continue            # the loader reports it with its own message
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
               gpu: bool | None = None, offload: Offload | None = None) -> Estimate | None:
    """Estimate the memory of one context per path (a path given twice: one model, two contexts) and
    raise WontFit with a one-line explanation when it exceeds what is free. Missing or non-GGUF paths
    are skipped (loading reports them). kv_type None: as `prove-local run` chooses
    (llama.default_kv_type, by the first model's file type and whether layers go to a GPU). gpu: whether llama.cpp can offload (default: ask it);
    gpu_free / ram_free override the measured free memory (tests). Returns the estimate, or None
    when the check is switched off (PROVE_NO_MEMORY_CHECK=1).
    offload: one more model whose layers go to explicit devices (--rpc): each device's share of its
    offloaded weights and KV cache (plus a compute buffer per context) must fit that device's free
    memory, and what stays local counts against the RAM with the other models."""
    if os.environ.get("PROVE_NO_MEMORY_CHECK", "") not in ("", "0"):
        return None
    files = _gguf_paths(paths)
    offload = offload if offload is not None and _gguf_paths([offload.path]) else None
    if not files:
        if offload is not None:
            _check_ram(Estimate(n_ctx, kv_type or "f16"), _check_offload(offload, n_ctx, kv_type, n_batch, flash_attn),
                       ram_free, False, 0)
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
    if gpu is None:
        gpu = gpu_offload_supported()
    ngl = n_gpu_layers if gpu else 0
    if kv_type is None:
        kv_type = default_kv_type(infos[0].file_type, gpu=ngl != 0, head_dims=(infos[0].head_dim,))
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
                f"--n-gpu-layers {k} to keep {layers - max(0, min(k, layers + 1) - 1)} of {layers} layers in RAM ({hint})")
    remote_cpu = 0.0
    if offload is not None:
        remote_cpu = _check_offload(offload, n_ctx, kv_type, n_batch, flash_attn, est.gpu if ngl != 0 else 0.0)
    _check_ram(est, remote_cpu, ram_free, gpu, ngl)
    return est


def _check_ram(est: Estimate, extra: float, ram_free, gpu: bool, ngl: int) -> None:
    ram = available_ram_bytes() if ram_free is None else ram_free
    need = est.cpu + extra
    if ram is not None and need > ram:
        raise WontFit(
            f"the models need about {gib(need)} of RAM ({est.breakdown()}"
            + (f"; {gib(extra)} of it for the --rpc model's local part" if extra else "") + f"), but only {gib(ram)} is "
            f"available; use a smaller quantization or a smaller --ctx"
            + (", or offload layers to a GPU with --n-gpu-layers" if gpu and ngl == 0 else "")
            + " (set PROVE_NO_MEMORY_CHECK=1 to load anyway)")


def _check_offload(o: Offload, n_ctx: int, kv_type: str | None, n_batch: int, flash_attn: bool,
                   local_gpu_used: float = 0.0) -> float:
    """Check each device's share of an offloaded model (local GPUs: minus what the other models
    put there, `local_gpu_used`); return the bytes that stay in local RAM."""
    info = read_gguf_info(o.path)
    kv = kv_type or default_kv_type(info.file_type, gpu=True, head_dims=(info.head_dim,))
    n = max(1, o.contexts)
    est = estimate([info] * n, n_ctx, kv, o.n_gpu_layers, n_batch=n_batch, flash_attn=flash_attn,
                   shared=[False] + [True] * (n - 1))
    spread = sum(p.weights_gpu + p.kv_gpu for p in est.parts)
    compute = sum(p.compute_gpu for p in est.parts)
    n_local = sum(o.local or []) or 1
    for i, ((label, free), share) in enumerate(zip(o.devices, o.shares())):
        if share == 0:
            continue
        if o.local and o.local[i]:
            free -= local_gpu_used / n_local
        need = spread * share + compute
        if need > free:
            raise WontFit(
                f"{o.path.name}: its share on {label} ({share:.0%} of the offloaded layers) needs about "
                f"{gib(need)}, but that device has {gib(free)} free; shift layers with --tensor-split (order: "
                f"{', '.join(lbl for lbl, _ in o.devices)}), keep layers local with --n-gpu-layers, or add a "
                "server (set PROVE_NO_MEMORY_CHECK=1 to load anyway)")
    return est.cpu
