"""Thin owners of llama.cpp resources (models, contexts), over llama-cpp-python's low-level API.

This is the only module that calls llama.cpp. The decoding rules see a `Context` through
`n_past`, `eval(tokens, rows)` and `truncate(n)`, and `eval_view` (the same rows, without a copy).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import queue
import re
import sys as _sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np

import llama_cpp as ll

from . import hugepages as hugepages_mod
from . import rpc
from .shapes import kv_pair
from .errors import ContextFull, LlamaError  # noqa: F401  (raised here, caught by the front ends)


# llama.cpp logs to stderr by default. Keep the last lines instead, to quote them in errors.
_log_tail: collections.deque[str] = collections.deque(maxlen=20)


@ll.llama_log_callback
def _log_callback(level, text, user_data):  # pragma: no cover - called from C
    line = text.decode("utf-8", "replace").rstrip()
    if line:
        _log_tail.append(line)
        if "model buffer size" in line:        # load_tensors: where the weights went (CPU, RPC0[host:port], CUDA0)
            _buffers.append(line)


_buffers: list[str] = []


_backend_ready = False

# Exact kernels: a batch's rows must be bit for bit the one-token rows, or lossless (and every exact
# mode) parts from ar at near-ties. Two of ggml-cpu's faster paths break that on quantized weights
# (measured with dev/row_equality.py, docs/adapter.md#exact-on-quantized-weights): its weight repacking
# (Q4_0, Q4_K, Q8_0, IQ4_NL repacked into interleaved blocks, a gemm kernel from 4 rows, a gemv below)
# and its tiled K-quant matmul (from 8 rows). Both are off unless PROVE_LOCAL_FAST_KERNELS=1; the
# third, llamafile's sgemm, is compiled out (-DGGML_LLAMAFILE=OFF, set-up command 1).
FAST_KERNELS = os.environ.get("PROVE_LOCAL_FAST_KERNELS", "") == "1"


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        if not os.environ.get("PROVE_LLAMA_LOG"):
            ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
        if not FAST_KERNELS:
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")   # read by ggml-cpu once, at its first matmul
        ll.llama_backend_init()
        _backend_ready = True


class _ComputeThread:
    """The one thread of this process that runs llama_decode (`decode`).

    ggml's CPU backend is an OpenMP build: each thread that calls llama_decode becomes the master of
    an OpenMP team of its own, and the team stays (its workers asleep) while that thread lives. Once
    two live threads have had teams, libgomp manages more threads than there are cores and stops
    spinning at barriers (its "throttled" wait), and ggml meets a barrier after every graph op: on this
    2-core machine a batched step of four one-token passes took 55-151 ms instead of 49 once the main
    thread had decoded one pass (calibration, a solo run) beside the pool's decode thread
    (dev/omp_teams.py; a pool of four `ar` requests: 21 tokens/s instead of 65). So every decode of the
    process goes to this thread, whichever thread asks; the asking thread waits (the hand-off: 28 us
    against a 12-50 ms pass, measured there too)."""

    def __init__(self):
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="prove-local llama", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job[2] = job[0](*job[1])
            except BaseException as e:   # noqa: BLE001 - handed to the caller
                job[3] = e
            finally:
                job[5] = True            # the result is there (read by a waiter an interrupt cut short)
                job[4].release()


_compute: _ComputeThread | None = None
_compute_lock = threading.Lock()


def _decode_now(ctx, batch) -> tuple[int, float]:
    """llama_decode, then llama_synchronize, timed where they run: (code, seconds). llama.cpp returns
    from llama_decode once a GPU backend has the work queued (its computation and the copy of the
    logits finish later, at the first read of an output: "wait for the computation to finish
    (automatically done when obtaining the model output)", llama-context.cpp), so a pass timed around
    llama_decode alone would be the launch, not the pass, and the planner's curve (calibrate.py times
    passes by `decode_seconds`) would be a GPU's launch costs. On a CPU the computation is done when
    llama_decode returns and the synchronize costs nothing measurable."""
    t0 = time.perf_counter()
    rc = ll.llama_decode(ctx, batch)
    if rc == 0:
        ll.llama_synchronize(ctx)
    return rc, time.perf_counter() - t0


def decode_timed(ctx, batch) -> tuple[int, float]:
    """llama_decode(ctx, batch) on the process's compute thread (_ComputeThread), finished on the device
    before it returns (`_decode_now`): its code and the seconds of the pass itself, timed on the compute
    thread, without the wait for other threads' passes queued ahead of it there (a calibration timed
    around that wait, in a process whose pool was decoding, cached SmolLM2's t(1..3) as 55 ms, ~10x).
    The caller's wait cannot be cut short: an interrupt (Ctrl-C) is raised once the decode is over, so
    nothing touches the context while llama.cpp still works on it."""
    return on_compute_thread(_decode_now, ctx, batch)


def decode(ctx, batch) -> int:
    """`decode_timed`'s code alone."""
    return decode_timed(ctx, batch)[0]


