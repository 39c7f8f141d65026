"""Training module (issue 4): MARS mask and target alignment against hand-computed cases, the
train-time mask against the inference-time proposal pass, and a miniature end-to-end run
(train -> HF folder -> convert -> llama.cpp logits == torch logits)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prove_local.train.mars import IGNORE, mars_attention_mask, mars_inputs, shift_targets
from prove_local.train.model import Qwen2Config, Qwen2ForCausalLM, load_hf, save_hf

ROOT = Path(__file__).resolve().parents[1]


def _rows(text: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row.split()[-1]] for row in text.strip().splitlines()])


def test_mars_mask_hand_computed_L6_block3():
    # Layout [n0..n5 | c0..c5]; noisy n_p in block k = p // 3 sees c_j for j < 3k and n_q for 3k <= q <= p.
    expected = _rows("""
        n0 100000000000
        n1 110000000000
        n2 111000000000
        n3 000100111000
        n4 000110111000
        n5 000111111000
        c0 000000100000
        c1 000000110000
        c2 000000111000
        c3 000000111100
        c4 000000111110
        c5 000000111111
    """)
    got = mars_attention_mask(6, 3)
    assert got.dtype == torch.bool
    assert torch.equal(got, expected)


def test_mars_mask_with_noisy_start_keeps_only_later_blocks():
    # layout [n3 n4 n5 | c0..c5]
    expected = _rows("""
        n3 100111000
        n4 110111000
        n5 111111000
        c0 000100000
        c1 000110000
        c2 000111000
        c3 000111100
        c4 000111110
        c5 000111111
    """)
    assert torch.equal(mars_attention_mask(6, 3, noisy_start=3), expected)
    with pytest.raises(AssertionError):
        mars_attention_mask(6, 3, noisy_start=2)


def test_right_shift_alignment_hand_computed():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1]])  # assistant tokens 13, 14, 15
    labels = shift_targets(ids, loss_mask)
    # output at p predicts token p+1, only where token p+1 is an assistant token
    assert labels.tolist() == [[IGNORE, IGNORE, 13, 14, 15, IGNORE]]

    x, pos, y, m = mars_inputs(ids, labels, mask_id=99, block=3)
    assert x.tolist() == [[99] * 6 + [10, 11, 12, 13, 14, 15]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5] * 2]
    # noisy row at position p has the same target as the clean row at p: x[p+1]
    assert y.tolist() == [[IGNORE, IGNORE, 13, 14, 15, IGNORE] * 2]
    # the mask at position 3 (block 1) sees clean tokens 0..2 only and predicts token 4 (= 14):
    # two tokens after the last clean token it sees, i.e. slot 2 of a proposal after token 12.
    assert m[3].nonzero().flatten().tolist() == [3, 6, 7, 8]
    assert y[0, 3].item() == 14

    x2, pos2, y2, _ = mars_inputs(ids, labels, mask_id=99, block=3, noisy_start=3)
    assert x2.tolist() == [[99] * 3 + [10, 11, 12, 13, 14, 15]]
    assert pos2.tolist() == [[3, 4, 5, 0, 1, 2, 3, 4, 5]]
    assert y2.tolist() == [[14, 15, IGNORE, IGNORE, IGNORE, 13, 14, 15, IGNORE]]


def _tiny_model(seed=0, vocab=64) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # make biases and norms non-trivial
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


@torch.no_grad()
def test_training_mask_equals_inference_proposal_pass():
    """The noisy rows of one [noisy | clean] forward equal the rows of the inference pass
    [context ..., last committed token, <|mask|> x (B-1)] with plain causal attention."""
    block, L, mask_id = 4, 12, 63
    m = _tiny_model()
    ids = torch.randint(0, 60, (1, L))
    x, pos, _, mask = mars_inputs(ids, torch.full_like(ids, IGNORE), mask_id, block)
    train_logits = m(x, pos, mask)[0]
    for k in range(1, L // block):
        t = block * k - 1                      # last committed token
        inf_ids = torch.cat([ids[:, : t + 1], torch.full((1, block - 1), mask_id)], dim=1)
        inf = m(inf_ids)[0]                    # causal, positions 0..t+block-1
        # slot 1 = row of the last real token = clean row t of the training pass
        torch.testing.assert_close(inf[t], train_logits[L + t], rtol=1e-5, atol=1e-5)
        for j in range(1, block):              # slot j+1 = row of the j-th mask = noisy row t + j
            torch.testing.assert_close(inf[t + j], train_logits[t + j], rtol=1e-5, atol=1e-5)


def test_hf_names_and_config_round_trip(tmp_path):
    m = _tiny_model()
    save_hf(m, tmp_path, model_type="a2d-qwen2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "a2d-qwen2"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_theta", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings", "torch_dtype"):
        assert key in cfg, key
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "lm_head.weight" not in names  # tied
    for suffix in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                   "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                   "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                   "post_attention_layernorm.weight"):
        assert f"model.layers.1.{suffix}" in names, suffix
    m2 = load_hf(tmp_path)
    ids = torch.randint(0, 64, (1, 9))
    torch.testing.assert_close(m(ids), m2(ids))


def test_miniature_training_run_end_to_end(tmp_path):
    """Train a few steps on a few examples with the real pipeline, convert, and compare logits."""
    pytest.importorskip("llama_cpp")
    from tokenizers import Tokenizer

    from prove_local.llama import Context, Model
    from prove_local.train.pipeline import VERIFIER_GGUF, PROPOSER_GGUF, main

    train_rows = [json.loads(l) for l in (ROOT / "prove_local" / "train" / "data" / "gsm8k_train.jsonl").open()][:40]
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps(r) + "\n" for r in train_rows[-4:]))
    out, models = tmp_path / "run", tmp_path / "models"
    summary = main([
        "--out", str(out), "--limit", "16", "--dev-data", str(dev), "--models-dir", str(models),
        "--vocab", "320", "--hidden", "48", "--layers", "2", "--inter", "96", "--heads", "4",
        "--kv-heads", "2", "--v-hidden", "32", "--v-layers", "1", "--v-heads", "2", "--v-kv-heads", "1",
        "--v-inter", "64", "--stage1-epochs", "3", "--stage2-epochs", "2", "--verifier-epochs", "2",
        "--max-tokens", "2048", "--warmup", "2", "--eval-every", "1000", "--final-eval-n", "4",
        "--jobs", "1", "--threads", "1", "--no-progress", "--bf16", "1",
    ])
    for name in ("proposer", "verifier", "baseline"):
        assert (out / "hf" / name / "model.safetensors").exists(), name
    assert json.loads((out / "hf" / "proposer" / "config.json").read_text())["model_type"] == "a2d-qwen2"
    assert (out / "loss_curves.png").exists()
    ev = summary["eval"]
    assert ev["proposer"]["slots_dev200"]["blocks"] > 0
    assert np.isfinite(ev["proposer_vs_baseline_dev_ar_loss_rel"])
    losses = [r["loss"] for r in json.loads((out / "curves" / "proposer_stage1_ar.json").read_text())["log"]]
    assert losses[-1] < losses[0]  # it learns
    # the saved weights are the trained ones: the bf16-autocast dev loss measured inside the training
    # loop matches the F32 dev loss of the saved folder (guards against stale autocast weight caches)
    in_loop = json.loads((out / "curves" / "verifier_ar.json").read_text())["log"][-1]["eval"]["dev_ar_loss"]
    assert abs(in_loop - ev["verifier"]["dev_ar_loss_f32"]) < 0.05

    tok = Tokenizer.from_file(str(out / "hf" / "proposer" / "tokenizer.json"))
    prompt = "<|im_start|>user\nTom has 3 apples and buys 5 more. How many?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt).ids + [tok.token_to_id("<|mask|>")] * 3
    for name, fname, role in (("proposer", PROPOSER_GGUF, "proposer"), ("verifier", VERIFIER_GGUF, "verifier")):
        path = models / fname
        assert path.exists(), summary.get("convert")
        ref = load_hf(out / "hf" / name).eval()
        with torch.no_grad():
            want = ref(torch.tensor([ids]))[0].numpy()
        model = Model(path)
        ctx = Context(model, n_ctx=256, n_threads=1, type_k="f32", type_v="f32", flash_attn=False)
        try:
            got = ctx.eval(ids, list(range(len(ids))))
            assert model.meta("prove.role") == role
            assert model.meta("prove.block_size") == "16"
            if role == "proposer":
                assert model.meta("tokenizer.ggml.mask_token_id") == str(tok.token_to_id("<|mask|>"))
        finally:
            ctx.close()
            model.close()
        assert np.ptp(want) > 0.5  # not flat
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-3)

    # and the exported proposer decodes exactly: lossless equals ar on llama.cpp
    from prove_local.engine import Engine, Settings
    prop = Model(models / PROPOSER_GGUF)
    engine = Engine.load(prop, n_ctx=512, n_threads=1, type_k="f32", type_v="f32")
    prompt_ids = prop.tokenize(prompt)
    out_ids = {mode: [t for c in engine.generate(prompt_ids, Settings(mode=mode, max_new=48)) for t in c.committed]
               for mode in ("ar", "lossless")}
    assert out_ids["lossless"] == out_ids["ar"] and len(out_ids["ar"]) > 0


def test_workers_stop_together():
    """A failing worker stops its sibling; a worker whose parent is gone exits on its own."""
    import multiprocessing as mp
    import sys
    import time

    from prove_local.train import pipeline

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=sys.exit, args=(3,), name="fails"),
             ctx.Process(target=time.sleep, args=(600,), name="sleeps")]
    with pytest.raises(SystemExit, match=r"fails \(exit code 3\)"):
        pipeline._run_workers(procs)
    assert procs[1].exitcode is not None and procs[1].exitcode < 0  # terminated, not finished

    orphan = ctx.Process(target=pipeline._worker, args=(time.sleep, 600, -1))  # -1: never our parent
    orphan.start()
    orphan.join(timeout=120)
    assert orphan.exitcode == 1


def test_distill_miniature_end_to_end(tmp_path):
    """Issue 16 in miniature, on the shipped pair: generate (Engine "ar") -> soft targets -> distil the
    verifier read from its GGUF -> HF folder -> F32 GGUF that llama.cpp loads and computes as torch does."""
    pytest.importorskip("llama_cpp")
    from prove_local.llama import Context, Model
    from prove_local.train import distill

    prop_path, ver_path = distill.PROPOSER, distill.VERIFIER
    if not (prop_path.exists() and ver_path.exists()):
        pytest.skip("embedded models not present")
    text = "<|im_start|>user\nTom has 3 apples and buys 5 more. How many?<|im_end|>\n<|im_start|>assistant\nTom"

    # the GGUF reader maps every tensor (torch logits == llama.cpp logits of the shipped verifier), and
    # the tokenizer rebuilt from the GGUF tokenizes as llama.cpp does
    model, meta = distill.read_gguf_model(ver_path)
    tok = distill.tokenizer_from_gguf(meta)
    ver = Model(ver_path)
    ids = ver.tokenize(text)
    assert tok.encode(text).ids == ids
    ctx = Context(ver, n_ctx=256, n_threads=1, type_k="f32", type_v="f32")
    try:
        want = ctx.eval(ids, list(range(len(ids))))
    finally:
        ctx.close()
    with torch.no_grad():
        got = model.eval()(torch.tensor([ids]))[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-3)

    out, models = tmp_path / "run", tmp_path / "models"
    common = ["--out", str(out), "--n-prompts", "6", "--shard", "4", "--max-new", "12", "--topk", "4", "--samples", "1",
              "--no-progress"]
    # a second process's share of the shards (--part 1/2: shard 1 only), then the rest and training in one call
    part = distill.main(common + ["--stage", "generate", "--part", "1/2"])
    assert part["generate"]["prompts"] == 2 and [p.name for p in (out / "gen").glob("shard_*.npz")] == ["shard_0001.npz"]
    assert (out / "summary.generate-1of2.json").exists()
    with pytest.raises(ValueError, match="--stage generate"):
        distill.main(common + ["--part", "0/2"])
    summary = distill.main(common + ["--epochs", "8", "--max-tokens", "4096", "--lr", "3e-3", "--warmup", "1",
                                     "--val-frac", "0.2", "--soft-weight", "0.5", "--eval-every", "1000", "--install",
                                     "--force", "--models-dir", str(models)])
    gen = summary["generate"]
    assert gen["prompts"] == 4 and sorted(p.name for p in (out / "gen").glob("shard_*.npz")) == \
        ["shard_0000.npz", "shard_0001.npz"]
    # the teacher-forced pass agrees with the greedy tokens it scores (top-1 = the generated token)
    assert gen["argmax_agree"] == gen["tokens"] > 0 and gen["sampled_tokens"] > 0
    data = distill.Data(out / "gen")
    assert [sum(e.loss_mask) for e in data.examples] == [len(t) for t in data.topk_ids]
    assert all(torch.all(lp[:, :-1] >= lp[:, 1:]) for lp in data.topk_logp)    # sorted, descending
    assert data.sampled == [False, True] * 6 and len(set(data.index)) == 6
    # hard targets are the proposer's argmax after each prefix: on a sampled continuation that is not
    # always the sampled token (what greedy would say there), on a greedy one it is
    _, labels, soft_ids, _ = distill._batch_targets(data, list(range(12)), 0)
    assert torch.equal(labels[labels != IGNORE], soft_ids[:, 0])
    cont = lambda e: torch.tensor(data.examples[e].ids[-len(data.topk_ids[e]):])
    assert all(torch.equal(cont(e), data.topk_ids[e][:, 0]) for e in range(0, 12, 2))
    assert any(not torch.equal(cont(e), data.topk_ids[e][:, 0]) for e in range(1, 12, 2))
    tr_idx, va_idx = data.split(0.2)
    assert len(va_idx) == 1 and not data.sampled[va_idx[0]]
    assert data.index[va_idx[0]] not in {data.index[e] for e in tr_idx}    # a held-out prompt: none of its continuations trained on
    # the loss: hard CE on the greedy token mixed with CE against the renormalised top-k
    h = torch.randn(1, 3, 4)
    labels = torch.tensor([[IGNORE, 2, 0]])
    soft_ids, soft_logp = torch.tensor([[2, 1], [0, 3]]), torch.log(torch.tensor([[0.6, 0.2], [0.3, 0.1]]))
    head = SimpleNamespace(logits=lambda x: x @ torch.eye(4))
    loss, hard, agree, rows = distill.distill_loss(head, h, labels, soft_ids, soft_logp, 0.25)
    logp = torch.log_softmax(h[0, 1:], -1)
    want_hard = -(logp[0, 2] + logp[1, 0]) / 2
    want_soft = -((0.75 * logp[0, 2] + 0.25 * logp[0, 1]) + (0.75 * logp[1, 0] + 0.25 * logp[1, 3])) / 2
    assert rows == 2 and agree == int(logp[0].argmax() == 2) + int(logp[1].argmax() == 0)
    torch.testing.assert_close(hard, want_hard)
    torch.testing.assert_close(loss, 0.75 * want_hard + 0.25 * want_soft)

    tr = summary["train"]
    assert tr["train_examples"] == 10 and tr["heldout_examples"] == 1 and tr["steps"] == 8
    log = json.loads((out / "curves" / "distill.json").read_text())["log"]
    assert log[-1]["loss"] < log[0]["loss"]                         # it learns its training set
    assert (out / "loss_curve.png").exists()

    # the converted GGUF: role, vocabulary as the original, llama.cpp logits == the HF folder's, weights moved
    path = models / distill.VERIFIER_GGUF
    assert path.exists() and (out / distill.VERIFIER_GGUF).read_bytes() == path.read_bytes()
    new = Model(path)
    ctx = Context(new, n_ctx=256, n_threads=1, type_k="f32", type_v="f32")
    try:
        assert new.meta("prove.role") == "verifier" and new.meta("prove.block_size") == "16"
        assert new.tokenize(text) == ids
        got_new = ctx.eval(ids, list(range(len(ids))))
    finally:
        ctx.close()
        new.close()
        ver.close()
    import gguf
    r_old, r_new = gguf.GGUFReader(str(ver_path)), gguf.GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert r_old.fields[key].contents() == r_new.fields[key].contents(), key
    with torch.no_grad():
        ref = load_hf(out / "hf" / "verifier").eval()(torch.tensor([ids]))[0].numpy()
    np.testing.assert_allclose(got_new, ref, rtol=1e-4, atol=2e-3)
    assert np.abs(got_new - want).max() > 1e-3
    # a distilled verifier is marked, and distilling it again needs --force
    assert r_new.fields["general.name"].contents().endswith(distill.DISTILLED_SUFFIX)
    with pytest.raises(SystemExit, match="already distilled"):
        distill.main(["--out", str(out), "--stage", "train", "--verifier", str(path), "--no-progress"])


def test_self_distill_targets_hand_computed():
    """Issue 21: clean rows get the proposer's argmax after each prefix; a noisy row gets it only while
    the tokens of its block that it cannot see are greedy decoding's own (prompt tokens count as given)."""
    from prove_local.train.self_distill import self_targets

    ids = [1, 2, 3, 10, 11, 12, 13, 14, 15, 16]         # prompt 0..2, continuation 3..9 (a sampled one)
    greedy = torch.tensor([10, 11, 99, 13, 14, 15, 16])  # argmax after ids[:3 + j]: position 5 left the path
    clean, noisy = self_targets(ids, 3, greedy, block=4)
    I = IGNORE
    assert clean.tolist() == [I, I, 10, 11, 99, 13, 14, 15, 16, I]
    # blocks [0..3] [4..7] [8..11]: row 4 sees nothing of its block but token 4 (on the path) -> kept;
    # rows 5..7 cannot see token 5 (off the path) -> dropped; row 8 starts a new block -> kept
    assert noisy.tolist() == [I, I, 10, 11, 99, I, I, I, 16, I]
    # a greedy continuation: every row keeps its target
    clean, noisy = self_targets([1, 2, 3, 10, 11, 12], 3, torch.tensor([10, 11, 12]), block=2)
    assert torch.equal(clean, noisy) and clean.tolist() == [I, I, 10, 11, 12, I]


