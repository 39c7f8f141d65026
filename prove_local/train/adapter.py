"""A gated MARS adapter for a stock GGUF: the model fills blocks of placeholders in one pass with a
LoRA that is on for the proposal pass only, so every committed token's KV, and ProVe-lossless'
output, stay the stock model's.

The idea is Samragh et al. 2025 ("Your LLM Knows the Future", arXiv 2507.11851): placeholders after
the context and a LoRA active on them only. llama.cpp switches an adapter per pass, not per token, so
the gate here is the pass: the proposal pass `[last, mask x (B-1)]` runs with the adapter on (row 0
gives slot 1, the j-th mask's row slot j+1) and all its positions are removed after it; every other
pass runs the stock weights. Training does exactly that: one no-grad stock forward over a sequence
gives the KV of every prefix; each training block `[S[t], mask x (B-1)]` runs with the adapter on,
attends to the stock KV of positions < t and causally within itself, and its rows are scored against
S[t+1 .. t+B]. S is the stock model's own greedy continuation of a prompt (self-distillation: the
targets are the tokens lossless decoding must match).

Commands (`python -m prove_local.train.adapter ...`, the `train` extra):
  gen     greedy continuations of GSM8K train prompts through the chat template (llama.cpp, batched)
  train   the LoRA on them (checkpoints that resume; a time budget; held-out slot match)
  export  the checkpoint as a llama.cpp LoRA GGUF (what convert_lora_to_gguf.py writes, plus
          prove.mask_token_id / prove.block_size / prove.base.*)
The torch forward works in the GGUF's own tensor layout and RoPE convention (llama: adjacent pairs,
qwen2: halves), so the adapter's tensors need no permutation and parity with llama.cpp is direct
(tests/test_adapter.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..chat import Conversation
from ..llama import Model, greedy_batched
from .distill import _fields

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


# --------------------------------------------------------------------------- the stock model in torch

@dataclass
class Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    eps: float
    rope_base: float
    neox: bool          # RoPE on halves (qwen2) rather than adjacent pairs (llama)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


ARCHS = {"llama": False, "qwen2": True}       # architecture -> RoPE on halves (NEOX)


class StockLM:
    """A llama/qwen2 GGUF's weights, dequantized to F32 with gguf-py, and its forward pass (frozen)."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        r = gguf.GGUFReader(str(self.path))
        self.meta = meta = _fields(r)
        arch = meta.get("general.architecture")
        if arch not in ARCHS:
            raise ValueError(f"{path}: architecture {arch!r}; the adapter trainer knows {', '.join(ARCHS)}")
        a = arch + "."
        self.shape = Shape(arch, int(meta[a + "block_count"]), int(meta[a + "embedding_length"]),
                           int(meta[a + "attention.head_count"]), int(meta[a + "attention.head_count_kv"]),
                           len(meta["tokenizer.ggml.tokens"]), float(meta[a + "attention.layer_norm_rms_epsilon"]),
                           float(meta.get(a + "rope.freq_base", 10000.0)), ARCHS[arch])
        self.w: dict[str, torch.Tensor] = {}
        for t in r.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            self.w[t.name] = torch.from_numpy(np.array(data, dtype=np.float32).reshape(
                [int(x) for x in reversed(t.shape)]))
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]      # tied embeddings
        self.tokens = meta["tokenizer.ggml.tokens"]
        self.token_types = [int(x) for x in meta["tokenizer.ggml.token_type"]]

    def n_in_out(self, name: str) -> tuple[int, int]:
        out, inp = self.w[name].shape
        return inp, out

    # RoPE -------------------------------------------------------------------------------------
    def rope_angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., T, head_dim/2] of integer positions pos [..., T] (computed once per pass)."""
        hd = self.shape.head_dim
        inv = self.shape.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos.to(torch.float64)[..., None] * inv
        return ang.cos().to(torch.float32), ang.sin().to(torch.float32)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, head_dim] rotated by the angles of rope_angles, ggml's convention."""
        hd = self.shape.head_dim
        if self.shape.neox:
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.eps) * self.w[name]

    def linear(self, x: torch.Tensor, name: str, lora: "Lora | None") -> torch.Tensor:
        y = x @ self.w[name + ".weight"].t()
        if name + ".bias" in self.w:
            y = y + self.w[name + ".bias"]
        if lora is not None and name in lora.a:
            y = y + (x @ lora.a[name].t()) @ lora.b[name].t() * lora.scale
        return y

    # passes -------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, lora: "Lora | None" = None,
                past: list | None = None, allowed: torch.Tensor | None = None, keep_kv: bool = False):
        """Logits [N, T, V] of tokens [N, T] at positions pos [N, T].
        past: per layer (k, v) [nkv, P, hd] of a shared prefix (stock KV); allowed [N, T, P + T]: which
        prefix and block positions each row attends to (default: the whole past, causal within).
        keep_kv: also return per layer (k, v) of these tokens ([nkv, T, hd], for N = 1)."""
        s = self.shape
        N, T = tokens.shape
        hd, nh, nkv = s.head_dim, s.n_head, s.n_head_kv
        P = past[0][0].shape[1] if past else 0
        if allowed is None:
            allowed = torch.cat([torch.ones(T, P, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()], 1)
            allowed = allowed.expand(N, T, P + T)
        x = self.w["token_embd.weight"][tokens]
        cos, sin = self.rope_angles(pos[:, None])
        kvs = []
        for i in range(s.n_layer):
            b = f"blk.{i}."
            h = self.norm(x, b + "attn_norm.weight")
            q = self.linear(h, b + "attn_q", lora).view(N, T, nh, hd).transpose(1, 2)
            k = self.linear(h, b + "attn_k", lora).view(N, T, nkv, hd).transpose(1, 2)
            v = self.linear(h, b + "attn_v", lora).view(N, T, nkv, hd).transpose(1, 2)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            if keep_kv:
                kvs.append((k[0], v[0]))
            if past:
                pk, pv = past[i]
                k = torch.cat([pk.expand(N, nkv, P, hd), k], dim=2)
                v = torch.cat([pv.expand(N, nkv, P, hd), v], dim=2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=nh != nkv)
            x = x + self.linear(y.transpose(1, 2).reshape(N, T, nh * hd), b + "attn_output", lora)
            h = self.norm(x, b + "ffn_norm.weight")
            g = self.linear(h, b + "ffn_gate", lora)
            x = x + self.linear(F.silu(g) * self.linear(h, b + "ffn_up", lora), b + "ffn_down", lora)
        logits = self.norm(x, "output_norm.weight") @ self.w["output.weight"].t()
        return (logits, kvs) if keep_kv else logits

    @torch.no_grad()
    def stock_kv(self, tokens: list[int]) -> list:
        """Per layer (k, v) [nkv, L, hd] of the stock model over a sequence (the prefix KV of every block)."""
        t = torch.tensor([tokens])
        _, kvs = self.forward(t, torch.arange(len(tokens))[None], keep_kv=True)
        return kvs


def mask_candidates(lm: StockLM) -> list[int]:
    """Special (control) tokens a chat never produces: not bos/eos, not in the chat template."""
    meta = lm.meta
    template = meta.get("tokenizer.chat_template", "") or ""
    used = {meta.get(k) for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                  "tokenizer.ggml.eot_token_id", "tokenizer.ggml.padding_token_id")}
    return [i for i, (t, ty) in enumerate(zip(lm.tokens, lm.token_types))
            if ty == 3 and i not in used and t not in template]


