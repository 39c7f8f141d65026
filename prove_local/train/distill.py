"""Distil the embedded verifier on the proposer's own outputs (the ProVe paper: a verifier
fine-tuned on the proposer's outputs commits 6-10 % more tokens per cycle at the same error rate).

    python -m prove_local.train.distill --out runs/distill

Stages (seeded; one torch thread and one llama.cpp thread by default):
1. generate: the proposer GGUF's greedy continuations (prove_local.engine.Engine, mode "ar") of a
   seeded random subset of the GSM8K train prompts, plus `--samples` sampled ones per prompt (at
   `--temperature`, seeded), written in shards (`gen/shard_*.npz`, resumable; `--part i/n` splits the
   shards over n processes). A second, teacher-forced pass of the proposer over prompt + continuation
   (one batched decode) records its top-k next-token log-probabilities at every continuation position.
2. train: the verifier GGUF's F32 weights, read with gguf-py into the torch model (names through the
   converter's own table, prove_local.convert.export), fine-tuned on those continuations:
   (1 - α) · CE(proposer's greedy token) + α · CE(proposer's top-k distribution, renormalised);
   α = 0 by default (sequence-level distillation), see --soft-weight. The hard target at every position
   is the proposer's argmax there (its top-1 from the teacher-forced pass): the token itself on a greedy
   continuation, and on a sampled one what greedy decoding would say after that prefix, so q learns
   P(token = the proposer's greedy token | prefix) on prefixes that leave the greedy path too.
   The last `--val-frac` of the prompts are held out: loss and top-1 agreement with the proposer,
   on their greedy continuations.
3. export: Hugging Face folder (weights + a tokenizer rebuilt from the GGUF's own vocabulary and
   merges) and an F32 GGUF through prove_local.convert.convert_checkpoint, both written atomically;
   `--install` also replaces prove_local/models/gsm8k-verifier.gguf.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..chat import Conversation
from ..convert import convert_checkpoint, export
from ..engine import Engine, Settings
from ..errors import ProveError
from ..llama import Context, Model
from .mars import IGNORE, Example, StageSpec, collate, load_jsonl, make_batches, shift_targets, train_stage
from .model import Qwen2Config, Qwen2ForCausalLM, save_hf
from .tokenizer import QWEN2_PATTERN, save_hf_tokenizer

PACKAGE = Path(__file__).resolve().parents[1]          # prove_local/
DEFAULT_TRAIN = PACKAGE / "train" / "data" / "gsm8k_train.jsonl"
MODELS_DIR = PACKAGE / "models"
PROPOSER = MODELS_DIR / "mars-gsm8k-proposer.gguf"
VERIFIER = MODELS_DIR / "gsm8k-verifier.gguf"
VERIFIER_GGUF = "gsm8k-verifier.gguf"
DISTILLED_SUFFIX = "-distilled"     # general.name of a distilled verifier ends with it


def add_generation_args(p, *, what: str) -> None:
    """The generation stage's options (shared with self_distill.py, which runs the same stage)."""
    p.add_argument("--out", default=f"runs/{what}")
    p.add_argument("--proposer", default=str(PROPOSER), help="proposer GGUF (the teacher)")
    p.add_argument("--train-data", default=str(DEFAULT_TRAIN))
    p.add_argument("--n-prompts", type=int, default=10**9, help="train prompts to continue (a seeded subset; default %(default)s: all of them if more)")
    p.add_argument("--max-new", type=int, default=256, help="max new tokens per continuation")
    p.add_argument("--topk", type=int, default=8, help="proposer log-probs kept per position (soft targets)")
    p.add_argument("--shard", type=int, default=250, help="prompts per generation shard")
    p.add_argument("--samples", type=int, default=1, help="sampled continuations per prompt, besides the greedy one")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled continuations")
    p.add_argument("--part", default="0/1", help="i/n: generate only shards s with s %% n == i (n processes in parallel)")
    p.add_argument("--gen-minutes", type=float, default=0.0,
                   help="stop generating after this many minutes, at a shard boundary (0: no limit)")
    p.add_argument("--ctx", type=int, default=1024, help="llama.cpp context for generation")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m prove_local.train.distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generation_args(p, what="distill")
    p.add_argument("--verifier", default=str(VERIFIER),
                   help="verifier GGUF to start from (F32; the one `python -m prove_local.train` writes, or the "
                        "pre-distillation file from git history; not an already distilled one)")
    p.add_argument("--force", action="store_true", help="start from an already distilled verifier anyway")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--soft-weight", type=float, default=0.0,
                   help="α: weight of the soft-target term (default 0: the gate wants P(token = the proposer's "
                        "greedy token), which hard targets estimate; soft targets pull q toward the proposer's "
                        "own probability, a weaker detector (lossless bench: AUC 0.745 for the proposer's q)")
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--bf16", type=int, default=1, help="bf16 autocast for matmuls (weights stay f32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads and llama.cpp threads")
    p.add_argument("--stage", choices=("all", "generate", "train"), default="all")
    p.add_argument("--install", action="store_true",
                   help=f"also replace {VERIFIER} with the distilled verifier (atomically)")
    p.add_argument("--models-dir", default=str(MODELS_DIR), help="where --install writes")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- GGUF -> torch

def _fields(reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # pragma: no cover - fields gguf-py cannot decode are not needed here
            pass
    return out


def read_gguf_model(path) -> tuple[Qwen2ForCausalLM, dict]:
    """A Qwen2 F32 GGUF as the torch model (tensor names through the converter's table, inverted).
    Returns (model, GGUF metadata)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    meta = _fields(r)
    arch = meta.get("general.architecture")
    if arch != "qwen2":
        raise ValueError(f"{path}: architecture {arch!r}; distillation supports qwen2 verifiers")
    a = "qwen2."
    cfg = Qwen2Config(
        vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=int(meta[a + "embedding_length"]),
        intermediate_size=int(meta[a + "feed_forward_length"]), num_hidden_layers=int(meta[a + "block_count"]),
        num_attention_heads=int(meta[a + "attention.head_count"]),
        num_key_value_heads=int(meta[a + "attention.head_count_kv"]),
        rms_norm_eps=float(meta[a + "attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta[a + "rope.freq_base"]), max_position_embeddings=int(meta[a + "context_length"]),
        tie_word_embeddings=not any(t.name == "output.weight" for t in r.tensors))
    names = {g: hf for hf, (g, _) in export.GLOBAL.items()}
    layer = {**export.LAYER, **export.LAYER_BY_ARCH[gguf.MODEL_ARCH.QWEN2]}
    for i in range(cfg.num_hidden_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{hf}" for hf, (g, _) in layer.items()})
    sd = {}
    for t in r.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: tensor {t.name} is {t.tensor_type.name}; distillation needs an F32 verifier")
        if t.name not in names:
            raise ValueError(f"{path}: tensor {t.name} maps to no Qwen2 parameter")
        sd[names[t.name]] = torch.from_numpy(np.array(t.data, dtype=np.float32))
    model = Qwen2ForCausalLM(cfg)
    model.load_state_dict(sd, strict=True)
    return model, meta


def tokenizer_from_gguf(meta: dict):
    """The HF `tokenizers` byte-level BPE equal to the GGUF's (tokens, merges, control/user tokens),
    built like train.tokenizer.train_byte_bpe, so the converter writes back the same vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if int(ty) == 1}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=normal, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if int(ty) in (3, 4):                                  # CONTROL / USER_DEFINED, in id order
            (tok.add_special_tokens if int(ty) == 3 else tok.add_tokens)([t])
            if tok.token_to_id(t) != i:
                raise ValueError(f"token {t!r}: GGUF id {i}, rebuilt tokenizer id {tok.token_to_id(t)}")
    return tok


# --------------------------------------------------------------------------- 1. generation

def prompt_order(n_rows: int, n: int, seed: int) -> list[int]:
    """The seeded subset of train prompts, in the order they are generated (a prefix is a subset)."""
    order = list(range(n_rows))
    random.Random(seed).shuffle(order)
    return order[: min(n, n_rows)]


def topk_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (descending) and their log-softmax values per row."""
    ids = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logits, ids, axis=1)
    order = np.argsort(-vals, axis=1)
    ids, vals = np.take_along_axis(ids, order, axis=1), np.take_along_axis(vals, order, axis=1)
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    return ids, vals - lse


def generate(a) -> dict:
    """Greedy continuations + top-k soft targets, shard by shard (existing shards are kept)."""
    from tqdm import tqdm

    rows = load_jsonl(a.train_data)
    order = prompt_order(len(rows), a.n_prompts, a.seed)
    gdir = Path(a.out) / "gen"
    gdir.mkdir(parents=True, exist_ok=True)
    part, n_parts = (int(x) for x in a.part.split("/"))
    if not 0 <= part < n_parts:
        raise ValueError(f"--part {a.part}: want i/n with 0 <= i < n")
    _dump(gdir / "spec.json", {"proposer": str(a.proposer), "train_data": str(a.train_data), "order": order,
                               "max_new": a.max_new, "topk": a.topk, "seed": a.seed, "samples": a.samples,
                               "temperature": a.temperature})
    # closed at the end of the block in reverse order: the scorer, the engine's context, the model
    with Model(a.proposer) as prop, \
            Engine.load(prop, n_ctx=a.ctx, n_threads=a.threads, type_k="f32", type_v="f32") as engine, \
            Context(prop, n_ctx=a.ctx, n_threads=a.threads, type_k="f32", type_v="f32") as scorer:
        greedy = Settings(mode="ar", max_new=a.max_new)
        t0 = time.time()
        stats = {"prompts": 0, "tokens": 0, "sampled_tokens": 0, "argmax_agree": 0, "seconds": 0.0, "stopped_early": False}
        shards = [order[i:i + a.shard] for i in range(0, len(order), a.shard)]
        mine = [s for s in range(len(shards)) if s % n_parts == part]
        bar = tqdm(total=sum(len(shards[s]) for s in mine), desc="generate", unit="prompt", disable=a.no_progress,
                   mininterval=5.0)
        try:
            for s in mine:
                idxs = shards[s]
                path = gdir / f"shard_{s:04d}.npz"
                if path.exists():
                    bar.update(len(idxs))
                    continue
                if a.gen_minutes and time.time() - t0 > a.gen_minutes * 60:
                    stats["stopped_early"] = True
                    break
                index, kind, plen, clen, toks, tk_ids, tk_lp = [], [], [], [], [], [], []
                for i in idxs:
                    prompt = Conversation(prop).prompt_tokens(rows[i]["question"])
                    runs = [(0, greedy)] + [(1, Settings(mode="ar", max_new=a.max_new, temperature=a.temperature,
                                                         top_k=0, top_p=1.0, min_p=0.0, seed=a.seed * 1_000_003 + i * 101 + j))
                                            for j in range(a.samples)]
                    for k, settings in runs:
                        cont = [t for c in engine.generate(prompt, settings) for t in c.committed]
                        # teacher-forced pass: the row before each continuation token predicts it
                        scorer.truncate(0)
                        seq = prompt + cont
                        logits = scorer.eval(seq, rows=list(range(len(prompt) - 1, len(seq) - 1)))
                        ids, lp = topk_logprobs(logits, a.topk)
                        if k == 0:
                            stats["argmax_agree"] += int((ids[:, 0] == np.array(cont)).sum())
                            stats["tokens"] += len(cont)
                        else:
                            stats["sampled_tokens"] += len(cont)
                        index.append(i); kind.append(k); plen.append(len(prompt)); clen.append(len(cont)); toks.extend(seq)
                        tk_ids.append(ids.astype(np.int32)); tk_lp.append(lp.astype(np.float32))
                    stats["prompts"] += 1
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{(stats['tokens'] + stats['sampled_tokens']) / max(time.time() - t0, 1e-9):.0f}",
                                    refresh=False)
                tmp = path.with_name(path.stem + ".tmp.npz")
                with open(tmp, "wb") as f:
                    np.savez(f, index=np.array(index, dtype=np.int32), kind=np.array(kind, dtype=np.int8), prompt_len=np.array(plen, dtype=np.int32),
                             cont_len=np.array(clen, dtype=np.int32), tokens=np.array(toks, dtype=np.int32),
                             topk_ids=np.concatenate(tk_ids), topk_logp=np.concatenate(tk_lp))
                os.replace(tmp, path)
        finally:
            bar.close()
    stats["seconds"] = round(time.time() - t0, 1)
    stats["tokens_per_s"] = round((stats["tokens"] + stats["sampled_tokens"]) / max(stats["seconds"], 1e-9), 1)
    print(f"[generate] {json.dumps(stats)}", flush=True)
    return stats


# --------------------------------------------------------------------------- 2. training

class Data:
    """Examples (prompt + continuation, loss on the continuation) and their soft targets: the rows of
    `topk_*[e]` are in the order of the example's labelled positions (as shift_targets selects them)."""

    def __init__(self, gdir: Path):
        self.examples: list[Example] = []
        self.topk_ids: list[torch.Tensor] = []
        self.topk_logp: list[torch.Tensor] = []
        self.index: list[int] = []
        self.sampled: list[bool] = []
        for path in sorted(gdir.glob("shard_*.npz")):
            if ".tmp" in path.name:
                continue
            z = np.load(path)
            kinds = z["kind"] if "kind" in z.files else np.zeros(len(z["index"]), dtype=np.int8)
            t0 = k0 = 0
            for i, k, pl, cl in zip(z["index"], kinds, z["prompt_len"], z["cont_len"]):
                ids = z["tokens"][t0:t0 + pl + cl].tolist()
                self.examples.append(Example(ids, [0] * int(pl) + [1] * int(cl)))
                self.topk_ids.append(torch.from_numpy(z["topk_ids"][k0:k0 + cl].astype(np.int64)))
                self.topk_logp.append(torch.from_numpy(z["topk_logp"][k0:k0 + cl].astype(np.float32)))
                self.index.append(int(i))
                self.sampled.append(bool(k))
                t0, k0 = t0 + pl + cl, k0 + cl

    def split(self, val_frac: float):
        """(train, held-out) example indices: the prompts of the last `val_frac` of the prompts, all of their
        continuations held out; the held-out list has their greedy continuations only."""
        prompts = list(dict.fromkeys(self.index))
        n_val = max(1, int(round(len(prompts) * val_frac))) if len(prompts) > 1 else 0
        held = set(prompts[len(prompts) - n_val:])
        train = [e for e, i in enumerate(self.index) if i not in held]
        val = [e for e, i in enumerate(self.index) if i in held and not self.sampled[e]]
        return train, val


def distill_loss(model, h: torch.Tensor, labels: torch.Tensor, soft_ids: torch.Tensor, soft_logp: torch.Tensor,
                 alpha: float):
    """(1-α)·CE(label) + α·CE(teacher top-k, renormalised) over the labelled rows of h [B, T, H].
    Returns (loss, hard CE, top-1 agreement count, rows)."""
    sel = labels != IGNORE
    logits = model.logits(h[sel]).float()
    y = labels[sel]
    logp = F.log_softmax(logits, dim=-1)
    hard = F.nll_loss(logp, y)
    loss = hard
    if alpha > 0:
        target = torch.softmax(soft_logp, dim=-1)                   # renormalised over the top k
        soft = -(target * logp.gather(1, soft_ids)).sum(-1).mean()
        loss = (1 - alpha) * hard + alpha * soft
    agree = int((logits.argmax(-1) == y).sum())
    return loss, hard.detach(), agree, int(sel.sum())


def _batch_targets(data: Data, idx: list[int], pad_id: int):
    """Inputs, hard targets (the proposer's argmax at every continuation position) and soft targets."""
    ids, lm = collate(data.examples, idx, pad_id)
    labels = shift_targets(ids, lm)
    soft_ids = torch.cat([data.topk_ids[i] for i in idx])
    labels[labels != IGNORE] = soft_ids[:, 0]          # rows in the same order (example, then position)
    return ids, labels, soft_ids, torch.cat([data.topk_logp[i] for i in idx])


@torch.no_grad()
def evaluate(model, data: Data, idx: list[int], pad_id: int, alpha: float, max_tokens: int = 8192) -> dict:
    """Held-out loss, hard CE (nats/token) and top-1 agreement with the proposer's greedy token."""
    model.eval()
    sub = [data.examples[i] for i in idx]
    tot = hard = agree = n = 0.0
    for b in make_batches(sub, max_tokens, random.Random(0)):
        ids, labels, si, sl = _batch_targets(data, [idx[j] for j in b], pad_id)
        loss, hd, ag, rows = distill_loss(model, model.hidden(ids), labels, si, sl, alpha)
        tot += float(loss) * rows; hard += float(hd) * rows; agree += ag; n += rows
    model.train()
    return {"loss": round(tot / max(n, 1), 4), "hard_ce": round(hard / max(n, 1), 4),
            "top1_agree": round(agree / max(n, 1), 4), "tokens": int(n)}


def plot_curve(log: list, evals: list, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:        # matplotlib comes with the bench/test extras, not train
        print(f"no loss curve plot ({e}); pip install matplotlib", flush=True)
        return

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    xs = [r["step"] for r in log]
    k = 25
    ma = [sum(r["loss"] for r in log[max(0, i - k + 1): i + 1]) / min(k, i + 1) for i in range(len(log))]
    ax[0].plot(xs, ma, label="train loss (moving average, 25 steps)")
    ax[0].plot(xs, [sum(r["hard"] for r in log[max(0, i - k + 1): i + 1]) / min(k, i + 1) for i in range(len(log))],
               label="train hard CE (moving average)")
    ex = [e["step"] for e in evals]
    ax[0].plot(ex, [e["hard_ce"] for e in evals], marker="o", label="held-out hard CE")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("nats/token"); ax[0].set_title("distillation loss")
    ax[1].plot(ex, [e["top1_agree"] for e in evals], marker="o")
    ax[1].set_xlabel("step"); ax[1].set_ylabel("share of tokens")
    ax[1].set_title("held-out: verifier argmax = proposer's greedy token")
    for x in ax:
        x.grid(alpha=0.3); x.legend(fontsize=8) if x is ax[0] else None
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def train(a) -> dict:
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    data = Data(out / "gen")
    if not data.examples:
        raise SystemExit(f"{out / 'gen'}: no generated shards; run with --stage generate first")
    model, meta = read_gguf_model(a.verifier)
    if str(meta.get("general.name", "")).endswith(DISTILLED_SUFFIX) and not a.force:
        raise SystemExit(f"{a.verifier}: already distilled (general.name {meta['general.name']!r}); start from the "
                         "verifier of `python -m prove_local.train` (or `git show 0c6ce41:prove_local/models/"
                         "gsm8k-verifier.gguf`), or pass --force")
    pad_id = int(meta.get("tokenizer.ggml.padding_token_id", 0))
    tr, va = data.split(a.val_frac)
    train_ex = [data.examples[i] for i in tr]
    n_batches = len(make_batches(train_ex, a.max_tokens, random.Random(0)))
    spec = StageSpec("distill", max(1, int(round(n_batches * a.epochs))), lr=a.lr, warmup=a.warmup,
                     max_tokens=a.max_tokens)
    evals = [{"step": 0, **evaluate(model, data, va, pad_id, a.soft_weight)}] if va else []
    print(f"[train] {len(tr)} train / {len(va)} held-out continuations; {spec.steps} steps "
          f"({a.epochs} epochs of {n_batches} batches); before: {json.dumps(evals[-1] if evals else {})}", flush=True)

    def loss_fn(m, idx, ids, lm):
        ids, labels, si, sl = _batch_targets(data, [tr[j] for j in idx], pad_id)
        loss, hard, _, _ = distill_loss(m, m.hidden(ids), labels, si, sl, a.soft_weight)
        return loss, {"hard": float(hard)}

    def eval_fn(m):
        e = evaluate(m, data, va, pad_id, a.soft_weight)
        evals.append({"step": len(log) + 1, **e})
        return e

    log: list = []
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    t0 = time.time()
    # cache_enabled=False: see pipeline._Ctx.autocast (stale bf16 weight copies otherwise)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(a.bf16), cache_enabled=False):
        train_stage(model, train_ex, spec, pad_id=pad_id, mask_id=-1, seed=a.seed + 1, log=log, name="distill",
                    eval_fn=eval_fn if va else None, eval_every=a.eval_every, progress=not a.no_progress,
                    loss_fn=loss_fn)
    secs = time.time() - t0
    toks = log[-1]["tokens"] if log else 0
    final = evaluate(model, data, va, pad_id, a.soft_weight) if va else {}
    curve = {"name": "distill", "spec": asdict(spec), "seconds": round(secs, 1), "tokens": toks,
             "tokens_per_s": round(toks / max(secs, 1e-9), 1), "log": log, "evals": evals}
    _dump(out / "curves" / "distill.json", curve)
    plot_curve(log, evals, out / "loss_curve.png")
    export_dir = save_verifier(model, meta, out, pad_id)
    return {"train_examples": len(tr), "heldout_examples": len(va), "steps": spec.steps, "epochs": a.epochs,
            "seconds": round(secs, 1), "tokens": toks, "tokens_per_s": curve["tokens_per_s"],
            "heldout_before": evals[0] if evals else None, "heldout_after_f32": final,
            "final_train_loss_avg50": round(sum(r["loss"] for r in log[-50:]) / max(len(log[-50:]), 1), 4),
            "hf": str(export_dir)}


# --------------------------------------------------------------------------- 3. export

def save_model(model, meta: dict, out: Path, pad_id: int, *, folder: str = "verifier", model_type: str = "qwen2",
               suffix: str = DISTILLED_SUFFIX, extra: dict | None = None) -> Path:
    """HF folder out/hf/<folder> (weights, config, tokenizer rebuilt from the GGUF), written atomically;
    its general.name (through _name_or_path) is the GGUF's own name + `suffix`."""
    tok = tokenizer_from_gguf(meta)
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    d, tmp = out / "hf" / folder, out / "hf" / (folder + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tmp, model_type=model_type,
            extra_config={"bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad_id,
                          "_name_or_path": str(meta.get("general.name") or folder) + suffix, **(extra or {})})
    mask = meta.get("tokenizer.ggml.mask_token_id")
    save_hf_tokenizer(tok, tmp, mask_token=tok.id_to_token(int(mask)) if mask is not None else None)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "pad_token_id": pad_id, "do_sample": False}, indent=2))
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    return d


