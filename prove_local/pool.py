"""A pool of engines on the same loaded models, for front ends that serve several users (the UI,
the HTTP server).

An `Engine` holds one committed sequence and its KV caches, so a request takes an engine from the
pool for its whole duration (one request per engine at a time). With `parallel` engines, that many
requests decode at once; more wait for a free engine, in arrival order. With `max_queue` set (the
server), at most that many wait: one more raises `QueueFull` at once instead of waiting, so that a
front end can answer "busy" (HTTP 503) rather than pile up work; the UI leaves it unbounded.

A caller may name the engine it used last (`prefer`), whose caches still hold its conversation:
only the new tokens are then evaluated. `prefer` may also be a function scoring a free engine (the
server scores by the prompt prefix an engine already holds, as llama-server picks a slot by prompt
similarity). Engines are created on first use; the first one at once, so that bad models fail at
start-up.

With `parallel` > 1 (and `batched`, the default) the engines share one llama.cpp context per model with
a sequence per engine (batching.py): every step of the requests in flight is one `llama_decode` per
context, and each request's output is what it would be alone. `batched=False` gives each engine
contexts of its own (each request its own `llama_decode` calls, competing for the same cores).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

from .batching import PROMPT_CACHE_MIB, PromptCache, Shared
from .errors import EngineBusy
from .loading import Loaded
from .lookup import Recent


class QueueFull(EngineBusy):
    """Every engine is busy and the wait queue is full."""


class Cancelled(EngineBusy):
    """The caller gave up while waiting for an engine (e.g. its client disconnected)."""


class EnginePool:
    def __init__(self, loaded: Loaded, parallel: int = 1, max_queue: int | None = None, batched: bool = True,
                 prompt_cache_mib: int = PROMPT_CACHE_MIB):
        self.loaded = loaded
        self.max_queue = max_queue
        self._engines = [None] * max(1, parallel)
        # the shared contexts of a batched pool (one sequence per engine), made now: every slot's KV (a
        # loader without models, such as the tests' fakes that make engines on scripted contexts, gets
        # engines of their own)
        # saved prompt states (batching.PromptCache), for every engine of the pool: one that drops a long
        # sequence keeps it there, one asked for it takes it back instead of a prefill (0 MiB: none)
        self.prompt_cache = PromptCache(prompt_cache_mib << 20) if prompt_cache_mib > 0 else None
        # the engines' finished requests, for each other's lookup drafts (lookup.Recent)
        self.recent = Recent()
        models = getattr(loaded, "models", None)
        self.shared = Shared(models, len(self._engines), adapter=loaded.adapter, prompt_cache=self.prompt_cache,
                             **loaded.context_options) if batched and len(self._engines) > 1 and models else None
        self._busy = [False] * len(self._engines)
        self._cond = threading.Condition()
        self._tickets = 0               # arrival numbers: waiting requests are served in order
        self._serving = 0               # the ticket whose turn it is
        self._gone: set[int] = set()    # tickets that left the queue before their turn
        self.n_waiting = 0              # requests waiting for an engine now
        self.peak_waiting = 0
        self.n_rejected = 0             # refused with QueueFull
        self.closed = False
        try:
            self._engines[0] = self._make(0)     # validates vocabularies and the mask token now
        except BaseException:
            if self.shared is not None:
                self.shared.close()
            raise

    def _make(self, i: int):
        """Engine i: on sequence i of the shared contexts, or on contexts of its own; with the first
        engine's pass costs once it has them (Engine.adopt_calibration)."""
        if self.shared is None:
            engine = self.loaded.engine()
            target = getattr(engine, "contexts", {}).get("target")
            if hasattr(target, "set_state") and self.prompt_cache is not None:   # (not a test's fake engine)
                target.prompt_cache = self.prompt_cache
        else:
            # (calibrated as the shared contexts run, with their flash attention setting)
            engine = self.loaded.engine(contexts=self.shared.views(i), flash_attn=self.shared.flash_attn)
            engine.member = self.shared.members[i]
        if hasattr(engine, "index"):
            engine.recent = self.recent
        first = self._engines[0] if self._engines else None
        if first is not None and hasattr(engine, "adopt_calibration"):
            engine.adopt_calibration(first)
        return engine

    def close(self, timeout: float | None = None) -> bool:
        """Close the engines (their contexts) once the requests holding them have given them back; a
        request waiting for one, or asking after this, raises Cancelled. The models stay the
        loader's (Loaded.close). `timeout`: seconds to wait for busy engines (None: as long as it
        takes); an engine still busy then is left open. Whether every engine was closed.
        `with EnginePool(loaded) as pool:` closes it at the end of the block."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not any(self._busy), timeout)
            done = [i for i, b in enumerate(self._busy) if not b]
            engines = [self._engines[i] for i in done]
            for i in done:
                self._engines[i] = None
            left = len(self._busy) - len(done)
        for e in engines:
            if e is not None:
                e.close()
        if left == 0 and self.shared is not None:
            self.shared.close()
        return left == 0

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def first(self):
        return self._engines[0]

    @property
    def parallel(self) -> int:
        """Requests that can decode at the same time (one engine each)."""
        return len(self._engines)

    @property
    def n_busy(self) -> int:
        with self._cond:
            return sum(self._busy)

    def stats(self) -> dict:
        """A consistent snapshot for metrics: slots, busy, waiting, peak waiting, rejected; `batch`, the
        steps of a batched pool (batching.Batcher.stats), and `prompt_cache` its saved prompt states
        (batching.PromptCache.stats)."""
        with self._cond:
            out = {"slots": len(self._engines), "busy": sum(self._busy), "waiting": self.n_waiting,
                   "queue_capacity": self.max_queue, "peak_waiting": self.peak_waiting,
                   "rejected": self.n_rejected}
        if self.shared is not None:                  # a batched pool: its steps (batching.Batcher.stats)
            out["batch"] = self.shared.batcher.stats()
        if self.prompt_cache is not None:
            out["prompt_cache"] = self.prompt_cache.stats()
        return out

    def _pick(self, prefer) -> int:
        free = [i for i, b in enumerate(self._busy) if not b]
        if isinstance(prefer, int) and prefer in free:
            return prefer                        # a slot asked for by number (the UI's: its conversation's KV)
        if self.shared is not None:
            free = self._contiguous(free)
        if callable(prefer):
            made = [i for i in free if self._engines[i] is not None]
            if made:
                best = max(made, key=lambda i: prefer(self._engines[i]))
                if prefer(self._engines[best]) > 0:
                    return best
        return next((j for j in free if self._engines[j] is not None), free[0])

    def _contiguous(self, free: list[int]) -> list[int]:
        """The free slots of a batched pool that leave the busy sequence ids in the fewest runs of
        consecutive ids. llama.cpp splits a step's batch into ubatches over consecutive sequence ids
        (`split_equal`, kv_unified off: batching.py), so two one-token passes of sequences 0 and 2
        decode as two graphs: SmolLM2-135M Q4_1, 2 threads, one `llama_decode` of a token each of
        sequences {0, 1} 19.6 ms, of {0, 2} 27.5 ms, of {0} alone 14.1, of all four 30.0. Slots were
        picked for their cached prompt alone, and two clients of a 4-slot server often got sequences
        apart (0.86x llama-server's throughput at 2 clients, 0.94-0.99x at 1, 4 and 8)."""
        busy = [i for i, b in enumerate(self._busy) if b]

        def runs(i: int) -> int:
            ids = sorted(busy + [i])
            return 1 + sum(b - a > 1 for a, b in zip(ids, ids[1:]))
        fewest = min(runs(i) for i in free)
        return [i for i in free if runs(i) == fewest]

    @contextlib.contextmanager
    def engine(self, prefer: int | Callable | None = None, abandoned: Callable[[], bool] | None = None):
        """(index, engine), exclusively for the duration of the block. Waits (first come, first
        served) while all engines are busy; raises QueueFull when `max_queue` requests wait
        already, and Cancelled when `abandoned()` turns true while waiting."""
        with self._cond:
            if self.closed:
                raise Cancelled("the engine pool is closed")
            if all(self._busy) or self.n_waiting:
                if self.max_queue is not None and self.n_waiting >= self.max_queue:
                    self.n_rejected += 1
                    raise QueueFull(f"all {len(self._engines)} engines are busy and {self.n_waiting} "
                                    "requests are waiting already; try again later")
            ticket = self._tickets
            self._tickets += 1
            self.n_waiting += 1
            try:
                while all(self._busy) or self._serving != ticket:
                    if self.closed:
                        raise Cancelled("the engine pool was closed while the request waited for an engine")
                    self.peak_waiting = max(self.peak_waiting, self.n_waiting)
                    if abandoned is not None and abandoned():
                        raise Cancelled("the request was abandoned while waiting for an engine")
                    self._cond.wait(0.25 if abandoned is not None else None)
            except BaseException:
                self._skip(ticket)
                raise
            finally:
                self.n_waiting -= 1
            self._advance()
            i = self._pick(prefer)
            self._busy[i] = True
            self._cond.notify_all()
        try:
            if self._engines[i] is None:
                self._engines[i] = self._make(i)
            yield i, self._engines[i]
        finally:
            with self._cond:
                self._busy[i] = False
                self._cond.notify_all()

    def _skip(self, ticket: int) -> None:
        """A waiter left the queue: later tickets must not wait for it (lock held)."""
        if ticket == self._serving:
            self._advance()
        else:
            self._gone.add(ticket)
        self._cond.notify_all()

    def _advance(self) -> None:
        """The next ticket's turn, skipping those that left (lock held)."""
        self._serving += 1
        while self._serving in self._gone:
            self._gone.discard(self._serving)
            self._serving += 1
