"""Hugging Face Qwen2 / Qwen3 (and MARS a2d-*) checkpoint -> GGUF, streaming one chunk of rows at a time.

The whole mapping is the name table below; everything is validated before the output is
opened, then tensors are written with GGUFWriter's two-phase API (all tensor infos first,
then each tensor's data in order), so memory stays at one chunk whatever the model size.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType as FT

from .errors import ConvertError
from .hf import Hparams, Tensor, open_weights, read_hparams, read_json
from .tokenizer import read_vocab

# ---------------------------------------------------------------------------- name table
# HF name -> (GGUF name, shape in terms of V vocab rows, H hidden, Q q width, KV k/v width,
# I intermediate, D head dim). Per-layer names are relative to model.layers.{i}.
GLOBAL = {
    "model.embed_tokens.weight": ("token_embd.weight", "V H"),
    "model.norm.weight": ("output_norm.weight", "H"),
    "lm_head.weight": ("output.weight", "V H"),            # absent when tied
}
LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", "H"),
    "self_attn.q_proj.weight": ("attn_q.weight", "Q H"),
    "self_attn.k_proj.weight": ("attn_k.weight", "KV H"),
    "self_attn.v_proj.weight": ("attn_v.weight", "KV H"),
    "self_attn.o_proj.weight": ("attn_output.weight", "H Q"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "H"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", "I H"),
    "mlp.up_proj.weight": ("ffn_up.weight", "I H"),
    "mlp.down_proj.weight": ("ffn_down.weight", "H I"),
}
LAYER_BY_ARCH = {
    gguf.MODEL_ARCH.QWEN2: {
        "self_attn.q_proj.bias": ("attn_q.bias", "Q"),
        "self_attn.k_proj.bias": ("attn_k.bias", "KV"),
        "self_attn.v_proj.bias": ("attn_v.bias", "KV"),
    },
    gguf.MODEL_ARCH.QWEN3: {
        "self_attn.q_norm.weight": ("attn_q_norm.weight", "D"),
        "self_attn.k_norm.weight": ("attn_k_norm.weight", "D"),
    },
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# --------------------------------------------------------------------------- output types
NUMPY_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
K_QUANTS = {"q4_k_m": FT.MOSTLY_Q4_K_M, "q5_k_m": FT.MOSTLY_Q5_K_M, "q6_k": FT.MOSTLY_Q6_K}
FILE_TYPES = {"f32": FT.ALL_F32, "f16": FT.MOSTLY_F16, "bf16": FT.MOSTLY_BF16,
              "q8_0": FT.MOSTLY_Q8_0, "q4_0": FT.MOSTLY_Q4_0, **K_QUANTS}
OUTTYPES = tuple(FILE_TYPES)
# The output head (token_embd when tied) keeps more precision, as llama.cpp's quantizer does.
HEAD_TYPES = {"q4_0": Q.Q8_0}
CHUNK_ELEMS = 8 * 1024 * 1024          # elements converted at once (32 MiB as F32)
ROLES = ("proposer", "verifier")


def expected_tensors(hp: Hparams) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (GGUF name, HF shape) for this config, in GGUF file order."""
    dims = {"V": hp.vocab_size, "H": hp.hidden, "Q": hp.heads * hp.head_dim,
            "KV": hp.kv_heads * hp.head_dim, "I": hp.intermediate, "D": hp.head_dim}

    def entry(gname: str, spec: str) -> tuple[str, tuple[int, ...]]:
        return gname, tuple(dims[d] for d in spec.split())

    out = {"model.embed_tokens.weight": entry(*GLOBAL["model.embed_tokens.weight"])}
    for i in range(hp.layers):
        for hf, (gname, spec) in {**LAYER, **LAYER_BY_ARCH[hp.arch]}.items():
            out[f"model.layers.{i}.{hf}"] = entry(f"blk.{i}.{gname}", spec)
    out["model.norm.weight"] = entry(*GLOBAL["model.norm.weight"])
    if not hp.tied:
        out["lm_head.weight"] = entry(*GLOBAL["lm_head.weight"])
    return out


