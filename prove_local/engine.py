"""The engine: contexts for one target model (+ verifier, + draft), and a generator of cycles.

The engine knows token ids only. `generate` streams `Cycle` events; stopping (end-of-generation
tokens, max new tokens, context full), KV reuse across requests and clean-up after an interrupted
generation live here, the decoding rules live in rules.py.
"""
from __future__ import annotations

import codecs
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator


from . import constrain, modes, rules, sampling
from .calibrate import (MEMORY_EVERY_S, SAME_CURVE, calibrate, entry_key, load_memory, memory_enabled, memory_path,
                        model_key, recalibrate, recheck_threads, same_curve, save_memory, switch_cost)
from .errors import ContextFull, EngineBusy, ModeError
from .llama import Adapter, Context, Model
from .lookup import PUBLISH_CONTEXT, NgramIndex, Recent
from .modes import AR_PLAN, DEFAULT_BLOCK, DEFAULT_DRAFT_K, LOOKUP, MODES, NO_HOOKS, Hooks, Plan
from .planner import Costs, Planner


MAX_LOGPROBS = 20                 # alternatives per token (OpenAI's top_logprobs limit)
MAX_RECALIBRATIONS = 2            # per role and engine: curves measured again because the passes disputed them
LOAD_PASSES = 8                   # recent stock passes whose step loads the planner prices against (Engine._load)
LOAD_EVERY = 4                    # target passes between two readings of those medians
ALONE = ({}, 0)                   # Engine._load while no other engine of the pool generates
LANE_HOOKS = Hooks()              # an ar cycle of the planner's lane (Planner.lane): no hooks, and not observed


@dataclass
class Settings:
    mode: str = "lossless"
    max_new: int = 256
    block: int | str | None = None  # "auto": the planner's choice per cycle; None: the GGUF's prove.block_size, else DEFAULT_BLOCK
    theta: float = 0.05
    tau: float = 0.95
    draft_k: int | str = DEFAULT_DRAFT_K   # "auto": the planner's choice per cycle
    # lookup drafts (modes that take them: lossless, spec, lookup): "auto" = the planner's choice per cycle
    # (where it plans the widths), 0 = off, K = a K-token lookup draft whenever the index has a match
    lookup: int | str = "auto"
    # lookup drafts may copy earlier requests' tokens held by this engine (lookup.NgramIndex.restart: a
    # repeated question, a regenerated answer); False: only this request's (bench: each run alone)
    recall: bool = True
    # sampling (llama.cpp's names and, except temperature, its defaults); temperature 0 is greedy.
    # The chain, its order and these defaults: sampling.py.
    temperature: float = sampling.TEMPERATURE
    top_k: int = sampling.TOP_K
    top_p: float = sampling.TOP_P
    min_p: float = sampling.MIN_P
    repeat_penalty: float = sampling.REPEAT_PENALTY
    repeat_last_n: int = sampling.REPEAT_LAST_N
    seed: int | None = None
    # constrained output and logprobs (constrain.py): a grammar.Grammar (or a fake with start() and
    # sentinel), and the number of top alternatives to report per token (None: no logprobs)
    grammar: object | None = None
    logprobs: int | None = None
    sampler: str = sampling.SAMPLER         # "coupled" (a seed means a text in every exact mode) or "rejection"
    # the probabilities that decide nothing in greedy decoding: a greedy ar cycle's p̃ (Cycle.p) and the
    # target's q of each draft an exact rule verifies (Cycle.q); the UI shows them and the bench scores
    # them; `run` and `serve` read neither and turn this off, which spares an exp pass over the
    # vocabulary per row (rules.ar_cycle: host time per SmolLM2 token 0.22 -> 0.12 ms here; a B=16
    # lossless cycle over 151,936 tokens 7.8 -> 5.5 ms: sampling.GREEDY_ARGMAX); they are then NaN
    p_tilde: bool = True


def planned(s: Settings, has_mask: bool = True) -> bool:
    """Whether the planner decides the widths of these settings: the width the mode takes (spec's
    draft length, the others' block; ar has none) is 'auto', or the mode has no width (the lookup
    mode; lossless on a model without a mask token, `has_mask` False, whose block is moot) but takes
    lookup drafts and they are 'auto'."""
    m = MODES[s.mode]
    width = m.width if has_mask or not m.needs_mask else None
    if width is not None:
        return getattr(s, width) == "auto"
    return m.lookup and s.lookup == "auto"


def lookup_on(s: Settings, has_mask: bool = True) -> bool:
    """Whether these settings draft by lookup: a mode that takes lookup drafts, and --lookup K > 0, or
    'auto' where the planner decides the widths (with fixed widths, 'auto' leaves lookup off: the
    cycles then follow the settings alone, and a seed repeats the text)."""
    if not MODES[s.mode].lookup or s.lookup == 0:
        return False
    return s.lookup != "auto" or planned(s, has_mask)


