"""scripts/inflate.py: a zero-padded Qwen2 GGUF computes the same logits as the original.

Real llama.cpp contexts on F32 weights and an F32 KV cache: the inflated model's greedy tokens must
equal the original's, and its logits agree to float rounding (the padded sums add exact zeros, but
the kernels' summation order changes with the width)."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prove_local.engine import Engine, Settings
from prove_local.llama import Context, Model
from prove_local.shapes import Shape
from tests.tiny import tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import inflate  # noqa: E402

F32 = dict(n_ctx=256, n_threads=1, type_k="f32", type_v="f32")
PROMPTS = ["Hello world", "def f(x): return x * 2", "The quick brown fox", "12345 + 678 = ?", "a a a a a"]


def greedy(model, prompt, n=24, mode="ar", **kw):
    eng = Engine.load(model, **F32)
    return [t for c in eng.generate(model.tokenize(prompt), Settings(mode=mode, max_new=n, **kw)) for t in c.committed]


@pytest.mark.parametrize("tied", [True, False])
def test_inflated_model_has_the_same_logits_and_greedy_tokens(tmp_path, tied):
    src = tiny_gguf(tmp_path, seed=3, tied=tied)             # hidden 64 = 4 heads x 16, 2 KV heads, 2 layers
    target = Shape(layers=4, hidden=192, heads=6, kv_heads=2, head_dim=32, intermediate=320, vocab=384, tied=tied)
    out = tmp_path / "big.gguf"
    info = inflate.inflate(src, target, out, log=lambda *a: None)
    # hidden = 12 heads x 16 (head dim kept), KV width 64 = 4 KV heads, grouping 3 >= 2
    assert info["shape"] == {"hidden": 192, "heads": 12, "kv_heads": 4, "head_dim": 16, "intermediate": 320, "layers": 4}
    small, big = Model(src), Model(out)
    assert big.n_params > 4 * small.n_params and big.n_params == info["n_params"]
    assert big.mask_token == small.mask_token and big.block_size == small.block_size
    toks = small.tokenize("The proposer guesses a block of masked tokens")
    a, b = Context(small, **F32), Context(big, **F32)
    la, lb = a.eval(toks, rows=list(range(len(toks)))), b.eval(toks, rows=list(range(len(toks))))
    assert np.abs(la - lb).max() < 1e-3 * max(1.0, np.abs(la).max())
    assert (la.argmax(1) == lb.argmax(1)).all()
    for p in PROMPTS:
        assert greedy(big, p) == greedy(small, p), p
    # and the exact modes on the inflated proposer still equal its ar
    assert greedy(big, PROMPTS[0], mode="lossless", block=4) == greedy(small, PROMPTS[0])


def test_plan_shape_for_the_qwen_targets():
    from prove_local.shapes import SHAPES
    small = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 768, "layers": 4}
    s05 = inflate.plan_shape(small, SHAPES["qwen2.5-0.5b"])
    assert s05 == {"hidden": 896, "heads": 14, "kv_heads": 2, "head_dim": 64, "intermediate": 4864, "layers": 24}
    s7 = inflate.plan_shape(small, SHAPES["qwen2.5-7b"])
    assert s7["hidden"] == 3584 and s7["kv_heads"] * 64 == 512 and s7["heads"] // s7["kv_heads"] >= 2
    # a head dim of 48 (multi-head: 1 query head per KV head)
    s = inflate.plan_shape({"hidden": 192, "heads": 4, "kv_heads": 4, "head_dim": 48, "intermediate": 512,
                            "layers": 2}, SHAPES["qwen2.5-1.5b"])
    assert s["hidden"] == 1536 and s["heads"] == 32 and s["heads"] % s["kv_heads"] == 0
    assert inflate.head_slots(4, 2, 2, 14) == [0, 1, 7, 8]


def test_inflate_command_errors(tmp_path):
    src = tiny_gguf(tmp_path, seed=0, arch="qwen3")
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "scripts" / "inflate.py"), *a],
                                    capture_output=True, text=True, timeout=60)
    r = run(str(src), "--shape", "qwen2.5-0.5b", "-o", str(tmp_path / "x.gguf"))
    assert r.returncode == 1 and "only qwen2" in r.stderr and r.stderr.count("\n") == 1
    r = run(str(tmp_path / "missing.gguf"), "--shape", "qwen2.5-0.5b", "-o", str(tmp_path / "x.gguf"))
    assert r.returncode == 1 and "no such file" in r.stderr
    q2 = tiny_gguf(tmp_path, seed=0)
    r = run(str(q2), "--shape", "gpt-9", "-o", str(tmp_path / "x.gguf"))
    assert r.returncode == 1 and "unknown --shape" in r.stderr
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.skipif(not __import__("os").environ.get("PROVE_LOCAL_SLOW_TESTS"),
                    reason="set PROVE_LOCAL_SLOW_TESTS=1: inflates the embedded proposer to 0.5B in F32 (1.4 GB)")
def test_embedded_proposer_inflated_to_qwen25_05b(tmp_path):
    from prove_local.chat import Conversation
    from prove_local.loading import EMBEDDED_PROPOSER
    out = tmp_path / "prop-0.5b.gguf"
    info = inflate.inflate(EMBEDDED_PROPOSER, "qwen2.5-0.5b", out, log=lambda *a: None)
    assert info["shape"]["hidden"] == 896 and info["shape"]["layers"] == 24 and info["n_params"] > 300e6
    small, big = Model(EMBEDDED_PROPOSER), Model(out)
    toks = Conversation(small).prompt_tokens("Natalia sold clips to 48 of her friends in April. How many?")
    runs = {}
    for name, m in (("small", small), ("big", big)):
        eng = Engine.load(m, **dict(F32, n_ctx=512))
        runs[name] = [t for c in eng.generate(toks, Settings(mode="ar", max_new=24)) for t in c.committed]
        if name == "big":
            lossless = [t for c in eng.generate(toks, Settings(mode="lossless", block=3, max_new=24)) for t in c.committed]
    assert runs["big"] == runs["small"] and lossless == runs["small"]
