"""Stop strings on streamed text: a stream never shows text past a stop string, even when the stop
string arrives split over several cycles."""


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