def seed_note(s: Settings) -> str | None:
    """Why a seed will not reproduce this sampled request, if it will not: under 'auto' widths the
    planner's choices follow measured timings. The coupled sampler (the default) draws every token
    from noise keyed by its position, so the exact modes give ar's text for the seed at any width;
    only the lossy modes' text (their gates commit different tokens at different widths) and any
    mode under the rejection sampler (whose random stream is consumed per cycle) then vary."""
    if s.seed is None or not planned(s) or s.temperature == 0:      # (T = 0: no randomness at all)
        return None
    if s.sampler == "rejection":
        return ("with --sampler rejection the seed repeats a sampled answer only with fixed widths (--block N / "
                "--draft-k N / --lookup K, or the request's block / draft_k / lookup): 'auto' widths follow "
                "measured timings (the default coupled sampler repeats it at any width)")
    if not MODES[s.mode].exact:
        return (f"mode {s.mode!r} is lossy: its text depends on the widths, so the seed repeats it only with a "
                "fixed --block N (or the request's block): 'auto' widths follow measured timings")
    return None


class Engine:
    """Decoding over a set of contexts ("target", optionally "verifier" and "draft") that share
    one committed token sequence. `Engine.load` builds it from GGUF models; tests pass fakes.
    The engine is long-lived (it owns the contexts and their caches); each `generate` call makes
    a `Request` that holds everything about that one generation."""

    def __init__(self, contexts: dict, *, is_eog, mask_token: int | None, n_ctx: int,
                 block_size: int | None = None, name: str = "the target"):
        self.contexts = contexts
        self.is_eog = is_eog
        self.mask_token = mask_token
        self.n_ctx = n_ctx
        self.block_size = block_size or DEFAULT_BLOCK
        self.name = name
        self.tokens: list[int] = []        # committed sequence; every context holds a prefix of it
        self.active: Request | None = None  # the open generation's request, if any (one at a time)
        # acceptance statistics (from every cycle) and the --block auto planner; pass costs are
        # calibrated at the first auto request (Engine.load sets context_options for that)
        self.planner = Planner()
        self.context_options: dict | None = None
        # lookup drafts: the n-gram index of the committed tokens (its own part always a prefix of
        # self.tokens), after earlier requests' tokens (its history)
        self.index = NgramIndex()
        self.recent: Recent | None = None          # a pool's engines' finished requests (lookup.Recent)
        self._thread_curves: dict[str, dict] = {}
        self._recalibrated: dict[str, int] = {}     # per role: curves measured again (_recalibrate)
        self.closed = False
        # batching.Member when the contexts are sequences of shared ones (pool.py): the engine tells the
        # step barrier when its generation runs, hands a cycle to its consumer, and ends (_run)
        self.member = None
        self._load_read: tuple | None = None       # (the target's n_decode, the load) of the last reading
        self._load_priced: tuple | None = None     # (the load, the planner's costs) it was last given
        # the planner's memory (calibrate.save_memory): its key once recalled, and when it was last written
        # and how much the planner had learned then (seconds of planned cycles + cycles recorded)
        self._memory_key: str | None = None
        self._memory_saved: tuple[float, float] | None = None

    def close(self) -> None:
        """Free the contexts (their KV caches), each before its model; the models stay (they belong
        to whoever loaded them: Loaded.close, or a Model's own `with`). An open generation is released
        first (its caches cut back); a later `generate` raises EngineBusy. Idempotent. `with
        Engine.load(...) as engine:` closes it at the end of the block."""
        if self.active is not None:
            self._release(self.active)
        if not self.closed:
            self.save_memory(force=True)
        for ctx in self.contexts.values():
            close = getattr(ctx, "close", None)       # (the tests' fake contexts have none)
            if close is not None:
                close()
        self.closed = True
        self.tokens = []
        self.index.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def load(cls, target: Model, verifier: Model | None = None, draft: Model | None = None, *,
             mask_token: int | None = None, adapter: Adapter | None = None, contexts: dict | None = None,
             **context_options) -> "Engine":
        """Contexts on the given models (options as for `Context`); checks that the verifier and
        draft share the target's vocabulary and that the mask token is in range. `adapter`: a gated
        MARS adapter on the target (a stock model): its mask token and block are the adapter's.
        `contexts`: ready contexts per role on these models instead (a batched pool's sequences of
        shared contexts, batching.py); `context_options` are then what calibration measures with."""
        models = {"target": target, "verifier": verifier, "draft": draft}
        for role in ("verifier", "draft"):
            if models[role] is not None:
                target.check_same_vocab(models[role])
        if adapter is not None and adapter.mask_token is None and mask_token is None:
            raise ModeError(f"{adapter.path}: the adapter names no mask token (prove.mask_token_id); pass --mask-token ID")
        own = adapter.mask_token if adapter is not None else target.mask_token
        mask = own if mask_token is None else mask_token
        if mask is not None and not 0 <= mask < target.n_vocab:
            raise ModeError(f"mask token id {mask} is outside the vocabulary of {target.path} (0..{target.n_vocab - 1})")
        if contexts is None:
            contexts = {role: Context(m, adapter=adapter if role == "target" else None, **context_options)
                        for role, m in models.items() if m is not None}
        elif sorted(contexts) != sorted(r for r, m in models.items() if m is not None):
            raise ModeError(f"contexts for {sorted(contexts)}; the models given are "
                            f"{sorted(r for r, m in models.items() if m is not None)}")
        block = adapter.block_size if adapter is not None else target.block_size
        engine = cls(contexts, is_eog=target.is_eog, mask_token=mask, n_ctx=contexts["target"].n_ctx,
                     block_size=block, name=str(target.path) + (f" + {adapter.path.name}" if adapter else ""))
        engine.context_options = dict(context_options)
        return engine

    def calibrate(self, refresh: bool = False) -> None:
        """Pass costs of every context's model as configured (calibrate.py: cached on disk, measured
        within a bounded time when missing); a small model's thread count is chosen by measurement.
        Engines without models (fakes) get t(n) proportional to n, a CPU's worst case."""
        if self.context_options is None:
            self.planner.costs = Costs({r: {1: 1e-3, 64: 64e-3} for r in self.contexts})
            return
        curves = {}
        for role, ctx in self.contexts.items():
            cal = calibrate(ctx.model, self.context_options, refresh=refresh)
            if cal["threads"] != ctx.n_threads:
                ctx.set_threads(cal["threads"])
            curves[role] = cal["curves"][cal["threads"]]
            self._thread_curves[role] = cal["curves"]
        self.planner.costs = Costs(curves)
        target = self.contexts["target"]
        if getattr(target, "adapter", None) is not None:   # a gated adapter: what its switches cost
            self.planner.costs.adapter_switch = switch_cost(target.model, target.adapter, self.context_options,
                                                    target.n_threads, refresh=refresh)
        self._recall_memory()

    def adopt_calibration(self, other: "Engine") -> bool:
        """Take the calibrated pass costs of `other`, an engine on the same models with the same options
        (a pool's first engine), instead of reading the cache again: a cached curve that lacks widths
        is completed by measuring at each read (calibrate._complete), which a pool's later engines did
        at their first request, in the middle of the others' decoding (serve_bench: the first requests
        at 2 and 4 clients 2.5-3x slower). A Costs of their own over the same curves, at the same
        thread counts. Whether anything was taken (not when `other` has none or this has its own)."""
        if other.planner.costs is None or self.planner.costs is not None or not other._thread_curves \
                or set(other._thread_curves) != set(self.contexts):
            return False
        curves = {}
        for role, ctx in self.contexts.items():
            th = other.contexts[role].n_threads
            if ctx.n_threads != th:
                ctx.set_threads(th)
            self._thread_curves[role] = dict(other._thread_curves[role])
            curves[role] = self._thread_curves[role][th]
        self.planner.costs = Costs(curves)
        self.planner.costs.adapter_switch = other.planner.costs.adapter_switch
        self._recall_memory()
        return True

    def memory_key(self) -> str:
        """The planner memory's key: the target's calibration key (model file, options, threads, build),
        whether the contexts are a batched pool's, the adapter's and the other roles' model files."""
        target = self.contexts["target"]
        key = [entry_key(target.model, self.context_options, target.n_threads), "memory",
               "pool" if self.member is not None else "solo"]
        adapter = getattr(target, "adapter", None)
        if adapter is not None:
            key.append("adapter=" + model_key(adapter))
        key += [f"{role}={model_key(self.contexts[role].model)}" for role in ("verifier", "draft") if role in self.contexts]
        return "|".join(key)

    def _recall_memory(self) -> None:
        """The planner starts from the memory an earlier engine left (calibrate.load_memory), once, before
        it observed anything; an entry that does not check out is left unused, with a note."""
        if self.context_options is None or self._memory_key is not None or not memory_enabled() \
                or self.planner.elapsed > 0:
            return
        self._memory_key = self.memory_key()
        data = load_memory(self._memory_key)
        if data is not None:
            why = self.planner.recall(data)
            if why is not None:
                print(f"prove-local: note: the planner memory of {self.name} in {memory_path()} is not used: {why}",
                      file=sys.stderr)

    def save_memory(self, force: bool = False) -> None:
        """Write the planner's memory (Planner.memory) if it learned anything since it was last written,
        and, unless `force`, MEMORY_EVERY_S have passed (the end of each request calls it). Under the key
        of the engine as it is now (its thread count may have been chosen again since it was read)."""
        if self._memory_key is None or not memory_enabled():
            return
        pl = self.planner
        now, seen = time.monotonic(), pl.elapsed + sum(st.n_cycles for st in pl.stats.values())
        last = self._memory_saved
        if seen <= (last[1] if last else 0.0) or not force and last is not None and now - last[0] < MEMORY_EVERY_S:
            return
        try:
            self._memory_key = self.memory_key()
        except OSError:                         # (a model file gone meanwhile: nothing to key it by)
            return
        save_memory(self._memory_key, pl.memory())
        self._memory_saved = (now, seen)

    def _recheck_threads(self) -> None:
        """Passes cost many times their calibrated t(n): choose the thread count again on the live
        contexts, among those calibration measured (only where the user did not fix it)."""
        for role, ctx in self.contexts.items():
            options = sorted(self._thread_curves.get(role, {}))
            if len(options) > 1:
                th = recheck_threads(ctx, options)
                self.planner.set_curve(role, self._thread_curves[role][th])

    def _recalibrate(self) -> None:
        """The passes of a role keep disagreeing with its cached curve (planner.Costs.flagged): measure
        it again (calibrate.recalibrate: a fresh context, the cache entry replaced, the reason kept in
        it) and hand the planner the new curve. At most MAX_RECALIBRATIONS times per role and engine:
        a machine whose load keeps changing is not measured over and over."""
        costs = self.planner.costs
        for role, why in list(costs.flagged.items()):
            ctx = self.contexts.get(role)
            done = self._recalibrated.get(role, 0)
            if self.context_options is None or ctx is None or done >= MAX_RECALIBRATIONS:
                costs.dismiss(role)
                continue
            self._recalibrated[role] = done + 1
            old = self._thread_curves.get(role, {}).get(ctx.n_threads)
            in_use = costs.solo(role, 1) if role in costs.base else None     # (the calibrated t(1) x the scale)
            curve = recalibrate(ctx.model, self.context_options, ctx.n_threads, why, in_use=in_use)
            if curve is None:                    # measured in a busy spell: the cached curve stays
                costs.dismiss(role)
                continue
            if old and same_curve(old, curve):
                # the cache was right: the passes in use differ from a calibration's run of them (on the
                # embedded proposer with F32 KV, one-token passes between the planner's Python cost ~1.2x
                # what they cost back to back, wide ones less so: "t(3) 0.63x"), and measuring again
                # (~0.9 s of a running engine) would find the same curve once more
                self._recalibrated[role] = MAX_RECALIBRATIONS
                print(f"prove-local: {role}'s new curve matches the cached one within {SAME_CURVE:.0%}: the passes "
                      "disagree with it in use, not the cache; not measured again", file=sys.stderr)
            self._thread_curves.setdefault(role, {})[ctx.n_threads] = curve
            self.planner.set_curve(role, curve)

    def explain(self, s: Settings, fix: str = "{flag} {width}") -> str | None:
        """Why the planner is running plain ar cycles for these settings, in one line (None if it is
        not, or the widths are fixed): see Planner.explain."""
        if not planned(s, self.mask_token is not None) or self.planner.costs is None:
            return None
        return self.planner.explain(s.mode, MODES[s.mode].key(s), fix)

    def default_mode(self) -> str:
        """lossless, with or without a mask token: without one its drafts come from lookup alone."""
        return "lossless"

    def check(self, s: Settings) -> None:
        mode = modes.get(s.mode)
        if s.lookup != "auto" and (not isinstance(s.lookup, int) or isinstance(s.lookup, bool) or s.lookup < 0):
            raise ModeError(f"lookup must be 'auto' or an integer >= 0 (0: off), not {s.lookup!r}")
        if mode.needs_mask and self.mask_token is None and not lookup_on(s, False):
            raise ModeError(f"mode {s.mode!r} needs a mask token for its MARS proposals, and {self.name} has none "
                            "(no prove.mask_token_id / tokenizer.ggml.mask_token_id); "
                            + ("its lookup drafts need none, but --lookup 0 turns them off; "
                               if mode.lookup else "")
                            + "pass --mask-token ID or use --mode ar/spec/lookup")
        if mode.width is None and mode.lookup and not lookup_on(s, self.mask_token is not None):
            raise ModeError(f"mode {s.mode!r} with --lookup 0 drafts nothing (use --mode ar, or --lookup auto/K)")
        if "verifier" in mode.roles and "verifier" not in self.contexts:
            raise ModeError(f"mode {s.mode!r} needs a verifier model (--verifier V.gguf)")
        if "draft" in mode.roles and "draft" not in self.contexts:
            raise ModeError(f"mode {s.mode!r} needs a draft model (--draft D.gguf)")
        if s.block not in (None, "auto") and (not isinstance(s.block, int) or s.block < 1) \
                or s.draft_k != "auto" and (not isinstance(s.draft_k, int) or s.draft_k < 0) or s.max_new < 0:
            raise ModeError("block must be 'auto' or >= 1, draft k 'auto' or >= 0, max new tokens >= 0")
        bad = sampling.check(s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.repeat_last_n, s.seed)
        if bad:
            raise ModeError(bad)
        if s.logprobs is not None and (not isinstance(s.logprobs, int) or isinstance(s.logprobs, bool)
                                       or not 0 <= s.logprobs <= MAX_LOGPROBS):
            raise ModeError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), not {s.logprobs!r}")
        if s.sampler not in sampling.SAMPLERS:
            raise ModeError(f"sampler must be one of {', '.join(sampling.SAMPLERS)}, not {s.sampler!r}")

    def plan(self, req: "Request") -> tuple[Plan, Hooks]:
        """The widths of the next cycle: the planner's (planner.py) for an auto request, else the
        request's fixed settings; cut to the room left in the context. With the hooks its cycle calls:
        the planner's verify width choice, the lookup index's drafting (modes.Hooks)."""
        room = self.n_ctx - len(self.tokens)
        offer = None
        if req.lookup and room > 2:            # "auto" or K: the index's match at the end of the tokens
            if req.lookup != "auto":           # --lookup K: a K-token draft wherever there is a match
                self.index.sync(self.tokens)
                if self.index.match() is not None:
                    return (Plan(LOOKUP, lookup=min(req.lookup, room - 1)),
                            Hooks(propose_lookup=self._committable(self.index.propose, req)))
            else:                              # the planner's: only what the n-gram statistics back
                # looked up only if the planner may use it, and only as long as it may use it (the
                # index catches up with the committed tokens then: the planner's back-off skips cycles)
                offer = self._offer
        if req.auto:
            pl = self.planner
            if self.member is not None:        # a batched pool: price the widths in the steps they join
                load = self._load()            # (given again only when read again, or to new costs)
                if self._load_priced is None or load is not self._load_priced[0] \
                        or self.planner.costs is not self._load_priced[1]:
                    self.planner.set_load(*load)
                    self._load_priced = (load, self.planner.costs)
            if pl.lane:                        # an ar cycle of the planner's lane: nothing to plan or learn
                pl.lane -= 1
                return AR_PLAN, LANE_HOOKS
            # an ar cycle of a quiet run (nothing due, nothing to copy): no planning at all
            if self.planner.quiet_cycle(req.key or req.settings.mode, max(1, len(self.tokens) - self.contexts["target"].n_past),
                                        offer):
                return AR_PLAN, NO_HOOKS
            plan, choose = self.planner.plan_cycle(req.settings.mode, self._pending(), req.block, room, key=req.key,
                                                   lookup=offer)
            draft = self._committable(self.index.propose_supported, req) if plan.lookup else None
            return plan, Hooks(choose_verify=choose, propose_lookup=draft)
        if req.block < 1:                      # no mask token: no MARS proposal
            return AR_PLAN, NO_HOOKS
        k = req.settings.draft_k if req.settings.draft_k != "auto" else DEFAULT_DRAFT_K
        return MODES[req.settings.mode].plan(max(1, min(req.block, room)), max(0, min(k, room))), NO_HOOKS

    def _load(self) -> tuple[dict[str, int], int]:
        """Other requests' tokens per role in the steps this engine's next passes will join, and the
        number of those requests (Planner.set_load): none while no other engine of the pool is
        generating, else medians over this engine's last LOAD_PASSES stock passes (SeqView.others),
        read again after every LOAD_EVERY target passes (the same object in between: the medians move
        slowly, and reading them every cycle was ~10 us of each engine's host time in every step)."""
        if not self.member.batcher.others_generating(self.member):
            self._load_read = None
            return ALONE
        passes = self.contexts["target"].n_decode
        if self._load_read is not None and 0 <= passes - self._load_read[0] < LOAD_EVERY:
            return self._load_read[1]
        out, seqs = {}, 0
        for role, ctx in self.contexts.items():
            recent = list(getattr(ctx, "others", ()))[-LOAD_PASSES:]
            if recent:
                out[role] = sorted(n for _, n in recent)[len(recent) // 2]
                seqs = max(seqs, sorted(k for k, _ in recent)[len(recent) // 2])
        load = out, seqs
        self._load_read = (passes, load)
        return load

    def _offer(self):
        """The lookup index's offer to the planner (NgramIndex.offer at the planner's lookup_need),
        the index synced to the committed tokens first."""
        self.index.sync(self.tokens)
        return self.index.offer(self.planner.lookup_need)

    def _committable(self, propose, req: "Request"):
        """A lookup drafting function cut to what the request can still commit: at most the tokens
        left to generate less one (the cycle commits the model's own token after the drafts), and
        no further than the first end-of-generation token (generation stops there). A draft that
        copies the prompt's end of turn and what follows it pays for a wider pass whose tail can
        never be kept."""
        left = req.settings.max_new - (len(self.tokens) - req.n_prompt) - 1

        def draft(k: int):
            self.index.sync(self.tokens)       # (synced by the offer that planned the draft: a length check)
            tokens, scores = propose(min(k, max(0, left)))
            for i, tok in enumerate(tokens):
                if self.is_eog(tok):
                    return tokens[:i + 1], scores[:i + 1]
            return tokens, scores
        return draft

    def _pending(self) -> dict[str, int]:
        """Tokens each context will be fed before its new ones (at least the last: rules._pending)."""
        out = {r: max(1, len(self.tokens) - c.n_past) for r, c in self.contexts.items()}
        if rules.gated(self.contexts["target"]):
            out[modes.GATED] = 1                # the lossless passes' widths differ (modes.lossless_widths)
        return out

    def _sync(self) -> None:
        """Drop from every cache whatever is not a committed prefix (after a cut or an interrupt), and
        what a gated adapter's pass kept (llama.Context.n_stock: the lossy modes' proposal passes),
        so that a later request, exact or not, reads the stock model's KV."""
        for ctx in self.contexts.values():
            ctx.truncate(min(ctx.n_past, len(self.tokens), getattr(ctx, "n_stock", ctx.n_past)))

    def _cached_prefix(self, prompt: list[int], keep: int) -> int:
        """A pool's prompt cache (batching.PromptCache): the target's committed sequence saved
        before this request drops it, and the longest saved prefix of `prompt` written in when it
        spares a prefill; the prompt tokens the target then holds (`keep` without a cache)."""
        ctx = self.contexts["target"]
        cache = getattr(ctx, "prompt_cache", None)
        if cache is None:
            return keep
        held = min(ctx.n_past, ctx.n_stock, len(self.tokens))
        if held - keep >= cache.min_tokens:
            cache.keep(ctx, self.tokens[:held])
        have = min(keep, ctx.n_past)
        n = cache.fill(ctx, prompt, have)
        if n > keep:                             # the target holds prompt[:n] now; the others their prefix
            self.tokens = list(prompt[:n])
            for role, c in self.contexts.items():
                if role != "target":
                    c.truncate(min(c.n_past, keep))
            return n
        return n if n < have else keep           # (n < have: a refused state emptied the target)

    def generate(self, prompt: list[int], settings: Settings | None = None) -> "Generation":
        """Stream the cycles that continue `prompt` (iterate the returned `Generation`). Cached tokens
        shared with the previous request are reused. If the consumer stops early (close, Ctrl-C
        mid-cycle), the caches are cut back to the committed tokens, so the next request works.
        One generation at a time: a second one while another is open raises EngineBusy."""
        if self.closed:
            raise EngineBusy(f"{self.name}: this engine is closed (its contexts are freed)")
        if self.active is not None:
            raise EngineBusy(f"{self.name}: a generation is still open on this engine; finish or close it first")
        s = settings or Settings(mode=self.default_mode())
        self.check(s)
        if not prompt:
            raise ModeError("empty prompt")
        if len(prompt) >= self.n_ctx:
            raise ContextFull(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx} "
                              "(raise --ctx or shorten the prompt)")
        keep = 0
        while keep < min(len(prompt), len(self.tokens)) and prompt[keep] == self.tokens[keep]:
            keep += 1
        # the index ends with the committed tokens: a conversation's next turn keeps its history's indexed,
        # a request that drops an answer keeps it before its own (the lookup's history) if it may recall
        if s.recall:
            self.index.sync(self.tokens)       # (the last request's answer, where no offer caught it up)
        self.index.restart(keep, recall=s.recall,
                           others=(lambda: self.recent.since(self)) if self.recent is not None else None)
        keep = self._cached_prefix(prompt, keep)
        self.tokens = self.tokens[:keep]
        self._sync()
        self.tokens = list(prompt)
        # one seed per request (sampling.py: the coupled sampler's noise is keyed by it, the rejection
        # sampler's generator seeded with it); without a seed a fresh one is drawn and recorded in the
        # request (reported by run --json, the server's `prove` object, the UI), so a run can be replayed
        seed = s.seed if s.seed is not None else secrets.randbits(63)
        auto = self.prepare(s)
        self.planner.start_request()
        mode = MODES[s.mode]
        block = self._widest_block(s)
        sampler = sampling.Sampler.for_settings(s, seed)
        watch = None
        if s.grammar is not None or s.logprobs is not None:
            watch = constrain.Watch(self.contexts, grammar=s.grammar, mask_token=self.mask_token,
                                    logprobs=s.logprobs, sampled=sampler is not None)
        self.active = Request(list(prompt), s, block, auto=auto, seed=seed, sampler=sampler, key=mode.key(s),
                              lookup=(s.lookup if lookup_on(s, self.mask_token is not None) else 0), watch=watch)
        return Generation(self, self.active)

    def prepare(self, s: Settings) -> bool:
        """Whether the planner decides this request's widths (`planned`); calibrates the pass costs
        first if so, or if the thread count is left to measurement, and not yet done.
        Front ends call it before timing anything (the first request would otherwise pay for it)."""
        auto = planned(s, self.mask_token is not None)
        threads_open = self.context_options is not None and self.context_options.get("n_threads") is None
        if (auto or threads_open) and self.planner.costs is None:
            self.calibrate()        # (also picks the thread count of small models when --threads is not set)
        mode = MODES[s.mode]
        if auto and set(mode.roles) == {"target"}:
            # what the first request's first plans would make (Planner.warm), at the pending tokens its first
            # cycle has (the prefill leaves one); not for modes with a partner model, whose first cycle
            # prices the partner's catch-up (it is prefilled only when the planner uses it)
            pending = {"target": 1}
            if rules.gated(self.contexts["target"]):
                pending[modes.GATED] = 1
            self.planner.warm(s.mode, pending, self._widest_block(s), mode.key(s),
                              lookup=lookup_on(s, self.mask_token is not None) and s.lookup == "auto")
        return auto

    def _widest_block(self, s: Settings) -> int:
        """The widest block of a request: the fixed one, else the GGUF's; none without a mask token (lookup
        drafts only)."""
        return (s.block if isinstance(s.block, int) else self.block_size) \
            if self.mask_token is not None or not MODES[s.mode].needs_mask else 0

    def _watched(self, req: "Request", cycle: rules.Cycle) -> bool:
        """A watched request's cycle (constrain.py): its committed run cut to the tokens the grammar
        allows (the caches cut back with it), their logprobs; whether the grammar is at a dead end."""
        if req.watch is None:
            return False
        ok, dead = req.watch.end(cycle.committed)
        if ok < len(cycle.committed):
            cycle.committed = cycle.committed[:ok]
            cycle.n_accepted = min(cycle.n_accepted, ok)
            saved, self.tokens = self.tokens, self.tokens + cycle.committed
            self._sync()                      # no cache may hold the forbidden tokens
            self.tokens = saved
        if req.settings.logprobs is not None:
            # a lossy mode commits its proposal's slots: their logprobs are the proposal rows'
            cycle.logprobs = req.watch.logprobs(cycle.committed, not modes.of(cycle.plan).exact, req.sampler)
        return dead

    def _release(self, req: "Request") -> None:
        if self.active is req:
            self._sync()
            self.active = None
            if self.recent is not None and req.settings.recall and len(self.tokens) > req.n_prompt:
                # (the prompt's end and the answer, for the pool's other engines: a request that may
                # not recall is not recalled either)
                self.recent.add(self, self.tokens[max(0, req.n_prompt - PUBLISH_CONTEXT):])
            self.save_memory()

    def _run(self, req: "Request") -> Iterator[rules.Cycle]:
        member = self.member
        try:
            if member is None:
                yield from self._cycles(req)
                return
            # an engine of a batched pool (batching.py): the steps wait for its passes while its
            # generation's code runs, not while a cycle is with the consumer, and never once it ended
            member.resume()
            cycles = self._cycles(req)
            try:
                for cycle in cycles:
                    member.park()
                    yield cycle
                    member.resume()
            finally:
                cycles.close()
        finally:
            if member is not None:
                member.leave()
            self._release(req)

    def _cycles(self, req: "Request") -> Iterator[rules.Cycle]:
        mode = MODES[req.settings.mode]
        s = req.settings
        t0 = time.perf_counter()
        n_pre = 0
        # prompt tokens the target's cache holds already (llama-server's timings.prompt_n leaves them out)
        req.n_cached = min(self.contexts["target"].n_past, len(self.tokens) - 1)
        # prefill: all but the last token, in the contexts the mode uses; under the planner only the
        # target's (its partner catches up in its first cycle: a planner that stays with ar never
        # pays for a verifier's or draft's prefill)
        for role in (("target",) if req.auto else mode.roles):
            ctx = self.contexts[role]
            n_pre += max(0, len(self.tokens) - 1 - ctx.n_past)
            if ctx.n_past < len(self.tokens) - 1:
                ctx.eval(self.tokens[ctx.n_past:-1], rows=[])
        # (the lookup index catches up with the prompt and the answer when it is first asked, `_offer`: a
        # request whose lookup table never has a plan never pays for it, ~3 us a token between passes)
        req.prefill = (n_pre, time.perf_counter() - t0)
        index = 0
        while s.max_new > 0:
            n_gen = len(self.tokens) - req.n_prompt
            before = {r: (c.n_decode, c.decode_seconds, getattr(c, "wait_seconds", 0.0)) for r, c in self.contexts.items()}
            t0 = time.perf_counter()        # the planner's time counts as the cycle's
            plan, hooks = self.plan(req)
            contexts = self.contexts if req.watch is None else req.watch.begin(self.tokens)
            cycle = modes.of(plan).cycle(contexts, self.tokens, plan, s, self.mask_token, sampler=req.sampler,
                                         hooks=hooks)
            cycle.seconds = time.perf_counter() - t0
            # the passes, recorded here only: the llama_decode calls made during this cycle (the rule records
            # the widths it fed; a pass wider than n_batch is several calls)
            cycle.passes = {r: c.n_decode - before[r][0] for r, c in self.contexts.items() if c.n_decode > before[r][0]}
            cycle.decode_seconds = {r: c.decode_seconds - before[r][1] for r, c in self.contexts.items()
                                    if c.n_decode > before[r][0]}
            # batched contexts (batching.SeqView): (sequences, tokens) of each llama_decode of the cycle's passes
            cycle.batch = {r: [b[-k] for k in range(min(n, len(b)), 0, -1)] for r, n in cycle.passes.items()
                           if (b := getattr(self.contexts[r], "batches", None)) is not None}
            cycle.waited = sum(getattr(c, "wait_seconds", 0.0) - before[r][2] for r, c in self.contexts.items())
            if not cycle.committed:
                raise RuntimeError(f"mode {s.mode}: a cycle committed no token (a decoding rule is broken)")
            if cycle.source is None:
                cycle.source = modes.sources(cycle)
            dead = self._watched(req, cycle)
            if not cycle.committed:                  # a grammar dead end before any token
                cycle.index, cycle.start, cycle.stop = index, n_gen, "grammar"
                req.count(cycle)
                self._sync()
                yield cycle
                return
            cycle.coupled = req.sampler is not None and req.sampler.coupled
            if hooks is LANE_HOOKS:                  # (a lane's ar cycle: the planner counts its time alone)
                self.planner.elapsed += cycle.seconds
            elif mode.width is not None or req.lookup:  # acceptance statistics and costs, every cycle
                if self.planner.observe(cycle, req.key, planned=req.auto):   # (plain ar: nothing to learn)
                    self._recheck_threads()          # passes far slower than calibrated
                if self.planner.costs is not None and self.planner.costs.flagged:
                    self._recalibrate()              # passes keep disagreeing with the cached curve
            run, stop = cycle.committed, None
            for i, tok in enumerate(run):
                if self.is_eog(tok):
                    run, stop = run[:i + 1], "eog"
                    break
            if n_gen + len(run) >= s.max_new:
                run, stop = run[:s.max_new - n_gen], ("eog" if stop == "eog" and n_gen + len(run) == s.max_new else "length")
            if len(self.tokens) + len(run) >= self.n_ctx:
                cut = run[:self.n_ctx - len(self.tokens)]
                stop = "eog" if stop == "eog" and len(cut) == len(run) else "context"
                run = cut
            if dead and stop is None:
                stop = "grammar"
            if cycle.logprobs is not None:
                cycle.logprobs = cycle.logprobs[:len(run)]
            cycle.n_accepted = min(cycle.n_accepted, len(run))
            cycle.committed, cycle.index, cycle.start, cycle.stop = run, index, n_gen, stop
            self.tokens.extend(run)
            req.count(cycle)
            index += 1
            if stop:
                self._sync()
            yield cycle
            if stop:
                return


@dataclass
class Request:
    """Everything about one generation: prompt, settings, and what it has done so far."""
    prompt: list[int]
    settings: Settings
    block: int                                  # fixed width, or the widest an auto request may use
    auto: bool = False                          # the planner picks widths (--block auto)
    prefill: tuple[int, float] = (0, 0.0)      # (prompt tokens evaluated, seconds)
    n_cached: int = 0                          # prompt tokens reused from the target's cache
    n_tokens: int = 0
    n_cycles: int = 0
    passes: dict = field(default_factory=dict)
    stop: str | None = None
    seed: int | None = None                    # the seed of `sampler` (settings.seed or drawn)
    sampler: sampling.Sampler | None = field(default=None, repr=False)   # None: greedy
    key: str = ""                              # the planner's statistics key (Mode.key)
    lookup: int | str = 0                      # lookup drafts: 0 off, "auto" (the planner), K (forced)
    watch: constrain.Watch | None = field(default=None, repr=False)   # grammar / logprobs (constrain.py)
    decode_start: float | None = None          # time.perf_counter() when the first cycle started,
    decode_end: float = 0.0                    # and when the last one ended (decode_seconds)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    @property
    def decode_seconds(self) -> float:
        """Seconds from the start of the first cycle to the end of the last: what tokens/s divides
        by (`tokens_per_second`). The prompt's prefill is not in it (`prefill` holds it); the time
        between cycles (the planner, a front end's work on each cycle) is."""
        return self.decode_end - self.decode_start if self.decode_start is not None else 0.0

    def count(self, cycle: rules.Cycle) -> None:
        now = time.perf_counter()
        if self.decode_start is None:
            self.decode_start = now - cycle.seconds
        self.decode_end = now
        self.n_tokens += len(cycle.committed)
        self.n_cycles += 1
        for role, n in cycle.passes.items():
            self.passes[role] = self.passes.get(role, 0) + n
        self.stop = cycle.stop


class Generation:
    """The handle `Engine.generate` returns: iterate it for the `Cycle` events. `close()` (or
    leaving the loop early and dropping it) cuts every cache back to the committed tokens and
    frees the engine for the next request. Holds no reference cycle, so dropping it cleans up."""

    def __init__(self, engine: Engine, request: Request):
        self.request = request
        self._engine = engine
        self._gen = engine._run(request)

    @property
    def prefill(self) -> tuple[int, float]:
        return self.request.prefill

    def __iter__(self):
        return self

    def __next__(self) -> rules.Cycle:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()                  # runs the clean-up if the generator started
        self._engine._release(self.request)  # and also if it never did

    def __del__(self):
        if getattr(self, "_gen", None) is not None:
            self.close()


class TextStream:
    """Incremental detokenizer: bytes of token pieces -> text, holding back split UTF-8 sequences."""

    def __init__(self, model: Model):
        self.model = model
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens: list[int]) -> str:
        return self._dec.decode(b"".join(self.model.piece(t) for t in tokens))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def tokens_per_second(n_tokens: int, decode_seconds: float) -> float:
    """The one definition of tokens/s, in every front end (run, serve, ui, bench; README
    "Tokens per second"): generated tokens ÷ `Request.decode_seconds`, the time from the start of
    the first cycle to the end of the last, the prompt's prefill excluded (reported on its own).
    llama-server's `predicted_per_second` is the same measure."""
    return n_tokens / decode_seconds if decode_seconds > 0 else 0.0


def summarize(cycles: list[rules.Cycle], seconds: float) -> dict:
    """Per-answer statistics from its cycle events; `seconds`: the request's decode_seconds."""
    n_tokens = sum(len(c.committed) for c in cycles)
    passes: dict[str, int] = {}
    decode: dict[str, float] = {}
    for c in cycles:
        for role, n in c.passes.items():
            passes[role] = passes.get(role, 0) + n
        for role, t in c.decode_seconds.items():
            decode[role] = decode.get(role, 0.0) + t
    cycle_seconds = sum(c.seconds for c in cycles)
    host = cycle_seconds - sum(decode.values())         # Python and numpy: the cycles' time outside llama_decode
    return {
        "n_tokens": n_tokens,
        "n_cycles": len(cycles),
        "tokens_per_cycle": n_tokens / len(cycles) if cycles else 0.0,
        "n_passes": passes,
        "passes_per_token": {r: n / n_tokens for r, n in passes.items()} if n_tokens else {},
        "seconds": seconds,
        "host_seconds": host,
        "tokens_per_second": tokens_per_second(n_tokens, seconds),
        "decode_seconds": decode,
        "overhead_share": 1.0 - sum(decode.values()) / cycle_seconds if cycle_seconds > 0 else 0.0,
        "batch": batch_summary(cycles),
        "stop": cycles[-1].stop if cycles else None,
    }


def batch_summary(cycles: list[rules.Cycle]) -> dict | None:
    """How the answer's passes were batched with other requests' (Cycle.batch, batching.py): the
    llama_decode calls, and the mean and largest sequences and tokens per decode; None when no pass
    went through a batched context."""
    got = [b for c in cycles for bs in getattr(c, "batch", {}).values() for b in bs]
    if not got:
        return None
    return {"decodes": len(got), "sequences_mean": round(sum(b[0] for b in got) / len(got), 3),
            "sequences_max": max(b[0] for b in got), "tokens_mean": round(sum(b[1] for b in got) / len(got), 3),
            "tokens_max": max(b[1] for b in got)}
