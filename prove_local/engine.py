"""The engine: contexts for one proposer (+ verifier, + draft), and a generator of cycles.

The engine knows token ids only. `generate` streams `Cycle` events; stopping (end-of-generation
tokens, max new tokens, context full), KV reuse across requests and clean-up after an interrupted
generation live here, the decoding rules live in rules.py.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass
from typing import Iterator

from . import rules
from .llama import Context, ContextFull, Model

MODES = ("ar", "lossless", "prove", "mars", "spec")
MODE_NEEDS = {"lossless": "mask", "prove": "mask", "mars": "mask"}
MODE_CONTEXTS = {"prove": ("proposer", "verifier"), "spec": ("proposer", "draft")}   # others: proposer
DEFAULT_BLOCK = 16


class ModeError(ValueError):
    """A mode was asked for that these models cannot run."""


@dataclass
class Settings:
    mode: str = "lossless"
    max_new: int = 256
    block: int | None = None    # None: the proposer GGUF's prove.block_size, else 16
    theta: float = 0.05
    tau: float = 0.95
    draft_k: int = 4


class Engine:
    """Decoding over a set of contexts ("proposer", optionally "verifier" and "draft") that share
    one committed token sequence. `Engine.load` builds it from GGUF models; tests pass fakes."""

    def __init__(self, contexts: dict, *, is_eog, mask_token: int | None, n_ctx: int,
                 block_size: int | None = None, name: str = "the proposer"):
        self.contexts = contexts
        self.is_eog = is_eog
        self.mask_token = mask_token
        self.n_ctx = n_ctx
        self.block_size = block_size or DEFAULT_BLOCK
        self.name = name
        self.tokens: list[int] = []        # committed sequence; every context holds a prefix of it
        self.prefill = (0, 0.0)            # (tokens evaluated, seconds) of the last request's prompt

    @classmethod
    def load(cls, proposer: Model, verifier: Model | None = None, draft: Model | None = None, *,
             mask_token: int | None = None, **context_options) -> "Engine":
        """Contexts on the given models (options as for `Context`); checks that the verifier and
        draft share the proposer's vocabulary and that the mask token is in range."""
        models = {"proposer": proposer, "verifier": verifier, "draft": draft}
        for role in ("verifier", "draft"):
            if models[role] is not None:
                proposer.check_same_vocab(models[role])
        mask = proposer.mask_token if mask_token is None else mask_token
        if mask is not None and not 0 <= mask < proposer.n_vocab:
            raise ModeError(f"mask token id {mask} is outside the vocabulary of {proposer.path} (0..{proposer.n_vocab - 1})")
        contexts = {role: Context(m, **context_options) for role, m in models.items() if m is not None}
        return cls(contexts, is_eog=proposer.is_eog, mask_token=mask, n_ctx=contexts["proposer"].n_ctx,
                   block_size=proposer.block_size, name=str(proposer.path))

    def default_mode(self) -> str:
        return "lossless" if self.mask_token is not None else "ar"

    def check(self, s: Settings) -> None:
        if s.mode not in MODES:
            raise ModeError(f"unknown mode {s.mode!r}; choose from {', '.join(MODES)}")
        if MODE_NEEDS.get(s.mode) == "mask" and self.mask_token is None:
            raise ModeError(f"mode {s.mode!r} needs a mask token, and {self.name} has none "
                            "(no prove.mask_token_id / tokenizer.ggml.mask_token_id); pass --mask-token ID "
                            "or use --mode ar/spec")
        if s.mode == "prove" and "verifier" not in self.contexts:
            raise ModeError("mode 'prove' needs a verifier model (--verifier V.gguf)")
        if s.mode == "spec" and "draft" not in self.contexts:
            raise ModeError("mode 'spec' needs a draft model (--draft D.gguf)")
        if (s.block or 1) < 1 or s.draft_k < 0 or s.max_new < 0:
            raise ModeError("block and max new tokens must be >= 1, draft k >= 0")

    def _rule(self, s: Settings, block: int):
        c = self.contexts
        if s.mode == "ar":
            return lambda t: rules.ar_cycle(c["proposer"], t)
        if s.mode == "lossless":
            return lambda t: rules.lossless_cycle(c["proposer"], t, min(block, self.n_ctx - len(t)), self.mask_token)
        if s.mode == "prove":
            return lambda t: rules.prove_cycle(c["proposer"], c["verifier"], t, min(block, self.n_ctx - len(t)),
                                               self.mask_token, s.theta)
        if s.mode == "mars":
            return lambda t: rules.mars_cycle(c["proposer"], t, min(block, self.n_ctx - len(t)), self.mask_token, s.tau)
        return lambda t: rules.spec_cycle(c["proposer"], c["draft"], t, min(s.draft_k, self.n_ctx - len(t)))

    def _sync(self) -> None:
        """Drop from every cache whatever is not a committed prefix (after a cut or an interrupt)."""
        for ctx in self.contexts.values():
            ctx.truncate(min(ctx.n_past, len(self.tokens)))

    def generate(self, prompt: list[int], settings: Settings | None = None) -> Iterator[rules.Cycle]:
        """Stream the cycles that continue `prompt`. Cached tokens shared with the previous request
        are reused. If the consumer stops early (or Ctrl-C lands mid-cycle), the caches are cut
        back to the committed tokens, so the next request works."""
        s = settings or Settings(mode=self.default_mode())
        self.check(s)
        if not prompt:
            raise ModeError("empty prompt")
        if len(prompt) >= self.n_ctx:
            raise ContextFull(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx} "
                              "(raise --ctx or shorten the prompt)")
        block = s.block or self.block_size
        keep = 0
        while keep < min(len(prompt), len(self.tokens)) and prompt[keep] == self.tokens[keep]:
            keep += 1
        self.tokens = self.tokens[:keep]
        self._sync()
        self.tokens = list(prompt)
        return self._run(s, block, len(prompt))

    def _run(self, s: Settings, block: int, n_prompt: int) -> Iterator[rules.Cycle]:
        try:
            t0 = time.perf_counter()
            n_pre = 0
            for role in MODE_CONTEXTS.get(s.mode, ("proposer",)):  # prefill: all but the last token
                ctx = self.contexts[role]
                n_pre += max(0, len(self.tokens) - 1 - ctx.n_past)
                if ctx.n_past < len(self.tokens) - 1:
                    ctx.eval(self.tokens[ctx.n_past:-1], rows=[])
            self.prefill = (n_pre, time.perf_counter() - t0)
            rule = self._rule(s, block)
            index = 0
            while s.max_new > 0:
                n_gen = len(self.tokens) - n_prompt
                before = {r: c.decode_seconds for r, c in self.contexts.items()}
                t0 = time.perf_counter()
                cycle = rule(self.tokens)
                cycle.seconds = time.perf_counter() - t0
                cycle.decode_seconds = {r: c.decode_seconds - before[r] for r, c in self.contexts.items()
                                        if c.decode_seconds > before[r]}
                assert cycle.committed, "a cycle must commit at least one token"
                run = cycle.committed
                for i, tok in enumerate(run):
                    if self.is_eog(tok):
                        run, cycle.stop = run[:i + 1], "eog"
                        break
                if n_gen + len(run) >= s.max_new:
                    run, cycle.stop = run[:s.max_new - n_gen], cycle.stop or "length"
                if len(self.tokens) + len(run) >= self.n_ctx:
                    run, cycle.stop = run[:self.n_ctx - len(self.tokens)], cycle.stop or "context"
                cycle.n_accepted = min(cycle.n_accepted, len(run))
                cycle.committed, cycle.index, cycle.start = run, index, n_gen
                self.tokens.extend(run)
                index += 1
                if cycle.stop:
                    self._sync()
                yield cycle
                if cycle.stop:
                    return
        finally:
            self._sync()


