"""Converter (issue 2): tiny Qwen2 / Qwen3 checkpoints -> GGUF, checked inside llama.cpp."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from prove_local import convert
import prove_local.convert.export  # noqa: F401  (convert.export below)
from prove_local.convert import ConvertError, convert_checkpoint
from prove_local.llama import Context, Model
from tests.tiny import load_weights, make_checkpoint, reference_logits, save_safetensors, tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("<|im_start|>user\ndef add(a, b):\n    return a + b  # The quick brown fox, 2024!<|im_end|>\n"
          "<|im_start|>assistant\n")
MASK = "<|mask|>"


def logits(gguf_path: Path, ids: list[int]) -> np.ndarray:
    """Every row's logits from llama.cpp with an F32 KV cache and flash attention off."""
    model = Model(gguf_path)
    ctx = Context(model, n_ctx=256, n_threads=1, type_k="f32", type_v="f32", flash_attn=False)
    try:
        return ctx.eval(ids, list(range(len(ids))))
    finally:
        ctx.close()
        model.close()


def prompt_ids() -> list[int]:
    ids = tokenizer().encode(PROMPT).ids
    assert 30 <= len(ids) <= 100
    return ids


def files_in(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


# ------------------------------------------------------------------------------ logit parity
PARITY_CASES = {
    "qwen2-tied": dict(arch="qwen2", tied=True),
    "qwen2-tied-2shards": dict(arch="qwen2", tied=True, shards=2),
    "qwen3-untied": dict(arch="qwen3", tied=False),
    "qwen3-untied-2shards": dict(arch="qwen3", tied=False, shards=2),
    "qwen2-bf16": dict(arch="qwen2", dtype="bf16", shards=2, seed=1),
    "qwen3-bf16": dict(arch="qwen3", tied=False, dtype="bf16", seed=2),
    "qwen3-f16-mha": dict(arch="qwen3", dtype="f16", kv_heads=4, seed=3),
    "a2d-qwen2": dict(arch="a2d-qwen2", seed=4),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_f32_gguf_matches_reference_forward(tmp_path, case):
    ckpt = make_checkpoint(tmp_path / "hf", **PARITY_CASES[case])
    out = convert_checkpoint(ckpt, tmp_path / "model.gguf", outtype="f32", progress=False)
    assert files_in(tmp_path) == {"hf", "model.gguf"}          # no temp files left behind
    ids = prompt_ids()
    ref = reference_logits(ckpt, ids)
    got = logits(out, ids)
    assert got.shape == ref.shape == (len(ids), 384)
    scale = np.abs(ref).max()
    assert scale > 5                                            # logits are not flat
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * scale)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_qwen3_head_dim_differs_from_hidden(tmp_path):
    ckpt = make_checkpoint(tmp_path / "hf", arch="qwen3", tied=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    out = convert_checkpoint(ckpt, tmp_path / "m.gguf", progress=False)
    model = Model(out)
    assert model.meta("qwen3.attention.key_length") == str(cfg["head_dim"])
    assert model.meta("qwen3.rope.freq_base") is not None and float(model.meta("qwen3.rope.freq_base")) == 1e6
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert {"output.weight", "blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    assert not any(n.endswith(".bias") for n in names)


def test_tied_checkpoint_carrying_lm_head_is_written_without_output(tmp_path):
    ckpt = make_checkpoint(tmp_path / "hf", arch="qwen2", tied=True)
    w = load_weights(ckpt)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
    w["model.rotary_emb.inv_freq"] = np.ones(8, dtype=np.float32)       # skipped, maps to nothing
    save_safetensors(ckpt / "model.safetensors", w, "f32")
    out = convert_checkpoint(ckpt, tmp_path / "m.gguf", progress=False)
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert "output.weight" not in names and "token_embd.weight" in names
    assert {f"blk.{i}.attn_{x}.bias" for i in range(2) for x in "qkv"} <= names
    ids = prompt_ids()
    np.testing.assert_allclose(logits(out, ids), reference_logits(ckpt, ids), rtol=1e-4, atol=2e-3)


def test_streamed_chunks_write_identical_bytes(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "hf", arch="qwen3", tied=False, dtype="bf16", shards=2)
    whole = convert_checkpoint(ckpt, tmp_path / "whole.gguf", outtype="q8_0", progress=False)
    monkeypatch.setattr(convert.export, "CHUNK_ELEMS", 100)                # a few rows per chunk
    chunked = convert_checkpoint(ckpt, tmp_path / "chunked.gguf", outtype="q8_0", progress=False)
    assert whole.read_bytes() == chunked.read_bytes()
    # and the F32 file holds exactly the checkpoint's values (BF16 widened bit for bit)
    f32 = convert_checkpoint(ckpt, tmp_path / "f32.gguf", outtype="f32", progress=False)
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(f32).tensors}
    w = load_weights(ckpt)
    np.testing.assert_array_equal(tensors["token_embd.weight"], w["model.embed_tokens.weight"])
    np.testing.assert_array_equal(tensors["blk.1.ffn_down.weight"], w["model.layers.1.mlp.down_proj.weight"])


# --------------------------------------------------------------------------- quantized outputs
@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    """Row widths that are multiples of 256, so K-quants apply instead of falling back."""
    d = tmp_path_factory.mktemp("wide")
    return {
        "qwen2": make_checkpoint(d / "qwen2", arch="qwen2", hidden=256, intermediate=512, seed=5),
        "qwen3": make_checkpoint(d / "qwen3", arch="qwen3", tied=False, dtype="bf16", hidden=256,
                                 intermediate=512, head_dim=128, seed=6),
    }


QUANT_TYPES = {  # outtype -> (expected general.file_type, a tensor type it must contain, min correlation)
    "f16": (1, "F16", 0.999), "bf16": (32, "BF16", 0.999), "q8_0": (7, "Q8_0", 0.99),
    "q4_0": (2, "Q4_0", 0.8), "q4_k_m": (15, "Q4_K", 0.8), "q5_k_m": (17, "Q5_K", 0.9),
    "q6_k": (18, "Q6_K", 0.95),
}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("outtype", QUANT_TYPES)
def test_quantized_outputs_load_and_keep_metadata(tmp_path, wide_checkpoints, arch, outtype):
    ckpt = wide_checkpoints[arch]
    out = convert_checkpoint(ckpt, tmp_path / f"m-{outtype}.gguf", outtype=outtype, block_size=8, progress=False)
    assert files_in(tmp_path) == {out.name}                     # intermediates removed
    file_type, must_have, min_corr = QUANT_TYPES[outtype]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert must_have in types.values()
    assert types["output_norm.weight"] == "F32"
    if outtype == "q4_0":                                       # the head keeps 8 bits
        assert types["token_embd.weight" if arch == "qwen2" else "output.weight"] == "Q8_0"

    model = Model(out)
    assert model.meta("general.file_type") == str(file_type)
    assert model.meta("prove.role") == "proposer"
    assert model.meta("prove.block_size") == "8"
    assert model.meta("prove.mask_token_id") == str(tokenizer().token_to_id(MASK))
    assert model.meta("tokenizer.ggml.mask_token_id") == str(tokenizer().token_to_id(MASK))
    model.close()

    ids = prompt_ids()
    got = logits(out, ids)
    assert np.isfinite(got).all()
    ref = reference_logits(ckpt, ids)
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > min_corr


# ---------------------------------------------------------------------------- tokenizer parity
TOKENIZER_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "中文分词测试：我们今天去公园散步。日本語のテキストも。한국어 문장도 있습니다.",
    "Emoji 🙂👍🏽 and a family 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, and ✨sparkles✨.",
    "Digits 1234567890, 3.14159, -0.5e10, 1,000,000 and 2024-06-01T12:30:00Z.",
    "Whitespace    runs\t\t\ttabs\n\n\n\nnewlines   \r\n  trailing   ",
    "   leading spaces and a single trailing space ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "Fill in: The capital of France is <|mask|><|mask|><|mask|>. Done<|mask|>x <|mask|> y",
    "<think>\nLet me reason step by step.\n</think>\n\nThe answer is 7.",
    "I'm sure they'll say it's fine; we've DONE it, YOU'RE right, she'd agree.",
    "Ünïcödé àccents, Ελληνικά, русский текст, العربية, עברית, हिन्दी.",
    "mixed中文English123混合😀text",
    "x = [1,2,3]; y = {'a': 1}; z = (a**2 + b**2) ** 0.5  // comment",
    "<|endoftext|>after end of text",
    "",
    " ",
    "\n",
    "a" * 50 + " " + "ab" * 20,
]


@pytest.fixture(scope="module")
def proposer_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("proposer")
    ckpt = make_checkpoint(d / "hf", arch="qwen2")
    return ckpt, convert_checkpoint(ckpt, d / "proposer.gguf", progress=False)


def test_tokenizer_parity_with_hf_tokenizers(proposer_gguf):
    ckpt, out = proposer_gguf
    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = Model(out)
    for text in TOKENIZER_CORPUS:
        assert model.tokenize(text, add_special=False, parse_special=True) == \
            hf.encode(text, add_special_tokens=False).ids, text
    mask_id = hf.token_to_id(MASK)
    assert model.tokenize(MASK, parse_special=True) == [mask_id]
    assert len(model.tokenize(MASK, parse_special=False)) > 1      # plain text without special parsing
    assert model.tokenize("<think>", parse_special=True) == [hf.token_to_id("<think>")]


def test_vocab_metadata(proposer_gguf):
    ckpt, out = proposer_gguf
    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = Model(out)
    assert model.n_vocab == 384                                    # padded to the embedding rows
    assert model.token_unused(383) and model.token_unused(hf.get_vocab_size())
    assert not model.token_unused(hf.token_to_id(MASK))
    assert model.meta("general.architecture") == "qwen2"
    assert model.meta("tokenizer.ggml.model") == "gpt2"
    assert model.meta("tokenizer.ggml.pre") == "qwen2"
    assert model.meta("tokenizer.ggml.eos_token_id") == str(hf.token_to_id("<|im_end|>"))
    assert model.meta("tokenizer.ggml.padding_token_id") == str(hf.token_to_id("<|endoftext|>"))
    assert model.meta("tokenizer.ggml.add_bos_token") == "false"
    assert "<|im_start|>" in model.chat_template
    assert model.is_eog(hf.token_to_id("<|im_end|>"))
    assert model.detokenize(model.tokenize("Hello 🙂 世界")) == "Hello 🙂 世界"


# --------------------------------------------------------------------------- metadata round trip
@pytest.mark.parametrize("mask, role, block, expect_role", [
    (True, None, 16, "proposer"),
    (True, "proposer", 4, "proposer"),
    (True, "verifier", 16, "verifier"),
    (False, None, 16, "verifier"),
    (False, "verifier", 32, "verifier"),
])
def test_metadata_round_trip(tmp_path, mask, role, block, expect_role):
    import llama_cpp

    ckpt = make_checkpoint(tmp_path / "hf", arch="qwen3", mask=mask)
    out = convert_checkpoint(ckpt, tmp_path / "m.gguf", role=role, block_size=block, progress=False)
    model = Model(out)
    mask_id = tokenizer().token_to_id(MASK)
    assert model.meta("prove.role") == expect_role
    assert model.meta("prove.block_size") == str(block)
    if mask:
        assert model.meta("prove.mask_token_id") == str(mask_id)
        assert model.meta("tokenizer.ggml.mask_token_id") == str(mask_id)
        assert llama_cpp.llama_vocab_mask(model._vocab) == mask_id
    else:
        assert model.meta("prove.mask_token_id") is None
        assert model.meta("tokenizer.ggml.mask_token_id") is None


# ---------------------------------------------------------------------------------- bad inputs
def _rewrite_weights(ckpt: Path, edit) -> None:
    w = load_weights(ckpt)
    edit(w)
    save_safetensors(ckpt / "model.safetensors", w, "f32")


def _set_config(ckpt: Path, **changes) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep if keep is not None else len(data) - 100])