def on_compute_thread(fn, *args):
    """fn(*args) on the process's compute thread (_ComputeThread; at once when called there): its result,
    or its exception raised here; the wait cannot be cut short (`decode`). For a caller that runs
    llama.cpp's compute itself (dev/decode_floor.py's C loop) without a second OpenMP team."""
    global _compute
    c = _compute
    if c is None or c.pid != os.getpid():           # first use, or a forked child (threads do not fork)
        with _compute_lock:
            if _compute is None or _compute.pid != os.getpid():
                _compute = _ComputeThread()
            c = _compute
    if threading.current_thread() is c.thread:
        return fn(*args)
    # The wait is a bare lock, which the compute thread releases once the result is in the job, not a
    # threading.Event: an interrupt can strike between an Event's lock and its `with`, leaving the lock
    # held, and then the compute thread's set() and this thread's next wait both block on it for good
    # (a Ctrl-C in the CLI's chat hung it so; tests/test_interrupts.py). A raw acquire either takes the
    # lock or raises; an interrupt just after it took it leaves job[5] set, which ends the loop.
    done = threading.Lock()
    done.acquire()
    job = [fn, args, None, None, done, False]
    c.jobs.put(job)
    interrupted = None
    while not job[5]:
        try:
            done.acquire()
        except BaseException as e:    # noqa: BLE001 - re-raised below, after the decode
            interrupted = e
    if interrupted is not None:
        raise interrupted
    if job[3] is not None:
        raise job[3]
    return job[2]


def _last_log(n: int = 3) -> str:
    errors = [line for line in _log_tail if "error" in line.lower() or "failed" in line.lower()]
    return "; ".join((errors or list(_log_tail))[-n:])


GGML_TYPES = {"f32": ll.GGML_TYPE_F32, "f16": ll.GGML_TYPE_F16, "q8_0": ll.GGML_TYPE_Q8_0,
              "q4_0": ll.GGML_TYPE_Q4_0}
FLASH_ATTN = ("auto", "on", "off")


def rowwise_flash_attn(type_k: str, type_v: str) -> bool:
    """Whether llama.cpp's CPU flash attention computes every query row alike in any pass: only its
    row-wise kernel does, and it takes that one whenever K or V is quantized. Over an F16 (or F32,
    which llama.cpp casts to F16 for it) K and V it has two faster kernels picked by the pass's shape:
    one query of one sequence over >= 512 cells is split over the threads and the parts merged, and
    >= 64 queries are tiled; either rounds differently from the row-wise one (ggml-cpu ops.cpp,
    ggml_compute_forward_flash_attn_ext_f16; dev/row_equality.py --prefix 900)."""
    return not ({type_k, type_v} <= {"f16", "f32"})


QK8_0 = 32        # values per q8_0 block: a q8_0 cache needs head widths it divides


def default_kv_type(file_type, gpu: bool, head_dims=()) -> str:
    """The KV cache type a model gets unless --kv-type says otherwise (one type, or K/V apart:
    shapes.kv_pair). `file_type`: the GGUF's general.file_type (0: all F32); `gpu`: its layers are
    offloaded (a GPU, an RPC server); `head_dims`: its per-head K and V widths (a q8_0 K only where
    QK8_0 divides them, else f16).

    F32 models: f32 (batched and one-token rows agree exactly, flash attention off). On a GPU: f16,
    llama.cpp's default. On a CPU: K q8_0 and V f16 ("q8_0/f16"), so that flash attention can be on
    and exact (`rowwise_flash_attn`: a quantized K takes the row-wise kernel) at close to llama.cpp's
    own speed. SmolLM2-135M Q4_1 on 2 cores: q8_0 for K and V decodes 1.20x faster than F16 with flash
    attention off (98.3 against 81.9 tokens/s, 7 rounds, dev/fa_bench.py) and moves the next-token
    distributions from that reference by a mean KL of 3.6e-3 (llama.cpp's default, F16 with flash
    attention on: 3.1e-3; dev/kv_fidelity.py, docs/run.md); an F16 V then decodes 1.01-1.04x faster
    again 100-450 tokens deep (the kernel accumulates an F16 V as it is, where a q8_0 V is dequantized
    cell by cell), in 1.44x the memory of q8_0 for both and 0.77x F16's."""
    try:
        f32 = int(file_type) == 0
    except (TypeError, ValueError):
        f32 = False
    if f32:
        return "f32"
    return "f16" if gpu or any(d % QK8_0 for d in head_dims) else "q8_0/f16"


def kv_options(kv_type: str) -> dict:
    """A context's type_k and type_v for a KV cache type as the options give it ("q8_0", "q8_0/f16")."""
    try:
        type_k, type_v = kv_pair(kv_type, GGML_TYPES)
    except ValueError as e:
        raise LlamaError(str(e)) from None
    return {"type_k": type_k, "type_v": type_v}


def flash_attn_setting(flash_attn, type_k: str = "f16", type_v: str = "f16", gpu: bool = False) -> str:
    """What a context's flash attention option comes to: "on", "off", or "auto" (llama.cpp's
    LLAMA_FLASH_ATTN_TYPE_AUTO: on where the backend has it for the KV type, as llama.cpp's own
    tools default to). `flash_attn`: "auto" (the default), "on" / True, "off" / False; `gpu`: the
    model's layers are offloaded (to a GPU or an RPC server).

    Under "auto" a CPU model gets "on" where llama.cpp's kernel is exact across pass widths
    (`rowwise_flash_attn`: a quantized K or V, as the default q8_0 cache) and "off" over an F16 or F32
    cache: there a verify pass's rows differ from the one-token rows `ar` reads once the context is
    long (SmolLM2 Q4_1, F16 KV, 900 tokens cached: 0 of 2-16 rows equal, up to 1.1 logits apart;
    dev/row_equality.py --prefix 900), and lossless would leave `ar`'s text at near-ties.
    `--flash-attn on` over F16 takes its speed anyway (1.11-1.21x), exact only below 256 cached
    tokens. On a GPU "auto" is llama.cpp's (off for an F32 cache: slower with it)."""
    if flash_attn is True or flash_attn == "on":
        return "on"
    if flash_attn is False or flash_attn == "off":
        return "off"
    if flash_attn != "auto":
        raise LlamaError(f"flash attention must be one of {', '.join(FLASH_ATTN)}, not {flash_attn!r}")
    if not gpu:
        return "on" if rowwise_flash_attn(type_k, type_v) else "off"
    return "off" if "f32" in (type_k, type_v) else "auto"


