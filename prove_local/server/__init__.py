"""`prove-local serve`: an OpenAI-compatible HTTP server on the same engine, with the ProVe cycle
statistics in every response.

Endpoints (as llama.cpp's tools/server names them, tools/server/README.md in llama.cpp): GET /health (503 while the models load, then 200 {"status": "ok"}),
GET /v1/models (OpenAI list format), POST /v1/chat/completions, POST /v1/completions, GET /metrics
(Prometheus text). Every generation is a projection of the engine's Cycle events.

The package, by concern (as llama-cpp-python's server splits app, settings, types and errors):
    cli.py        the `serve` command: arguments, API keys, binding, uvicorn, loading in the background
    state.py      what the app serves: the engine pool, the defaults, the keys, the open jobs
    app.py        the FastAPI app: routes, authorization, the body limit, error handlers
    schemas.py    the request bodies (pydantic) and their parsing into a 400 naming the field
    inputs.py     a request -> prompt tokens, engine.Settings and stop strings
    jobs.py       one generation on a worker thread, its events and its `prove` statistics
    responses.py  a job's events as an OpenAI answer: one JSON object, or server-sent events
    stops.py      stop strings on streamed text
    metrics.py    GET /metrics counters
    errors.py     OpenAI-style error answers
How a request flows through them: docs/design.md, "How a request flows".

What we take from llama.cpp's server: /health and /metrics (with its `llamacpp:spec_decode_*`
counters), --parallel slots, --api-key-file, the 127.0.0.1 default, the `timings` object (with
`draft_n` / `draft_n_accepted`, PR #12603), the `grammar` and `json_schema` fields (constrain.py). Where we differ from llama-cpp-python's server (FastAPI + sse-starlette): no global lock
(N engines decode at once, the rest wait in a bounded queue and get 503 beyond it), API keys
compared in constant time (hmac.compare_digest) instead of `==`, a body size limit, and every bad
request answered with a 4xx OpenAI-style `{"error": {...}}` object.

FastAPI, pydantic and uvicorn (the `server` extra) are imported only when `serve` runs: this
package's __init__ and cli.py do not import app.py, schemas.py or responses.py.
"""
from ..hosts import is_loopback
from .cli import add_parser, cmd_serve, exposure_warning, read_api_keys
from .metrics import Metrics
from .state import State
from .stops import StopText

__all__ = ["add_parser", "cmd_serve", "exposure_warning", "is_loopback", "Metrics",
           "read_api_keys", "State", "StopText"]