def choose_mask(lm: StockLM) -> int:
    """The vocabulary's own mask token if it has one, else the last unused special token."""
    named = [i for i, t in enumerate(lm.tokens) if t in ("<|mask|>", "<mask>")]
    if named:
        return named[0]
    cands = mask_candidates(lm)
    if not cands:
        raise ValueError(f"{lm.path}: no unused special token to serve as the placeholder")
    return cands[-1]


# --------------------------------------------------------------------------- the adapter

class Lora:
    """Low-rank updates W + scale * B A for the target tensors of every layer (A [r, n_in], B [n_out, r],
    llama.cpp's lora_a / lora_b). B starts at zero: a fresh adapter is the stock model."""

    def __init__(self, lm: StockLM, rank: int, alpha: float, targets=TARGETS, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rank, self.alpha, self.scale = rank, float(alpha), float(alpha) / rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for i in range(lm.shape.n_layer):
            for t in targets:
                name = f"blk.{i}.{t}"
                n_in, n_out = lm.n_in_out(name + ".weight")
                self.a[name] = (torch.randn(rank, n_in, generator=g) / math.sqrt(n_in)).requires_grad_()
                self.b[name] = torch.zeros(n_out, rank, requires_grad=True)

    def parameters(self) -> list[torch.Tensor]:
        return [p for name in self.a for p in (self.a[name], self.b[name])]

    def state(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "a": {k: v.detach() for k, v in self.a.items()},
                "b": {k: v.detach() for k, v in self.b.items()}}

    def load(self, state: dict) -> None:
        with torch.no_grad():
            for k in self.a:
                self.a[k].copy_(state["a"][k])
                self.b[k].copy_(state["b"][k])


def block_batch(seq: list[int], starts: list[int], block: int, mask: int):
    """Inputs, positions, attention and targets of the training blocks `[seq[t], mask x (block-1)]` at
    each t of `starts`: a block sees the stock KV of positions < t and itself causally; row s of
    block t is scored against seq[t+1+s] (-100 past the sequence's end)."""
    L, K = len(seq), len(starts)
    t = torch.tensor(starts)
    tokens = torch.full((K, block), mask, dtype=torch.long)
    tokens[:, 0] = torch.tensor([seq[s] for s in starts])
    pos = t[:, None] + torch.arange(block)[None]
    # all blocks side by side in one row of K*block queries (no copy of the prefix KV per block):
    # a query sees the prefix before its block's t, and its own block causally
    prefix = (torch.arange(L)[None, None, :] < t[:, None, None]).expand(K, block, L).reshape(K * block, L)
    blk = torch.arange(K * block) // block
    own = (blk[:, None] == blk[None, :]) & (torch.arange(K * block)[:, None] >= torch.arange(K * block)[None, :])
    allowed = torch.cat([prefix, own], 1)[None]
    seq_t = torch.tensor(seq + [-100] * (block + 1))
    targets = seq_t[pos + 1]
    return tokens.reshape(1, -1), pos.reshape(1, -1), allowed, targets


def slot_weights(block: int, decay: float) -> torch.Tensor:
    """Loss weight per slot: decay**s (a slot counts only while every slot before it matched)."""
    return decay ** torch.arange(block, dtype=torch.float32)


def block_loss(lm: StockLM, lora: Lora, seq: list[int], starts: list[int], block: int, mask: int,
               decay: float, kv=None):
    """The gated MARS loss of one sequence's blocks, and (matches per slot, scored per slot)."""
    kv = lm.stock_kv(seq) if kv is None else kv
    tokens, pos, allowed, targets = block_batch(seq, starts, block, mask)
    logits = lm.forward(tokens, pos, lora, past=kv, allowed=allowed).view(*targets.shape, -1)
    w = slot_weights(block, decay)[None].expand_as(targets)
    valid = targets >= 0
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.clamp(min=0).reshape(-1), reduction="none")
    ce = ce.view_as(targets)
    loss = (ce * w * valid).sum() / (w * valid).sum().clamp(min=1e-9)
    hit = (logits.argmax(-1) == targets) & valid
    return loss, hit.sum(0), valid.sum(0), hit


