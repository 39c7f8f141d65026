"""A pool of engines on the same loaded models, for front ends that serve several users (the UI,
the HTTP server).

An `Engine` holds one committed sequence and its KV caches, so a request takes an engine from the
pool for its whole duration (one request per engine at a time). With `parallel` engines, that many
requests decode at once; more wait for a free engine. A caller may name the engine it used last
(`prefer`), whose caches still hold its conversation: only the new tokens are then evaluated.
Engines are created on first use; the first one at once, so that bad models fail at start-up.
"""
from __future__ import annotations

import contextlib
import threading

from .loading import Loaded


class EnginePool:
    def __init__(self, loaded: Loaded, parallel: int = 1):
        self.loaded = loaded
        self._engines = [None] * max(1, parallel)
        self._busy = [False] * len(self._engines)
        self._cond = threading.Condition()
        self._engines[0] = loaded.engine()       # validates vocabularies and the mask token now

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
                self._engines[i] = self.loaded.engine()
            yield i, self._engines[i]
        finally:
            with self._cond:
                self._busy[i] = False
                self._cond.notify()
