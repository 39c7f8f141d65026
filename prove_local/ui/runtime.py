"""What the UI holds between requests: the models (loaded once, from the command line), a pool of
engines on them (`prove_local.pool`), and per-browser-session conversations. An answer is the
answer pipeline's (`prove_local.answer`: the generation and its statistics); this module only drives
it and records the events. A session
prefers the engine it used last, whose caches still hold its conversation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prove_local.answer import Answer, summary
from prove_local.chat import Conversation
from prove_local.engine import DEFAULT_BLOCK, Settings
from prove_local.errors import ContextFull, LlamaError, ModeError, TemplateMissing
from prove_local.loading import EMBEDDED_PROPOSER, Loaded, load_models
from prove_local.modes import MODES
from prove_local.pool import EnginePool

from .view import AnswerView, token_label


class UIError(Exception):
    """A message for the page."""


class Runtime:
    def __init__(self, loaded: Loaded | None = None, *, parallel: int = 1, system: str | None = None,
                 error: str | None = None, n_ctx: int = 4096):
        self.loaded = loaded
        self.target = loaded.target if loaded else None
        self.verifier = loaded.verifier if loaded else None
        self.draft = loaded.draft if loaded else None
        self.system = system
        self.error = error                     # set when the models could not be loaded
        self.pool: EnginePool | None = None
        self.mode_errors: dict[str, str] = {}
        self.default_mode = "ar"
        self.block_size = DEFAULT_BLOCK
        self.n_ctx = loaded.context_options.get("n_ctx", n_ctx) if loaded else n_ctx
        self._parallel = max(1, parallel)
        if loaded is not None and error is None:
            try:
                self.pool = EnginePool(loaded, parallel)
            except (LlamaError, ModeError) as e:
                self.error = f"could not set up the models: {e}"
            else:
                first = self.pool.first
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
        try:
            loaded = load_models(args, parallel=max(1, args.parallel))
        except LlamaError as e:
            hint = ("; the embedded models are not installed: pass MODEL.gguf on the command line"
                    if not args.model and not EMBEDDED_PROPOSER.is_file() else "")
            return cls(error=f"model failed to load: {e}{hint}", parallel=args.parallel, n_ctx=args.ctx)
        return cls(loaded, parallel=args.parallel, system=args.system)

    def close(self, timeout: float = 5.0) -> None:
        """Free the engines (the pool waits up to `timeout` seconds for the requests holding them), then
        the models; with an engine still busy after that the models stay loaded (the process is ending)."""
        if self.pool is not None and not self.pool.close(timeout):
            return
        if self.loaded is not None:
            self.loaded.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def parallel(self) -> int:
        """Requests that can decode at the same time (one engine each)."""
        return self.pool.parallel if self.pool else self._parallel

    @property
    def modes(self) -> list[str]:
        return [m for m in MODES if m not in self.mode_errors] if self.error is None else []

    def names(self) -> dict[str, str]:
        """File names by role; a MARS adapter on the stock model is listed as `adapter`."""
        adapter = self.loaded.adapter if self.loaded is not None else None
        return {role: m.path.name for role, m in
                (("target", self.target), ("adapter", adapter), ("verifier", self.verifier), ("draft", self.draft))
                if m is not None}

    def engine(self, prefer: int | None = None):
        """(index, engine) from the pool, exclusively for the duration of the block."""
        return self.pool.engine(prefer)

    # ------------------------------------------------------------------------ text
    def prompt_tokens(self, messages: list[dict], user: str) -> list[int]:
        """The conversation so far plus `user`, rendered with the GGUF's chat template (a model
        without a template gets a plain completion of `user`)."""
        try:
            conv = Conversation(self.target, system=self.system)
        except TemplateMissing:
            return self.target.tokenize(user, add_special=True)
        conv.messages += messages
        return conv.prompt_tokens(user)

    def token_text(self, token: int) -> str:
        return token_label(self.target.piece(token, special=True))

    def reply_text(self, tokens: list[int]) -> str:
        return self.target.detokenize([t for t in tokens if not self.target.is_eog(t)])


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
    seed: int | None = None           # the sampler's seed (the request's, or the one drawn for it)
    planner_note: str | None = None   # why --block auto ran plain ar cycles (Engine.explain), if it did
    request: object = None            # the engine's Request: its decode_seconds time tokens/s

    @property
    def decode_seconds(self) -> float:
        return self.request.decode_seconds if self.request is not None else 0.0


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
    turn = Turn(user, prompt, settings, AnswerView(runtime.target))
    sess.turns.append(turn)
    error = None
    t0 = time.perf_counter()
    try:
        with runtime.engine(sess.engine_hint) as (idx, engine):
            sess.engine_hint = idx
            answer = Answer(engine, runtime.target, prompt, settings)
            turn.seed, turn.request = answer.request.seed, answer.request
            with answer:
                for piece in answer:
                    turn.view.add(piece.cycle)
                    if sess.stop_requested:
                        turn.note = "stopped"
                        break
                    yield turn
            turn.planner_note = engine.explain(settings, fix="set the block length (draft k) to {width}")
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
        turn.stats = summary(cycles, turn.request)
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
    """Run the prompt of a finished turn again in `ar` (same max new tokens, same sampling settings and
    seed: with the coupled sampler an exact mode's sampled text is then ar's, token for token) and
    measure both answers by their tokens/s (engine.tokens_per_second: decode time, prefill excluded)."""
    if runtime.error:
        raise UIError(runtime.error)
    if not sess.turns:
        raise UIError("send a prompt first: “Compare with AR” reruns the last prompt in AR mode")
    turn = sess.turns[turn_index]
    if turn.running:
        raise UIError("wait for the answer to finish")
    s = turn.settings
    settings = Settings(mode="ar", max_new=s.max_new, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                        min_p=s.min_p, repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n,
                        seed=turn.seed, sampler=s.sampler)
    try:
        with runtime.engine(sess.engine_hint) as (idx, engine):
            sess.engine_hint = idx
            with Answer(engine, runtime.target, turn.prompt, settings) as answer:
                for _ in answer:
                    pass
    except (LlamaError, ModeError) as e:
        raise UIError(_error_text(e, runtime)) from e
    ar_stats = answer.summary()
    ar_text = runtime.reply_text(answer.tokens)
    mode_stats = turn.stats
    speedup = (mode_stats["tokens_per_second"] / ar_stats["tokens_per_second"]
               if mode_stats and ar_stats["tokens_per_second"] > 0 else None)
    turn.compare = {"ar_text": ar_text, "ar_stats": ar_stats, "speedup": speedup,
                    "mode_text": runtime.reply_text(turn.view.tokens),
                    "identical": runtime.reply_text(turn.view.tokens) == ar_text}
    return turn.compare
