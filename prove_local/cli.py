"""`prove-local` command line: `run` (one prompt or an interactive chat) and `calibrate`; every other
command registers its own parser (convert, ui, pull, bench, serve, rpc-server)."""
from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
from pathlib import Path

from . import modes, sampling
from .answer import Answer
from .bench import add_parser as add_bench
from .calibrate import cache_path, calibrate
from .chat import Conversation, clean_text
from .convert.cli import add_parser as add_convert
from .engine import Settings, seed_note
from .errors import ContextFull, ProveError, UsageError
from .files import read_limited
from .grammar import MAX_GRAMMAR_FILE, Grammar, GrammarError
from .llama import Model, gpu_offload_supported, kv_options
from .loading import (EMBEDDED_PROPOSER, EMBEDDED_VERIFIER, GPU_LAYERS, KV_METAVAR, KV_TYPE, MAX_NEW, TAU, THETA, THREADS,
                      add_flash_attn_arg, add_hugepages_arg, add_model_args, add_width_args, finite_float, load_engine)
from .pull import add_parser as add_pull
from .rpc import add_parser as add_rpc_server
from .server import add_parser as add_serve      # FastAPI is imported only when `serve` runs
from .ui.app import add_parser as add_ui         # gradio likewise, when `ui` runs

# alternating colors per cycle; the lossless correction / bonus token is underlined
COLORS = ("\x1b[38;5;39m", "\x1b[38;5;214m")
BONUS, RESET = "\x1b[4m", "\x1b[0m"


def add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate with a proposer (and a verifier or draft)",
                       description="Generate text with ProVe decoding. Without -p: an interactive chat.")
    add_model_args(p)
    p.add_argument("--mode", choices=modes.NAMES,
                   help="decoding rule (default: lossless; without a mask token its drafts come from lookup only)")
    p.add_argument("--theta", type=THETA, default=0.05,
                   help="ProVe gate: commit while p*q >= theta, a finite number >= 0 (default 0.05)")
    p.add_argument("--tau", type=TAU, default=0.95,
                   help="MARS rule: commit while p >= tau, a finite number >= 0 (default 0.95)")
    add_width_args(p)
    add_sampling_args(p)
    p.add_argument("-p", "--prompt", help="one prompt; the answer streams to stdout")
    p.add_argument("-n", "--max-new", type=MAX_NEW, default=256, help="max new tokens per answer, >= 1 (default 256)")
    p.add_argument("--raw", action="store_true", help="plain completion of the prompt, no chat template")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per answer instead of streamed text")
    p.add_argument("--no-color", action="store_true", help="no colors even on a terminal")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--grammar", metavar="FILE", help="constrain the answer to a GBNF grammar (llama.cpp's format)")
    c.add_argument("--json-schema", metavar="FILE", help="constrain the answer to JSON following this JSON schema")
    p.set_defaults(func=cmd_run)


def read_grammar(args, model):
    """--grammar FILE / --json-schema FILE as a grammar.Grammar (None without either); a bad file is
    one line naming it and the parser's complaint."""
    path = args.grammar or args.json_schema
    if path is None:
        return None
    flag = "--grammar" if args.grammar else "--json-schema"
    try:        # a regular file of bounded size: /dev/zero or a FIFO is refused before any read
        text = read_limited(path, MAX_GRAMMAR_FILE).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e})") from None
    try:
        return Grammar(model, text) if args.grammar else Grammar.from_schema(model, text)
    except GrammarError as e:
        raise UsageError(f"{flag} {path}: {e}") from None


def add_sampling_args(p) -> None:
    """The sampler chain's options (llama.cpp's names and defaults, except temperature: 0 = greedy)."""
    g = p.add_argument_group("sampling", "penalties -> temperature -> top-k -> top-p -> min-p; the exact modes "
                             "(lossless, spec, lookup) give ar's sampled text for the seed (coupled sampler)")
    d = sampling
    g.add_argument("--temp", "--temperature", dest="temperature", type=d.temperature_arg, default=d.TEMPERATURE,
                   help=f"temperature (default {d.TEMPERATURE:g}: greedy, every exact mode equals ar token for token)")
    g.add_argument("--top-k", type=int, default=d.TOP_K,
                   help=f"keep the k most probable tokens (default {d.TOP_K}; 0: off)")
    g.add_argument("--top-p", type=float, default=d.TOP_P,
                   help=f"keep the smallest head with this mass (default {d.TOP_P}; 1: off)")
    g.add_argument("--min-p", type=float, default=d.MIN_P,
                   help=f"keep tokens with p >= min_p * p_max (default {d.MIN_P}; 0: off)")
    g.add_argument("--repeat-penalty", type=float, default=d.REPEAT_PENALTY,
                   help=f"penalty on recent tokens (default {d.REPEAT_PENALTY}: off)")
    g.add_argument("--repeat-last-n", type=int, default=d.REPEAT_LAST_N,
                   help=f"tokens the penalty looks back over (default {d.REPEAT_LAST_N}; -1: the whole context)")
    g.add_argument("--seed", type=int, help="random seed (default: a fresh one, reported in --json); with the "
                   "coupled sampler it fixes the text of ar, lossless, spec and lookup, at any width")
    g.add_argument("--sampler", choices=d.SAMPLERS, default=d.SAMPLER,
                   help="how tokens are drawn and verified at T > 0: 'coupled' (default: noise keyed by position, "
                        "every exact mode gives ar's text for the seed) or 'rejection' (exact speculative sampling: "
                        "the same distribution, a seed's text depends on the widths)")


