"""MARS training recipe (stage 1 AR SFT, stage 2 block training) on chat-formatted GSM8K.

The pieces the tests pin down are small pure functions:
- `shift_targets`: right-shifted labels (the output at position p predicts token p+1).
- `mars_attention_mask`: the [noisy | clean] mask (clean causal; a noisy position in block
  k = pos // B sees clean tokens < B*k and noisy positions of its own block up to itself).
- `mars_inputs`: builds ids / position ids / labels for the [noisy | clean] sequence.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .model import Qwen2Config, Qwen2ForCausalLM

IGNORE = -100


# --------------------------------------------------------------------------- data

def load_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_segments(question: str, answer: str) -> tuple[str, str]:
    """(prompt, completion) as the ChatML template renders [user, assistant].

    prompt = what `apply_chat_template(..., add_generation_prompt=True)` gives for the user turn;
    completion = the assistant content followed by <|im_end|> (the loss covers exactly this).
    """
    prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return prompt, f"{answer}<|im_end|>"


def encode_example(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask (1 on assistant tokens incl. <|im_end|>)."""
    prompt, completion = chat_segments(question, answer)
    p = tok.encode(prompt, add_special_tokens=False).ids
    c = tok.encode(completion, add_special_tokens=False).ids
    return p + c, [0] * len(p) + [1] * len(c)


