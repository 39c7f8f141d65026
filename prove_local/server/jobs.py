"""One generation of the server: a worker thread takes an engine from the pool, iterates
`Engine.generate`, turns the committed tokens into text (stop strings applied there) and hands the
pieces to the request's event loop. Closing the generation (stop string, client gone, shutdown) runs
the engine's clean-up: every KV cache is cut back to the committed tokens, so the next request on
that engine works."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from .. import modes, planner
from ..engine import TextStream, summarize
from ..errors import ProveError
from .errors import ApiError
from .metrics import draft_counts
from .stops import StopText

log = logging.getLogger("prove_local.server")


class Job:
    """One generation: runs in its own thread (the engine is synchronous), hands events to the
    request's event loop: ("start", slot), ("text", str), ("done", None) or ("error", exc)."""

    def __init__(self, state, prompt: list[int], settings, stops: list[str], notes: list[str]):
        self.state, self.prompt, self.settings, self.stops, self.notes = state, prompt, settings, stops, notes
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.cycles: list = []
        self.request = None                  # the engine's Request (prefill, block)
        self.slot = -1
        self.finish: str | None = None       # stop, length, cancelled, error
        self._checked = time.monotonic()     # when we last asked whether the client is still there
        self.thread = threading.Thread(target=self._run, name="generate", daemon=True)

    def start(self) -> "Job":
        self.state.jobs.add(self)
        self.thread.start()
        return self

    def _emit(self, kind: str, value=None) -> None:
        with contextlib.suppress(RuntimeError):      # the event loop is gone (shutdown)
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def _affinity(self, engine) -> int:
        """Prompt tokens an engine holds already (its KV cache is reused for them)."""
        n, toks = 0, engine.tokens
        for a, b in zip(toks, self.prompt):
            if a != b:
                break
            n += 1
        return n

    def _run(self) -> None:
        pool = self.state.pool
        try:
            with pool.engine(prefer=self._affinity, abandoned=self.cancel.is_set) as (slot, engine):
                self.slot = slot
                gen = engine.generate(self.prompt, self.settings)
                self.request = gen.request
                self._emit("start", slot)
                with contextlib.closing(gen):
                    self._decode(gen, TextStream(pool.loaded.proposer), StopText(self.stops))
            if self.finish is None:              # the engine stopped without a cycle (max_new 0)
                self.finish = "length"
            self.state.metrics.generation(self)
            self._emit("done")
        except BaseException as e:               # noqa: BLE001 - every failure goes to the client
            if not isinstance(e, (ProveError, ApiError)):
                log.exception("generation failed")
            self.finish = "error" if self.request is not None else None
            if self.request is not None:
                self.state.metrics.generation(self)
            self._emit("error", e)
        finally:
            self.state.jobs.discard(self)

    def _decode(self, gen, stream: TextStream, stop: StopText) -> None:
        """The cycles of `gen` as text events, until the engine stops, a stop string, or a cancel."""
        for cycle in gen:
            self.cycles.append(cycle)
            text = stop.feed(stream.feed(cycle.committed))
            if cycle.stop:
                text += stop.feed(stream.flush())
                text += stop.flush()
            if text:
                self._emit("text", text)
            if stop.stopped:
                self.finish = "stop_string"
            elif cycle.stop == "eog":
                self.finish = "stop"
            elif cycle.stop:
                self.finish = "length"
            if self.finish:
                break
            if self.cancel.is_set():
                self.finish = "cancelled"
                break

    async def next(self, request=None):
        """The next event; while waiting, a client that went away cancels the job."""
        while True:
            if request is not None and time.monotonic() - self._checked > 0.5:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    self.cancel.set()
            try:
                return await asyncio.wait_for(self.events.get(), 0.5)
            except asyncio.TimeoutError:
                pass

    def stats(self) -> dict:
        """The `prove` extension object: what the cycles of this answer did. `seconds` is the decode
        time (engine.tokens_per_second's), `prefill` the prompt's."""
        seconds = self.request.decode_seconds if self.request is not None else 0.0
        s = summarize(self.cycles, seconds)
        mode = modes.MODES[self.settings.mode]
        d_n, d_acc = draft_counts(self.cycles)
        prefill = self.request.prefill if self.request is not None else (0, 0.0)
        return {
            "mode": self.settings.mode,
            "block": (("auto" if self.request.auto else self.request.block)
                      if self.request is not None and mode.width == "block" else None),
            "widths": planner.widths_histogram(self.cycles),
            "draft_k": self.settings.draft_k if mode.width == "draft_k" else None,
            "lookup": (self.request.lookup if self.request is not None else self.settings.lookup) if mode.lookup else None,
            "drafts": {src: {"drafted": n, "accepted": a} for src, (n, a) in modes.draft_counts(self.cycles).items()},
            "n_cycles": s["n_cycles"],
            "tokens_per_cycle": round(s["tokens_per_cycle"], 4),
            "passes": s["n_passes"],
            "draft_n": d_n,
            "draft_n_accepted": d_acc,
            "decode_seconds": {r: round(t, 6) for r, t in s["decode_seconds"].items()},
            "seconds": round(seconds, 6),
            "tokens_per_second": round(s["tokens_per_second"], 3),
            "prefill": {"tokens": prefill[0], "seconds": round(prefill[1], 6)},
            # the request's seed (its own, or the one drawn for it: send it back to replay a sampled answer)
            "seed": self.request.seed if self.request is not None else self.settings.seed,
            "sampler": self.settings.sampler,
            "slot": self.slot,
            # eog, length, context (the engine's), stop_string, or cancelled (the client went away)
            "stop": (self.finish if self.finish in ("cancelled", "stop_string") else
                     self.request.stop if self.request is not None else None),
            "notes": self.notes,
        }

    def usage(self) -> dict:
        n = sum(len(c.committed) for c in self.cycles)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}


def finish_reason(job: Job) -> str:
    """OpenAI's names: "stop" (end of generation or a stop string), "length" (max_tokens or the
    context full)."""
    return "length" if job.finish == "length" else "stop"
