"""One answer, in one place: an engine's generation → text pieces → stop strings → statistics.

`Answer` iterates a generation's cycles, turns each cycle's committed tokens into text (incrementally:
a UTF-8 sequence split over tokens is held back until it is whole), applies the stop strings (a
stream never shows text past one, even one that arrives split over cycles) and keeps the cycles for
the statistics (`summary`: engine.summarize's figures with the draft counts, the widths and the
request's prefill and seed). The command line (`run`), the server (server/jobs.py) and the UI
(ui/runtime.py) wrap it, each adding only its own output format.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

from . import modes, planner
from .engine import TextStream, summarize


class StopText:
    """Text with the stop strings honoured: cut at the first stop string, and hold back any tail
    that could be the start of one, so that a streamed answer never shows text past a stop."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf, self.stopped = self.buf[:min(hits)], "", True
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def flush(self) -> str:
        """The held-back tail, at the end of the generation (it did not become a stop string)."""
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out


class Piece(NamedTuple):
    """One cycle of an answer: the cycle, the new text it shows (stop strings applied), and how many of
    that text's first characters come before the text of the cycle's correction or bonus token
    (the accepted run, and text held back by earlier cycles): a front end that colors the two."""
    cycle: object
    text: str
    accepted: int


class Answer:
    """One generation of `engine` as text: iterate for `Piece`s. It ends where the engine stops, or at
    a stop string (`stopped`); leaving the loop early, or `close()`, closes the generation (the engine
    cuts its caches back to the committed tokens). `model` detokenizes (`.piece(token) -> bytes`)."""

    def __init__(self, engine, model, prompt: list[int], settings, stops=()):
        self.engine, self.model, self.settings = engine, model, settings
        self.generation = engine.generate(prompt, settings)
        self.request = self.generation.request
        self.cycles: list = []
        self._text = TextStream(model)
        self._stops = StopText(list(stops))

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the answer."""
        return self._stops.stopped

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.cycles for t in c.committed]

    def __iter__(self) -> Iterator[Piece]:
        try:
            for cycle in self.generation:
                self.cycles.append(cycle)
                held = len(self._stops.buf)
                run = self._text.feed(cycle.committed[:cycle.n_accepted])
                text = run + self._text.feed(cycle.committed[cycle.n_accepted:])
                text = self._stops.feed(text)
                accepted = min(len(text), held + len(run))
                if cycle.stop:
                    text += self._stops.feed(self._text.flush())
                    text += self._stops.flush()
                yield Piece(cycle, text, accepted)
                if self._stops.stopped:
                    break
        finally:
            self.generation.close()

    def close(self) -> None:
        self.generation.close()

    def rest(self) -> str:
        """Text still held back (an unfinished UTF-8 sequence, a possible start of a stop string) when
        the answer ended without the engine's stop (interrupted): the end of a printed answer."""
        return self._stops.feed(self._text.flush()) + self._stops.flush()

    def __enter__(self) -> "Answer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def text(self) -> str:
        """The whole answer's text as one detokenization of its tokens (end-of-generation tokens left
        out), without stop strings: what a conversation keeps."""
        return self.model.detokenize([t for t in self.tokens if not self.model.is_eog(t)])

    def summary(self) -> dict:
        """The answer's statistics (`summary`)."""
        return summary(self.cycles, self.request)


def summary(cycles: list, request=None) -> dict:
    """The statistics of an answer's cycles: engine.summarize's (tokens, cycles, passes, seconds = the
    decode time, tokens/s, ...) and `drafts` (modes.draft_counts: drafted and accepted per source),
    `widths` (planner.widths_histogram), and from the engine's Request (None: a request that never
    started) `prefill` (tokens, seconds), `seed` (the request's, drawn if it had none) and `n_cached`
    (prompt tokens reused from the cache)."""
    out = summarize(cycles, request.decode_seconds if request is not None else 0.0)
    out.update(drafts=modes.draft_counts(cycles), widths=planner.widths_histogram(cycles),
               prefill=request.prefill if request is not None else (0, 0.0),
               seed=request.seed if request is not None else None,
               n_cached=request.n_cached if request is not None else 0)
    return out
