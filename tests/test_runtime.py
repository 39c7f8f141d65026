"""The decoding rules on real llama.cpp contexts, with tiny random-weight F32 GGUF models.

F32 weights and an F32 KV cache, so batched and one-token evaluation agree and exactness can be
demanded token for token.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from prove_local.chat import Conversation
from prove_local.engine import Engine, Settings
from prove_local.llama import Context, ContextFull, LlamaError, Model
from tests.reference import chat_reference, greedy_ar, next_logits
from tests.tiny import tiny_gguf

PROMPTS = [
    "Hello world", "def f(x): return x * 2", "The cat sat on the mat.", "12345 + 678 = ?",
    "<|im_start|>user\nhi<|im_end|>", "Natalia sold clips to 48 of her friends.", "日本語のテキスト",
    "a a a a a", "for i in range(10):\n    print(i)", "What is 7 times 8?", "   spaces   ", "🙂 emoji test",
    "Question: how many apples?", "x = [1, 2, 3]", "The quick brown fox", "#### 72", "<think>hmm</think>",
    "Weng earns $12 an hour.", "A\nB\nC", "if (a && b) { return; }",
]
F32 = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    prop = Model(tiny_gguf(d, seed=0))
    ver = Model(tiny_gguf(d, seed=1, hidden=32, role="verifier"))
    draft = Model(tiny_gguf(d, seed=0, mask=False, role="verifier"))  # same weights as the proposer
    other = Model(tiny_gguf(d, seed=2, hidden=32, role="verifier"))
    yield prop, ver, draft, other


@pytest.fixture(scope="module")
def engine(models):
    prop, ver, draft, other = models
    return Engine.load(prop, ver, other, **F32)


def generate(engine, prompt, **kw):
    cycles = list(engine.generate(prompt, Settings(**kw)))
    return cycles, [t for c in cycles for t in c.committed]


@pytest.fixture(scope="module")
def ar_outputs(models):
    """Greedy decoding by hand on a fresh context (tests/reference.py), not the engine's ar."""
    prop = models[0]
    return {p: greedy_ar(prop, prop.tokenize(p), 64, **F32) for p in PROMPTS}


def test_metadata(models):
    prop, ver, *_ = models
    assert prop.mask_token is not None and prop.block_size == 16 and prop.role == "proposer"
    assert ver.role == "verifier" and "<|im_start|>" in prop.chat_template


@pytest.mark.parametrize("mode,extra", [("ar", {}), ("lossless", {}), ("lossless", {"block": 5}),
                                        ("spec", {"draft_k": 3}), ("prove", {"theta": 1.01}), ("mars", {"tau": 1.01})])
def test_exact_modes_equal_greedy_ar(engine, models, ar_outputs, mode, extra):
    prop = models[0]
    for p in PROMPTS:
        cycles, out = generate(engine, prop.tokenize(p), mode=mode, max_new=64, **extra)
        assert len(out) == 64 or cycles[-1].stop == "eog"
        assert out == ar_outputs[p], (mode, p)
        if mode in ("prove", "mars"):       # gate never passes: one token per cycle
            assert all(len(c.committed) == 1 for c in cycles)


def test_spec_with_identical_draft_accepts_everything(models):
    prop, _, draft, _ = models
    e = Engine.load(prop, draft=draft, **F32)
    cycles, out = generate(e, prop.tokenize("Hello world"), mode="spec", max_new=40, draft_k=4)
    assert all(c.n_accepted == len(c.proposed) for c in cycles[:-1])
    assert out == greedy_ar(prop, prop.tokenize("Hello world"), 40, **F32)


def test_prove_theta_zero_commits_whole_blocks(engine, models):
    cycles, out = generate(engine, models[0].tokenize("The quick brown fox"), mode="prove", theta=0.0,
                           block=8, max_new=40)
    assert [len(c.committed) for c in cycles] == [8] * 5
    assert all(c.passes == {"target": 1, "verifier": 1} for c in cycles)


