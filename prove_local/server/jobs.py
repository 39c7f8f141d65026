"""One generation of the server: a worker thread takes an engine from the pool, runs the answer
(answer.Answer: the generation's text with the stop strings applied, and its statistics) and hands
the pieces to the request's event loop. Closing the generation (stop string, client gone, shutdown) runs
the engine's clean-up: every KV cache is cut back to the committed tokens, so the next request on
that engine works."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time

from .. import modes
from ..answer import Answer, summary
from ..errors import DeadlineExceeded, ProveError
from .errors import ApiError

log = logging.getLogger("prove_local.server")


class Workers:
    """The threads that run the jobs: one per job running, each kept once its job is over and given the
    next. A thread started per request cost a one-token request 2.75 ms of its 19.2 (SmolLM2, 2 cores,
    two servers interleaved): `Thread.start` returns only once the new thread runs (py-spy put 1.1 ms a
    request in that wait; why it is that long on 2 cores was not measured). Never fewer threads than jobs at once:
    a job waiting for an engine (pool.engine's queue) holds its thread as before. At most `keep` threads
    wait for work; one more ends with its job (a burst of refused requests leaves no crowd behind)."""

    def __init__(self, name: str = "generate", keep: int = 32):
        self.name, self.keep = name, keep
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.idle = 0                       # threads waiting for a job
        self.threads = 0

    def submit(self, fn) -> None:
        """Run fn() on an idle thread, or on a new one."""
        with self._lock:
            new = self.idle == 0
            if new:
                self.threads += 1
            else:
                self.idle -= 1
        self._jobs.put(fn)
        if new:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        while True:
            fn = self._jobs.get()
            try:
                fn()
            except BaseException:           # noqa: BLE001 - a job answers its own errors (Job._run)
                log.exception("a job failed outside its own handling")
            with self._lock:
                if self.idle >= self.keep:
                    self.threads -= 1
                    return
                self.idle += 1


WORKERS = Workers()


class Job:
    """One generation: runs on a thread of its own while it lasts (`WORKERS`: the engine is synchronous),
    hands events to the request's event loop: ("start", slot), ("text", (str, logprob entries)), ("done", None) or ("error", exc)."""

    def __init__(self, state, prompt: list[int], settings, stops: list[str], notes: list[str], *,
                 collect: bool = False):
        """collect: a non-streamed answer: its text is gathered in this thread and handed to the event
        loop once, before "done", instead of one event per cycle. Each hand-off wakes the loop, Python
        work that on a small CPU takes a core from llama.cpp's threads in the middle of a decode (its
        threads meet at a barrier after every op). serve_bench, 3 rounds, 2 cores: 97.1 -> 99.5 tokens/s
        at 4 clients, 81.1 -> 82.0 at 2; CPU time of the run 83 -> 78 s."""
        self.state, self.prompt, self.settings, self.stops, self.notes = state, prompt, settings, stops, notes
        self.collect = collect
        self._held: list[tuple[str, list]] = []   # collect: the text events not handed over yet
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.cycles: list = []               # the answer's cycles (Answer.cycles once it started)
        self.request = None                  # the engine's Request (prefill, block)
        self.slot = -1
        self.finish: str | None = None       # stop, length, grammar, cancelled, error
        self.logprobs: list = []             # (token, logprob, top) per answer token, when asked for
        self._checked = time.monotonic()     # when we last asked whether the client is still there
        # the request's deadline (serve --request-timeout), from its arrival: queueing counts
        timeout = getattr(state, "request_timeout", 0) or 0
        self.deadline = time.monotonic() + timeout if timeout > 0 else None

    def start(self) -> "Job":
        self.state.jobs.add(self)
        WORKERS.submit(self._run)
        return self

    def _emit(self, kind: str, value=None) -> None:
        if kind == "text" and self.collect:
            self._held.append(value)
            return
        if self._held:                               # collect: the whole text, then the event
            held, self._held = self._held, []
            self._emit_now("text", ("".join(t for t, _ in held), [e for _, es in held for e in es]))
        self._emit_now(kind, value)

    def _emit_now(self, kind: str, value) -> None:
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

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _run(self) -> None:
        pool = self.state.pool
        grammar = self.settings.grammar
        if grammar is not None and hasattr(grammar, "deadline"):
            grammar.deadline = self.deadline     # checked before every grammar step (grammar.py)
        try:
            with pool.engine(prefer=self._affinity,
                             abandoned=lambda: self.cancel.is_set() or self.expired()) as (slot, engine):
                self.slot = slot
                model = pool.loaded.target
                answer = Answer(engine, model, self.prompt, self.settings, self.stops)
                self.request, self.cycles = answer.request, answer.cycles
                self._emit("start", slot)
                try:
                    with answer:
                        self._decode(answer, model)
                except DeadlineExceeded:         # inside a cycle (a grammar step): the cycle is dropped
                    self.finish = "deadline"
            if self.finish is None:              # the engine stopped without a cycle (max_new 0)
                self.finish = "length"
            self.state.metrics.generation(self)
            self._emit("done")
        except BaseException as e:               # noqa: BLE001 - every failure goes to the client
            if self.slot < 0 and self.expired() and not self.cancel.is_set():
                e = ApiError(503, f"no engine came free within the request's deadline of "
                                  f"{self.state.request_timeout:g} s (--request-timeout)", "unavailable_error",
                             code="deadline_exceeded")
            if not isinstance(e, (ProveError, ApiError)):
                log.exception("generation failed")
            self.finish = "error" if self.request is not None else None
            if self.request is not None:
                self.state.metrics.generation(self)
            self._emit("error", e)
        finally:
            self.state.jobs.discard(self)

    def _decode(self, answer: Answer, model) -> None:
        """The answer's pieces as text events (text, logprob entries of its tokens), until the engine
        stops, a stop string, or a cancel."""
        for piece in answer:
            cycle, text = piece.cycle, piece.text
            entries = []
            if cycle.logprobs:
                # end-of-generation tokens have no text, and no entry (as llama-server's); a stop
                # string inside the cycle's text keeps the entries of the whole cycle
                entries = [(model.piece(t), lp, [(model.piece(i), v) for i, v in top])
                           for t, lp, top in (cycle.logprobs or []) if not model.is_eog(t)]
                self.logprobs += entries
            if text or entries:
                self._emit("text", (text, entries))
            if answer.stopped:
                self.finish = "stop_string"
            elif cycle.stop == "eog":
                self.finish = "stop"
            elif cycle.stop == "grammar":
                self.finish = "grammar"
            elif cycle.stop:
                self.finish = "length"
            if self.finish:
                break
            if self.cancel.is_set():
                self.finish = "cancelled"
                break
            if self.expired():
                self.finish = "deadline"
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
        s = summary(self.cycles, self.request)
        seconds, drafts, prefill = s["seconds"], s["drafts"], s["prefill"]
        mode = modes.MODES[self.settings.mode]
        return {
            "mode": self.settings.mode,
            "block": (("auto" if self.request.auto else self.request.block)
                      if self.request is not None and mode.width == "block" else None),
            "widths": s["widths"],
            "draft_k": self.settings.draft_k if mode.width == "draft_k" else None,
            "lookup": (self.request.lookup if self.request is not None else self.settings.lookup) if mode.lookup else None,
            "drafts": {src: {"drafted": n, "accepted": a} for src, (n, a) in drafts.items()},
            "n_cycles": s["n_cycles"],
            "tokens_per_cycle": round(s["tokens_per_cycle"], 4),
            "passes": s["n_passes"],
            "draft_n": drafts.drafted,
            "draft_n_accepted": drafts.accepted,
            "decode_seconds": {r: round(t, 6) for r, t in s["decode_seconds"].items()},
            "seconds": round(seconds, 6),
            "tokens_per_second": round(s["tokens_per_second"], 3),
            "prefill": {"tokens": prefill[0], "seconds": round(prefill[1], 6)},
            # --parallel N: how its passes were batched with other requests' (engine.batch_summary)
            "batch": s.get("batch"),
            # the request's seed (its own, or the one drawn for it: send it back to replay a sampled answer)
            "seed": self.request.seed if self.request is not None else self.settings.seed,
            "sampler": self.settings.sampler,
            "slot": self.slot,
            # eog, length, context, grammar (the engine's), stop_string, or cancelled (the client went away)
            "stop": (self.finish if self.finish in ("cancelled", "stop_string", "deadline") else
                     self.request.stop if self.request is not None else None),
            "notes": self.notes,
        }

    def timings(self) -> dict:
        """llama-server's `timings` object (tools/server/server.cpp, result_timings; draft_n and
        draft_n_accepted from PR #12603), with its meanings: prompt_n the prompt tokens evaluated for
        this request (those reused from the target's KV cache left out), prompt_ms their prefill
        (the last prompt token is evaluated in the first cycle, as llama-server evaluates it with the
        prompt: a difference of one token's pass); predicted_n the generated tokens, predicted_ms the
        decode time (engine.tokens_per_second's, so predicted_per_second is the `prove` object's
        tokens_per_second); draft_n / draft_n_accepted the drafted and accepted tokens
        (modes.draft_counts: slot 1 of a MARS block is no draft), present, as in llama-server, only
        when something was drafted."""
        req = self.request
        prompt_n = len(self.prompt) - (req.n_cached if req is not None else 0)
        prompt_ms = (req.prefill[1] if req is not None else 0.0) * 1e3
        predicted_n = sum(len(c.committed) for c in self.cycles)
        predicted_ms = (req.decode_seconds if req is not None else 0.0) * 1e3
        out = {
            "prompt_n": prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
            "prompt_per_second": round(prompt_n / prompt_ms * 1e3, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / predicted_n, 3) if predicted_n else 0.0,
            "predicted_per_second": round(predicted_n / predicted_ms * 1e3, 3) if predicted_ms > 0 else 0.0,
        }
        drafts = modes.draft_counts(self.cycles)
        if drafts.drafted > 0:
            out["draft_n"], out["draft_n_accepted"] = drafts.drafted, drafts.accepted
        return out

    def usage(self) -> dict:
        n = sum(len(c.committed) for c in self.cycles)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}


def finish_reason(job: Job) -> str:
    """OpenAI's names: "stop" (end of generation or a stop string), "length" (max_tokens or the
    context full); and "grammar": the request's grammar allows no further token and cannot end there
    (a dead end, e.g. a grammar that requires text no token can spell)."""
    if job.finish == "deadline":         # (prove.stop says "deadline": serve --request-timeout)
        return "length"
    return job.finish if job.finish in ("length", "grammar") else "stop"