def sampling_settings(args) -> dict:
    return {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                          "repeat_last_n", "seed", "sampler")}


def answer(engine, model, prompt_tokens, settings, out, color: bool):
    """Run one request (answer.Answer), streaming its text to `out`. Returns (the Answer, interrupted)."""
    ans = Answer(engine, model, prompt_tokens, settings)
    interrupted = False
    with ans:
        try:
            for piece in ans:
                if out is None:
                    continue
                c, text = piece.cycle, piece.text
                if color:
                    extra = c.committed[c.n_accepted:]
                    out.write(COLORS[c.index % 2] + text[:piece.accepted]
                              + (BONUS + text[piece.accepted:] if extra else "") + RESET)
                else:
                    out.write(text)
                out.flush()
        except KeyboardInterrupt:
            interrupted = True
    if out is not None:
        out.write(ans.rest())
    return ans, interrupted


def report(engine, settings, ans, interrupted) -> dict:
    """The --json object of one answer; `seconds` and tokens/s are the decode time's (prefill apart)."""
    s = ans.summary()
    return {
        "mode": settings.mode, "text": ans.text(),
        "token_ids": ans.tokens, "prompt_tokens": ans.request.n_prompt, "n_cycles": s["n_cycles"],
        "n_passes": s["n_passes"], "tokens_per_cycle": s["tokens_per_cycle"], "passes_per_token": s["passes_per_token"],
        "seconds": s["seconds"], "host_seconds": s["host_seconds"], "tokens_per_second": s["tokens_per_second"],
        "prefill": {"tokens": s["prefill"][0], "seconds": s["prefill"][1]},
        "stop": "interrupted" if interrupted else s["stop"],
        "widths": s["widths"],
        "drafts": {src: {"drafted": n, "accepted": a} for src, (n, a) in s["drafts"].items()},
        "planner": engine.explain(settings),      # why auto ran plain ar cycles, if it did
        "settings": {"block": settings.block or engine.block_size, "theta": settings.theta, "tau": settings.tau,
                     "draft_k": settings.draft_k, "lookup": settings.lookup, "max_new": settings.max_new,
                     "temperature": settings.temperature,
                     "top_k": settings.top_k, "top_p": settings.top_p, "min_p": settings.min_p,
                     "repeat_penalty": settings.repeat_penalty, "repeat_last_n": settings.repeat_last_n,
                     "seed": s["seed"], "sampler": settings.sampler},
    }


def json_line(obj) -> str:
    """One JSON object; a non-finite float (never valid JSON) becomes null."""
    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v
    return json.dumps(finite(obj), ensure_ascii=False, allow_nan=False)


def summary_line(r: dict) -> str:
    passes = ", ".join(f"{k} {v}" for k, v in r["n_passes"].items())
    return (f"[{r['mode']}] {len(r['token_ids'])} tokens, {r['n_cycles']} cycles, "
            f"{r['tokens_per_cycle']:.2f} tokens/cycle, passes: {passes}, {r['tokens_per_second']:.1f} tokens/s"
            + (", widths " + ", ".join(f"{k} x{v}" for k, v in list(r["widths"].items())[:4])
               if r.get("widths") and "auto" in (r["settings"]["block"], r["settings"]["lookup"]) else "")
            + ("".join(f", {src} drafts {d['accepted']}/{d['drafted']} accepted" for src, d in r["drafts"].items()
                       if src == "lookup") if r.get("drafts") else "")
            + (" (interrupted)" if r["stop"] == "interrupted" else ""))


def cmd_run(args) -> int:
    if isinstance(args.block, int) and args.block >= args.ctx:     # before loading anything
        raise UsageError(f"--block {args.block} does not fit the {args.ctx}-token context (--ctx)")
    engine, model = load_engine(args)
    try:
        return _run(args, engine, model)
    finally:
        engine.close()          # (its contexts freed, and the planner's memory written: Engine.save_memory)