def plan_tensors(hp: Hparams, tensors: dict[str, Tensor], hf_dir: Path) -> list[tuple[str, Tensor]]:
    """Match checkpoint tensors to the name table; every mismatch is an error naming the tensor."""
    expected = expected_tensors(hp)
    for name, t in tensors.items():
        if name.endswith(IGNORED_SUFFIXES) or (hp.tied and name == "lm_head.weight"):
            continue
        if name not in expected:
            raise ConvertError(f"{t.file}: tensor {name!r} maps to no {hp.arch_name} GGUF tensor")
        gname, shape = expected[name]
        if t.shape != shape:
            raise ConvertError(f"{t.file}: tensor {name!r} has shape {list(t.shape)}, "
                               f"but config.json implies {list(shape)}")
    plan = []
    for name, (gname, _) in expected.items():
        if name not in tensors:
            hint = " (config.json has tie_word_embeddings false)" if name == "lm_head.weight" else ""
            raise ConvertError(f"{hf_dir}: tensor {name!r} is missing from the weights{hint}")
        plan.append((gname, tensors[name]))
    return plan


def tensor_type(gname: str, t: Tensor, outtype: str, tied: bool) -> Q:
    if len(t.shape) == 1:
        return Q.F32                                    # norms and biases
    qtype = NUMPY_TYPES[outtype]
    if gname == "output.weight" or (tied and gname == "token_embd.weight"):
        qtype = HEAD_TYPES.get(outtype, qtype)
    if t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return Q.F16                                    # row width does not fit the block size
    return qtype


SAME_BITS = {("F32", Q.F32), ("F16", Q.F16), ("BF16", Q.BF16)}


def converted_chunks(t: Tensor, qtype: Q) -> Iterator[np.ndarray]:
    rows = max(1, CHUNK_ELEMS // max(1, t.row_elems))
    for start in range(0, t.n_rows, rows):
        stop = min(t.n_rows, start + rows)
        if (t.dtype, qtype) in SAME_BITS:
            yield t.read(start, stop)                   # copied bit for bit
        else:
            yield gguf.quants.quantize(t.read_f32(start, stop), qtype)


class _Streamed:
    """Stands in for an array in GGUFWriter.write_tensor_data, which only uses .nbytes and .tofile()."""

    def __init__(self, nbytes: int, chunks: Iterator[np.ndarray], bar):
        self.nbytes, self.chunks, self.bar = nbytes, chunks, bar

    def tofile(self, f) -> None:
        written = 0
        for chunk in self.chunks:
            try:
                chunk.tofile(f)
            except OSError as e:        # numpy says only "N requested and M written" (no errno)
                raise OSError(e.errno, _write_failure(f, e)) from None
            written += chunk.nbytes
            self.bar.update(chunk.nbytes)
        assert written == self.nbytes, (written, self.nbytes)


def _write_failure(f, e: OSError) -> str:
    """What failed when a tensor's bytes could not be written: the file, its folder's free space."""
    name = getattr(f, "name", "the output")
    try:
        st = os.fstatvfs(f.fileno())
        free = st.f_bavail * st.f_frsize
        where = f"; {free} bytes free on that disk" + (" (it is full)" if free < (1 << 20) else "")
    except (OSError, AttributeError, ValueError):
        where = ""
    return f"cannot write the tensor data to {name} ({e.strerror or e}){where}"


def _add_hparams(w: gguf.GGUFWriter, hp: Hparams, where: Path) -> None:
    w.add_context_length(hp.context_length)
    w.add_embedding_length(hp.hidden)
    w.add_block_count(hp.layers)
    w.add_feed_forward_length(hp.intermediate)
    w.add_head_count(hp.heads)
    w.add_head_count_kv(hp.kv_heads)
    w.add_key_length(hp.head_dim)
    w.add_value_length(hp.head_dim)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    if hp.rope_scaling:
        kind = hp.rope_scaling.get("rope_type", hp.rope_scaling.get("type"))
        if kind not in ("linear", "yarn"):
            raise ConvertError(f"{where}: rope_scaling type {kind!r} is not supported (linear, yarn)")
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(hp.rope_scaling["factor"]))
        if kind == "yarn" and "original_max_position_embeddings" in hp.rope_scaling:
            w.add_rope_scaling_orig_ctx_len(int(hp.rope_scaling["original_max_position_embeddings"]))