class TextStream:
    """Incremental detokenizer: bytes of token pieces -> text, holding back split UTF-8 sequences."""

    def __init__(self, model: Model):
        self.model = model
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens: list[int]) -> str:
        return self._dec.decode(b"".join(self.model.piece(t) for t in tokens))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def summarize(cycles: list[rules.Cycle], seconds: float) -> dict:
    """Per-answer statistics from its cycle events."""
    n_tokens = sum(len(c.committed) for c in cycles)
    passes: dict[str, int] = {}
    decode: dict[str, float] = {}
    for c in cycles:
        for role, n in c.passes.items():
            passes[role] = passes.get(role, 0) + n
        for role, t in c.decode_seconds.items():
            decode[role] = decode.get(role, 0.0) + t
    cycle_seconds = sum(c.seconds for c in cycles)
    return {
        "n_tokens": n_tokens,
        "n_cycles": len(cycles),
        "tokens_per_cycle": n_tokens / len(cycles) if cycles else 0.0,
        "n_passes": passes,
        "passes_per_token": {r: n / n_tokens for r, n in passes.items()} if n_tokens else {},
        "seconds": seconds,
        "tokens_per_second": n_tokens / seconds if seconds > 0 else 0.0,
        "decode_seconds": decode,
        "overhead_share": 1.0 - sum(decode.values()) / cycle_seconds if cycle_seconds > 0 else 0.0,
        "stop": cycles[-1].stop if cycles else None,
    }
