#!/usr/bin/env python3
"""Inflate a small Qwen2 GGUF with zeros to a large model's shape: the same logits, the large model's
pass cost. A stand-in for measuring decoding with a small pair's real acceptance under a large
proposer's cost (issue 11).

    python scripts/inflate.py IN.gguf --shape qwen2.5-0.5b|qwen2.5-1.5b|qwen2.5-7b -o OUT.gguf [--outtype f32|f16|q8_0]

How the padded model computes the same function (numpy [out, in] layout below):
  * residual stream: the embedding rows are padded with zero columns, and every matrix writing into
    the stream (attention output, FFN down) has zero rows past the original hidden width, so the
    padded coordinates stay 0 all the way;
  * RMSNorm over H' > H coordinates of which H - H' are zero: mean' = (H/H') mean, so with
    eps' = eps * H/H' and weights w' = w * sqrt(H/H') (zero on padded coordinates) every norm gives
    exactly the original values (the epsilon is one per model: Qwen3's per-head q/k norms would break,
    so only Qwen2 is accepted);
  * attention: the head dimension is kept (RoPE frequencies depend on it) and every original query
    head keeps its KV head: KV head k stays KV head k, original query head j (group k = j // g, rank
    r = j % g) becomes head k * g' + r of the new grouping g' = heads' / kv_heads' >= g. Padded query
    heads have zero weights and biases, and their columns of the output projection are zero; padded
    KV heads have zero K and V;
  * MLP: padded intermediate units have zero gate and up rows (silu(0) * 0 = 0) and zero down columns;
  * padded layers come after the original ones with every weight zero: attention and MLP add 0, the
    layer is the identity.
The widths chosen: heads' = hidden_target / head_dim (hidden = heads x head dim), kv_heads' close to
the target's KV width / head_dim among the divisors of heads' that keep g' >= g; intermediate and
layers as the target's (never below the original's).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class InflateError(Exception):
    pass


def plan_shape(small: dict, target) -> dict:
    """The padded shape: small = {hidden, heads, kv_heads, head_dim, intermediate, layers};
    target: a shapes.Shape."""
    hd, nh, nkv = small["head_dim"], small["heads"], small["kv_heads"]
    g = nh // nkv
    heads = max(nh, round(target.hidden / hd))
    kv_target = target.kv_heads * target.head_dim / hd
    best = None
    for h in range(heads, heads + 4 * max(1, g) * max(1, nkv) + 1):     # the nearest feasible head count
        for kv in range(nkv, h + 1):
            if h % kv or h // kv < g:
                continue
            err = abs(h * hd - target.hidden) / target.hidden + abs(kv - kv_target) / max(kv_target, 1)
            if best is None or err < best[0] - 1e-12:
                best = (err, h, kv)
        if best is not None and h * hd >= target.hidden:
            break
    _, heads, kv_heads = best
    return {"hidden": heads * hd, "heads": heads, "kv_heads": kv_heads, "head_dim": hd,
            "intermediate": max(small["intermediate"], target.intermediate),
            "layers": max(small["layers"], target.layers)}


def head_slots(nh: int, nkv: int, new_kv: int, new_heads: int) -> list[int]:
    """New index of each original query head (its KV head unchanged)."""
    g, g2 = nh // nkv, new_heads // new_kv
    return [(j // g) * g2 + j % g for j in range(nh)]


def _read(path: Path):
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise InflateError(f"{path}: not a readable GGUF file ({e})") from None
    fields = {k: f for k, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    arch = arch.contents() if arch is not None else None
    if arch != "qwen2":
        raise InflateError(f"{path}: general.architecture is {arch!r}; only qwen2 models can be inflated "
                           "(one RMSNorm epsilon per model: qwen3's per-head norms would change)")
    return reader, fields


def _meta(fields, key, default=None):
    f = fields.get(key)
    return f.contents() if f is not None else default


def _tensor(t) -> np.ndarray:
    """A reader tensor as float32 [out, in] (dequantized when needed)."""
    import gguf
    qt = gguf.GGMLQuantizationType(t.tensor_type)
    if qt == gguf.GGMLQuantizationType.F32:
        a = np.asarray(t.data, dtype=np.float32)
    elif qt == gguf.GGMLQuantizationType.F16:
        a = np.asarray(t.data, dtype=np.float16).astype(np.float32)
    else:
        a = gguf.quants.dequantize(t.data, qt).astype(np.float32)
    return a.reshape(tuple(reversed([int(x) for x in t.shape])))


def inflate(src: Path, shape_name: str, out: Path, outtype: str = "f32", log=print) -> dict:
    import gguf
    from prove_local.shapes import SHAPES, Shape

    if shape_name not in SHAPES and not isinstance(shape_name, Shape):
        raise InflateError(f"unknown --shape {shape_name!r}; choose from qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b")
    target = shape_name if isinstance(shape_name, Shape) else SHAPES[shape_name]
    reader, fields = _read(src)
    a = "qwen2"
    H = int(_meta(fields, f"{a}.embedding_length"))
    nh = int(_meta(fields, f"{a}.attention.head_count"))
    nkv = int(_meta(fields, f"{a}.attention.head_count_kv", nh))
    hd = int(_meta(fields, f"{a}.attention.key_length", H // nh))
    small = {"hidden": H, "heads": nh, "kv_heads": nkv, "head_dim": hd,
             "intermediate": int(_meta(fields, f"{a}.feed_forward_length")), "layers": int(_meta(fields, f"{a}.block_count"))}
    if nh * hd != H:
        raise InflateError(f"{src}: hidden {H} != heads {nh} x head dim {hd}")
    new = plan_shape(small, target)
    H2, L2, I2 = new["hidden"], new["layers"], new["intermediate"]
    eps = float(_meta(fields, f"{a}.attention.layer_norm_rms_epsilon"))
    slots = head_slots(nh, nkv, new["kv_heads"], new["heads"])
    norm_scale = math.sqrt(H / H2)
    tensors = {t.name: t for t in reader.tensors}
    qtypes = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "q8_0": gguf.GGMLQuantizationType.Q8_0}
    if outtype not in qtypes:
        raise InflateError(f"unknown --outtype {outtype!r}; choose from {', '.join(qtypes)}")

    def head_rows(w: np.ndarray, n_new: int, index) -> np.ndarray:
        """[n_old*hd, ...] -> [n_new*hd, ...] with old head j at new head index(j)."""
        out = np.zeros((n_new * hd,) + w.shape[1:], np.float32)
        for j in range(w.shape[0] // hd):
            k = index(j)
            out[k * hd:(k + 1) * hd] = w[j * hd:(j + 1) * hd]
        return out

    def pad(w: np.ndarray, shape) -> np.ndarray:
        out = np.zeros(shape, np.float32)
        out[tuple(slice(0, s) for s in w.shape)] = w
        return out

    def build(name: str) -> np.ndarray | None:
        """The padded tensor `name`, or None if the original has no such tensor."""
        parts = name.split(".")
        if parts[0] == "blk":
            i, rest = int(parts[1]), ".".join(parts[2:])
            if i >= small["layers"]:
                ref = f"blk.0.{rest}"
                if ref not in tensors:
                    return None
                w0 = build(ref)
                return np.zeros_like(w0)                   # an identity layer: every weight zero
            w = _tensor(tensors[name])
            if rest in ("attn_norm.weight", "ffn_norm.weight"):
                return pad(w * norm_scale, (H2,))
            if rest.startswith("attn_q."):
                w = head_rows(w, new["heads"], lambda j: slots[j])
                return pad(w, (new["heads"] * hd, H2)) if w.ndim == 2 else w
            if rest.startswith("attn_k.") or rest.startswith("attn_v."):
                w = head_rows(w, new["kv_heads"], lambda j: j)
                return pad(w, (new["kv_heads"] * hd, H2)) if w.ndim == 2 else w
            if rest == "attn_output.weight":
                cols = head_rows(w.T, new["heads"], lambda j: slots[j]).T
                return pad(cols, (H2, new["heads"] * hd))
            if rest in ("ffn_gate.weight", "ffn_up.weight"):
                return pad(w, (I2, H2))
            if rest == "ffn_down.weight":
                return pad(w, (H2, I2))
            raise InflateError(f"{src}: tensor {name} is not part of a Qwen2 layer; cannot inflate it")
        w = _tensor(tensors[name])
        if name == "output_norm.weight":
            return pad(w * norm_scale, (H2,))
        if name in ("token_embd.weight", "output.weight"):
            return pad(w, (w.shape[0], H2))
        raise InflateError(f"{src}: unexpected tensor {name}")

    layer_names = sorted({".".join(t.split(".")[2:]) for t in tensors if t.startswith("blk.")})
    names = [n for n in ("token_embd.weight",) if n in tensors]
    names += [f"blk.{i}.{r}" for i in range(L2) for r in layer_names]
    names += [n for n in ("output_norm.weight", "output.weight") if n in tensors]
    unknown = [t for t in tensors if t not in names and not t.startswith("blk.")]
    if unknown:
        raise InflateError(f"{src}: unexpected tensor(s) {', '.join(unknown)}")

    def shape_of(name: str) -> tuple:
        rest = ".".join(name.split(".")[2:]) if name.startswith("blk.") else name
        if rest.endswith("norm.weight"):
            return (H2,)
        if rest.startswith("attn_q."):
            return (new["heads"] * hd, H2) if rest.endswith("weight") else (new["heads"] * hd,)
        if rest.startswith(("attn_k.", "attn_v.")):
            return (new["kv_heads"] * hd, H2) if rest.endswith("weight") else (new["kv_heads"] * hd,)
        if rest == "attn_output.weight":
            return (H2, new["heads"] * hd)
        if rest in ("ffn_gate.weight", "ffn_up.weight"):
            return (I2, H2)
        if rest == "ffn_down.weight":
            return (H2, I2)
        rows = int(tensors[name].shape[-1]) if len(tensors[name].shape) > 1 else int(tensors[name].shape[0])
        return (rows, H2)

    def out_type(name: str, shp: tuple):
        if len(shp) == 1 or outtype == "f32" or shp[-1] % 32:
            return gguf.GGMLQuantizationType.F32
        return qtypes[outtype]

    n_params = sum(math.prod(shape_of(n)) for n in names)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    w = gguf.GGUFWriter(str(tmp), a)
    overrides = {f"{a}.embedding_length": H2, f"{a}.block_count": L2, f"{a}.feed_forward_length": I2,
                 f"{a}.attention.head_count": new["heads"], f"{a}.attention.head_count_kv": new["kv_heads"],
                 f"{a}.attention.key_length": hd, f"{a}.attention.value_length": hd,
                 f"{a}.attention.layer_norm_rms_epsilon": eps * H / H2,
                 "general.file_type": {"f32": 0, "f16": 1, "q8_0": 7}[outtype]}
    for key, f in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = overrides.pop(key) if key in overrides else f.contents()
        if key == "general.name":
            value = f"{value} inflated to {target if isinstance(shape_name, Shape) else shape_name}"
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, value in overrides.items():
        w.add_key_value(key, value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32)
    plan = []
    for n in names:
        shp = shape_of(n)
        qt = out_type(n, shp)
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor_info(n, shp, np.dtype(np.float32), math.prod(shp) * 4)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor_info(n, shp, np.dtype(np.float16), math.prod(shp) * 2)
        else:
            bshape = gguf.quant_shape_to_byte_shape(shp, qt)
            w.add_tensor_info(n, bshape, np.dtype(np.uint8), math.prod(bshape), raw_dtype=qt)
        plan.append((n, shp, qt))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for n, shp, qt in plan:
            t = build(n)
            assert t.shape == shp, (n, t.shape, shp)
            if qt == gguf.GGMLQuantizationType.F32:
                w.write_tensor_data(np.ascontiguousarray(t, np.float32))
            elif qt == gguf.GGMLQuantizationType.F16:
                w.write_tensor_data(t.astype(np.float16))
            else:
                w.write_tensor_data(gguf.quants.quantize(t, qt))
        w.close()
        tmp.replace(out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    info = {"shape": new, "n_params": n_params, "original": small, "rms_eps": eps * H / H2, "outtype": outtype,
            "path": str(out), "bytes": out.stat().st_size}
    log(f"inflated {src.name} -> {out.name}: layers {L2}, hidden {H2} ({new['heads']} heads x {hd}), "
        f"KV heads {new['kv_heads']} (width {new['kv_heads'] * hd}), intermediate {I2}; "
        f"{n_params / 1e6:.1f} M parameters, {info['bytes'] / 2**20:.0f} MiB ({outtype})")
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Pad a small Qwen2 GGUF with zeros to a large shape that computes the same logits.")
    p.add_argument("src", metavar="IN.gguf")
    p.add_argument("--shape", required=True, help="qwen2.5-0.5b, qwen2.5-1.5b or qwen2.5-7b (any Qwen2 shape of prove_local/shapes.py)")
    p.add_argument("-o", "--out", required=True, metavar="OUT.gguf")
    p.add_argument("--outtype", default="f32", choices=("f32", "f16", "q8_0"),
                   help="type of the matrices (norms and biases stay F32; default f32, the exact one)")
    a = p.parse_args(argv)
    src = Path(a.src)
    if not src.is_file():
        print(f"inflate: error: {src}: no such file", file=sys.stderr)
        return 1
    try:
        inflate(src, a.shape, Path(a.out), a.outtype)
    except InflateError as e:
        print(f"inflate: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"inflate: error: {a.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