def _model_name(hf_dir: Path, config: dict) -> str:
    name = str(config.get("_name_or_path") or "").rstrip("/").split("/")[-1]
    return name or hf_dir.resolve().name


def _write_gguf(hf_dir: Path, path: Path, outtype: str, role: str | None, block_size: int,
                progress: bool, label: str) -> None:
    """Validate the checkpoint, then write `path` (an open temp name) with numpy-capable `outtype`."""
    config = read_json(hf_dir / "config.json")
    hp = read_hparams(config, hf_dir / "config.json")
    plan = plan_tensors(hp, open_weights(hf_dir), hf_dir)
    vocab = read_vocab(hf_dir, n_rows=plan[0][1].shape[0])
    role = resolve_role(role, vocab.mask_id, config, hf_dir)

    w = gguf.GGUFWriter(path, hp.arch_name)
    try:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(_model_name(hf_dir, config))
        w.add_file_type(FILE_TYPES[outtype])
        if NUMPY_TYPES[outtype] not in (Q.F32, Q.F16, Q.BF16):
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_hparams(w, hp, hf_dir / "config.json")
        vocab.add_to_gguf(w)
        w.add_string("prove.role", role)
        w.add_uint32("prove.block_size", block_size)
        if vocab.mask_id is not None:
            w.add_uint32("prove.mask_token_id", vocab.mask_id)

        types = [tensor_type(g, t, outtype, hp.tied) for g, t in plan]
        byte_shapes = [gguf.quant_shape_to_byte_shape(t.shape, q) for (_, t), q in zip(plan, types)]
        for (gname, _), qtype, shape in zip(plan, types, byte_shapes):
            w.add_tensor_info(gname, shape, np.dtype(np.uint8), math.prod(shape), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()

        from tqdm import tqdm
        total = sum(math.prod(shape) for shape in byte_shapes)
        with tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=not progress) as bar:
            for (gname, t), qtype, shape in zip(plan, types, byte_shapes):      # one tensor at a time
                bar.set_postfix_str(f"{gname} {qtype.name}", refresh=False)
                w.write_tensor_data(_Streamed(math.prod(shape), converted_chunks(t, qtype), bar))
        w.flush()
    finally:
        w.close()


def resolve_role(role: str | None, mask_id: int | None, config: dict, hf_dir: Path) -> str:
    """Default: a checkpoint with a mask token (or a MARS a2d-* model type) is a proposer."""
    is_mars = str(config.get("model_type", "")).startswith("a2d")
    if role is None:
        role = "proposer" if mask_id is not None or is_mars else "verifier"
    if role not in ROLES:
        raise ConvertError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    if role == "proposer" and mask_id is None:
        raise ConvertError(
            f"{hf_dir / 'tokenizer_config.json'}: a proposer needs a mask token, but there is no mask_token; "
            f"use --role verifier to convert it as a plain (verifier) model")
    return role


