"""What the UI holds between requests: the models (loaded once, from the command line), a pool of
engines on them, and per-browser-session conversations. Decoding is the runtime's
(`Engine.generate`); this module only drives it and records the events.

Isolation: an `Engine` holds one committed sequence and its KV caches, so a request takes an
engine from the pool for its whole duration (one request per engine at a time). With
`parallel` engines, that many requests decode at once; more wait for a free engine. A session
prefers the engine it used last, whose caches still hold its conversation.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prove_local.chat import Conversation, TemplateMissing
from prove_local.engine import MODES, Engine, ModeError, Settings, summarize
from prove_local.llama import ContextFull, LlamaError

from .view import AnswerView, token_label


class UIError(Exception):
    """A message for the page."""


class Runtime:
    def __init__(self, proposer=None, verifier=None, draft=None, *, mask_token: int | None = None,
                 parallel: int = 1, system: str | None = None, error: str | None = None, **context_options):
        self.proposer, self.verifier, self.draft = proposer, verifier, draft
        self.mask_token = mask_token
        self.system = system
        self.context_options = context_options
        self.error = error                     # set when the models could not be loaded
        self._engines: list[Engine | None] = [None] * max(1, parallel)
        self._busy = [False] * len(self._engines)
        self._cond = threading.Condition()
        self.mode_errors: dict[str, str] = {}
        self.default_mode = "ar"
        self.block_size = 16
        self.n_ctx = context_options.get("n_ctx", 4096)
        if proposer is not None and error is None:
            try:
                first = self._new_engine()      # validates vocabularies and the mask token now
            except (LlamaError, ModeError) as e:
                self.error = f"could not set up the models: {e}"
            else:
                self._engines[0] = first
                self.default_mode = first.default_mode()
                self.block_size = first.block_size
                self.n_ctx = first.n_ctx
                for m in MODES:
                    try:
                        first.check(Settings(mode=m))
                    except ModeError as e:
                        self.mode_errors[m] = str(e)

    # ------------------------------------------------------------------------ loading
    @classmethod
    def from_args(cls, args) -> "Runtime":
        """Models from the command line (the embedded pair when no model is given). A failure
        to load does not raise: the page starts and shows `error`."""
        from prove_local.cli import EMBEDDED_PROPOSER, EMBEDDED_VERIFIER
        from prove_local.llama import Model, gpu_offload_supported

        model = Path(args.model) if args.model else EMBEDDED_PROPOSER
        verifier = Path(args.verifier) if args.verifier else None
        if verifier is None and not args.model and EMBEDDED_VERIFIER.is_file():
            verifier = EMBEDDED_VERIFIER        # the embedded verifier is optional
        opts = dict(n_ctx=args.ctx, n_threads=args.threads, flash_attn=args.flash_attn)
        try:
            from prove_local.memory import check_fits

            ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (-1 if gpu_offload_supported() else 0)
            parallel = max(1, args.parallel)
            check_fits([model, verifier, args.draft] * parallel, args.ctx, args.kv_type, ngl,
                       flash_attn=args.flash_attn)
            prop = Model(model, n_gpu_layers=ngl)
            ver = Model(verifier, n_gpu_layers=ngl) if verifier else None
            draft = None
            if args.draft:
                draft = prop if Path(args.draft) == model else Model(args.draft, n_gpu_layers=ngl)
        except LlamaError as e:
            hint = ("; the embedded models are not installed: pass MODEL.gguf on the command line"
                    if not args.model and not EMBEDDED_PROPOSER.is_file() else "")
            return cls(error=f"model failed to load: {e}{hint}", parallel=args.parallel, **opts)
        # as `prove-local run`: an F32 KV cache for F32 models (batched and one-token evaluation agree)
        kv = args.kv_type or ("f32" if prop.meta("general.file_type") == "0" else "f16")
        opts.update(type_k=kv, type_v=kv)
        return cls(prop, ver, draft, mask_token=args.mask_token, parallel=args.parallel, system=args.system, **opts)

    def _new_engine(self) -> Engine:
        return Engine.load(self.proposer, self.verifier, self.draft, mask_token=self.mask_token,
                           **self.context_options)

    @property
    def parallel(self) -> int:
        """Requests that can decode at the same time (one engine each)."""
        return len(self._engines)

    @property
    def modes(self) -> list[str]:
        return [m for m in MODES if m not in self.mode_errors] if self.error is None else []

    def names(self) -> dict[str, str]:
        return {role: m.path.name for role, m in
                (("proposer", self.proposer), ("verifier", self.verifier), ("draft", self.draft)) if m is not None}

    # ------------------------------------------------------------------------ engines
    @contextlib.contextmanager
    def engine(self, prefer: int | None = None):
        """(index, engine), exclusively for the duration of the block."""
        with self._cond:
            while all(self._busy):
                self._cond.wait()
            free = [i for i, b in enumerate(self._busy) if not b]
            i = prefer if prefer in free else next((j for j in free if self._engines[j] is not None), free[0])
            self._busy[i] = True
        try:
            if self._engines[i] is None:
                self._engines[i] = self._new_engine()
            yield i, self._engines[i]
        finally:
            with self._cond:
                self._busy[i] = False
                self._cond.notify()

    # ------------------------------------------------------------------------ text
    def prompt_tokens(self, messages: list[dict], user: str) -> list[int]:
        """The conversation so far plus `user`, rendered with the GGUF's chat template (a model
        without a template gets a plain completion of `user`)."""
        try:
            conv = Conversation(self.proposer, system=self.system)
        except TemplateMissing:
            return self.proposer.tokenize(user, add_special=True)
        conv.messages += messages
        return conv.prompt_tokens(user)

    def token_text(self, token: int) -> str:
        return token_label(self.proposer.piece(token, special=True))

    def reply_text(self, tokens: list[int]) -> str:
        return self.proposer.detokenize([t for t in tokens if not self.proposer.is_eog(t)])


# ---------------------------------------------------------------------------- sessions
@dataclass
class Turn:
    user: str
    prompt: list[int]
    settings: Settings
    view: AnswerView
    seconds: float = 0.0
    stats: dict | None = None
    note: str = ""
    running: bool = True
    compare: dict | None = None


@dataclass
class Session:
    """One browser session's state (plain data: gradio keeps one per session)."""
    messages: list = field(default_factory=list)    # chat-template messages of finished turns
    turns: list = field(default_factory=list)
    selected: tuple | None = None                   # (turn, cycle) in the inspector
    engine_hint: int | None = None
    stop_requested: bool = False