@pytest.mark.parametrize("mode", ["lossless", "prove", "spec", "mars"])
def test_kv_cache_holds_only_committed_tokens(models, mode):
    prop, ver, _, other = models
    e = Engine.load(prop, ver, other, **F32)
    prompt = prop.tokenize("Natalia sold clips to 48 of her friends.")
    checked = 0
    for cycle in e.generate(prompt, Settings(mode=mode, max_new=40, block=6, theta=0.0005, tau=0.01, draft_k=3)):
        for role, ctx in e.contexts.items():
            if ctx.n_past == 0:
                continue   # not used by this mode
            got = next_logits(ctx, e.tokens)
            fresh = Context(ctx.model, **F32)
            want = fresh.eval(e.tokens)[0]
            fresh.close()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"{mode}/{role}")
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize("mode", ["lossless", "spec", "ar"])
def test_multi_turn_chat_equals_conversation_from_scratch(models, mode):
    """Every turn, decoded on the KV cache the earlier turns left, equals greedy decoding of the whole
    conversation from scratch on a fresh context (tests/reference.py, no engine)."""
    prop, _, draft, _ = models
    e = Engine.load(prop, draft=draft, **F32)
    users = ["Hello there", "Tell me more", "Thanks!", "And <|im_end|> again?"]
    want = chat_reference(prop, users, 24)
    conv = Conversation(prop)
    for i, user in enumerate(users):
        prompt = conv.prompt_tokens(user)
        gen = e.generate(prompt, Settings(mode=mode, max_new=24, block=5, draft_k=3))
        out = [t for c in gen for t in c.committed]
        if i:     # the earlier turns came from the cache (prefill counts over the mode's contexts)
            assert gen.prefill[0] < (len(prompt) - 1) * (2 if mode == "spec" else 1)
        assert out == want[i], (mode, i)
        conv.add_reply(prop.detokenize([t for t in out if not prop.is_eog(t)]))


@pytest.mark.parametrize("mode,n_batch", [("ar", 512), ("lossless", 512), ("lossless", 4), ("prove", 512),
                                          ("prove", 4), ("mars", 512), ("spec", 512), ("spec", 2)])
def test_passes_measured_equal_declared(models, mode, n_batch):
    """The engine counts passes (llama_decode calls, Context.n_decode); the rule declares the width of
    each pass and the mode registry predicts those widths. All three agree on real contexts: one
    decode per n_batch tokens of each pass."""
    import math
    from prove_local import modes
    prop, ver, draft, _ = models
    e = Engine.load(prop, ver, draft, n_batch=n_batch, **F32)
    prompt = prop.tokenize("Natalia sold clips to 48 of her friends.")
    before = {r: c.n_decode for r, c in e.contexts.items()}
    gen = e.generate(prompt, Settings(mode=mode, max_new=30, block=6, theta=0.0005, tau=0.01, draft_k=3))
    mode_ = modes.get(mode)
    n = 0
    while True:
        # the prefill (inside the first next()) leaves one prompt token pending in every context
        pending = {r: max(1, len(e.tokens) - e.contexts[r].n_past) if n else 1 for r in mode_.roles}
        plan, _ = e.plan(gen.request)
        try:
            c = next(gen)
        except StopIteration:
            break
        declared = {r: w for r, w in c.widths.items() if w}
        assert declared == {r: w for r, w in mode_.widths(pending, plan).items() if w}, (mode, c.index)
        assert c.passes == {r: sum(math.ceil(x / n_batch) for x in w) for r, w in declared.items()}, (mode, c.index)
        n += 1
    assert n >= 3
    # the request's totals are the decode calls the contexts made, less the prompt's prefill
    prefill = math.ceil((len(prompt) - 1) / n_batch)
    assert gen.request.passes == {r: e.contexts[r].n_decode - before[r] - prefill for r in mode_.roles}