def _run(args, engine, model) -> int:
    mode = args.mode or engine.default_mode()
    if args.mode is None and engine.mask_token is None:
        print(f"note: {model.path.name} has no mask token: lossless drafts by lookup only (continuations copied from "
              "the prompt and the answer, verified exactly); --lookup 0 with --mode ar for plain decoding",
              file=sys.stderr)
    settings = Settings(mode=mode, max_new=args.max_new, block=args.block, theta=args.theta, tau=args.tau,
                        draft_k=args.draft_k, lookup=args.lookup, grammar=read_grammar(args, model),
                        p_tilde=False, **sampling_settings(args))
    engine.check(settings)
    engine.prepare(settings)            # --block auto: pass costs calibrated (or read from the cache) now
    note = seed_note(settings)
    if note:
        print(f"note: {note}", file=sys.stderr)
    color = sys.stdout.isatty() and not args.no_color and not args.json
    system = clean_text(args.system) if args.system is not None else None
    conv = None if args.raw else Conversation(model, system=system)

    def turn(text: str) -> tuple[dict, bool]:
        text = clean_text(text)
        tokens = model.tokenize(text, add_special=True) if conv is None else conv.prompt_tokens(text)
        try:
            ans, interrupted = answer(engine, model, tokens, settings, None if args.json else sys.stdout, color)
        except BaseException:
            if conv is not None:    # the turn did not happen: the conversation stays as it was
                conv.forget_last_user()
            raise
        r = report(engine, settings, ans, interrupted)
        if conv is not None:
            conv.add_reply(r["text"])
        if args.json:
            print(json_line(r))
        else:
            print()
            print(summary_line(r), file=sys.stderr)
            if r["planner"]:
                print(f"note: {r['planner']}", file=sys.stderr)
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
            conv = None if args.raw else Conversation(model, system=system)
            continue
        try:
            turn(text)
        except ContextFull as e:   # refuse this turn, keep the conversation
            print(f"prove-local: this turn does not fit: {e}; the conversation is kept "
                  "(/reset starts over, or raise --ctx)", file=sys.stderr)


# ------------------------------------------------------------------------------- calibrate
MAX_BUDGET = 3600.0     # seconds per model: a measurement, not a soak (nan/inf never ended)


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure (or show) the pass-cost curve t(n) of models as configured",
                       description="Measure t(n), the seconds of one llama_decode of n tokens, for each model "
                                   "with the given configuration, and cache it (the planner of --block auto "
                                   "reads it). Cached curves are shown unless --refresh.")
    p.add_argument("models", nargs="*", metavar="MODEL.gguf", help="GGUF files (default: the embedded pair)")
    p.add_argument("--refresh", action="store_true", help="measure again even when a cached curve exists")
    p.add_argument("--budget", type=finite_float(0.0, MAX_BUDGET), default=0.8,
                   help=f"seconds per model, shared by the thread counts tried, > 0 and <= {MAX_BUDGET:g} (default 0.8)")
    p.add_argument("--threads", type=THREADS, help="CPU threads (default: chosen by measurement for small models)")
    p.add_argument("--n-gpu-layers", type=GPU_LAYERS,
                   help="layers to offload (default: all when llama.cpp has a GPU backend)")
    add_flash_attn_arg(p)
    add_hugepages_arg(p)
    p.add_argument("--kv-type", type=KV_TYPE, metavar=KV_METAVAR,
                   help="KV cache type, or K/V apart (default: as run: f32 for F32 models, f16 on a GPU, q8_0/f16 on a CPU)")
    p.add_argument("--json", action="store_true", help="print the curves as JSON")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    """Measure (or show the cached) t(n) of each model: calibrate.py."""
    paths = [Path(m) for m in args.models] or [EMBEDDED_PROPOSER, EMBEDDED_VERIFIER]
    if args.budget <= 0:
        raise UsageError("--budget must be > 0")
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (-1 if gpu_offload_supported() else 0)
    out = {}
    for path in paths:
        model = Model(path, n_gpu_layers=ngl, hugepages=args.hugepages)
        opts = dict(n_threads=args.threads, flash_attn=args.flash_attn, **kv_options(args.kv_type or model.default_kv_type))
        cal = calibrate(model, opts, refresh=args.refresh, budget_s=args.budget, verbose=not args.json)
        out[str(path)] = {"threads": cal["threads"], "measured_now": cal["measured"],
                          "curves": {str(th): c for th, c in cal["curves"].items()}}
        if not args.json:
            for th, c in cal["curves"].items():
                t1 = c[1]
                ratios = ", ".join(f"{n}:{c[n] / t1:.2f}" for n in (2, 3, 4, 8, 16, 32) if n in c)
                mark = " (chosen)" if th == cal["threads"] and len(cal["curves"]) > 1 else ""
                print(f"{path.name}: {th} thread(s){mark}: t(1) {t1 * 1e3:.3f} ms; t(n)/t(1) {ratios}")
        model.close()
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"cache: {cache_path()}", file=sys.stderr)
    return 0


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): `prove-local run: error: argument --theta: ...`."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\nprove-local: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`| head -c 1`): stop quietly, as Unix tools do (status 128 + SIGPIPE)
        _quiet_stdout()
        return 141
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EIO, errno.EPIPE):
            raise
        _quiet_stdout()
        print(f"prove-local: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return 1


def _main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="prove-local", description="Proposer-verifier decoding on llama.cpp.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    add_convert(sub)
    add_ui(sub)
    add_pull(sub)
    add_bench(sub)
    add_serve(sub)
    add_rpc_server(sub)
    add_calibrate_parser(sub)

    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()      # a write error surfaces here, inside main's handlers
        return rc
    except ProveError as e:
        print(f"prove-local: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
