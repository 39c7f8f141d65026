"""End-to-end training of the embedded pair: tokenizer -> proposer (AR + MARS) -> verifier ->
AR-only baseline -> evaluation -> Hugging Face folders -> F32 GGUF (via convert.convert_checkpoint).

Run:  python -m prove_local.train --out runs/embedded
Two worker processes (1 torch thread each) by default:
  job A: proposer stage 1 (AR SFT) -> checkpoint -> proposer stage 2 (MARS block training)
  job B: verifier (AR only) -> waits for the stage-1 checkpoint -> baseline: the same stage-1
         weights continued AR-only for as many steps as stage 2 (same size, same steps, same data)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..convert import convert_checkpoint
from .mars import (Example, StageSpec, encode_example, eval_ar_loss, eval_slots, load_jsonl,
                   make_batches, train_stage)
from .model import Qwen2Config, Qwen2ForCausalLM, load_hf, save_hf
from .tokenizer import save_hf_tokenizer, train_byte_bpe

PACKAGE = Path(__file__).resolve().parents[1]          # prove_local/
DEFAULT_TRAIN = PACKAGE / "train" / "data" / "gsm8k_train.jsonl"
DEFAULT_DEV = PACKAGE.parents[1] / "shared" / "datasets" / "gsm8k" / "test_dev.jsonl"
MODELS_DIR = PACKAGE / "models"
PROPOSER_GGUF = "mars-gsm8k-proposer.gguf"
VERIFIER_GGUF = "gsm8k-verifier.gguf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m prove_local.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/embedded")
    p.add_argument("--train-data", default=str(DEFAULT_TRAIN))
    p.add_argument("--dev-data", default=str(DEFAULT_DEV), help="for evaluation only; skipped if missing")
    p.add_argument("--limit", type=int, default=0, help="use only the first N training examples (tests)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--block", type=int, default=16)
    # proposer (and baseline) size
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--inter", type=int, default=768)
    # verifier size
    p.add_argument("--v-hidden", type=int, default=192)
    p.add_argument("--v-layers", type=int, default=3)
    p.add_argument("--v-heads", type=int, default=3)
    p.add_argument("--v-kv-heads", type=int, default=1)
    p.add_argument("--v-inter", type=int, default=576)
    # schedule, in epochs over the training data (converted to a fixed number of steps)
    p.add_argument("--stage1-epochs", type=float, default=3.0)
    p.add_argument("--stage2-epochs", type=float, default=6.0)
    p.add_argument("--verifier-epochs", type=float, default=6.0)
    p.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--stage2-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--bf16", type=int, default=1, help="bf16 autocast for matmuls (weights stay f32)")
    p.add_argument("--jobs", type=int, default=2, help="1: sequential in-process; 2: two workers")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--eval-n", type=int, default=48, help="dev examples for the in-training proxy")
    p.add_argument("--final-eval-n", type=int, default=500)
    p.add_argument("--models-dir", default=str(MODELS_DIR))
    p.add_argument("--no-convert", action="store_true")
    p.add_argument("--convert-only", action="store_true", help="only convert existing HF folders")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- helpers

def _seed_all(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)


def load_examples(tok, path, limit=0):
    rows = load_jsonl(path)
    if limit:
        rows = rows[:limit]
    return [Example(*encode_example(tok, r["question"], r["answer"])) for r in rows]


def proposer_config(a, vocab) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads,
                       num_key_value_heads=a.kv_heads)


def verifier_config(a, vocab) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=a.v_hidden, intermediate_size=a.v_inter,
                       num_hidden_layers=a.v_layers, num_attention_heads=a.v_heads,
                       num_key_value_heads=a.v_kv_heads)


def steps_for(examples, epochs: float, max_tokens: int) -> int:
    n = len(make_batches(examples, max_tokens, random.Random(0)))
    return max(1, int(round(n * epochs)))


class _Ctx:
    """Everything a worker needs, rebuilt from the saved tokenizer (picklable by path)."""

    def __init__(self, a):
        from tokenizers import Tokenizer

        self.a = a
        self.out = Path(a.out)
        self.tok = Tokenizer.from_file(str(self.out / "tokenizer" / "tokenizer.json"))
        self.vocab = self.tok.get_vocab_size()
        self.pad_id = self.tok.token_to_id("<|endoftext|>")
        self.mask_id = self.tok.token_to_id("<|mask|>")
        self.im_end = self.tok.token_to_id("<|im_end|>")
        self.train = load_examples(self.tok, a.train_data, a.limit)
        self.dev = load_examples(self.tok, a.dev_data) if Path(a.dev_data).exists() else []

    def autocast(self):
        # cache_enabled=False: the stage loop runs inside one autocast region, and autocast's weight
        # cache would otherwise keep serving the bf16 copies cast at the first step (stale weights).
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(self.a.bf16), cache_enabled=False)

    def eval_fn(self, mars: bool):
        dev = self.dev[: self.a.eval_n]
        if not dev:
            return None

        def fn(model):
            with self.autocast():
                r = {"dev_ar_loss": round(eval_ar_loss(model, dev, self.pad_id), 4)}
                if mars:
                    s = eval_slots(model, dev, self.pad_id, self.mask_id, self.a.block)
                    r.update(slot_acc=s["slot_acc"][:6], tf_tokens_per_cycle=s["tf_tokens_per_cycle"],
                             dev_noisy_loss=round(s["noisy_loss"], 4))
            return r
        return fn

    def extra_config(self):
        return {"bos_token_id": None, "eos_token_id": self.im_end, "pad_token_id": self.pad_id}

    def save(self, model, name, model_type, mask_token="<|mask|>", extra=None):
        d = self.out / "hf" / name
        tmp = self.out / "hf" / (name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cfg = self.extra_config()
        cfg.update(extra or {})
        save_hf(model, tmp, model_type=model_type, extra_config=cfg)
        save_hf_tokenizer(self.tok, tmp, mask_token=mask_token)
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": self.im_end, "pad_token_id": self.pad_id, "do_sample": False}, indent=2))
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        return d


def _dump(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _run_stage(ctx, model, spec, name, seed, mars_eval):
    log: list = []
    t0 = time.time()
    with ctx.autocast():
        train_stage(model, ctx.train, spec, pad_id=ctx.pad_id, mask_id=ctx.mask_id, seed=seed, log=log,
                    name=name, eval_fn=ctx.eval_fn(mars_eval), eval_every=ctx.a.eval_every,
                    progress=not ctx.a.no_progress)
    secs = time.time() - t0
    toks = log[-1]["tokens"] if log else 0
    _dump(ctx.out / "curves" / f"{name}.json",
          {"name": name, "spec": asdict(spec), "seconds": round(secs, 1), "tokens": toks,
           "tokens_per_s": round(toks / max(secs, 1e-9), 1), "log": log})
    print(f"[{name}] done: {spec.steps} steps, {toks} tokens, {secs:.0f}s, {toks / max(secs, 1e-9):.0f} tok/s",
          flush=True)
    return model


# --------------------------------------------------------------------------- jobs

def job_proposer(a):
    torch.set_num_threads(a.threads)
    ctx = _Ctx(a)
    s1 = StageSpec("ar", steps_for(ctx.train, a.stage1_epochs, a.max_tokens), lr=a.lr, warmup=a.warmup,
                   max_tokens=a.max_tokens)
    s2 = StageSpec("mars", steps_for(ctx.train, a.stage2_epochs, a.max_tokens), lr=a.stage2_lr,
                   warmup=a.warmup, max_tokens=a.max_tokens, block=a.block)
    _seed_all(a.seed)
    model = Qwen2ForCausalLM(proposer_config(a, ctx.vocab))
    _run_stage(ctx, model, s1, "proposer_stage1_ar", a.seed + 1, mars_eval=False)
    ck = ctx.out / "ckpt" / "stage1.pt"
    ck.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), str(ck) + ".tmp")
    os.replace(str(ck) + ".tmp", ck)
    _run_stage(ctx, model, s2, "proposer_stage2_mars", a.seed + 2, mars_eval=True)
    ctx.save(model, "proposer", "a2d-qwen2", extra={"mars_block_size": a.block})


def job_verifier_and_baseline(a):
    torch.set_num_threads(a.threads)
    ctx = _Ctx(a)
    sv = StageSpec("ar", steps_for(ctx.train, a.verifier_epochs, a.max_tokens), lr=a.lr, warmup=a.warmup,
                   max_tokens=a.max_tokens)
    _seed_all(a.seed + 10)
    ver = Qwen2ForCausalLM(verifier_config(a, ctx.vocab))
    _run_stage(ctx, ver, sv, "verifier_ar", a.seed + 11, mars_eval=False)
    ctx.save(ver, "verifier", "qwen2")
    job_baseline(a, ctx)


def job_baseline(a, ctx=None):
    """Same stage-1 weights, continued AR-only for as many steps (same lr schedule) as stage 2."""
    torch.set_num_threads(a.threads)
    ctx = ctx or _Ctx(a)
    ck = ctx.out / "ckpt" / "stage1.pt"
    while not ck.exists():
        time.sleep(5)
    sb = StageSpec("ar", steps_for(ctx.train, a.stage2_epochs, a.max_tokens), lr=a.stage2_lr,
                   warmup=a.warmup, max_tokens=a.max_tokens)
    model = Qwen2ForCausalLM(proposer_config(a, ctx.vocab))
    model.load_state_dict(torch.load(ck))
    _run_stage(ctx, model, sb, "baseline_stage2_ar", a.seed + 2, mars_eval=False)
    ctx.save(model, "baseline", "qwen2")


# --------------------------------------------------------------------------- evaluation, plots, export

def final_eval(a) -> dict:
    ctx = _Ctx(a)
    res: dict = {}
    if not ctx.dev:
        return {"note": f"dev data {a.dev_data} missing: no evaluation"}
    dev = ctx.dev[: a.final_eval_n]
    torch.set_num_threads(max(1, a.threads * a.jobs))
    for name in ("proposer", "baseline", "verifier"):
        d = ctx.out / "hf" / name
        if not d.exists():
            continue
        m = load_hf(d).eval()
        r = {"params": sum(p.numel() for p in m.parameters()), "config": json.loads((d / "config.json").read_text())}
        r["dev_ar_loss_f32"] = round(eval_ar_loss(m, dev, ctx.pad_id), 4)
        r["train_ar_loss_f32_first500"] = round(eval_ar_loss(m, ctx.train[:500], ctx.pad_id), 4)
        if name == "proposer":
            s = eval_slots(m, dev[:200], ctx.pad_id, ctx.mask_id, a.block)
            r["slots_dev200"] = s
        res[name] = r
    if "proposer" in res and "baseline" in res:
        p, b = res["proposer"]["dev_ar_loss_f32"], res["baseline"]["dev_ar_loss_f32"]
        res["proposer_vs_baseline_dev_ar_loss_rel"] = round(p / b - 1, 4)
    return res


def plot_curves(out: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover
        print("no matplotlib:", e)
        return
    curves = {p.stem: json.loads(p.read_text()) for p in sorted((out / "curves").glob("*.json"))}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, c in curves.items():
        log = c["log"]
        xs = [r["step"] for r in log]
        offset = 0
        if name in ("proposer_stage2_mars", "baseline_stage2_ar") and "proposer_stage1_ar" in curves:
            offset = len(curves["proposer_stage1_ar"]["log"])
        xs = [x + offset for x in xs]

        def smooth(v, k=25):
            outv, acc = [], []
            for x in v:
                acc.append(x)
                if len(acc) > k:
                    acc.pop(0)
                outv.append(sum(acc) / len(acc))
            return outv
        if name == "proposer_stage2_mars":
            axes[0].plot(xs, smooth([r["clean"] for r in log]), label=f"{name} (clean/AR term)")
            axes[0].plot(xs, smooth([r["noisy"] for r in log]), label=f"{name} (noisy term)")
        else:
            axes[0].plot(xs, smooth([r["loss"] for r in log]), label=name)
        ev = [(x, r["eval"]) for x, r in zip(xs, log) if "eval" in r]
        if ev:
            axes[1].plot([x for x, _ in ev], [e["dev_ar_loss"] for _, e in ev], marker="o", label=f"{name} dev AR")
            if "dev_noisy_loss" in ev[0][1]:
                axes[1].plot([x for x, _ in ev], [e["dev_noisy_loss"] for _, e in ev], marker="x",
                             label=f"{name} dev noisy")
    axes[0].set_title("training loss (moving average, 25 steps)")
    axes[1].set_title(f"dev loss (in-training proxy)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)


def convert_all(a) -> dict:
    out = Path(a.out)
    models = Path(a.models_dir)
    models.mkdir(parents=True, exist_ok=True)
    res = {}
    for name, fname, role in (("proposer", PROPOSER_GGUF, "proposer"), ("verifier", VERIFIER_GGUF, "verifier")):
        src = out / "hf" / name
        if not src.exists():
            res[name] = "missing HF folder"
            continue
        dst = models / fname
        tmp = models / (fname + ".tmp")
        try:
            convert_checkpoint(str(src), str(tmp), outtype="f32", role=role, block_size=a.block, progress=not a.no_progress)
            os.replace(tmp, dst)
            res[name] = {"path": str(dst), "bytes": dst.stat().st_size}
        except Exception as e:
            if tmp.exists():
                tmp.unlink()
            res[name] = f"failed: {type(e).__name__}: {e}"
        print(f"[convert] {name}: {res[name]}", flush=True)
    return res


def _worker(job, a, parent_pid: int):
    """Run one job in a spawned process that exits if its parent goes away (killed, Ctrl-C)."""
    import threading

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(2)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()
    job(a)


def _run_workers(procs):
    """Start the workers; if one fails or the parent is interrupted/terminated, stop the others."""
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(1)
    finally:
        signal.signal(signal.SIGTERM, old)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    bad = [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode != 0]
    if bad:
        raise SystemExit(f"worker(s) failed: {', '.join(bad)}")


def main(argv=None):
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.convert_only:
        print(json.dumps(convert_all(a), indent=1))
        return
    t0 = time.time()
    torch.set_num_threads(max(1, a.threads * a.jobs))
    # 1. tokenizer (deterministic: the BPE trainer is deterministic for a fixed corpus)
    rows = load_jsonl(a.train_data)
    if a.limit:
        rows = rows[: a.limit]
    tok = train_byte_bpe([r["question"] for r in rows] + [r["answer"] for r in rows], a.vocab)
    save_hf_tokenizer(tok, out / "tokenizer")
    ck = out / "ckpt" / "stage1.pt"
    if ck.exists():
        ck.unlink()
    _dump(out / "args.json", vars(a))
    print(f"tokenizer: {tok.get_vocab_size()} tokens; args: {json.dumps(vars(a))}", flush=True)

    # 2. models
    if a.jobs <= 1:
        job_proposer(a)
        job_verifier_and_baseline(a)
    else:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(job_proposer, a, os.getpid()), name="proposer"),
                 ctx.Process(target=_worker, args=(job_verifier_and_baseline, a, os.getpid()),
                             name="verifier+baseline")]
        _run_workers(procs)
    train_secs = time.time() - t0
    print(f"training done in {train_secs / 60:.1f} min", flush=True)

    # 3. curves, evaluation, export
    plot_curves(out)
    summary = {"train_wall_seconds": round(train_secs, 1), "args": vars(a)}
    for p in sorted((out / "curves").glob("*.json")):
        c = json.loads(p.read_text())
        summary.setdefault("stages", {})[c["name"]] = {
            "steps": c["spec"]["steps"], "seconds": c["seconds"], "tokens": c["tokens"],
            "tokens_per_s": c["tokens_per_s"],
            "final_train_loss_avg50": round(sum(r["loss"] for r in c["log"][-50:]) / len(c["log"][-50:]), 4),
        }
    _dump(out / "summary.json", summary)
    summary["eval"] = final_eval(a)
    _dump(out / "summary.json", summary)
    print(json.dumps(summary["eval"], indent=1, default=str), flush=True)
    if not a.no_convert:
        summary["convert"] = convert_all(a)
        _dump(out / "summary.json", summary)
    print(f"all done in {(time.time() - t0) / 60:.1f} min", flush=True)
    return summary