def test_interrupted_generation_then_next_request(models):
    prop = models[0]
    e = Engine.load(prop, **F32)
    prompt = prop.tokenize("Question: how many apples?")
    gen = e.generate(prompt, Settings(mode="lossless", max_new=60, block=6))
    next(gen), next(gen)
    gen.close()
    ctx = e.contexts["target"]
    fresh = Context(prop, **F32)
    np.testing.assert_allclose(next_logits(ctx, e.tokens), fresh.eval(e.tokens)[0], rtol=1e-4, atol=1e-3)
    kept = list(e.tokens)
    _, out = generate(e, kept, mode="lossless", max_new=20)
    assert out == greedy_ar(prop, kept, 20, **F32)


def test_prompt_longer_than_context(models):
    prop = models[0]
    e = Engine.load(prop, n_ctx=32, n_threads=1)
    with pytest.raises(ContextFull, match="prompt has 40 tokens"):
        generate(e, [5] * 40, mode="ar")


def test_context_fills_up_cleanly(models):
    prop = models[0]
    e = Engine.load(prop, n_ctx=64, n_threads=1, type_k="f32", type_v="f32")
    prompt = prop.tokenize("The cat sat on the mat.")
    cycles, out = generate(e, prompt, mode="lossless", max_new=500, block=8)
    assert cycles[-1].stop == "context" and len(prompt) + len(out) == 64
    assert out == greedy_ar(prop, prompt, 500, **{**F32, "n_ctx": 64})