def save_verifier(model, meta: dict, out: Path, pad_id: int) -> Path:
    return save_model(model, meta, out, pad_id)


def convert_and_install(hf_dir: Path, out: Path, fname: str, role: str, block: int, install: bool,
                        models_dir, progress: bool) -> dict:
    """out/<fname> (F32 GGUF) from the HF folder; with `install` also models_dir/<fname>, replaced atomically."""
    dst = convert_checkpoint(hf_dir, out / fname, outtype="f32", role=role, block_size=block, progress=progress)
    res = {"gguf": str(dst), "bytes": dst.stat().st_size}
    if install:
        models = Path(models_dir)
        models.mkdir(parents=True, exist_ok=True)
        tmp = models / (fname + ".tmp")
        shutil.copyfile(dst, tmp)
        os.replace(tmp, models / fname)
        res["installed"] = str(models / fname)
    return res


def convert(a, block: int) -> dict:
    """out/gsm8k-verifier.gguf (F32) from the HF folder; with --install also the embedded file."""
    out = Path(a.out)
    return convert_and_install(out / "hf" / "verifier", out, VERIFIER_GGUF, "verifier", block, a.install,
                               a.models_dir, not a.no_progress)


def run_stages(a, train_stage, convert_stage) -> dict:
    """The stages of a distillation run (this module's, and self_distill's): generate (this module's
    `generate`, or a share of it with --part), then `train_stage(a)` and `convert_stage(a, summary)`;
    OUT/summary.json rewritten after each stage (one per part for a parallel generation)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    summary_path = out / "summary.json"
    if a.part != "0/1":          # parallel generation: one summary per part, no training
        if a.stage != "generate":
            raise ValueError(f"--part {a.part} generates a share of the shards: use it with --stage generate, "
                             "then run --stage train once")
        summary_path = out / f"summary.generate-{a.part.replace('/', 'of')}.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary["args"] = vars(a)
    if a.stage in ("all", "generate"):
        summary["generate"] = generate(a)
        _dump(summary_path, summary)
    if a.stage in ("all", "train"):
        summary["train"] = train_stage(a)
        _dump(summary_path, summary)
        summary["convert"] = convert_stage(a, summary)
        _dump(summary_path, summary)
    summary["wall_seconds_this_call"] = round(time.time() - t0, 1)
    _dump(summary_path, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "args"}, indent=1, default=str), flush=True)
    return summary


def main(argv=None):
    def convert_stage(a, summary):
        _, meta = read_gguf_model(a.verifier)
        return convert(a, int(meta.get("prove.block_size", 16)))
    return run_stages(parse_args(argv), train, convert_stage)


def cli(argv=None):
    """`python -m prove_local.train.distill`: bad input ends with one line naming it, exit code 1."""
    try:
        main(argv)
    except (ProveError, ValueError, OSError) as e:
        raise SystemExit(f"distill: {e}") from None


if __name__ == "__main__":
    cli()