def shift_targets(ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """labels[..., p] = ids[..., p+1] where loss_mask[..., p+1] else IGNORE; the last is IGNORE."""
    labels = torch.full_like(ids, IGNORE)
    nxt = ids[..., 1:]
    labels[..., :-1] = torch.where(loss_mask[..., 1:].bool(), nxt, torch.full_like(nxt, IGNORE))
    return labels


def mars_attention_mask(L: int, block: int, noisy_start: int = 0) -> torch.Tensor:
    """Boolean mask (True = may attend) for the sequence [noisy | clean].

    clean: positions 0..L-1 (causal). noisy: positions noisy_start..L-1 (noisy_start a multiple
    of `block`), laid out first. A noisy query at position p (block k = p // block) attends to
    clean keys at positions < block*k and to noisy keys q with block*k <= q <= p.
    Shape [(L - noisy_start) + L, (L - noisy_start) + L].
    """
    assert noisy_start % block == 0
    npos = torch.arange(noisy_start, L)
    cpos = torch.arange(L)
    Ln = len(npos)
    m = torch.zeros(Ln + L, Ln + L, dtype=torch.bool)
    # clean -> clean: causal
    m[Ln:, Ln:] = cpos[None, :] <= cpos[:, None]
    # noisy -> clean: earlier blocks only
    bstart = (npos // block) * block
    m[:Ln, Ln:] = cpos[None, :] < bstart[:, None]
    # noisy -> noisy: same block, up to itself
    same = (npos[None, :] // block) == (npos[:, None] // block)
    m[:Ln, :Ln] = same & (npos[None, :] <= npos[:, None])
    return m


def mars_inputs(ids: torch.Tensor, labels: torch.Tensor, mask_id: int, block: int, noisy_start: int = 0):
    """[noisy | clean] ids, position ids, labels and the attention mask for a batch [B, L].

    Noisy tokens are all `mask_id` and carry the same position ids (and the same right-shifted
    labels) as the clean tokens at those positions.
    """
    B, L = ids.shape
    noisy = torch.full((B, L - noisy_start), mask_id, dtype=ids.dtype)
    x = torch.cat([noisy, ids], dim=1)
    pos = torch.cat([torch.arange(noisy_start, L), torch.arange(L)]).expand(B, -1)
    y = torch.cat([labels[:, noisy_start:], labels], dim=1)
    return x, pos, y, mars_attention_mask(L, block, noisy_start)


@dataclass
class Example:
    ids: list[int]
    loss_mask: list[int]


def make_batches(examples: list[Example], max_tokens: int, rng: random.Random, max_batch: int = 64):
    """Length-bucketed batches (about max_tokens padded tokens each), in shuffled order."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        L = len(examples[i].ids)
        if cur and (max(cur_max, L) * (len(cur) + 1) > max_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(examples: list[Example], idx: list[int], pad_id: int):
    L = max(len(examples[i].ids) for i in idx)
    ids = torch.full((len(idx), L), pad_id, dtype=torch.long)
    lm = torch.zeros((len(idx), L), dtype=torch.long)
    for r, i in enumerate(idx):
        e = examples[i]
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
        lm[r, : len(e.ids)] = torch.tensor(e.loss_mask)
    return ids, lm


# --------------------------------------------------------------------------- losses

def _ce_at_labels(model: Qwen2ForCausalLM, h: torch.Tensor, y: torch.Tensor):
    """Mean CE over labelled rows only (the LM head runs only where a label exists)."""
    sel = y != IGNORE
    if not sel.any():
        return h.sum() * 0.0, 0
    logits = model.logits(h[sel])
    return F.cross_entropy(logits.float(), y[sel]), int(sel.sum())


def ar_loss(model, ids, loss_mask):
    labels = shift_targets(ids, loss_mask)
    h = model.hidden(ids)
    return _ce_at_labels(model, h, labels)[0]


def mars_loss(model, ids, loss_mask, mask_id: int, block: int, ar_weight: float = 1.0):
    """CE(noisy) + ar_weight * CE(clean). Noisy rows start at the first block that has a label."""
    labels = shift_targets(ids, loss_mask)
    return mars_loss_targets(model, ids, labels, labels, mask_id, block, ar_weight)


def slot_weights(L: int, block: int, noisy_start: int, decay: float) -> torch.Tensor:
    """Weight of each noisy row: decay ** (slot - 2), where the noisy row at position p is slot
    p % block + 2 of its block's proposal (slot 1 is the clean row before the block)."""
    return decay ** (torch.arange(noisy_start, L) % block).float()


def mars_loss_targets(model, ids, clean_labels, noisy_labels, mask_id: int, block: int, ar_weight: float = 1.0,
                      slot_decay: float = 1.0, clean_soft: tuple | None = None):
    """MARS loss with separate targets for the clean rows and the noisy rows (both right-shifted, IGNORE
    where a row has no target): CE(noisy) + ar_weight * CE(clean). With slot_decay < 1 the noisy rows'
    CE is a weighted mean, slot s weighted slot_decay ** (s - 2), so the early slots (those a leading
    run of accepted slots reaches) get more of the capacity. `clean_soft` = (ids [N, k], log-probs [N, k])
    for the N clean rows that have a label (row-major order) replaces the clean rows' hard targets by
    CE against that distribution renormalised over its k tokens (a teacher's top-k).
    Returns (loss, noisy CE, clean CE)."""
    lab = torch.where(noisy_labels != IGNORE, noisy_labels, clean_labels)
    has = (lab != IGNORE).any(0).nonzero()
    first = int(has[0]) if len(has) else 0
    noisy_start = (first // block) * block
    x, pos, _, m = mars_inputs(ids, clean_labels, mask_id, block, noisy_start)
    h = model.hidden(x, pos, m)
    Ln = x.shape[1] - ids.shape[1]
    yn = noisy_labels[:, noisy_start:]
    if slot_decay == 1.0:
        ln, _ = _ce_at_labels(model, h[:, :Ln], yn)
    else:
        sel = yn != IGNORE
        w = slot_weights(ids.shape[1], block, noisy_start, slot_decay).expand_as(yn)[sel]
        if sel.any():
            ce = F.cross_entropy(model.logits(h[:, :Ln][sel]).float(), yn[sel], reduction="none")
            ln = (w * ce).sum() / w.sum()
        else:
            ln = h.sum() * 0.0
    if clean_soft is None:
        lc, _ = _ce_at_labels(model, h[:, Ln:], clean_labels)
    else:
        soft_ids, soft_logp = clean_soft
        logp = F.log_softmax(model.logits(h[:, Ln:][clean_labels != IGNORE]).float(), dim=-1)
        lc = -(torch.softmax(soft_logp, dim=-1) * logp.gather(1, soft_ids)).sum(-1).mean()
    return ln + ar_weight * lc, ln.detach(), lc.detach()


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def eval_ar_loss(model, examples: list[Example], pad_id: int, max_tokens: int = 8192) -> float:
    """Token-mean CE on assistant tokens (teacher-forced, plain causal)."""
    model.eval()
    tot, n = 0.0, 0
    for idx in make_batches(examples, max_tokens, random.Random(0)):
        ids, lm = collate(examples, idx, pad_id)
        labels = shift_targets(ids, lm)
        h = model.hidden(ids)
        sel = labels != IGNORE
        logits = model.logits(h[sel])
        tot += float(F.cross_entropy(logits, labels[sel], reduction="sum"))
        n += int(sel.sum())
    model.train()
    return tot / max(n, 1)


@torch.no_grad()
def eval_slots(model, examples: list[Example], pad_id: int, mask_id: int, block: int = 16,
               max_tokens: int = 4096) -> dict:
    """Teacher-forced per-slot accuracy against the reference text, and a cycle-length proxy.

    Slot 1 is the clean (AR) prediction of the token after position b*k - 1; slot j+1 (j >= 1)
    is the noisy row at position b*k + j - 1. Only blocks whose slots all lie in the answer count.
    `tf_tokens_per_cycle` = mean over such blocks of (leading run of correct slots, slot 1 counted
    as correct since lossless always commits it) + 1, capped at block+1.
    """
    model.eval()
    correct = torch.zeros(block)
    count = torch.zeros(block)
    runs = []
    noisy_loss, clean_loss, nn_, nc = 0.0, 0.0, 0, 0
    for idx in make_batches(examples, max_tokens, random.Random(0)):
        ids, lm = collate(examples, idx, pad_id)
        labels = shift_targets(ids, lm)
        x, pos, y, m = mars_inputs(ids, labels, mask_id, block, 0)
        h = model.hidden(x, pos, m)
        L = ids.shape[1]
        pred = model.logits(h).argmax(-1)
        lg_n = model.logits(h[:, :L][labels != IGNORE])
        lg_c = model.logits(h[:, L:][labels != IGNORE])
        noisy_loss += float(F.cross_entropy(lg_n, labels[labels != IGNORE], reduction="sum"))
        clean_loss += float(F.cross_entropy(lg_c, labels[labels != IGNORE], reduction="sum"))
        nn_ += int((labels != IGNORE).sum()); nc += int((labels != IGNORE).sum())
        pn, pc, lab = pred[:, :L].tolist(), pred[:, L:].tolist(), labels.tolist()
        for b in range(ids.shape[0]):
            for k in range(1, L // block + 1):
                t = block * k - 1  # last clean token the block sees
                if block * k + block - 2 >= L:
                    continue
                rows_label = [lab[b][t]] + [lab[b][block * k + j - 1] for j in range(1, block)]
                if any(v == IGNORE for v in rows_label):
                    continue
                preds = [pc[b][t]] + [pn[b][block * k + j - 1] for j in range(1, block)]
                ok = [p == v for p, v in zip(preds, rows_label)]
                for s in range(block):
                    correct[s] += ok[s]
                    count[s] += 1
                run = 1
                while run < block and ok[run]:
                    run += 1
                runs.append(min(run + 1, block + 1))
    model.train()
    acc = (correct / count.clamp(min=1)).tolist()
    return {
        "slot_acc": [round(a, 4) for a in acc],
        "blocks": int(count[0]),
        "tf_tokens_per_cycle": round(sum(runs) / max(len(runs), 1), 3),
        "noisy_loss": noisy_loss / max(nn_, 1),
        "clean_loss": clean_loss / max(nc, 1),
    }


# --------------------------------------------------------------------------- training

@dataclass
class StageSpec:
    kind: str                 # "ar" or "mars"
    steps: int
    lr: float = 3e-3
    warmup: int = 100
    min_lr_frac: float = 0.1
    max_tokens: int = 4096    # padded clean tokens per batch
    block: int = 16
    ar_weight: float = 1.0


def lr_at(step: int, spec: StageSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (spec.min_lr_frac + (1 - spec.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train_stage(model, examples: list[Example], spec: StageSpec, *, pad_id: int, mask_id: int, seed: int,
                log: list, name: str, eval_fn=None, eval_every: int = 0, progress: bool = True,
                weight_decay: float = 0.1, loss_fn=None):
    """Run one stage; appends {"step", "loss", ...} dicts to `log`. Returns the model.
    `loss_fn(model, idx, ids, loss_mask) -> (loss, extra log fields)` replaces the stage's own loss
    (idx: the batch's example indices; used by distill.py for soft targets)."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    rng = random.Random(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    batches: list = []
    bar = tqdm(range(spec.steps), desc=name, disable=not progress, mininterval=5.0, smoothing=0.05)
    t0 = time.time()
    tokens = 0
    ema = None
    for step in bar:
        if not batches:
            batches = make_batches(examples, spec.max_tokens, rng)
        idx = batches.pop()
        ids, lm = collate(examples, idx, pad_id)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, spec)
        rec = {"step": step}
        if loss_fn is not None:
            loss, extra = loss_fn(model, idx, ids, lm)
            rec.update(loss=float(loss.detach()), **extra)
        elif spec.kind == "ar":
            loss = ar_loss(model, ids, lm)
            rec["loss"] = float(loss.detach())
        else:
            loss, ln, lc = mars_loss(model, ids, lm, mask_id, spec.block, spec.ar_weight)
            rec.update(loss=float(loss.detach()), noisy=float(ln), clean=float(lc))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += ids.numel()
        rec["tokens"] = tokens
        rec["time"] = round(time.time() - t0, 2)
        ema = rec["loss"] if ema is None else 0.98 * ema + 0.02 * rec["loss"]
        if step % 10 == 0:
            bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}")
        if eval_fn is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == spec.steps):
            rec["eval"] = eval_fn(model)
            bar.write(f"[{name}] step {step + 1}: {json.dumps(rec['eval'])}")
        log.append(rec)
    bar.close()
    return model