def test_bad_model_files(tmp_path, models):
    with pytest.raises(LlamaError, match="no such model file"):
        Model(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04not a gguf")
    with pytest.raises(LlamaError, match=r"junk\.gguf: not a GGUF file"):
        Model(junk)
    data = models[0].path.read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(LlamaError, match=r"truncated\.gguf: llama\.cpp could not load"):
        Model(cut)


def test_verifier_with_other_vocabulary_is_refused(tmp_path, models):
    import shutil
    from prove_local.convert import convert_checkpoint
    from tests.tiny import make_checkpoint
    ckpt = make_checkpoint(tmp_path / "hf", seed=3, hidden=32)
    vocab = json.loads((ckpt / "tokenizer.json").read_text())
    a, b = list(vocab["model"]["vocab"])[100:102]       # swap two tokens: same size, other vocabulary
    vocab["model"]["vocab"][a], vocab["model"]["vocab"][b] = vocab["model"]["vocab"][b], vocab["model"]["vocab"][a]
    (ckpt / "tokenizer.json").write_text(json.dumps(vocab))
    other = Model(convert_checkpoint(ckpt, tmp_path / "other.gguf", role="verifier", progress=False))
    with pytest.raises(LlamaError, match="vocabulary differs .* at token 10[01]"):
        Engine.load(models[0], other, n_ctx=64)
    shutil.rmtree(ckpt)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "prove_local.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_json_and_errors(models, tmp_path):
    prop = models[0]
    r = cli("run", str(prop.path), "-p", "Hello there", "-n", "20", "--json", "--threads", "1", "--kv-type", "f32")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("mode", "text", "token_ids", "n_cycles", "n_passes", "tokens_per_cycle", "seconds", "tokens_per_second"):
        assert key in out
    assert out["mode"] == "lossless" and 0 < len(out["token_ids"]) <= 20
    # host time: the cycles' time outside llama_decode (the prefill is not a cycle)
    assert 0 < out["host_seconds"] < out["seconds"]
    r2 = cli("run", str(prop.path), "-p", "Hello there", "-n", "20", "--json", "--mode", "ar", "--threads", "1", "--kv-type", "f32")
    assert json.loads(r2.stdout)["token_ids"] == out["token_ids"]

    r = cli("run", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert r.returncode == 1 and "nope.gguf: no such model file" in r.stderr and "Traceback" not in r.stderr
    r = cli("run", str(models[2].path), "-p", "hi", "--mode", "mars")
    assert r.returncode == 1 and "needs a mask token" in r.stderr and "Traceback" not in r.stderr
    r = cli("run", str(models[2].path), "-p", "hi", "--mode", "lossless", "--lookup", "0")    # (lookup drafts need none)
    assert r.returncode == 1 and "needs a mask token" in r.stderr and "Traceback" not in r.stderr
    r = cli("run", str(prop.path), "-p", "word " * 100, "--ctx", "32")
    assert r.returncode == 1 and "the context holds 32" in r.stderr and "Traceback" not in r.stderr
    r = cli("run", str(prop.path), "-p", "hi", "--mode", "prove")
    assert r.returncode == 1 and "--verifier" in r.stderr


# the interactive Ctrl-C test, bounded, is tests/test_cli_hardening.py::test_interactive_chat_survives_ctrl_c


# ------------------------------------------------------------------ what the rules read from a row
def _softmax64(row):
    z = np.exp(row.astype(np.float64) - row.max())
    return z / z.sum()


def _chain64(row, T, top_k, top_p, min_p):
    """The sampler chain (no penalty) written plainly in float64 over the whole row."""
    x = row.astype(np.float64)
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = _softmax64(x[order] / T)
    if top_p < 1:
        p = p[:np.searchsorted(np.cumsum(p), top_p) + 1]
    p = p / p.sum()
    if min_p > 0:
        p = p[p >= min_p * p[0]]
    out = np.zeros(len(row))
    out[order[:len(p)]] = p / p.sum()
    return out


def test_rows_read_in_place_match_a_float64_reference(tmp_path):
    """Real logits of a 40,000-row vocabulary: the rows the rules read without a copy (eval_view) are
    eval's rows bit for bit; the argmax, p̃ and the probability of a given token (logits.py: one exp
    pass, the subtraction skipped for a maximum in [0, 87 - ln n]) equal a float64 softmax to float32
    rounding, on both sides of that range; the sampler's candidates-only chain equals the plain
    float64 chain over the whole row."""
    from prove_local import rules
    from prove_local.logits import top_candidates
    from prove_local.sampling import Sampler
    m = Model(tiny_gguf(tmp_path, seed=3, vocab_rows=40000))
    ctx = Context(m, **F32)
    toks = m.tokenize("Natalia sold clips to 48 of her friends in April.")
    ctx.eval(toks[:-6], rows=[])
    copy = ctx.eval(toks[-6:], rows=[0, 2, 3, 5])
    ctx.truncate(len(toks) - 6)
    view = ctx.eval_view(toks[-6:], rows=[0, 2, 3, 5])
    assert view.shape == (4, 40000) and np.array_equal(view, copy) and not view.flags.owndata
    rng = np.random.default_rng(0)
    for shift in (0.0, 40.0, -40.0, 95.0):           # 40: the skipped subtraction; -40 and 95: the full one
        logits = (np.asarray(view, dtype=np.float32) * 4 + np.float32(shift)).astype(np.float32)
        ref = np.array([_softmax64(r) for r in logits])
        ids, p = rules.top1(logits)
        assert np.array_equal(ids, ref.argmax(axis=1))
        np.testing.assert_allclose(p, ref.max(axis=1), rtol=2e-6)
        x = rng.integers(0, 40000, 4)
        np.testing.assert_allclose(rules.prob_of(logits, x), ref[np.arange(4), x], rtol=2e-6, atol=1e-12)
        g, q = rules.greedy_and_prob(logits, x[:3])
        assert np.array_equal(g, ids)
        np.testing.assert_allclose(q, ref[np.arange(3), x[:3]], rtol=2e-6, atol=1e-12)
    row = np.asarray(view[1])
    for k in (1, 5, 40, 200, 39999):               # the k largest values (equal logits may swap ids)
        cand = top_candidates(row, k)
        assert len(set(cand.tolist())) == k and np.array_equal(np.sort(row[cand]), np.sort(row)[-k:])
    for T, top_k, top_p, min_p in ((0.8, 40, 0.95, 0.05), (1.0, 0, 1.0, 0.0), (0.6, 0, 0.9, 0.05), (1.5, 200, 0.5, 0.0)):
        got = Sampler(None, T, top_k, top_p, min_p).dist(view, [])
        for i in range(4):
            np.testing.assert_allclose(got[i], _chain64(view[i], T, top_k, top_p, min_p), rtol=1e-9, atol=1e-15)
    ctx.close(), m.close()