# --------------------------------------------------------------------------- data

def _atomic_save(path: Path, save) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        save(f)
    os.replace(tmp, path)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def generate(a) -> dict:
    """Greedy continuations of a seeded subset of prompts, written in shards (existing ones kept)."""
    from tqdm import tqdm

    rows = read_jsonl(a.prompts)
    order = list(range(len(rows)))
    random.Random(a.seed).shuffle(order)
    order = order[a.skip:a.skip + a.n]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, n_tok, n_done = time.time(), 0, 0
    with Model(a.model) as model:
        shards = [order[i:i + a.shard] for i in range(0, len(order), a.shard)]
        bar = tqdm(total=len(order), desc="generate", unit="prompt", disable=a.no_progress, mininterval=5.0)
        for s, idxs in enumerate(shards):
            path = out / f"{a.name}_{a.skip // a.shard + s:04d}.npz"
            if path.exists():
                bar.update(len(idxs))
                continue
            prompts = [Conversation(model).prompt_tokens(rows[i]["question"]) for i in idxs]
            got: dict[int, list[int]] = {}
            for j, cont in greedy_batched(model, prompts, a.max_new, n_seq=a.n_seq, n_threads=a.threads):
                got[j] = cont
                n_tok += len(cont)
                bar.update(1)
                bar.set_postfix(tok_s=f"{n_tok / max(time.time() - t0, 1e-9):.0f}", refresh=False)
            seqs = [prompts[j] + got[j] for j in range(len(prompts))]
            _atomic_save(path, lambda f: np.savez(
                f, index=np.array(idxs, dtype=np.int32), prompt_len=np.array([len(p) for p in prompts], dtype=np.int32),
                seq_len=np.array([len(x) for x in seqs], dtype=np.int32),
                tokens=np.array([t for x in seqs for t in x], dtype=np.int32)))
            n_done += len(idxs)
        bar.close()
    stats = {"prompts": n_done, "tokens": n_tok, "seconds": round(time.time() - t0, 1)}
    print(f"[gen] {json.dumps(stats)}", flush=True)
    return stats