def test_mars_loss_targets_matches_mars_loss_and_weights_slots():
    from prove_local.train.mars import mars_loss, mars_loss_targets, slot_weights

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 39, (2, 11))
    lm = torch.zeros_like(ids)
    lm[:, 5:] = 1
    labels = shift_targets(ids, lm)
    want = mars_loss(model, ids, lm, 39, 4)
    got = mars_loss_targets(model, ids, labels, labels, 39, 4)
    for w, g in zip(want, got):
        torch.testing.assert_close(w, g)
    assert slot_weights(11, 4, 4, 0.5).tolist() == [1, 0.5, 0.25, 0.125, 1, 0.5, 0.25]
    # with every noisy row but one dropped, the weighting cannot matter; dropping rows changes the noisy term
    one = torch.full_like(labels, IGNORE)
    one[0, 6] = labels[0, 6]
    a = mars_loss_targets(model, ids, labels, one, 39, 4, slot_decay=0.3)
    b = mars_loss_targets(model, ids, labels, one, 39, 4)
    torch.testing.assert_close(a[1], b[1])
    assert abs(float(b[1]) - float(want[1])) > 1e-4
    torch.testing.assert_close(a[2], want[2])              # the clean term is untouched
    # soft clean targets: a one-hot teacher is the hard CE; a two-token one is the mixed CE
    y = labels[labels != IGNORE]
    other = (y + 1) % 40
    onehot = (torch.stack([y, other], 1), torch.tensor([[0.0, -1e4]]).expand(len(y), 2))
    torch.testing.assert_close(mars_loss_targets(model, ids, labels, labels, 39, 4, clean_soft=onehot)[2], want[2])
    mix = (onehot[0], torch.log(torch.tensor([[0.75, 0.25]])).expand(len(y), 2))
    got_mix = mars_loss_targets(model, ids, labels, labels, 39, 4, clean_soft=mix)[2]
    x, pos, _, m = mars_inputs(ids, labels, 39, 4, 4)
    logp = torch.log_softmax(model.logits(model.hidden(x, pos, m)[:, -11:][labels != IGNORE]), -1)
    want_mix = -(0.75 * logp.gather(1, y[:, None]) + 0.25 * logp.gather(1, other[:, None])).mean()
    torch.testing.assert_close(got_mix, want_mix)