def gpu_offload_supported() -> bool:
    """Whether llama.cpp has a local GPU to offload to. Not llama_supports_gpu_offload() alone: a
    build with the RPC backend answers True there on a machine without any GPU."""
    _init_backend()
    return bool(ll.llama_supports_gpu_offload()) and local_gpu_count() > 0


def local_gpu_count() -> int:
    """GPU devices among ggml's registered backends (RPC servers are not registered globally)."""
    _init_backend()
    # by soname: the copies libllama loaded (the wheel ships libggml.so and libggml.so.0 as two files)
    ggml, base = ctypes.CDLL("libggml.so.0"), ctypes.CDLL("libggml-base.so.0")
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype, ggml.ggml_backend_dev_get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    base.ggml_backend_dev_type.restype, base.ggml_backend_dev_type.argtypes = ctypes.c_int, [ctypes.c_void_p]
    base.ggml_backend_dev_name.restype, base.ggml_backend_dev_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    n = 0
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        # enum ggml_backend_dev_type: 1 GPU, 2 IGPU
        n += base.ggml_backend_dev_type(dev) in (1, 2) and not base.ggml_backend_dev_name(dev).startswith(b"RPC")
    return n


def default_threads(model: "Model") -> int:
    """One thread for tiny models: their matrix products are too small to split, and a thread that
    waits at llama.cpp's barriers for a core another process holds stalls every pass (measured here:
    3 tokens/s with 2 threads on a loaded 2-core machine, 2,236 with 1). All cores otherwise."""
    if model.n_params < SMALL_MODEL_PARAMS:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


SMALL_MODEL_PARAMS = 30_000_000


def _rpc_lost(endpoints: list[str]) -> bool:
    """Whether remote buffers must not be freed. True also while the interpreter shuts down (the
    rpc module may be gone): leaking at exit is harmless, writing to a dead server aborts."""
    rpc = _sys.modules.get("prove_local.rpc")
    return rpc is None or rpc.lost(endpoints)