def load_sequences(paths) -> list[tuple[list[int], int]]:
    """(tokens, prompt length) of every generated sequence in the shard files, in file order."""
    out = []
    for p in paths:
        with np.load(p) as z:
            toks, lens, plens = z["tokens"].tolist(), z["seq_len"].tolist(), z["prompt_len"].tolist()
        at = 0
        for n, pl in zip(lens, plens):
            out.append((toks[at:at + n], pl))
            at += n
    return out


def shard_files(folder, name: str) -> list[Path]:
    return sorted(Path(folder).glob(f"{name}_*.npz"))


# --------------------------------------------------------------------------- training

def pick_starts(rng: random.Random, seq_len: int, prompt_len: int, n: int) -> list[int]:
    """Block positions t (the last real token of each block) among the continuation's."""
    cands = list(range(prompt_len - 1, seq_len - 1))
    return sorted(rng.sample(cands, min(n, len(cands))))


@torch.no_grad()
def evaluate(lm: StockLM, lora: Lora, seqs, block: int, mask: int, every: int = 4) -> dict:
    """Held-out slot match: the share of blocks (every `every`-th continuation position) whose slot s
    equals the stock greedy token, and the expected lossless tokens per cycle (leading run + 1)."""
    hits, valid, runs, n_blocks = torch.zeros(block), torch.zeros(block), 0.0, 0
    for seq, pl in seqs:
        starts = list(range(pl - 1, len(seq) - 1, every))
        if not starts:
            continue
        _, h, v, hit = block_loss(lm, lora, seq, starts, block, mask, 1.0)
        hits += h
        valid += v
        lead = (hit.cumprod(1)).sum(1).float()
        runs += float((lead + 1).sum())      # the matched run (slot 1 tested too: gated), then the stock token
        n_blocks += len(starts)
    rate = (hits / valid.clamp(min=1)).tolist()
    return {"slot_match": [round(x, 4) for x in rate], "tokens_per_cycle": round(runs / max(n_blocks, 1), 3),
            "blocks": n_blocks}