def test_self_distill_miniature_end_to_end(tmp_path):
    """Issue 21 in miniature, on the shipped proposer: generate -> MARS training on greedy targets (+ the
    reference AR term, slot weights) -> a2d HF folder -> F32 GGUF that llama.cpp loads, computes as torch
    does, and decodes exactly (lossless == ar)."""
    pytest.importorskip("llama_cpp")
    from prove_local.engine import Engine, Settings
    from prove_local.llama import Context, Model
    from prove_local.train import distill, self_distill

    if not distill.PROPOSER.exists():
        pytest.skip("embedded proposer not present")
    train_rows = [json.loads(l) for l in (ROOT / "prove_local" / "train" / "data" / "gsm8k_train.jsonl").open()]
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps(r) + "\n" for r in train_rows[-3:]))
    out, models = tmp_path / "run", tmp_path / "models"
    common = ["--out", str(out), "--n-prompts", "6", "--shard", "3", "--max-new", "24", "--samples", "1",
              "--dev-data", str(dev), "--no-progress"]
    part = self_distill.main(common + ["--stage", "generate", "--part", "1/2"])
    assert part["generate"]["prompts"] == 3 and [p.name for p in (out / "gen").glob("shard_*.npz")] == ["shard_0001.npz"]
    with pytest.raises(ValueError, match="--stage generate"):
        self_distill.main(common + ["--part", "0/2"])
    with pytest.raises(SystemExit, match="not a MARS proposer"):
        self_distill.main(common + ["--proposer", str(distill.VERIFIER)])
    summary = self_distill.main(common + ["--epochs", "10", "--lr", "3e-3", "--warmup", "1", "--val-frac", "0.2",
                                          "--ref-weight", "0.5", "--slot-decay", "0.8", "--eval-every", "5",
                                          "--install", "--models-dir", str(models)])
    tr = summary["train"]
    assert tr["train_prompts"] == 5 and tr["heldout_examples"] == 1 and tr["train_examples"] == 10
    # the GGUF read into torch reproduces llama.cpp's greedy tokens (the data's teacher is this model)
    assert tr["before_f32"]["slot_acc"][0] >= self_distill.MIN_AGREEMENT
    # sampled continuations leave the greedy path, so some noisy rows have no target; clean rows all do
    assert 0 < tr["noisy_rows_with_target"] < tr["rows"]
    log = json.loads((out / "curves" / "self-distill.json").read_text())["log"]
    assert {"noisy", "clean", "ref"} <= set(log[0])
    first, last = (sum(r["noisy"] for r in log[i:i + 5]) / 5 for i in (0, len(log) - 5))
    assert last < first                                          # it learns the greedy targets
    assert (out / "loss_curve.png").exists()
    assert np.isfinite(tr["after_f32"]["dev_ar_loss"]) and tr["dev_references"] == 3

    path = models / self_distill.PROPOSER_GGUF
    assert path.exists() and (out / self_distill.PROPOSER_GGUF).read_bytes() == path.read_bytes()
    text = "<|im_start|>user\nTom has 3 apples and buys 5 more. How many?<|im_end|>\n<|im_start|>assistant\nTom"
    new = Model(path)
    ids = new.tokenize(text) + [int(new.meta("tokenizer.ggml.mask_token_id"))] * 3
    ctx = Context(new, n_ctx=256, n_threads=1, type_k="f32", type_v="f32")
    try:
        assert new.meta("prove.role") == "proposer" and new.meta("prove.block_size") == "16"
        assert new.meta("general.name").endswith(self_distill.SUFFIX)
        got = ctx.eval(ids, list(range(len(ids))))
    finally:
        ctx.close()
    with torch.no_grad():
        ref = load_hf(out / "hf" / "proposer").eval()(torch.tensor([ids]))[0].numpy()
    assert json.loads((out / "hf" / "proposer" / "config.json").read_text())["model_type"] == "a2d-qwen2"
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-3)
    engine = Engine.load(new, n_ctx=512, n_threads=1, type_k="f32", type_v="f32")
    prompt = new.tokenize(text[:-3])
    outs = {m: [t for c in engine.generate(prompt, Settings(mode=m, max_new=40)) for t in c.committed]
            for m in ("ar", "lossless")}
    engine.contexts["target"].close()
    new.close()
    assert outs["lossless"] == outs["ar"] and len(outs["ar"]) > 0