def _quantize_with_llama_cpp(src: Path, dst: Path, ftype: FT, progress: bool = False) -> None:
    """llama.cpp's own quantizer (K-quants), in a child process (quantize.py) so that Ctrl-C and
    SIGTERM stop it: the wait below is Python, where signal handlers run; on any exception (the
    KeyboardInterrupt or SystemExit they raise) the child is killed before the exception goes on
    to the caller's temp-file cleanup. Its log is quoted only on failure."""
    import subprocess

    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        raise ConvertError(f"K-quant output needs llama-cpp-python ({e})") from None
    if progress:
        print(f"quantizing to {ftype.name.removeprefix('MOSTLY_')} with llama.cpp ...", file=sys.stderr, flush=True)
    # own session: a terminal's Ctrl-C reaches only this process, which then kills the child. The
    # signals wait while the child starts, so that no interrupt falls between its start and the `try`.
    stop = {signal.SIGINT, signal.SIGTERM}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "prove_local.convert.quantize", str(src), str(dst),
                                 str(int(ftype))], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, "PROVE_QUANTIZE_PARENT": str(os.getpid())})   # see quantize.py
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)    # a pending signal is handled here, inside the try
        err = _stderr_when_done(proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        why = lines[-1] if lines else f"the quantizer exited with status {proc.returncode}"
        raise ConvertError(f"{src}: llama_model_quantize to {ftype.name} failed ({why})")


SIGNAL_POLL = 0.2      # seconds: the longest a signal taken by another thread waits for its handler


def _stderr_when_done(proc) -> bytes:
    """The child's stderr once it has exited, waited for in short slices. Python runs signal handlers
    in the main thread only, when it next runs Python code; a signal the kernel gave another thread
    (tqdm's monitor, or any thread while the main one blocked signals to start the child) wakes
    nothing, so one blocking read would hold Ctrl-C back until the quantizer finished (minutes for a
    large model; `tests/test_interrupts.py` sends the signal to another thread on purpose)."""
    import subprocess

    while True:
        try:
            return proc.communicate(timeout=SIGNAL_POLL)[1]
        except subprocess.TimeoutExpired:
            continue


def _temp_path(out: Path, tag: str) -> Path:
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=f".{tag}.part")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)                       # as a plainly created file would be
    os.close(fd)
    return Path(name)


def _source_float_type(hf_dir: Path) -> str:
    """bf16 for BF16 checkpoints (exact), f16 otherwise: the intermediate for K-quants."""
    return "bf16" if any(t.dtype == "BF16" for t in open_weights(hf_dir).values()) else "f16"


def convert_checkpoint(hf_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f32",
                       role: str | None = None, block_size: int = 16, progress: bool = True) -> Path:
    """Convert a Hugging Face Qwen2/Qwen3 (or MARS a2d-*) checkpoint directory to one GGUF file.

    outtype: f32 | f16 | bf16 | q8_0 | q4_0 (written directly) | q4_k_m | q5_k_m | q6_k (through
    llama.cpp's quantizer from a temporary F16/BF16 file). role None: "proposer" if the tokenizer
    has a mask token (or the model type is a MARS a2d-*), else "verifier". Writes prove.role,
    prove.block_size and (with a mask token) prove.mask_token_id.
    The output appears only when complete; raises ConvertError on bad input.
    """
    hf_dir, out = Path(hf_dir), Path(out_path)
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir}: checkpoint directory not found")
    if not (hf_dir / "config.json").is_file():
        raise ConvertError(f"{hf_dir / 'config.json'}: file not found")
    if outtype not in FILE_TYPES:
        raise ConvertError(f"unknown output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConvertError(f"block size must be a positive integer, got {block_size!r}")
    if out.is_dir():
        raise ConvertError(f"{out}: is a directory")
    out.parent.mkdir(parents=True, exist_ok=True)

    temps: list[Path] = []
    try:
        final = _temp_path(out, outtype)
        temps.append(final)
        if outtype in K_QUANTS:
            mid_type = _source_float_type(hf_dir)
            mid = _temp_path(out, mid_type)
            temps.append(mid)
            _write_gguf(hf_dir, mid, mid_type, role, block_size, progress, f"{out.name} ({mid_type} for llama.cpp)")
            _quantize_with_llama_cpp(mid, final, K_QUANTS[outtype], progress)
        else:
            _write_gguf(hf_dir, final, outtype, role, block_size, progress, f"{out.name} ({outtype})")
        os.replace(final, out)
        temps.remove(final)
    finally:                                            # also on KeyboardInterrupt
        for p in temps:
            p.unlink(missing_ok=True)
    return out
