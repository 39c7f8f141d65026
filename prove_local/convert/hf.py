"""Reading a Hugging Face checkpoint directory without torch: config.json and safetensors files.

Tensors are read in row ranges straight from the file (no memory map), so converting a
tensor never holds more than the chunk being converted.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.utility import SafetensorsLocal

from .errors import ConvertError

# Architecture by config.json `architectures[0]`, then by `model_type`. MARS proposers
# (a2d-*) are plain Qwen weights with a different attention mask at training time.
ARCHITECTURES = {
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "A2DQwen2LMHeadModel": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "A2DQwen3LMHeadModel": gguf.MODEL_ARCH.QWEN3,
    "A2DQwen3InstructLMHeadModel": gguf.MODEL_ARCH.QWEN3,
}
MODEL_TYPES = {
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "a2d-qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "a2d-qwen3": gguf.MODEL_ARCH.QWEN3,
}

# safetensors dtype -> numpy dtype of the stored bits (BF16 is read as uint16).
STORED_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(np.uint16)}


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConvertError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class Hparams:
    arch: gguf.MODEL_ARCH
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    tied: bool
    rope_scaling: dict | None

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


def resolve_arch(config: dict, where: Path) -> gguf.MODEL_ARCH:
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    family = str(model_type).rsplit("-", 1)[-1]        # e.g. another "<method>-qwen3" fine-tune
    if family in ("qwen2", "qwen3"):
        return MODEL_TYPES[family]                     # the weights are still checked tensor by tensor
    raise ConvertError(
        f"{where}: unknown architecture {archs or None} (model_type {model_type!r}); "
        f"supported: {', '.join(ARCHITECTURES)} / model types {', '.join(MODEL_TYPES)}"
    )


def read_hparams(config: dict, where: Path) -> Hparams:
    arch = resolve_arch(config, where)

    def get(key: str, default=None, kind=int):
        value = config.get(key, default)
        if value is None:
            raise ConvertError(f"{where}: missing key {key!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConvertError(f"{where}: key {key!r} must be a positive integer, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ConvertError(f"{where}: key {key!r} must be a positive number, got {value!r}")
        return value

    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    rope = config.get("rope_parameters") or {}
    rope_scaling = config.get("rope_scaling") or None
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ConvertError(f"{where}: key 'rope_scaling' must be an object, got {rope_scaling!r}")
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    if hidden % heads and config.get("head_dim") is None:
        raise ConvertError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim")
    return Hparams(
        arch=arch,
        hidden=hidden,
        layers=get("num_hidden_layers"),
        heads=heads,
        kv_heads=get("num_key_value_heads", heads),
        head_dim=get("head_dim", hidden // heads),
        intermediate=get("intermediate_size"),
        vocab_size=get("vocab_size"),
        context_length=get("max_position_embeddings"),
        rms_eps=float(get("rms_norm_eps", kind=float)),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        tied=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
    )


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file, read on demand in row ranges."""
    name: str
    dtype: str          # "F32" | "F16" | "BF16"
    shape: tuple[int, ...]
    file: Path
    offset: int         # absolute byte offset of the data in `file`

    @property
    def n_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * STORED_DTYPES[self.dtype].itemsize

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in the stored dtype (BF16 as uint16)."""
        stop = self.n_rows if stop is None else stop
        dt = STORED_DTYPES[self.dtype]
        out = np.empty((stop - start) * self.row_elems, dtype=dt)
        try:
            with open(self.file, "rb") as f:
                f.seek(self.offset + start * self.row_elems * dt.itemsize)
                got = f.readinto(out)
        except OSError as e:
            raise ConvertError(f"{self.file}: cannot read tensor {self.name!r} ({e})") from None
        if got != out.nbytes:
            raise ConvertError(f"{self.file}: tensor {self.name!r} is truncated")
        return out.reshape((stop - start, *self.shape[1:]) if self.shape else ())

    def read_f32(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return to_f32(self.read(start, stop), self.dtype)


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


def _open_safetensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise ConvertError(f"{path}: weights file not found")
    try:
        local = SafetensorsLocal(path)
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError) as e:
        raise ConvertError(f"{path}: not a readable safetensors file ({e})") from None
    size = os.path.getsize(path)
    tensors = {}
    for name, t in local.tensors.items():
        if t.dtype not in STORED_DTYPES:
            raise ConvertError(f"{path}: tensor {name!r} has dtype {t.dtype}; only F32, F16 and BF16 are supported")
        tensor = Tensor(name, t.dtype, tuple(int(d) for d in t.shape), path, t.data_range.offset)
        if t.data_range.size != tensor.nbytes:
            raise ConvertError(f"{path}: tensor {name!r} has {t.data_range.size} bytes, shape {list(tensor.shape)} needs {tensor.nbytes}")
        if t.data_range.offset + t.data_range.size > size:
            raise ConvertError(f"{path}: file is truncated (tensor {name!r} ends past the end of the file)")
        tensors[name] = tensor
    return tensors


def open_weights(hf_dir: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint: a single model.safetensors or shards listed in model.safetensors.index.json."""
    index_path = hf_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index_path}: missing or empty 'weight_map'")
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(_open_safetensors(hf_dir / shard))
        for name, shard in weight_map.items():
            if name not in tensors or tensors[name].file != hf_dir / shard:
                raise ConvertError(f"{hf_dir / shard}: tensor {name!r} listed in {index_path.name} is not in this file")
        return tensors
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return _open_safetensors(single)
    hint = " (PyTorch .bin checkpoints are not supported: save with safe_serialization=True)" \
        if any(hf_dir.glob("*.bin")) else ""
    raise ConvertError(f"{hf_dir}: no weights found (model.safetensors or model.safetensors.index.json){hint}")
