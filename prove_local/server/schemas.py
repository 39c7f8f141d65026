"""The request bodies (pydantic, strict types: "5" is not a number; unknown fields ignored as OpenAI
clients expect), and `parse`: body bytes -> a validated request, or a 400 naming the field.

pydantic comes with FastAPI (the `server` extra): only the app imports this module."""

import json
import math
import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat import clean_text
from .errors import ApiError

MAX_DEPTH = 64                  # JSON nesting of a request body (a schema is bounded at 64 levels too)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")      # a \uD800-\uDFFF escape: maybe a lone surrogate


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None


class StreamOptions(Body):
    include_usage: bool = False


class ResponseFormat(Body):
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} (llama-server also takes a
    "schema" there) or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None
    schema_: dict | None = Field(None, alias="schema")


class Common(Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # extensions: llama.cpp's sampling names, and the ProVe settings
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=0)
    mode: str | None = None
    theta: float | None = Field(None, ge=0)
    tau: float | None = Field(None, ge=0)
    block: Union[Literal["auto"], Annotated[int, Field(ge=1, le=512)], None] = None
    draft_k: Union[Literal["auto"], Annotated[int, Field(ge=0, le=512)], None] = None
    lookup: Union[Literal["auto"], Annotated[int, Field(ge=0, le=512)], None] = None
    recall: bool | None = None                  # False: no lookup draft from an earlier request's tokens
    grammar: str | None = None                  # llama-server's GBNF field
    json_schema: dict | None = None             # llama-server's schema field (as response_format json_schema)
    sampler: Literal["coupled", "rejection"] | None = None


class Chat(Common):
    messages: list[Message] = Field(min_length=1)


class Completion(Common):
    prompt: Union[str, list[str]]
    echo: bool | None = False
    suffix: str | None = None


def _constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _clean(obj, raw: bytes):
    """The parsed body, checked for depth (an iterative walk: no recursion on hostile input), with
    lone surrogates (JSON "\\ud800": not text, and no UTF-8 encoder takes them) replaced by U+FFFD
    as the command line does (chat.clean_text). Walks only when the bytes could need it."""
    surrogates = _SURROGATE.search(raw) is not None
    if not surrogates and raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return obj

    def fix(v):
        return clean_text(v) if surrogates and isinstance(v, str) else v

    root = [fix(obj)]
    stack = [(root, 0, 0)]
    while stack:
        container, key, depth = stack.pop()
        v = container[key]
        if isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ApiError(400, f"the request body nests JSON more than {MAX_DEPTH} levels deep")
            if isinstance(v, dict):
                if surrogates:
                    v = container[key] = {fix(k): fix(x) for k, x in v.items()}
                stack.extend((v, k, depth + 1) for k in v)
            else:
                if surrogates:
                    v[:] = [fix(x) for x in v]
                stack.extend((v, i, depth + 1) for i in range(len(v)))
    return root[0]


def parse(raw: bytes, kind: type[Body]) -> Body:
    """Body bytes -> validated request, or a 400 naming the field."""
    try:
        obj = json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:      # JSONDecodeError, UnicodeDecodeError, a 5,000-digit integer, NaN, 1e999
        raise ApiError(400, f"malformed JSON in the request body: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    obj = _clean(obj, raw)
    try:
        return kind.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union[")))
        raise ApiError(400, f"{where}: {err['msg']}" if where else err["msg"], param=where or None) from None
