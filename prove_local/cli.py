"""`prove-local` command line: run (one prompt or an interactive chat) and convert."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from . import modes
from .errors import ProveError
from .loading import add_model_args, add_width_args, load_engine

# alternating colors per cycle; the lossless correction / bonus token is underlined
COLORS = ("\x1b[38;5;39m", "\x1b[38;5;214m")
BONUS, RESET = "\x1b[4m", "\x1b[0m"


def add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate with a proposer (and a verifier or draft)",
                       description="Generate text with ProVe decoding. Without -p: an interactive chat.")
    add_model_args(p)
    p.add_argument("--mode", choices=modes.NAMES,
                   help="decoding rule (default: lossless if the model has a mask token, else ar)")
    p.add_argument("--theta", type=float, default=0.05, help="ProVe gate: commit while p*q >= theta (default 0.05)")
    p.add_argument("--tau", type=float, default=0.95, help="MARS rule: commit while p >= tau (default 0.95)")
    add_width_args(p)
    p.add_argument("-p", "--prompt", help="one prompt; the answer streams to stdout")
    p.add_argument("-n", "--max-new", type=int, default=256, help="max new tokens per answer (default 256)")
    p.add_argument("--raw", action="store_true", help="plain completion of the prompt, no chat template")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per answer instead of streamed text")
    p.add_argument("--no-color", action="store_true", help="no colors even on a terminal")
    p.set_defaults(func=cmd_run)


def answer(engine, model, prompt_tokens, settings, out, color: bool):
    """Run one request, streaming committed text to `out`. Returns (cycles, seconds, interrupted)."""
    from .engine import TextStream

    stream = TextStream(model)
    cycles, interrupted = [], False
    t0 = time.perf_counter()
    gen = engine.generate(prompt_tokens, settings)
    request = gen.request
    with contextlib.closing(gen):
        try:
            for c in gen:
                cycles.append(c)
                if out is None:
                    continue
                run, extra = c.committed[:c.n_accepted], c.committed[c.n_accepted:]
                if color:
                    out.write(COLORS[c.index % 2] + stream.feed(run) + (BONUS + stream.feed(extra) if extra else "") + RESET)
                else:
                    out.write(stream.feed(c.committed))
                out.flush()
        except KeyboardInterrupt:
            interrupted = True
    seconds = time.perf_counter() - t0
    if out is not None:
        out.write(stream.flush())
    return cycles, seconds, interrupted, request


def report(engine, model, settings, cycles, seconds, request, interrupted) -> dict:
    from .engine import summarize

    ids = [t for c in cycles for t in c.committed]
    s = summarize(cycles, seconds)
    return {
        "mode": settings.mode, "text": model.detokenize([t for t in ids if not model.is_eog(t)]),
        "token_ids": ids, "prompt_tokens": request.n_prompt, "n_cycles": s["n_cycles"], "n_passes": s["n_passes"],
        "tokens_per_cycle": s["tokens_per_cycle"], "passes_per_token": s["passes_per_token"],
        "seconds": s["seconds"], "tokens_per_second": s["tokens_per_second"],
        "prefill": {"tokens": request.prefill[0], "seconds": request.prefill[1]},
        "stop": "interrupted" if interrupted else s["stop"],
        "widths": widths_histogram(settings.mode, cycles),
        "settings": {"block": settings.block or engine.block_size, "theta": settings.theta, "tau": settings.tau,
                     "draft_k": settings.draft_k, "max_new": settings.max_new},
    }


def widths_histogram(mode: str, cycles) -> dict:
    """How often each width was chosen (planner.label: 'ar', 'B=4 v=2', 'k=3'), most frequent first."""
    from collections import Counter
    from .planner import label
    return dict(Counter(label(mode, c) for c in cycles).most_common())


def summary_line(r: dict) -> str:
    passes = ", ".join(f"{k} {v}" for k, v in r["n_passes"].items())
    return (f"[{r['mode']}] {len(r['token_ids'])} tokens, {r['n_cycles']} cycles, "
            f"{r['tokens_per_cycle']:.2f} tokens/cycle, passes: {passes}, {r['tokens_per_second']:.1f} tokens/s"
            + (", widths " + ", ".join(f"{k} x{v}" for k, v in list(r["widths"].items())[:4])
               if r.get("widths") and r["settings"]["block"] == "auto" else "")
            + (" (interrupted)" if r["stop"] == "interrupted" else ""))


def cmd_run(args) -> int:
    from .chat import Conversation
    from .engine import Settings

    engine, model = load_engine(args)
    mode = args.mode or engine.default_mode()
    if args.mode is None and mode == "ar":
        print(f"note: {model.path.name} has no mask token; using --mode ar (pass --mask-token ID for the exact modes)",
              file=sys.stderr)
    settings = Settings(mode=mode, max_new=args.max_new, block=args.block, theta=args.theta, tau=args.tau,
                        draft_k=args.draft_k)
    engine.check(settings)
    engine.prepare(settings)            # --block auto: pass costs calibrated (or read from the cache) now
    color = sys.stdout.isatty() and not args.no_color and not args.json
    conv = None if args.raw else Conversation(model, system=args.system)

    def turn(text: str) -> tuple[dict, bool]:
        tokens = model.tokenize(text, add_special=True) if conv is None else conv.prompt_tokens(text)
        cycles, seconds, interrupted, request = answer(engine, model, tokens, settings, None if args.json else sys.stdout, color)
        r = report(engine, model, settings, cycles, seconds, request, interrupted)
        if conv is not None:
            conv.add_reply(r["text"])
        if args.json:
            print(json.dumps(r, ensure_ascii=False))
        else:
            print()
            print(summary_line(r), file=sys.stderr)
        return r, interrupted

    if args.prompt is not None:
        _, interrupted = turn(args.prompt)
        return 130 if interrupted else 0

    print(f"prove-local chat: {model.path.name}, mode {mode}. Empty line or Ctrl-D quits, /reset forgets the conversation, "
          "Ctrl-C stops an answer.", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not text.strip():
            return 0
        if text.strip() == "/reset":
            conv = None if args.raw else Conversation(model, system=args.system)
            continue
        turn(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prove-local", description="Proposer-verifier decoding on llama.cpp.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    from prove_local.convert.cli import add_parser as add_convert
    add_convert(sub)
    from prove_local.ui.app import add_parser as add_ui
    add_ui(sub)
    from prove_local.pull import add_parser as add_pull
    add_pull(sub)
    from prove_local.bench import add_parser as add_bench
    add_bench(sub)
    from prove_local.calibrate import add_parser as add_calibrate
    add_calibrate(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ProveError as e:
        print(f"prove-local: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
