"""The FastAPI app: routes, API keys, the body size limit and the error handlers.

FastAPI is the `server` extra: this module imports it at its top, and is itself imported only when
`serve` runs (server/cli.py) or a test builds the app."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import modes
from .errors import ApiError, api_error_of
from .guard import Guard, json_content_type
from .inputs import chat_prompt, completion_prompt, settings_for, stop_list
from .jobs import Job
from .responses import Answer, collected, streamed
from .schemas import Chat, Completion, parse
from .state import State

log = logging.getLogger("prove_local.server")


def create_app(state: State) -> FastAPI:
    """The FastAPI app on `state` (models loaded or loading)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.shutdown()                     # open generations stop at their next cycle
        await asyncio.to_thread(state.close)  # then the engines, then the models (the pool may wait)

    app = FastAPI(title="prove-local", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app, state)
    app.add_middleware(Guard, state=state)       # Host and Origin checks before any route (guard.py)

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        if state.error is not None:
            raise ApiError(503, f"the models failed to load: {state.error}", "unavailable_error")
        ready(state)
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        authorize(state, request)
        ready(state)
        listing = model_list(state)
        state.metrics.request("/v1/models", 200)
        return listing

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(state, request)
        ready(state)
        state.metrics.request("/metrics", 200)
        return PlainTextResponse(state.metrics.render(state.pool.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generate(state, request, "chat")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        return await generate(state, request, "completion")

    return app


# ------------------------------------------------------------------------------ errors
def error_response(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.status in (408, 413):        # the body was not read to its end: the connection cannot go on
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


def _add_error_handlers(app: FastAPI, state: State) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError):
        state.metrics.request(request.url.path, e.status)
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        state.metrics.request("other", e.status_code)
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind))

    @app.exception_handler(Exception)
    async def on_exception(request: Request, e: Exception):    # no traceback ever reaches a client
        log.exception("request failed")
        return error_response(api_error_of(e))


# ------------------------------------------------------------------------------ every request
def ready(state: State) -> None:
    if state.pool is None:
        raise ApiError(503, "Loading model", "unavailable_error")


def authorize(state: State, request: Request) -> None:
    if not state.keys:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    given_b = given.strip().encode()
    ok = False
    for key in state.keys:             # constant time per key, and every key is compared
        ok |= hmac.compare_digest(given_b, key.encode())
    if scheme.lower() != "bearer" or not ok:
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                       "authentication_error", code="invalid_api_key")


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON: a form or text/plain POST is a request any web page can
    make a browser send without asking (guard.py)."""
    if not json_content_type(request.headers.get("content-type")):
        raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), not "
                            f"{request.headers.get('content-type') or 'untyped'}", code="unsupported_media_type")


async def read_body(state: State, request: Request) -> bytes:
    """The body, JSON only, at most --max-body bytes, arrived within --read-timeout seconds (a body
    shorter than its Content-Length would otherwise hold the connection for good)."""
    require_json(request)
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > state.max_body:
        raise ApiError(413, f"the request body has {size} bytes; the limit is {state.max_body} (--max-body)",
                       code="body_too_large")
    chunks, n = [], 0

    async def read():
        nonlocal n
        async for chunk in request.stream():
            n += len(chunk)
            if n > state.max_body:
                raise ApiError(413, f"the request body is over the limit of {state.max_body} bytes (--max-body)",
                               code="body_too_large")
            chunks.append(chunk)
    try:
        await asyncio.wait_for(read(), state.read_timeout or None)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {state.read_timeout:g} s (--read-timeout): "
                            f"{n} bytes came", code="body_timeout") from None
    return b"".join(chunks)


# ------------------------------------------------------------------------------ endpoints
def model_list(state: State) -> dict:
    """GET /v1/models: the loaded models in OpenAI's list format; the target's entry names the modes."""
    data = []
    for role, mid in state.model_ids.items():
        entry = {"id": mid, "object": "model", "created": state.created, "owned_by": "prove-local",
                 "prove": {"role": role}}
        if role == "target":
            entry["prove"]["modes"] = [m for m in modes.NAMES if m not in state.mode_errors]
            entry["prove"]["default_mode"] = state.defaults.mode
            entry["prove"]["n_ctx"] = state.pool.first.n_ctx
        data.append(entry)
    return {"object": "list", "data": data}


async def generate(state: State, request: Request, kind: str):
    """POST /v1/chat/completions (kind "chat") and /v1/completions ("completion")."""
    authorize(state, request)
    require_json(request)
    ready(state)
    body = parse(await read_body(state, request), Chat if kind == "chat" else Completion)
    job = await start_job(state, request, body, kind)
    answer = Answer.new(kind, state.model_id)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        state.metrics.request(answer.endpoint, 200)
        return streamed(job, answer, include_usage)
    result = await collected(job, answer, request)
    state.metrics.request(answer.endpoint, 200)
    return result


async def start_job(state: State, request: Request, body, kind: str) -> Job:
    """The request's job, once it holds an engine: errors up to then (a bad request, a full queue)
    are answered with a 4xx/503 before any byte of the answer."""
    model = state.pool.loaded.target
    prompt = chat_prompt(model, body.messages) if kind == "chat" else completion_prompt(model, body)
    settings, notes = settings_for(state, body, len(prompt))
    stops = stop_list(body)
    if state.closing:
        raise ApiError(503, "the server is shutting down", "unavailable_error")
    job = Job(state, prompt, settings, stops, notes, collect=not body.stream).start()
    try:
        event, value = await job.next(request)       # engine taken (or an error: 4xx/503 before any byte)
    except BaseException:
        job.cancel.set()
        raise
    if event == "error":
        raise api_error_of(value)
    return job