BAD_INPUTS = {  # name -> (make_checkpoint kwargs, edit(ckpt), convert kwargs, text the error must contain)
    "missing config.json": ({}, lambda c: (c / "config.json").unlink(), {}, "config.json"),
    "missing tokenizer.json": ({}, lambda c: (c / "tokenizer.json").unlink(), {}, "tokenizer.json"),
    "missing tokenizer_config.json": ({}, lambda c: (c / "tokenizer_config.json").unlink(), {},
                                      "tokenizer_config.json"),
    "missing weights": ({}, lambda c: (c / "model.safetensors").unlink(), {}, "model.safetensors"),
    "missing shard": ({"shards": 2}, lambda c: (c / "model-00002-of-00002.safetensors").unlink(), {},
                      "model-00002-of-00002.safetensors"),
    "unknown architecture": ({}, lambda c: _set_config(c, architectures=["LlamaForCausalLM"], model_type="llama"),
                             {}, "LlamaForCausalLM"),
    "config key missing": ({}, lambda c: _set_config(c, hidden_size=None), {}, "hidden_size"),
    "tensor maps to nothing": ({}, lambda c: _rewrite_weights(
        c, lambda w: w.__setitem__("model.layers.0.mlp.extra_proj.weight", np.zeros((4, 4), np.float32))),
        {}, "model.layers.0.mlp.extra_proj.weight"),
    "layer beyond num_hidden_layers": ({}, lambda c: _set_config(c, num_hidden_layers=1), {},
                                       "model.layers.1."),
    "tensor missing": ({}, lambda c: _rewrite_weights(c, lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
                       {}, "model.layers.1.mlp.up_proj.weight"),
    "untied without lm_head": ({}, lambda c: _set_config(c, tie_word_embeddings=False), {}, "lm_head.weight"),
    "shape disagrees with config": ({}, lambda c: _set_config(c, intermediate_size=96), {},
                                    "model.layers.0.mlp.down_proj.weight"),
    "qwen2 weights under a qwen3 config": ({}, lambda c: _set_config(c, architectures=["Qwen3ForCausalLM"]), {},
                                           "model.layers.0.self_attn.k_proj.bias"),
    "vocab larger than embedding": ({"vocab_rows": 300}, lambda c: None, {}, "only 300 rows"),
    "truncated safetensors": ({}, lambda c: _truncate(c / "model.safetensors"), {}, "truncated"),
    "truncated header": ({}, lambda c: _truncate(c / "model.safetensors", keep=20), {}, "model.safetensors"),
    "unreadable safetensors": ({}, lambda c: (c / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0not json!!!!!!!!"),
                               {}, "not a readable safetensors"),
    "proposer without mask token": ({"mask": False}, lambda c: None, {"role": "proposer"}, "--role verifier"),
    "a2d model without mask token": ({"mask": False, "arch": "a2d-qwen2"}, lambda c: None, {}, "mask"),
    "unsupported rope scaling": ({}, lambda c: _set_config(c, rope_scaling={"type": "dynamic", "factor": 2.0}),
                                 {}, "rope_scaling"),
    "unknown outtype": ({}, lambda c: None, {"outtype": "q3_k"}, "q3_k"),
    "bad block size": ({}, lambda c: None, {"block_size": 0}, "block size"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_the_problem_and_writes_nothing(tmp_path, case):
    kwargs, edit, convert_kwargs, needle = BAD_INPUTS[case]
    ckpt = make_checkpoint(tmp_path / "hf", **kwargs)
    edit(ckpt)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConvertError) as err:
        convert_checkpoint(ckpt, out_dir / "model.gguf", progress=False, **convert_kwargs)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)
    assert files_in(out_dir) == set()                               # neither output nor temp file


def test_a2d_without_mask_converts_as_verifier_when_asked(tmp_path):
    ckpt = make_checkpoint(tmp_path / "hf", arch="a2d-qwen2", mask=False)
    out = convert_checkpoint(ckpt, tmp_path / "m.gguf", role="verifier", progress=False)
    assert Model(out).meta("prove.role") == "verifier"


def test_failure_midway_keeps_previous_output_and_leaves_no_temp(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "hf")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "model.gguf").write_bytes(b"previous")
    calls = []

    def interrupted(t, qtype):
        calls.append(t.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        yield from original(t, qtype)

    original = convert.export.converted_chunks
    monkeypatch.setattr(convert.export, "converted_chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(ckpt, out_dir / "model.gguf", progress=False)
    assert files_in(out_dir) == {"model.gguf"}
    assert (out_dir / "model.gguf").read_bytes() == b"previous"

    def failing_quantize(src, dst, ftype, progress=False):
        assert src.exists() and dst.exists()
        raise ConvertError("quantizer failed")

    monkeypatch.setattr(convert.export, "converted_chunks", original)
    monkeypatch.setattr(convert.export, "_quantize_with_llama_cpp", failing_quantize)
    with pytest.raises(ConvertError):
        convert_checkpoint(ckpt, out_dir / "model.gguf", outtype="q4_k_m", progress=False)
    assert files_in(out_dir) == {"model.gguf"}


# ------------------------------------------------------------------------------- command line
def test_cli_convert_and_error(tmp_path, capsys):
    from prove_local.cli import main

    ckpt = make_checkpoint(tmp_path / "hf", mask=False)
    out = tmp_path / "v.gguf"
    assert main(["convert", str(ckpt), "-o", str(out), "--outtype", "q8_0", "--block-size", "8", "-q"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert Model(out).meta("prove.role") == "verifier"

    bad = tmp_path / "bad.gguf"
    assert main(["convert", str(ckpt), "-o", str(bad), "--role", "proposer", "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "mask" in err
    assert not bad.exists()


def test_cli_entry_point_subprocess(tmp_path):
    ckpt = make_checkpoint(tmp_path / "hf")
    (ckpt / "tokenizer.json").unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "prove_local.cli", "convert", str(ckpt), "-o", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "tokenizer.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.gguf").exists()
    shutil.rmtree(ckpt)


def test_output_permissions_follow_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        out = convert_checkpoint(make_checkpoint(tmp_path / "hf"), tmp_path / "m.gguf", outtype="f16", progress=False)
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o644


def test_llama_cpp_quantizer_failure_is_a_convert_error(tmp_path):
    src = tmp_path / "not-a-model.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ConvertError, match="not-a-model.gguf"):
        convert.export._quantize_with_llama_cpp(src, tmp_path / "dst.gguf", gguf.LlamaFileType.MOSTLY_Q4_K_M)


def test_yarn_rope_scaling_is_written(tmp_path):
    ckpt = make_checkpoint(tmp_path / "hf")
    _set_config(ckpt, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    model = Model(convert_checkpoint(ckpt, tmp_path / "m.gguf", progress=False))
    assert model.meta("qwen2.rope.scaling.type") == "yarn"
    assert float(model.meta("qwen2.rope.scaling.factor")) == 4.0
    assert model.meta("qwen2.rope.scaling.original_context_length") == "1024"