def train(a) -> dict:
    from tqdm import tqdm

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    lm = StockLM(a.model)
    mask = a.mask_token if a.mask_token is not None else choose_mask(lm)
    data = load_sequences(shard_files(a.data, "train"))
    held = load_sequences(shard_files(a.data, "dev"))[: a.eval_n]
    if not data:
        raise SystemExit(f"{a.data}: no train_*.npz shards (run `gen` first)")
    out = Path(a.out)
    ckpt = out / "checkpoint.pt"
    lora = Lora(lm, a.rank, a.alpha, tuple(a.targets.split(",")), seed=a.seed)
    opt = torch.optim.AdamW(lora.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.99))
    state = {"step": 0, "seconds": 0.0, "log": [], "evals": [], "epoch_order": None, "cursor": 0}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        lora.load(saved["lora"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"[train] resumed at step {state['step']} ({state['seconds']:.0f} s so far)", flush=True)
    rng = random.Random(a.seed * 7919 + state["step"])

    def save():
        _atomic_save(ckpt, lambda f: torch.save({"lora": lora.state(), "opt": opt.state_dict(), "state": state,
                                                 "mask": mask, "block": a.block, "args": vars(a)}, f))

    def lr_at(step):
        warm = max(1, a.steps // 20)
        if step < warm:
            return a.lr * (step + 1) / warm
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, a.steps - warm)))))

    t_start, last_save = time.time(), time.time()
    base_seconds = state["seconds"]
    bar = tqdm(total=a.steps, initial=state["step"], desc="train", unit="step", disable=a.no_progress, mininterval=10.0)
    stop = "steps"
    while state["step"] < a.steps:
        if a.minutes and base_seconds + time.time() - t_start > a.minutes * 60:
            stop = "time"
            break
        if state["epoch_order"] is None or state["cursor"] >= len(state["epoch_order"]):
            data = load_sequences(shard_files(a.data, "train"))     # shards a running `gen` added since
            order = list(range(len(data)))
            rng.shuffle(order)
            state["epoch_order"], state["cursor"] = order, 0
        for g in opt.param_groups:
            g["lr"] = lr_at(state["step"])
        opt.zero_grad(set_to_none=True)
        tot, hit1 = 0.0, torch.zeros(a.block)
        val1 = torch.zeros(a.block)
        for _ in range(a.accum):
            idx = state["epoch_order"][state["cursor"] % len(state["epoch_order"])]
            state["cursor"] += 1
            seq, pl = data[idx]
            seq = seq[: a.max_len]
            starts = pick_starts(rng, len(seq), pl, a.blocks_per_seq)
            if not starts:
                continue
            loss, h, v, _ = block_loss(lm, lora, seq, starts, a.block, mask, a.decay)
            (loss / a.accum).backward()
            tot += float(loss.detach()) / a.accum
            hit1 += h
            val1 += v
        torch.nn.utils.clip_grad_norm_(lora.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["seconds"] = base_seconds + time.time() - t_start
        m = (hit1 / val1.clamp(min=1)).tolist()
        state["log"].append({"step": state["step"], "loss": round(tot, 4), "slot2": round(m[1], 3),
                             "seconds": round(state["seconds"], 1)})
        bar.update(1)
        bar.set_postfix(loss=f"{tot:.3f}", slot2=f"{m[1]:.2f}", refresh=False)
        if a.eval_every and state["step"] % a.eval_every == 0 and held:
            ev = evaluate(lm, lora, held, a.block, mask)
            ev["step"] = state["step"]
            state["evals"].append(ev)
            print(f"\n[eval] step {state['step']}: {json.dumps(ev)}", flush=True)
        if time.time() - last_save > a.save_minutes * 60:
            save()
            last_save = time.time()
    bar.close()
    final = evaluate(lm, lora, held, a.block, mask) if held else None
    if final:
        final["step"] = state["step"]
        state["evals"].append(final)
    save()
    summary = {"step": state["step"], "seconds": round(state["seconds"], 1), "stopped": stop, "mask_token": mask,
               "train_sequences": len(data), "held_out": final}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[train] {json.dumps(summary)}", flush=True)
    return summary


# --------------------------------------------------------------------------- export

def export(lm: StockLM, lora: Lora, path, *, mask: int, block: int, dtype: str = "f16", name: str = "") -> Path:
    """Write the adapter as llama.cpp's LoRA GGUF: general.type = adapter, adapter.type = lora,
    adapter.lora.alpha, tensors `<base tensor>.lora_a` [r, n_in] / `.lora_b` [n_out, r] (numpy
    order; ggml's ne is reversed), plus prove.mask_token_id, prove.block_size and the base's shape."""
    import gguf

    path = Path(path)
    s = lm.shape
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), s.arch)
    w.add_string("general.type", "adapter")
    w.add_string("general.name", name or f"MARS adapter for {lm.meta.get('general.name', lm.path.stem)}")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(lora.alpha))
    w.add_uint32("prove.mask_token_id", int(mask))
    w.add_uint32("prove.block_size", int(block))
    w.add_uint32("prove.base.n_vocab", s.n_vocab)
    w.add_uint32("prove.base.embedding_length", s.n_embd)
    w.add_uint32("prove.base.block_count", s.n_layer)
    np_type = {"f16": np.float16, "f32": np.float32}[dtype]
    for k in lora.a:
        w.add_tensor(k + ".weight.lora_a", lora.a[k].detach().numpy().astype(np_type))
        w.add_tensor(k + ".weight.lora_b", lora.b[k].detach().numpy().astype(np_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def export_cmd(a) -> Path:
    lm = StockLM(a.model)
    saved = torch.load(Path(a.checkpoint), weights_only=False)
    st = saved["lora"]
    targets = tuple(dict.fromkeys(k.split(".", 2)[2] for k in st["a"]))
    lora = Lora(lm, st["rank"], st["alpha"], targets)
    lora.load(st)
    p = export(lm, lora, a.out, mask=saved["mask"], block=saved["block"], dtype=a.dtype)
    print(f"[export] {p} ({p.stat().st_size / 2**20:.1f} MiB)", flush=True)
    return p


# --------------------------------------------------------------------------- command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m prove_local.train.adapter", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="greedy continuations of prompts by the stock model (llama.cpp, batched)")
    g.add_argument("--model", required=True, help="the stock GGUF")
    g.add_argument("--prompts", required=True, help="JSONL with a 'question' per line (GSM8K train)")
    g.add_argument("--out", required=True, help="data folder (shards NAME_XXXX.npz; existing ones are kept)")
    g.add_argument("--name", default="train", help="shard name: train or dev")
    g.add_argument("--n", type=int, default=512, help="prompts (a seeded shuffle, from --skip)")
    g.add_argument("--skip", type=int, default=0)
    g.add_argument("--shard", type=int, default=64)
    g.add_argument("--max-new", type=int, default=256)
    g.add_argument("--n-seq", type=int, default=16, help="sequences decoded together")
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true")
    t = sub.add_parser("train", help="train the gated LoRA (resumes from OUT/checkpoint.pt)")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--block", type=int, default=16)
    t.add_argument("--rank", type=int, default=16)
    t.add_argument("--alpha", type=float, default=32.0)
    t.add_argument("--targets", default=",".join(TARGETS))
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--steps", type=int, default=400)
    t.add_argument("--accum", type=int, default=2, help="sequences per step")
    t.add_argument("--blocks-per-seq", type=int, default=12)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--decay", type=float, default=0.85, help="slot weight decay**s")
    t.add_argument("--mask-token", type=int, default=None, help="placeholder id (default: the last unused special token)")
    t.add_argument("--minutes", type=float, default=0.0, help="stop (and save) after this much training time")
    t.add_argument("--save-minutes", type=float, default=5.0)
    t.add_argument("--eval-every", type=int, default=0)
    t.add_argument("--eval-n", type=int, default=24, help="held-out sequences (dev_*.npz) evaluated")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-progress", action="store_true")
    e = sub.add_parser("export", help="write the checkpoint as a llama.cpp LoRA GGUF")
    e.add_argument("--model", required=True)
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--dtype", choices=("f16", "f32"), default="f16")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    return {"gen": generate, "train": train, "export": export_cmd}[a.cmd](a)


if __name__ == "__main__":
    main()