class Model:
    """Weights, vocabulary and metadata of one GGUF file. Serves any number of contexts."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, *, devices: list | None = None,
                 tensor_split: list[float] | None = None, hugepages: str = "auto"):
        """devices: ggml backend devices to offload to, in order (RPC servers' devices from
        prove_local.rpc, local GPUs); None: every local GPU (llama.cpp's default). tensor_split:
        the share of the offloaded layers per device (default: proportional to their free memory).
        hugepages: "auto", "on" or "off": the weights on 2 MiB pages instead of the file's mapping
        (hugepages.choose; `self.hugepages` says what was done and why)."""
        self.path = Path(path)
        self.n_gpu_layers = n_gpu_layers
        if not self.path.is_file():
            raise LlamaError(f"{self.path}: no such model file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise LlamaError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        _init_backend()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = FAST_KERNELS          # no CPU weight repacking (exact kernels, above)
        self.devices = list(devices or [])
        # the RPC servers this model's layers live on: checked before every pass (prove_local.rpc)
        self.endpoints = sorted({d.endpoint for d in self.devices if getattr(d, "endpoint", None)})
        if devices:
            # a NULL-terminated ggml_backend_dev_t array; kept alive with the model
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*[d.ptr for d in devices], None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if tensor_split:
            if len(tensor_split) > ll.LLAMA_MAX_DEVICES:
                raise LlamaError(f"--tensor-split has {len(tensor_split)} values; llama.cpp takes at most {ll.LLAMA_MAX_DEVICES}")
            self._split = (ctypes.c_float * ll.LLAMA_MAX_DEVICES)(*tensor_split)
            params.tensor_split = self._split
        _log_tail.clear()
        _buffers.clear()
        size = self.path.stat().st_size
        huge, why = hugepages_mod.choose(hugepages, size, n_gpu_layers == 0 and not devices)
        load = hugepages_mod.Load(size) if huge else None
        if load:    # read into llama.cpp's own buffer (its --no-mmap), advised before the first tensor is read
            params.load_mode = ll.LLAMA_LOAD_MODE_NONE
            params.progress_callback = ll.llama_progress_callback(load.progress)
        with load or contextlib.nullcontext():
            self._model = ll.llama_model_load_from_file(str(self.path).encode(), params)
        if load and load.interrupted:       # Ctrl-C during the load (Load.progress cancelled it)
            if self._model:
                ll.llama_model_free(self._model)
                self._model = None
            raise KeyboardInterrupt
        if load:
            why += f": {load.mib:.0f} MiB of the load's memory on huge pages{hugepages_mod.explain(load.error)}"
        # whether the weights were read onto advised anonymous memory, how much of what the load
        # allocated is on huge pages now (the weights and llama.cpp's other buffers), and why (one line)
        self.hugepages = {"on": huge, "mib": load.mib if load else 0.0, "why": why}
        if not self._model:
            raise LlamaError(f"{self.path}: llama.cpp could not load this model ({_last_log() or 'no reason given'})")
        # {buffer name: MiB of weights}, e.g. {"CPU_Mapped": 0.1, "RPC0[10.0.0.2:50052]": 9300.0}
        # (from llama.cpp's log; empty when PROVE_LLAMA_LOG sends the log to stderr instead)
        self.placement = {m.group(1): float(m.group(2)) for m in
                          (re.search(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", b) for b in _buffers) if m}
        self._vocab_ptr = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = ll.llama_model_n_ctx_train(self._model)
        self.n_params = ll.llama_model_n_params(self._model)
        self._eog = np.array([bool(ll.llama_vocab_is_eog(self._vocab, i)) for i in range(self.n_vocab)])
        self._pieces: list[bytes] | None = None
        # what lives on this model and must be freed before it (llama-cpp-python's _internals keeps
        # the same order with an exit stack): contexts first, then adapters
        self._dependents: list = []

    # --- metadata -------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the key is missing (arrays are not readable)."""
        buf = ctypes.create_string_buffer(4096)
        n = ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    @property
    def head_dims(self) -> tuple[int, int]:
        """Per-head K and V widths: `{arch}.attention.key_length` / `value_length`, else n_embd / n_head."""
        arch = self.meta("general.architecture") or ""
        d = ll.llama_model_n_embd(self._model) // max(1, ll.llama_model_n_head(self._model))
        k, v = self.meta(f"{arch}.attention.key_length"), self.meta(f"{arch}.attention.value_length")
        return (int(k) if k else d, int(v) if v else (int(k) if k else d))

    @property
    def default_kv_type(self) -> str:
        """The KV cache type this model gets unless one is asked for (`default_kv_type`)."""
        return default_kv_type(self.meta("general.file_type"), gpu=self.n_gpu_layers != 0, head_dims=self.head_dims)

    @property
    def mask_token(self) -> int | None:
        """The MARS placeholder id: `prove.mask_token_id`, else the vocabulary's mask token."""
        value = self.meta("prove.mask_token_id")
        token = int(value) if value is not None else ll.llama_vocab_mask(self._vocab)
        return token if 0 <= token < self.n_vocab else None

    @property
    def block_size(self) -> int | None:
        value = self.meta("prove.block_size")
        return int(value) if value is not None else None

    @property
    def role(self) -> str | None:
        return self.meta("prove.role")

    @property
    def chat_template(self) -> str | None:
        t = ll.llama_model_chat_template(self._model, None)
        return t.decode("utf-8") if t else None

    # --- vocabulary -----------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (control tokens render empty unless `special`)."""
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def special_text(self, which: str) -> str:
        """Text of the "bos" or "eos" token ('' when the vocabulary has none)."""
        tok = {"bos": ll.llama_vocab_bos, "eos": ll.llama_vocab_eos}[which](self._vocab)
        return self.piece(tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""

    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token])

    def token_unused(self, token: int) -> bool:
        return bool(ll.llama_vocab_get_attr(self._vocab, token) & ll.LLAMA_TOKEN_ATTR_UNUSED)

    def check_same_vocab(self, other: "Model") -> None:
        """Raise unless `other` tokenizes like this model (padding rows beyond the shorter vocab
        must be unused, as with Qwen2.5 0.5B's 151,936 rows next to 7B's 152,064)."""
        n = min(self.n_vocab, other.n_vocab)
        for i in range(n):
            if self.piece(i, True) != other.piece(i, True):
                raise LlamaError(
                    f"{other.path}: vocabulary differs from {self.path} at token {i} "
                    f"({other.piece(i, True)!r} vs {self.piece(i, True)!r}); a verifier or draft "
                    "must share the target's tokenizer")
        longer = self if self.n_vocab > n else other
        for i in range(n, longer.n_vocab):
            if not longer.token_unused(i):
                raise LlamaError(f"{longer.path}: token {i} ({longer.piece(i, True)!r}) is not in "
                                 f"the other model's {n}-token vocabulary")

    @property
    def arch(self) -> str | None:
        return self.meta("general.architecture")

    @property
    def _vocab(self):
        """The vocabulary, for llama.cpp's calls; after close() an error instead of a freed pointer."""
        if getattr(self, "_model", None) is None:
            raise LlamaError(f"{self.path}: the model is closed")
        return self._vocab_ptr

    def _own(self, resource) -> None:
        """Register a context or adapter, closed (newest first) before this model is freed. Held by
        weak reference: a context nobody holds is still freed when it is dropped."""
        self._dependents.append(weakref.ref(resource))

    def _disown(self, resource) -> None:
        self._dependents[:] = [r for r in getattr(self, "_dependents", ()) if r() is not None and r() is not resource]

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the weights, after every context and adapter made on them."""
        for ref in reversed(list(getattr(self, "_dependents", ()))):
            if (resource := ref()) is not None:
                resource.close()
        if getattr(self, "_model", None):
            if self.endpoints and _rpc_lost(self.endpoints):
                self._model = None      # its buffers are on a lost server: freeing them would abort
                return
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()

class Adapter:
    """A LoRA adapter (llama.cpp's GGUF adapter format) loaded for one model.

    A MARS adapter (prove-local's gated proposal adapter, prove_local/train/adapter.py) also names
    the placeholder token it was trained with (`prove.mask_token_id`, an unused special token of the
    base vocabulary) and the block it was trained at (`prove.block_size`). The adapter is switched on
    per pass (`Context.eval_view(..., adapter=True)`): the base model's own passes stay stock."""

    def __init__(self, model: Model, path: str | os.PathLike, scale: float = 1.0):
        self.model, self.path, self.scale = model, Path(path), float(scale)
        self._adapter = None
        if not self.path.is_file():
            raise LlamaError(f"{self.path}: no such adapter file")
        meta = _gguf_kv(self.path)
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise LlamaError(f"{self.path}: not a LoRA adapter (general.type={meta.get('general.type')!r}, "
                             f"adapter.type={meta.get('adapter.type')!r}; expected 'adapter' and 'lora')")
        if meta.get("general.architecture") != model.arch:
            raise LlamaError(f"{self.path}: an adapter for a {meta.get('general.architecture')!r} model; "
                             f"{model.path} is {model.arch!r}")
        for key in ("embedding_length", "block_count"):
            want, have = meta.get(f"prove.base.{key}"), model.meta(f"{model.arch}.{key}")
            if want is not None and have is not None and int(want) != int(have):
                raise LlamaError(f"{self.path}: trained for a base with {key} {want}; {model.path} has {have}")
        if meta.get("prove.base.n_vocab") is not None and int(meta["prove.base.n_vocab"]) != model.n_vocab:
            raise LlamaError(f"{self.path}: trained for a {meta['prove.base.n_vocab']}-token vocabulary; "
                             f"{model.path} has {model.n_vocab}")
        self.mask_token = int(meta["prove.mask_token_id"]) if "prove.mask_token_id" in meta else None
        if self.mask_token is not None and not 0 <= self.mask_token < model.n_vocab:
            raise LlamaError(f"{self.path}: mask token id {self.mask_token} is outside {model.path}'s vocabulary")
        self.block_size = int(meta["prove.block_size"]) if "prove.block_size" in meta else None
        _log_tail.clear()
        self._adapter = ll.llama_adapter_lora_init(model._model, str(self.path).encode())
        if not self._adapter:
            raise LlamaError(f"{self.path}: llama.cpp could not load this adapter for {model.path} "
                             f"({_last_log() or 'no reason given'})")
        self._list = (ll.llama_adapter_lora_p_ctypes * 1)(self._adapter)
        self._scales = (ctypes.c_float * 1)(self.scale)
        model._own(self)

    def close(self) -> None:
        if getattr(self, "_adapter", None):
            if getattr(self.model, "_model", None):   # (freed with its model otherwise)
                ll.llama_adapter_lora_free(self._adapter)
            self._adapter = None
            self.model._disown(self)

    def __del__(self):
        self.close()


def _gguf_kv(path: Path) -> dict:
    """The scalar metadata of a GGUF file (gguf-py; arrays are skipped), or LlamaError naming the file."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise LlamaError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    out = {}
    for key, field in reader.fields.items():
        if len(field.types) == 1 and field.types[0] != gguf.GGUFValueType.ARRAY:
            try:
                out[key] = field.contents()
            except Exception:       # pragma: no cover - a field gguf-py cannot decode
                pass
    return out


class Context:
    """One KV cache (sequence 0) on a model: `n_past` tokens evaluated so far.

    `eval` appends tokens at `n_past` and returns the logits of the requested rows (`eval_view`:
    the same rows without a copy, valid until the next pass); `truncate(n)` drops the KV cells at
    positions >= n.
    """

    def __init__(self, model: Model, n_ctx: int = 4096, n_threads: int | None = None,
                 n_batch: int = 512, flash_attn: bool | str = "auto", type_k: str = "f16", type_v: str = "f16",
                 adapter: "Adapter | None" = None, n_seq: int = 1):
        """adapter: a gated MARS adapter (Adapter) on the same model: on only for the passes that
        ask for it (`eval_view(..., adapter=True)`, the MARS proposal pass), off for every other.
        flash_attn: "auto" (default), "on" or "off" (True / False too): `flash_attn_setting`."""
        self.model = model
        if adapter is not None and adapter.model is not model:
            raise LlamaError(f"{adapter.path}: loaded for {adapter.model.path}, not for {model.path}")
        self.adapter = adapter
        self._adapter_on = False
        params = ll.llama_context_default_params()
        # n_seq > 1: a context of n_seq sequences, each with its own KV cells of n_ctx tokens (llama.cpp
        # divides n_ctx by n_seq_max when kv_unified is off), decoded together by `decode_batch`
        # (batching.py gives each sequence the interface of a one-sequence context)
        self.n_seq = max(1, int(n_seq))
        params.n_ctx = n_ctx * self.n_seq
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = self.n_seq
        if self.n_seq > 1:
            params.kv_unified = False    # a KV stream per sequence: attention reads its own cells only
        threads = n_threads or default_threads(model)
        params.n_threads = params.n_threads_batch = threads
        self.flash_attn = flash_attn_setting(flash_attn, type_k, type_v, gpu=model.n_gpu_layers != 0)
        if self.n_seq > 1 and self.flash_attn == "auto":
            # several sequences (batching.py) on a GPU: off unless asked for. Its kernels are picked by the
            # batch's shape as the CPU's fast ones are (`rowwise_flash_attn`), so a sequence's rows could
            # depend in the last bits on which others share its decodes; unmeasured here, so not assumed
            self.flash_attn = "off"
        params.flash_attn_type = {"on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                                  "auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO}[self.flash_attn]
        try:
            params.type_k, params.type_v = GGML_TYPES[type_k], GGML_TYPES[type_v]
        except KeyError as e:
            raise LlamaError(f"unknown KV cache type {e.args[0]!r}; choose from {sorted(GGML_TYPES)}") from None
        params.no_perf = True
        _log_tail.clear()
        self._ctx = ll.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise LlamaError(f"{model.path}: could not create a context of {n_ctx} tokens"
                             f"{f' x {self.n_seq} sequences' if self.n_seq > 1 else ''} ({_last_log()})")
        self._mem = ll.llama_get_memory(self._ctx)
        # llama.cpp rounds the cache up (to 256 cells) and clamps n_batch to the n_ctx asked for
        self.n_ctx = min(n_ctx, ll.llama_n_ctx(self._ctx) if self.n_seq == 1 else ll.llama_n_ctx_seq(self._ctx))
        self.n_batch = ll.llama_n_batch(self._ctx)
        self.n_vocab = model.n_vocab
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        # numpy views of the batch arrays: filled by slices, not token by token through ctypes
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._positions = np.arange(self.n_ctx + self.n_batch, dtype=self._pos.dtype)
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.n_batch,))[:] = 1
        for i in range(self.n_batch):
            self._batch.seq_id[i][0] = 0
        self._seqs = np.zeros(self.n_batch, dtype=np.int32)   # the sequence id each batch slot holds now
        self.n_threads = threads
        self.n_past = 0
        self.n_decode = 0          # llama_decode calls, i.e. forward passes
        self.decode_seconds = 0.0  # time spent inside llama_decode
        self._view: tuple[int, np.ndarray] | None = None   # (buffer address, array over it)
        # positions [0, n_stock) were written with the adapter off (the stock model's KV); an adapter
        # pass that keeps its positions (the lossy modes' proposal passes) lowers it
        self.n_stock = 0
        self.prompt_cache = None   # a pool's saved prompt states (batching.PromptCache; Engine._cached_prefix)
        model._own(self)

    @property
    def gated(self) -> bool:
        """Whether this context's MARS proposals come from a gated adapter: the proposal pass runs
        with the adapter on, and every position it writes must be removed after it (rules.py)."""
        return self.adapter is not None

    def _use_adapter(self, on: bool) -> None:
        if on and self.adapter is None:
            raise LlamaError(f"{self.model.path}: an adapter pass on a context without an adapter")
        if on != self._adapter_on:
            a = self.adapter
            rc = ll.llama_set_adapters_lora(self._ctx, a._list if on else None, 1 if on else 0,
                                            a._scales if on else None)
            if rc != 0:
                raise LlamaError(f"{a.path}: llama_set_adapters_lora failed with code {rc}")
            self._adapter_on = on

    def eval(self, tokens: list[int], rows: list[int] | None = None, adapter: bool = False) -> np.ndarray:
        """Append `tokens` at `n_past`; return float32 logits [len(rows), n_vocab] for the
        requested rows (indices into `tokens`; default: the last one), a copy the caller owns.
        One decode per `n_batch` tokens. `adapter`: with the context's adapter on for this pass."""
        return self._eval(tokens, rows, copy=True, adapter=adapter)

    def eval_view(self, tokens: list[int], rows: list[int] | None = None, adapter: bool = False) -> np.ndarray:
        """As `eval`, but the rows are a view into llama.cpp's output buffer (not to be written to) where they
        are all in it (ascending rows of the last `n_batch` chunk; a copy otherwise): valid until
        this context's next pass. The decoding rules read rows this way (a 152k-token row is 600 kB
        to copy, and a rule needs two numbers from it)."""
        return self._eval(tokens, rows, copy=False, adapter=adapter)

    def _eval(self, tokens: list[int], rows: list[int] | None, copy: bool, adapter: bool = False) -> np.ndarray:
        if not getattr(self, "_ctx", None):
            raise LlamaError(f"{self.model.path}: this context is closed")
        if rows is None:
            rows = [len(tokens) - 1] if tokens else []
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFull(f"{self.n_past} + {len(tokens)} tokens do not fit the {self.n_ctx}-token context")
        last = (len(tokens) - 1) // self.n_batch * self.n_batch if tokens else 0
        ordered = all(a < b for a, b in zip(rows, rows[1:]))
        # a view needs every row in the last chunk's outputs, in batch order
        view = not copy and ordered and (not rows or rows[0] >= last)
        out = None if view else np.empty((len(rows), self.n_vocab), dtype=np.float32)
        if self.model.endpoints:        # a server that went away: one line, before ggml aborts on it
            rpc.check(self.model.endpoints)
        if adapter or self._adapter_on:
            self._use_adapter(adapter)
        if adapter:
            self.n_stock = min(self.n_stock, self.n_past)
        elif self.n_stock == self.n_past:
            self.n_stock += len(tokens)
        if len(tokens) <= self.n_batch:   # one chunk (every pass of a cycle): fill the batch directly
            chunks = [(0, len(tokens), len(rows))]
            self._out[:len(tokens)] = 0
            self._out[rows] = 1
        else:
            wanted = np.zeros(len(tokens), dtype=np.int8)
            wanted[rows] = 1
            chunks = [(s, min(self.n_batch, len(tokens) - s), None) for s in range(0, len(tokens), self.n_batch)]
        done = 0
        for start, n, n_rows in chunks:
            self._batch.n_tokens = n
            self._tok[:n] = tokens[start:start + n]
            self._pos[:n] = self._positions[self.n_past:self.n_past + n]
            if n_rows is None:
                self._out[:n] = wanted[start:start + n]
                n_rows = int(wanted[start:start + n].sum())
            rc, seconds = decode_timed(self._ctx, self._batch)
            self.decode_seconds += seconds
            self.n_decode += 1
            if rc != 0:
                # a failed decode leaves the cache as it was before this chunk
                raise LlamaError(f"llama_decode failed with code {rc} at position {self.n_past} "
                                 f"({'no KV slot' if rc == 1 else _last_log()})")
            self.n_past += n
            if n_rows and out is not None:
                out[done:done + n_rows] = self._logits_view(n_rows)
                done += n_rows
        if out is None:
            return self._logits_view(len(rows))
        if not ordered:          # rows come back in batch order
            out = out[np.argsort(np.argsort(rows))]
        return out

    def _logits_view(self, n_rows: int) -> np.ndarray:
        """The first n_rows rows of llama.cpp's logits buffer, without a copy (not to be written to:
        it is not marked read-only because numpy's argmax copies a read-only array first, which
        costs more than the argmax). The array over the buffer is kept while the buffer stays where
        it is (llama.cpp reallocates it only to grow it), so a pass does not pay for building one."""
        if n_rows == 0:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        ptr = ll.llama_get_logits(self._ctx)
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        cached = self._view
        if cached is None or cached[0] != addr or cached[1].shape[0] < n_rows:
            arr = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))
            self._view = cached = (addr, arr)
        return cached[1][:n_rows]

    def decode_batch(self, passes: list, adapter: bool = False, views=None) -> list[np.ndarray]:
        """One `llama_decode` of several sequences' passes (a context made with n_seq > 1; batching.py
        drives it). `passes`: (seq, pos, tokens, rows) each, ascending by seq, every seq at most once:
        `tokens` appended to sequence `seq` at positions pos.., logits wanted for `rows` (indices into
        `tokens`). `adapter`: the context's adapter on for this decode (it is per context, so passes
        that want it and passes that do not go in separate decodes). Returns each pass's rows as float32
        [len(rows), n_vocab]: a copy its caller owns (the next decode overwrites llama.cpp's buffer,
        whoever asks for it), or, for a pass whose entry in `views` is true and whose rows are in batch
        order, a view into that buffer (as `eval_view`'s: not to be written to, valid until this context's
        next decode; the caller sees to it that none comes first). On failure every sequence is cut
        back to its pos (llama.cpp keeps what the decode's earlier ubatches wrote) and LlamaError says why."""
        if not getattr(self, "_ctx", None):
            raise LlamaError(f"{self.model.path}: this context is closed")
        n = sum(len(t) for _, _, t, _ in passes)
        if not 0 < n <= self.n_batch:
            raise LlamaError(f"a batch of {n} tokens; this context decodes 1..{self.n_batch} at once")
        if self.model.endpoints:
            rpc.check(self.model.endpoints)
        wanted, i = [], 0
        for seq, pos, tokens, rows in passes:
            k = len(tokens)
            if not 0 <= seq < self.n_seq or pos + k > self.n_ctx:
                raise LlamaError(f"sequence {seq} positions {pos}..{pos + k - 1}: outside this context's "
                                 f"{self.n_seq} sequences of {self.n_ctx} tokens")
            self._tok[i:i + k] = tokens
            self._pos[i:i + k] = self._positions[pos:pos + k]
            if k == 1:                    # (a one-token pass, the common one: no array operations)
                if self._seqs[i] != seq:
                    self._batch.seq_id[i][0] = seq
                    self._seqs[i] = seq
            else:
                for j in np.flatnonzero(self._seqs[i:i + k] != seq):   # (ctypes writes only where the layout changed)
                    self._batch.seq_id[i + j][0] = seq
                self._seqs[i:i + k] = seq
            self._out[i:i + k] = 0
            u = np.asarray(rows, dtype=np.int64)
            if len(u) > 1:
                u = np.unique(u)
            if len(u) and (u[0] < 0 or u[-1] >= k):
                raise LlamaError(f"rows {list(rows)} outside a pass of {k} tokens")
            self._out[i + u] = 1
            wanted.append(u)
            i += k
        self._batch.n_tokens = n
        if adapter or self._adapter_on:
            self._use_adapter(adapter)
        rc, seconds = decode_timed(self._ctx, self._batch)
        self.decode_seconds += seconds
        self.n_decode += 1
        if rc != 0:
            why = "no KV slot" if rc == 1 else _last_log()
            for seq, pos, _, _ in passes:
                ll.llama_memory_seq_rm(self._mem, seq, pos, -1)
            raise LlamaError(f"llama_decode failed with code {rc} for sequences "
                             f"{', '.join(str(p[0]) for p in passes)} ({why})")
        logits = self._logits_view(sum(len(u) for u in wanted))
        out, r = [], 0
        for k, ((_, _, _, rows), u) in enumerate(zip(passes, wanted)):
            block = logits[r:r + len(u)]
            r += len(u)
            same = len(rows) == len(u) and (len(u) == 1 or all(int(a) == int(b) for a, b in zip(rows, u)))
            if not same:                  # (rows out of order or repeated: fancy indexing, a copy)
                out.append(block[np.searchsorted(u, np.asarray(rows, dtype=np.int64))])
            else:
                out.append(block if views is not None and views[k] else block.copy())
        return out

    def drop(self, seq: int, p0: int) -> None:
        """Remove positions p0.. of sequence `seq` (a context made with n_seq > 1; `truncate` is sequence 0's)."""
        if not getattr(self, "_ctx", None):
            return
        if not ll.llama_memory_seq_rm(self._mem, seq, p0, -1):
            raise LlamaError(f"llama_memory_seq_rm refused to drop positions {p0}.. of sequence {seq} (recurrent model?)")

    def seq_state(self, seq: int, limit: int | None = None) -> bytes | None:
        """Sequence `seq`'s KV cells as llama.cpp serializes them (`llama_state_seq_get_data`): what
        `set_seq_state` writes back, byte for byte, into any sequence of a context of the same model
        and cache types (batching.PromptCache); None when that is more than `limit` bytes."""
        n = ll.llama_state_seq_get_size(self._ctx, seq)
        if limit is not None and n > limit:
            return None
        buf = (ctypes.c_uint8 * n)()
        got = ll.llama_state_seq_get_data(self._ctx, buf, n, seq)
        if got != n:
            raise LlamaError(f"{self.model.path}: llama_state_seq_get_data wrote {got} of {n} bytes for sequence {seq}")
        return bytes(buf)

    def state(self, limit: int | None = None) -> bytes | None:
        """This context's KV state (sequence 0: seq_state; batching.PromptCache.keep)."""
        return self.seq_state(0, limit=limit)

    def set_state(self, data: bytes, n: int) -> None:
        """Replace the KV with a `state()` of n positions (batching.PromptCache.fill); empty on failure."""
        self.n_past = self.n_stock = 0
        self.set_seq_state(0, data)
        self.n_past = self.n_stock = n

    def set_seq_state(self, seq: int, data: bytes) -> None:
        """Replace sequence `seq`'s KV cells with a `seq_state` (`llama_state_seq_set_data`)."""
        self.drop(seq, 0)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if ll.llama_state_seq_set_data(self._ctx, buf, len(data), seq) != len(data):
            self.drop(seq, 0)
            raise LlamaError(f"{self.model.path}: llama_state_seq_set_data refused a {len(data)}-byte state "
                             f"for sequence {seq} ({_last_log()})")

    def set_threads(self, n: int) -> None:
        """Change the CPU threads of later passes (the planner's thread re-check, calibrate.py)."""
        ll.llama_set_n_threads(self._ctx, n, n)
        self.n_threads = n

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of the KV cache, drop the rest (`llama_memory_seq_rm`). A closed context
        holds nothing: there is nothing to drop (an engine's clean-up after its models were closed)."""
        if not getattr(self, "_ctx", None):
            return
        if n < 0 or n > self.n_past:
            raise LlamaError(f"cannot truncate a context of {self.n_past} tokens to {n}")
        if not ll.llama_memory_seq_rm(self._mem, 0, n, -1):
            raise LlamaError(f"llama_memory_seq_rm refused to drop positions {n}.. (recurrent model?)")
        self.n_past = n
        self.n_stock = min(self.n_stock, n)

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            ll.llama_batch_free(self._batch)
            if not (self.model.endpoints and _rpc_lost(self.model.endpoints)):   # see Model.close
                ll.llama_free(self._ctx)
            self._ctx = None
            self.model._disown(self)

    def __del__(self):
        self.close()


def greedy_batched(model: Model, prompts: list[list[int]], max_new: int, *, n_seq: int = 8,
                   n_threads: int | None = None, n_batch: int = 1024):
    """Greedy continuations of many prompts, `n_seq` sequences at a time in one context: every step
    feeds each active sequence's next token, and the prompts of newly admitted ones, in one
    `llama_decode` (continuous batching, as llama-server's slots). Yields (prompt index,
    continuation) as each finishes: at its first end-of-generation token (kept) or at `max_new`.
    For data generation (train/adapter.py): a batch's rows may differ from a lone sequence's in the
    last bits, as llama.cpp's batched evaluation does."""
    if not prompts:
        return
    longest = max(len(p) for p in prompts) + max_new
    if longest > n_batch:
        raise LlamaError(f"a prompt of {longest - max_new} tokens + {max_new} new does not fit a {n_batch}-token batch")
    _init_backend()
    params = ll.llama_context_default_params()
    params.n_ctx = n_seq * longest
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = n_seq
    params.kv_unified = False        # a stream per sequence: attention reads its own cells, not every slot's
    params.n_threads = params.n_threads_batch = n_threads or default_threads(model)
    params.no_perf = True
    ctx = ll.llama_init_from_model(model._model, params)
    if not ctx:
        raise LlamaError(f"{model.path}: could not create a {n_seq}-sequence context ({_last_log()})")
    mem = ll.llama_get_memory(ctx)
    batch = ll.llama_batch_init(n_batch, 0, 1)
    queue = collections.deque(enumerate(prompts))
    free = list(range(n_seq - 1, -1, -1))
    active: dict[int, list] = {}         # seq -> [prompt index, continuation, tokens to feed, next position]
    try:
        while queue or active:
            while queue and free and sum(len(a[2]) for a in active.values()) + len(queue[0][1]) <= n_batch:
                i, prompt = queue.popleft()
                active[free.pop()] = [i, [], list(prompt), 0]
            n, rows = 0, []
            for seq, (_, _, feed, pos) in active.items():
                for j, tok in enumerate(feed):
                    batch.token[n], batch.pos[n], batch.n_seq_id[n] = tok, pos + j, 1
                    batch.seq_id[n][0] = seq
                    batch.logits[n] = j == len(feed) - 1
                    n += 1
                rows.append((seq, n - 1))
            batch.n_tokens = n
            rc = decode(ctx, batch)
            if rc != 0:
                raise LlamaError(f"llama_decode failed with code {rc} ({_last_log()})")
            for seq, row in rows:
                a = active[seq]
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, row), shape=(model.n_vocab,))
                tok = int(logits.argmax())
                a[3] += len(a[2])
                a[1].append(tok)
                a[2] = [tok]
                if model.is_eog(tok) or len(a[1]) >= max_new:
                    yield a[0], a[1]
                    ll.llama_memory_seq_rm(mem, seq, -1, -1)
                    del active[seq]
                    free.append(seq)
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
