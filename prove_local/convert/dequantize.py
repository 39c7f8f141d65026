"""A quantized GGUF rewritten with F32 (or F16) tensors (gguf-py's dequantizers), every metadata key kept.

What for: the exactness reference of a quantized model. Greedy decoding on F32 weights with an F32 KV
cache gives the same tokens whether llama.cpp evaluates one row or many, so lossless == ar holds
bit for bit there, and the torch side of the adapter trainer's parity test reads the same numbers.
`--outtype f16` writes the matrices as F16 (vectors such as norms stay F32, as llama.cpp's converter
keeps them): the F16 point of a pass-cost curve (`scripts/adapter_bench.py --llama-bench`).
`python -m prove_local.convert.dequantize IN.gguf OUT.gguf [--outtype f16]`.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np


def dequantize_gguf(src, dst, progress: bool = False, outtype: str = "f32") -> Path:
    """Write `dst`: `src`'s metadata and its tensors as F32 (`outtype` f16: matrices as F16), to a
    temporary file, then renamed."""
    import gguf

    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype {outtype!r}: choose f32 or f16")
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        vtype = field.types[0]
        if key == "general.file_type":
            w.add_uint32(key, int(gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_F16))
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    for t in tqdm(r.tensors, desc="dequantize", unit="tensor", disable=not progress):
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        dtype = np.float16 if outtype == "f16" and len(t.shape) > 1 else np.float32
        w.add_tensor(t.name, np.ascontiguousarray(data, dtype=dtype).reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, dst)
    return dst


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m prove_local.convert.dequantize", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a GGUF file (any llama.cpp type gguf-py can dequantize)")
    p.add_argument("dst", help="the GGUF to write")
    p.add_argument("--outtype", choices=("f32", "f16"), default="f32", help="tensor type (default f32)")
    a = p.parse_args(argv)
    print(dequantize_gguf(a.src, a.dst, progress=True, outtype=a.outtype))


if __name__ == "__main__":
    main()