def _error_text(e: Exception, runtime: Runtime) -> str:
    if isinstance(e, ContextFull):
        return (f"context full: {e}. Press “Clear” to start a new conversation, or restart with a "
                f"larger --ctx (now {runtime.n_ctx}).")
    if isinstance(e, TemplateMissing):
        return str(e)
    if isinstance(e, ModeError):
        return f"mode not available: {e}"
    return f"llama.cpp error: {e}"


def run_turn(runtime: Runtime, sess: Session, user: str, settings: Settings):
    """Generate the answer to `user` in `sess`; yields the `Turn` after every cycle (and once at
    the end). Errors end up in `turn.note` and raise `UIError` after the last yield."""
    if runtime.error:
        raise UIError(runtime.error)
    if sess.turns and sess.turns[-1].running:
        raise UIError("an answer is still being generated in this session: wait for it, or press Stop")
    sess.stop_requested = False
    try:
        prompt = runtime.prompt_tokens(sess.messages, user)
    except Exception as e:   # jinja errors from a template
        raise UIError(f"the chat template failed: {e}") from e
    turn = Turn(user, prompt, settings, AnswerView(runtime.proposer))
    sess.turns.append(turn)
    error = None
    t0 = time.perf_counter()
    try:
        with runtime.engine(sess.engine_hint) as (idx, engine):
            sess.engine_hint = idx
            gen = engine.generate(prompt, settings)
            with contextlib.closing(gen):
                for cycle in gen:
                    turn.view.add(cycle)
                    if sess.stop_requested:
                        turn.note = "stopped"
                        break
                    yield turn
    except (LlamaError, ModeError) as e:
        error = _error_text(e, runtime)
    except GeneratorExit:       # the page went away mid-answer: the engine was released above
        turn.running, turn.note = False, "interrupted"
        turn.view.finish()
        if turn.view.cycles:
            sess.messages += [{"role": "user", "content": user},
                              {"role": "assistant", "content": runtime.reply_text(turn.view.tokens)}]
        raise
    except Exception as e:      # keep the session usable and say what happened
        error = f"internal error: {type(e).__name__}: {e}"
    turn.seconds = time.perf_counter() - t0
    turn.view.finish()
    turn.running = False
    cycles = turn.view.cycles
    if cycles:
        turn.stats = summarize(cycles, sum(c.seconds for c in cycles))
        if sess.stop_requested:
            turn.stats["stop"] = "stopped"
    if error:
        turn.note = error
    elif turn.stats and turn.stats["stop"] == "context":
        turn.note = (f"the context ({runtime.n_ctx} tokens) is full: the answer was cut. Press “Clear”, "
                     "or restart with a larger --ctx.")
    if cycles:
        sess.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": runtime.reply_text(turn.view.tokens)}]
    else:                       # nothing was generated: the turn does not enter the conversation
        sess.turns.pop()
    sess.stop_requested = False
    yield turn
    if error:
        raise UIError(error)


def compare_with_ar(runtime: Runtime, sess: Session, turn_index: int = -1) -> dict:
    """Run the prompt of a finished turn again in `ar` (same max new tokens) and measure both
    answers by their decode time (the sum of their cycles' seconds, prefill excluded)."""
    if runtime.error:
        raise UIError(runtime.error)
    if not sess.turns:
        raise UIError("send a prompt first: “Compare with AR” reruns the last prompt in AR mode")
    turn = sess.turns[turn_index]
    if turn.running:
        raise UIError("wait for the answer to finish")
    settings = Settings(mode="ar", max_new=turn.settings.max_new)
    try:
        with runtime.engine(sess.engine_hint) as (idx, engine):
            sess.engine_hint = idx
            cycles = list(engine.generate(turn.prompt, settings))
    except (LlamaError, ModeError) as e:
        raise UIError(_error_text(e, runtime)) from e
    ar_stats = summarize(cycles, sum(c.seconds for c in cycles))
    ar_text = runtime.reply_text([t for c in cycles for t in c.committed])
    mode_stats = turn.stats
    speedup = (mode_stats["tokens_per_second"] / ar_stats["tokens_per_second"]
               if mode_stats and ar_stats["tokens_per_second"] > 0 else None)
    turn.compare = {"ar_text": ar_text, "ar_stats": ar_stats, "speedup": speedup,
                    "mode_text": runtime.reply_text(turn.view.tokens),
                    "identical": runtime.reply_text(turn.view.tokens) == ar_text}
    return turn.compare
