"""A GGUF header read without llama.cpp: metadata and tensor shapes (`read_gguf_header`), and the
model's `ModelInfo` for the memory estimate (`read_gguf_info`)."""
from __future__ import annotations

import os
import math
from pathlib import Path

from .shapes import ModelInfo

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


