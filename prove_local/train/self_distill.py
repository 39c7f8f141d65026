"""Self-distil the embedded MARS proposer on its own greedy continuations (Medusa-2's
self-distillation, DistillSpec: a drafter trained on its target's outputs is accepted more often).

    python -m prove_local.train.self_distill --out runs/self-distill --install

`lossless` commits a proposed slot only when it equals the proposer's own greedy token, but MARS
trained the slots on the reference solutions, a noisier target. This stage continues MARS block
training with the greedy token as every slot's target, so slot i learns what greedy decoding would
produce there. Stages (seeded; one torch thread and one llama.cpp thread by default):

1. generate: distill.py's generation stage, unchanged (`--part i/n` splits the shards over n
   processes): the proposer GGUF's greedy continuation of each of a seeded subset of the GSM8K train
   prompts (`--n-prompts`, default 1,000), `--samples` sampled ones (at `--temperature`), and a teacher-forced pass that records the
   proposer's argmax after every prefix.
2. train: the proposer's F32 weights read from its GGUF, MARS block training ([noisy | clean], the
   MARS attention mask) on those continuations with the proposer's argmax as target:
   - clean rows: CE(the proposer's argmax after the prefix): the token itself on a greedy
     continuation, what greedy decoding says after the prefix on a sampled one, so the greedy path
     stays the model's own (`--clean soft`: its top-k distribution instead, renormalised);
   - noisy rows: the same target, but a noisy row at position p (block k) does not see the tokens
     16k .. p, so its target is what greedy decoding would produce only where those tokens are the
     greedy ones too: on a greedy continuation every row, on a sampled one the rows up to the first
     sampled token of the block that leaves the greedy path (the others are left out);
   - `--ref-weight` w (0.5) * CE(reference solution) (plain AR) on the batch's prompts, so the model
     keeps what the references taught it (0: off).
   The last `--val-frac` of the prompts are held out: teacher-forced slot match against their greedy
   continuations (the slots `lossless` commits) and the AR loss on GSM8K dev references.
3. export: Hugging Face folder (`a2d-qwen2`, weights + the GGUF's own tokenizer) and an F32 GGUF
   through prove_local.convert.convert_checkpoint; `--install` replaces
   prove_local/models/mars-gsm8k-proposer.gguf (atomically).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import ProveError
from . import distill
from .mars import (IGNORE, Example, StageSpec, ar_loss, chat_segments, collate, encode_example, eval_ar_loss, eval_slots,
                   load_jsonl, make_batches, mars_loss_targets, train_stage)

PACKAGE = Path(__file__).resolve().parents[1]          # prove_local/
DEFAULT_DEV = PACKAGE.parents[1] / "shared" / "datasets" / "gsm8k" / "test_dev.jsonl"
PROPOSER_GGUF = "mars-gsm8k-proposer.gguf"
SUFFIX = "-selfdistilled"          # general.name of a self-distilled proposer ends with it
MIN_AGREEMENT = 0.95               # the starting model's argmax vs the generated greedy tokens


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m prove_local.train.self_distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    distill.add_generation_args(p, what="self-distill")
    # the shipped run: 1,000 prompts (a seeded subset; the order is distill's, so a prefix of its)
    p.set_defaults(n_prompts=1000, shard=100)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ar-weight", type=float, default=1.0, help="weight of the clean (AR) rows' CE on the greedy targets")
    p.add_argument("--clean", choices=("argmax", "soft"), default="argmax",
                   help="clean rows' target: the proposer's argmax (default), or its own top-k distribution, "
                        "renormalised (soft: a smaller rise of the dev AR loss, +4 %% against +8 %%, but fewer "
                        "accepted slots on the bench: 3.10 against 3.23 tokens per B=16 cycle)")
    p.add_argument("--ref-weight", type=float, default=0.5,
                   help="weight of an AR CE on the reference solutions of the batch's prompts (0: off)")
    p.add_argument("--slot-decay", type=float, default=1.0,
                   help="noisy rows weighted decay ** (slot - 2) (1: the plain MARS mean)")
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--dev-data", default=str(DEFAULT_DEV), help="GSM8K dev references for the AR loss; skipped if missing")
    p.add_argument("--eval-n", type=int, default=48, help="dev references for the in-training AR loss")
    p.add_argument("--final-eval-n", type=int, default=500, help="dev references for the before/after AR loss")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--greedy-only", action="store_true",
                   help="train on the greedy continuations only (the sampled ones stay generated, unused)")
    p.add_argument("--bf16", type=int, default=0,
                   help="bf16 autocast for matmuls (off by default: 2.4x slower per step than F32 on this "
                        "project's CPU, which has no bf16 instructions)")
    p.add_argument("--threads", type=int, default=1, help="torch threads and llama.cpp threads")
    p.add_argument("--stage", choices=("all", "generate", "train"), default="all")
    p.add_argument("--install", action="store_true",
                   help=f"also replace {distill.PROPOSER} with the self-distilled proposer (atomically)")
    p.add_argument("--models-dir", default=str(distill.MODELS_DIR), help="where --install writes")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- targets

def self_targets(ids: list[int], prompt_len: int, greedy: torch.Tensor, block: int):
    """(clean, noisy) right-shifted targets of one prompt + continuation (IGNORE where none).

    `greedy[j]` is the proposer's argmax after ids[:prompt_len + j] (the teacher-forced pass). Clean
    row p (p + 1 in the continuation) gets greedy[p + 1 - prompt_len]. The noisy row at p belongs to
    block k = p // block and sees no token from block * k on; its target is greedy decoding's token
    only if the tokens block * k .. p it does not see are greedy decoding's too (prompt tokens count
    as given), so it gets the same target where they are and IGNORE where one of them is not.
    """
    L, n = len(ids), len(greedy)
    clean = torch.full((L,), IGNORE, dtype=torch.long)
    clean[prompt_len - 1: prompt_len - 1 + n] = greedy
    off = torch.zeros(L + (-L) % block, dtype=torch.long)       # 1 where a token left the greedy path
    off[prompt_len:L] = (torch.tensor(ids[prompt_len:]) != greedy).long()
    seen_off = off.view(-1, block).cumsum(1).view(-1)[:L]         # within each block, up to p
    noisy = torch.where(seen_off == 0, clean, torch.full_like(clean, IGNORE))
    return clean, noisy


class Targets:
    """Per-example (clean, noisy) targets of a distill.Data, padded per batch."""

    def __init__(self, data: distill.Data, block: int):
        self.clean, self.noisy = [], []
        for e, g in zip(data.examples, data.topk_ids):
            c, n = self_targets(e.ids, len(e.ids) - len(g), g[:, 0], block)
            self.clean.append(c)
            self.noisy.append(n)

    def batch(self, idx: list[int], L: int):
        clean = torch.full((len(idx), L), IGNORE, dtype=torch.long)
        noisy = torch.full((len(idx), L), IGNORE, dtype=torch.long)
        for r, e in enumerate(idx):
            clean[r, : len(self.clean[e])] = self.clean[e]
            noisy[r, : len(self.noisy[e])] = self.noisy[e]
        return clean, noisy


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, held: list[Example], dev: list[Example], pad_id: int, mask_id: int, block: int) -> dict:
    """Teacher-forced slot match against the held-out prompts' greedy continuations (slot 1 = the
    clean row, i.e. the model's own argmax against the generated greedy token), the cycle proxy, and
    the AR loss on dev references."""
    r = {}
    if held:
        s = eval_slots(model, held, pad_id, mask_id, block)
        r.update(slot_acc=s["slot_acc"], blocks=s["blocks"], tf_tokens_per_cycle=s["tf_tokens_per_cycle"],
                 heldout_greedy_ce=round(s["clean_loss"], 4), heldout_noisy_ce=round(s["noisy_loss"], 4))
    if dev:
        r["dev_ar_loss"] = round(eval_ar_loss(model, dev, pad_id), 4)
    return r


def plot_curve(log: list, evals: list, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:        # matplotlib comes with the bench/test extras, not train
        print(f"no loss curve plot ({e}); pip install matplotlib", flush=True)
        return

    def ma(v, k=25):
        return [sum(v[max(0, i - k + 1): i + 1]) / min(k, i + 1) for i in range(len(v))]

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.2))
    xs = [r["step"] for r in log]
    for key, label in (("noisy", "noisy rows CE"), ("clean", "clean rows CE"), ("ref", "reference AR CE")):
        if log and key in log[0]:
            ax[0].plot(xs, ma([r[key] for r in log]), label=f"train {label} (moving average, 25 steps)")
    ex = [e["step"] for e in evals]
    if evals and "heldout_noisy_ce" in evals[0]:
        ax[0].plot(ex, [e["heldout_noisy_ce"] for e in evals], marker="o", label="held-out noisy CE (greedy targets)")
        ax[0].plot(ex, [e["heldout_greedy_ce"] for e in evals], marker="o", label="held-out clean CE (greedy targets)")
    ax[0].set_title("self-distillation loss"); ax[0].set_ylabel("nats/token")
    if evals and "slot_acc" in evals[0]:
        for s in (1, 2, 3, 4, 8):
            ax[1].plot(ex, [e["slot_acc"][s - 1] for e in evals], marker="o", label=f"slot {s}")
        ax[1].set_title("held-out: slot = greedy token (teacher-forced)"); ax[1].set_ylabel("share")
    if evals and "dev_ar_loss" in evals[0]:
        ax[2].plot(ex, [e["dev_ar_loss"] for e in evals], marker="o")
        ax[2].set_title("GSM8K dev: AR loss on the references"); ax[2].set_ylabel("nats/token")
    for x in ax:
        x.set_xlabel("step"); x.grid(alpha=0.3)
    ax[0].legend(fontsize=7); ax[1].legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


# --------------------------------------------------------------------------- training

def reference_examples(tok, rows: list[dict], which) -> dict[int, Example]:
    return {i: Example(*encode_example(tok, rows[i]["question"], rows[i]["answer"])) for i in which}


def train(a) -> dict:
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    data = distill.Data(out / "gen")
    if not data.examples:
        raise SystemExit(f"{out / 'gen'}: no generated shards; run with --stage generate first")
    model, meta = distill.read_gguf_model(a.proposer)
    if meta.get("prove.role") != "proposer" or meta.get("tokenizer.ggml.mask_token_id") is None:
        raise SystemExit(f"{a.proposer}: not a MARS proposer (prove.role {meta.get('prove.role')!r}, no mask token)")
    pad_id = int(meta.get("tokenizer.ggml.padding_token_id", 0))
    mask_id = int(meta["tokenizer.ggml.mask_token_id"])
    block = int(meta.get("prove.block_size", 16))
    tok = distill.tokenizer_from_gguf(meta)
    rows = load_jsonl(a.train_data)
    tr, va = data.split(a.val_frac)
    if a.greedy_only:
        tr = [e for e in tr if not data.sampled[e]]
    targets = Targets(data, block)
    refs = reference_examples(tok, rows, sorted({data.index[e] for e in tr})) if a.ref_weight > 0 else {}
    e0 = data.examples[tr[0]]
    want = tok.encode(chat_segments(rows[data.index[tr[0]]]["question"], "")[0], add_special_tokens=False).ids
    if e0.ids[: len(want)] != want:
        raise SystemExit(f"{a.train_data}: the prompts the GGUF's tokenizer builds differ from the generated ones")
    dev = []
    if Path(a.dev_data).exists():
        dev = [Example(*encode_example(tok, r["question"], r["answer"])) for r in load_jsonl(a.dev_data)[: a.final_eval_n]]
    held = [data.examples[i] for i in va]
    train_ex = [data.examples[i] for i in tr]
    n_batches = len(make_batches(train_ex, a.max_tokens, random.Random(0)))
    spec = StageSpec("mars", max(1, int(round(n_batches * a.epochs))), lr=a.lr, warmup=a.warmup,
                     max_tokens=a.max_tokens, block=block, ar_weight=a.ar_weight)
    model.eval()
    before = evaluate(model, held, dev, pad_id, mask_id, block)           # F32
    if held and before["slot_acc"][0] < MIN_AGREEMENT:
        raise SystemExit(f"{a.proposer}: its argmax equals the generated greedy tokens at only "
                         f"{before['slot_acc'][0]:.1%} of the held-out positions: the continuations in {out / 'gen'} "
                         "were generated by another proposer")
    kept = sum(int((targets.noisy[e] != IGNORE).sum()) for e in tr)
    rows_all = sum(int((targets.clean[e] != IGNORE).sum()) for e in tr)
    print(f"[train] {len(tr)} train / {len(va)} held-out continuations; {spec.steps} steps ({a.epochs} epochs of "
          f"{n_batches} batches); noisy rows with a greedy target: {kept} of {rows_all}; before: "
          f"{json.dumps({k: v for k, v in before.items() if k != 'slot_acc'})} slots {before.get('slot_acc', [])[:6]}",
          flush=True)
    eval_dev = dev[: a.eval_n]

    def loss_fn(m, idx, ids, lm):
        ex = [tr[j] for j in idx]
        clean, noisy = targets.batch(ex, ids.shape[1])
        soft = None
        if a.clean == "soft":      # rows in the order of the labelled clean rows: example, then position
            soft = (torch.cat([data.topk_ids[e] for e in ex]), torch.cat([data.topk_logp[e] for e in ex]))
        loss, ln, lc = mars_loss_targets(m, ids, clean, noisy, mask_id, block, a.ar_weight, a.slot_decay, soft)
        rec = {"noisy": float(ln), "clean": float(lc)}
        if a.ref_weight > 0:
            prompts = list(dict.fromkeys(data.index[e] for e in ex))
            rid, rlm = collate(refs, prompts, pad_id)
            lr = ar_loss(m, rid, rlm)
            loss = loss + a.ref_weight * lr
            rec["ref"] = float(lr.detach())
        return loss, rec

    evals = [{"step": 0, **{k: before[k] for k in before if k != "dev_ar_loss"},
              **({"dev_ar_loss": round(eval_ar_loss(model, eval_dev, pad_id), 4)} if eval_dev else {})}]

    def eval_fn(m):
        e = evaluate(m, held, eval_dev, pad_id, mask_id, block)
        evals.append({"step": len(log) + 1, **e})
        return {k: (v[:6] if k == "slot_acc" else v) for k, v in e.items()}

    log: list = []
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    model.train()
    t0 = time.time()
    # cache_enabled=False: see pipeline._Ctx.autocast (stale bf16 weight copies otherwise)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(a.bf16), cache_enabled=False):
        train_stage(model, train_ex, spec, pad_id=pad_id, mask_id=mask_id, seed=a.seed + 1, log=log,
                    name="self-distill", eval_fn=eval_fn if (held or eval_dev) else None, eval_every=a.eval_every,
                    progress=not a.no_progress, loss_fn=loss_fn)
    secs = time.time() - t0
    toks = log[-1]["tokens"] if log else 0
    model.eval()
    after = evaluate(model, held, dev, pad_id, mask_id, block)            # F32
    curve = {"name": "self-distill", "spec": asdict(spec), "seconds": round(secs, 1), "tokens": toks,
             "tokens_per_s": round(toks / max(secs, 1e-9), 1), "log": log, "evals": evals}
    distill._dump(out / "curves" / "self-distill.json", curve)
    plot_curve(log, evals, out / "loss_curve.png")
    name = str(meta.get("general.name") or "proposer")
    hf = distill.save_model(model, meta, out, pad_id, folder="proposer", model_type="a2d-qwen2",
                            suffix="" if name.endswith(SUFFIX) else SUFFIX, extra={"mars_block_size": block})
    avg = lambda k: round(sum(r[k] for r in log[-50:]) / max(len(log[-50:]), 1), 4) if log and k in log[0] else None
    return {"train_examples": len(tr), "heldout_examples": len(va), "train_prompts": len({data.index[e] for e in tr}),
            "noisy_rows_with_target": kept, "rows": rows_all, "steps": spec.steps, "epochs": a.epochs,
            "seconds": round(secs, 1), "tokens": toks, "tokens_per_s": curve["tokens_per_s"],
            "before_f32": before, "after_f32": after, "dev_references": len(dev),
            "final_train_avg50": {k: avg(k) for k in ("loss", "noisy", "clean", "ref") if avg(k) is not None},
            "hf": str(hf), "block": block}


def main(argv=None):
    def convert_stage(a, summary):
        return distill.convert_and_install(Path(a.out) / "hf" / "proposer", Path(a.out), PROPOSER_GGUF, "proposer",
                                           summary["train"]["block"], a.install, a.models_dir, not a.no_progress)
    return distill.run_stages(parse_args(argv), train, convert_stage)


def cli(argv=None):
    """`python -m prove_local.train.self_distill`: bad input ends with one line naming it, exit code 1."""
    try:
        main(argv)
    except (ProveError, ValueError, OSError) as e:
        raise SystemExit(f"self_distill: {e}") from None


if __name__ == "__main__":
    cli()
