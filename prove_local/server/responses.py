"""A running job's events as an OpenAI answer: one JSON object, or a stream of server-sent events
(`chat.completion.chunk` / `text_completion` chunks, then `data: [DONE]`). The `prove` object with
the cycle statistics and llama-server's `timings` object ride on the last chunk (and on the usage
chunk), or on the whole answer.

SSE: FastAPI's own `fastapi.sse` (FastAPI >= 0.135; `EventSourceResponse` and `format_sse_event`)
rather than sse-starlette: FastAPI is needed anyway, so it is one dependency less, and it sends
nothing but our own `data:` lines. We return the response object from a plain endpoint (not a
generator path operation), so FastAPI's 15 s keep-alive `: ping` comments are never sent: comment
pings broke some OpenAI clients when llama.cpp added them (Ollama PR #16443, llama-cpp-python
#1256), and OpenAI's own streams have none. FastAPI is the `server` extra: only the app imports
this module."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from fastapi.sse import EventSourceResponse, format_sse_event

from .errors import api_error_of
from .jobs import Job, finish_reason


@dataclass
class Answer:
    """The OpenAI envelope of one answer: its id, creation time and object names."""
    kind: str                   # "chat" or "completion"
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: str, model: str) -> "Answer":
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        return cls(kind, rid, int(time.time()), model)

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def base(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None, first: bool = False, logprobs=None,
              offset: int = 0) -> dict:
        lp = self.logprobs(logprobs, offset) if logprobs is not None else None
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else
                     {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return {**self.base(), "choices": [choice]}

    def logprobs(self, entries: list, offset: int = 0) -> dict:
        """OpenAI's logprobs object for (piece bytes, logprob, [(piece bytes, logprob), ...]) entries:
        chat {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}, completions {tokens,
        token_logprobs, top_logprobs: [{token: logprob}], text_offset} (`offset`: characters before)."""
        if self.chat:
            return {"content": [{**_token(b, lp), "top_logprobs": [_token(tb, tlp) for tb, tlp in top]}
                                for b, lp, top in entries], "refusal": None}
        tokens = [b.decode("utf-8", "replace") for b, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_finite(lp) for _, lp, _ in entries],
                "top_logprobs": [{tb.decode("utf-8", "replace"): _finite(tlp) for tb, tlp in top} for _, _, top in entries],
                "text_offset": offsets}

    def whole(self, content: str, job: Job) -> dict:
        lp = self.logprobs(job.logprobs) if job.settings.logprobs is not None else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": lp,
                      "finish_reason": finish_reason(job)}
        else:
            choice = {"index": 0, "text": content, "logprobs": lp, "finish_reason": finish_reason(job)}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": job.usage(),
                "timings": job.timings(), "prove": job.stats()}


def _finite(lp: float) -> float:
    """A log-probability JSON can carry: -inf (a token outside the distribution) as OpenAI's -9999.0."""
    return lp if lp > -9999.0 else -9999.0


def _token(piece: bytes, lp: float) -> dict:
    return {"token": piece.decode("utf-8", "replace"), "logprob": _finite(lp), "bytes": list(piece)}


def sse(obj) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def streamed(job: Job, answer: Answer, include_usage: bool) -> EventSourceResponse:
    return EventSourceResponse(_events(job, answer, include_usage),
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(job: Job, answer: Answer, include_usage: bool):
    want_lp = job.settings.logprobs is not None
    offset = 0                        # characters streamed so far (completions' text_offset)
    try:
        if answer.chat:
            yield sse(answer.chunk(None, None, first=True))
        while True:
            ev, value = await job.next()
            if ev == "text":
                text, entries = value
                yield sse(answer.chunk(text, None, logprobs=entries if want_lp else None, offset=offset))
                offset += len(text)
            elif ev == "done":
                yield sse({**answer.chunk(None, finish_reason(job)), "timings": job.timings(), "prove": job.stats()})
                if include_usage:     # OpenAI: a last chunk with no choices, only usage
                    yield sse({**answer.base(), "choices": [], "usage": job.usage(), "timings": job.timings(),
                               "prove": job.stats()})
                break
            elif ev == "error":
                err = api_error_of(value)
                yield sse(err.body())
                break
        yield format_sse_event(data_str="[DONE]")
    finally:                          # the client went away (or we are done): stop decoding
        job.cancel.set()


async def collected(job: Job, answer: Answer, request) -> dict:
    """The whole answer once the job is done (a client that goes away meanwhile stops it)."""
    text = []
    try:
        while True:
            ev, value = await job.next(request)
            if ev == "text":
                text.append(value[0])
            elif ev == "done":
                break
            elif ev == "error":
                raise api_error_of(value)
    finally:
        job.cancel.set()
    return answer.whole("".join(text), job)
