"""`prove-local serve`: an OpenAI-compatible HTTP server on the same engine, with the ProVe cycle
statistics in every response.

Endpoints (as llama.cpp's tools/server names them, see shared/notes/anchors-sampling-server-planner.md,
"OpenAI-compatible server"): GET /health (503 while the models load, then 200 {"status": "ok"}),
GET /v1/models (OpenAI list format), POST /v1/chat/completions, POST /v1/completions, GET /metrics
(Prometheus text). Every generation is a projection of the engine's Cycle events: a worker thread
takes an engine from the pool (prove_local/pool.py), iterates `Engine.generate`, turns the
committed tokens into text (stop strings applied there) and hands the pieces to the request's
event loop. Closing the generation (stop string, client gone, shutdown) runs the engine's clean-up:
every KV cache is cut back to the committed tokens, so the next request on that engine works.

What we take from llama.cpp's server: /health and /metrics, --parallel slots, --api-key-file,
the 127.0.0.1 default, `timings.draft_n` / `draft_n_accepted` (PR #12603; here in the `prove`
object). Where we differ from llama-cpp-python's server (FastAPI + sse-starlette): no global lock
(N engines decode at once, the rest wait in a bounded queue and get 503 beyond it), API keys
compared in constant time (hmac.compare_digest) instead of `==`, a body size limit, and every bad
request answered with a 4xx OpenAI-style `{"error": {...}}` object.

SSE: FastAPI's own `fastapi.sse` (FastAPI >= 0.135; `EventSourceResponse` and `format_sse_event`)
rather than sse-starlette: FastAPI is needed anyway, so it is one dependency less, and it sends
nothing but our own `data:` lines. We return the response object from a plain endpoint (not a
generator path operation), so FastAPI's 15 s keep-alive `: ping` comments are never sent: comment
pings broke some OpenAI clients when llama.cpp added them (Ollama PR #16443, llama-cpp-python
#1256), and OpenAI's own streams have none.

FastAPI, pydantic and uvicorn are imported only when `serve` runs (the `server` extra).
"""

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import modes, planner
from .errors import (ContextFull, EngineBusy, LlamaError, MissingExtra, ModeError, ProveError,
                     TemplateMissing, UsageError)
from .hosts import is_loopback  # noqa: F401  (also this module's API)
from .loading import PARALLEL, TAU, THETA, add_model_args, add_width_args, int_in

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE = 16
DEFAULT_MAX_BODY = 2 * 1024 * 1024     # bytes; a 32k-token conversation is ~130 kB of text
MAX_STOPS = 4                          # as OpenAI's API
log = logging.getLogger("prove_local.server")


# ------------------------------------------------------------------------------ command line
def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'server' extra)",
                       description="Serve the models over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                   "/v1/completions, /v1/models, /health, /metrics). Without a model: the "
                                   "embedded pair.")
    add_model_args(p)
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int_in(0, 65535, " (0: a free port)"), default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0 picks a free one and prints it)")
    p.add_argument("--parallel", type=PARALLEL, default=1, help="requests decoded at the same time (default 1)")
    p.add_argument("--queue", type=int_in(0), default=DEFAULT_QUEUE,
                   help=f"requests that may wait for a free engine; beyond that: 503 (default {DEFAULT_QUEUE})")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    keys.add_argument("--api-key-file", metavar="F", help="like --api-key, one accepted key per line")
    p.add_argument("--max-body", type=int_in(1), default=DEFAULT_MAX_BODY,
                   help=f"largest request body in bytes (default {DEFAULT_MAX_BODY})")
    p.add_argument("--mode", choices=modes.NAMES,
                   help="decoding rule when a request names none (default: lossless if the model has a "
                        "mask token, else ar)")
    add_width_args(p)       # --block / --draft-k: 'auto' (the planner) unless a request or this fixes them
    p.add_argument("--theta", type=THETA, default=0.05, help="default ProVe gate (default 0.05)")
    p.add_argument("--tau", type=TAU, default=0.95, help="default MARS threshold (default 0.95)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="temperature when a request gives none (default 0: greedy, so that the exact modes "
                        "answer exactly as greedy decoding; OpenAI's default would be 1.0, llama-server's 0.8)")
    p.set_defaults(func=cmd_serve)


def exposure_warning(host: str, port: int, keys: list[str]) -> str | None:
    """What to tell the user who listens beyond this machine without a key (else None)."""
    if is_loopback(host) or keys:
        return None
    return (f"listening on {host} without an API key: anyone who can reach port {port} can use the models "
            "(pass --api-key or --api-key-file)")


def read_api_keys(args) -> list[str]:
    """The accepted keys: --api-key, or the non-empty lines of --api-key-file (llama.cpp's option)."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise UsageError("--api-key is empty")
        return [args.api_key.strip()]
    if args.api_key_file is None:
        return []
    path = Path(args.api_key_file)
    try:
        keys = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--api-key-file {path}: cannot read it ({e})") from None
    if not keys:
        raise UsageError(f"--api-key-file {path}: no key in it (one key per line)")
    return keys


def _listen(host: str, port: int) -> socket.socket:
    """Bind before anything loads, so that a busy port is one line at once, and --port 0 works."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import pydantic  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise MissingExtra("server", e.name or "fastapi") from None
    if args.parallel < 1 or args.queue < 0 or args.max_body < 1:
        raise UsageError("--parallel must be >= 1, --queue >= 0 and --max-body >= 1")
    keys = read_api_keys(args)
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    warning = exposure_warning(args.host, port, keys)
    if warning:
        print(f"prove-local serve: warning: {warning}", file=sys.stderr)
    state = State(keys=keys, max_body=args.max_body)
    app = create_app(state)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):       # Ctrl-C / SIGTERM: open generations stop at once,
            state.shutdown()                     # so the graceful shutdown does not wait for them
            super().handle_exit(sig, frame)

    server = Server(config)

    def load():
        try:
            state.load(args)
        except ProveError as e:
            state.error = e
        except Exception as e:           # noqa: BLE001 - reported as one line, then the server stops
            state.error = UsageError(f"the models could not be loaded: {type(e).__name__}: {e}")
        if state.error is not None:
            server.should_exit = True
        else:
            print(f"prove-local serve: ready ({state.describe()})", file=sys.stderr, flush=True)

    shown = f"[{host}]" if ":" in host else host
    print(f"prove-local serve: listening on http://{shown}:{port}/v1 (loading the models)", file=sys.stderr, flush=True)
    threading.Thread(target=load, name="load-models", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        state.shutdown()
        sock.close()
    if state.error is not None:
        raise state.error
    return 0


# ------------------------------------------------------------------------------ state
class ApiError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def api_error_of(e: BaseException) -> ApiError:
    """The answer to an exception raised while serving a request."""
    from .pool import Cancelled, QueueFull

    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFull):
        return ApiError(503, f"server busy: {e}", "unavailable_error", code="queue_full")
    if isinstance(e, Cancelled):
        return ApiError(499, str(e), "cancelled")
    if isinstance(e, ContextFull):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (ModeError, TemplateMissing, UsageError)):
        return ApiError(400, str(e))
    if isinstance(e, EngineBusy):
        return ApiError(503, str(e), "unavailable_error")
    if isinstance(e, LlamaError):
        return ApiError(500, f"llama.cpp error: {e}", "server_error")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class Metrics:
    """Counters for GET /metrics (Prometheus text format), updated under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}     # (endpoint, status) -> count
        self.finished: dict[str, int] = {}                 # finish reason -> count
        self.prompt_tokens = self.tokens = self.cycles = self.draft_n = self.draft_n_accepted = 0
        self.accepted_by_slot: dict[int, int] = {}
        self.tokens_by_slot: dict[int, int] = {}
        self.passes: dict[str, int] = {}
        self.decode_seconds: dict[str, float] = {}

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def generation(self, job: "Job") -> None:
        with self.lock:
            self.finished[job.finish] = self.finished.get(job.finish, 0) + 1
            self.prompt_tokens += len(job.prompt)
            for c in job.cycles:
                self.tokens += len(c.committed)
                self.cycles += 1
                self.accepted_by_slot[job.slot] = self.accepted_by_slot.get(job.slot, 0) + c.n_accepted
                self.tokens_by_slot[job.slot] = self.tokens_by_slot.get(job.slot, 0) + len(c.committed)
                for r, n in c.passes.items():
                    self.passes[r] = self.passes.get(r, 0) + n
                for r, t in c.decode_seconds.items():
                    self.decode_seconds[r] = self.decode_seconds.get(r, 0.0) + t
            d_n, d_acc = draft_counts(job.cycles)
            self.draft_n += d_n
            self.draft_n_accepted += d_acc

    def render(self, pool_stats: dict | None) -> str:
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP prove_{name} {help_}")
            out.append(f"# TYPE prove_{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                out.append(f"prove_{name}{{{lab}}} {value}" if lab else f"prove_{name} {value}")

        with self.lock:
            metric("requests_total", "counter", "HTTP requests answered, by endpoint and status",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            metric("generations_total", "counter",
                   "generations by how they ended (stop, length, cancelled = client gone, error)",
                   [({"finish": f}, n) for f, n in sorted(self.finished.items())])
            metric("prompt_tokens_total", "counter", "prompt tokens of the generations", [({}, self.prompt_tokens)])
            metric("tokens_generated_total", "counter", "tokens committed", [({}, self.tokens)])
            metric("cycles_total", "counter", "decoding cycles", [({}, self.cycles)])
            metric("tokens_per_cycle", "gauge", "tokens committed per cycle, over all generations",
                   [({}, self.tokens / self.cycles if self.cycles else 0.0)])
            metric("accepted_tokens_total", "counter", "accepted proposals (Cycle.n_accepted) per engine slot",
                   [({"slot": s}, n) for s, n in sorted(self.accepted_by_slot.items())])
            metric("slot_tokens_total", "counter", "tokens committed per engine slot",
                   [({"slot": s}, n) for s, n in sorted(self.tokens_by_slot.items())])
            metric("draft_n_total", "counter", "tokens proposed or drafted (llama.cpp's draft_n)", [({}, self.draft_n)])
            metric("draft_n_accepted_total", "counter", "proposed or drafted tokens accepted (draft_n_accepted)",
                   [({}, self.draft_n_accepted)])
            metric("passes_total", "counter", "forward passes (llama_decode calls) per model",
                   [({"model": r}, n) for r, n in sorted(self.passes.items())])
            metric("decode_seconds_total", "counter", "seconds in llama_decode per model",
                   [({"model": r}, round(t, 6)) for r, t in sorted(self.decode_seconds.items())])
        if pool_stats is not None:
            metric("slots", "gauge", "engines (--parallel)", [({}, pool_stats["slots"])])
            metric("slots_busy", "gauge", "engines decoding now", [({}, pool_stats["busy"])])
            metric("queue_length", "gauge", "requests waiting for an engine", [({}, pool_stats["waiting"])])
            metric("queue_capacity", "gauge", "most requests that may wait (--queue)",
                   [({}, pool_stats["queue_capacity"])])
            metric("queue_peak", "gauge", "most requests that waited at once", [({}, pool_stats["peak_waiting"])])
            metric("requests_rejected_total", "counter", "requests refused with 503 (queue full)",
                   [({}, pool_stats["rejected"])])
        return "\n".join(out) + "\n"


def _label(value) -> str:
    """A Prometheus label value, escaped as the text format requires."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def draft_counts(cycles) -> tuple[int, int]:
    """llama.cpp's draft_n / draft_n_accepted for our cycles: the tokens proposed (MARS block slots,
    or spec's drafts) and those accepted. Plain ar proposes nothing, nor do the plain ar cycles that
    the planner runs inside another mode (--block auto)."""
    drafted = [c for c in cycles if c.plan.proposes]
    return sum(len(c.proposed) for c in drafted), sum(c.n_accepted for c in drafted)


@dataclass
class State:
    """What the app serves: the pool once loaded, the keys, the counters and the open jobs."""
    keys: list[str] = field(default_factory=list)
    max_body: int = DEFAULT_MAX_BODY
    pool: object = None
    error: ProveError | None = None
    defaults: object = None                  # engine.Settings a request starts from
    model_ids: dict = field(default_factory=dict)   # role -> id
    created: int = 0
    metrics: Metrics = field(default_factory=Metrics)
    jobs: set = field(default_factory=set)
    mode_errors: dict = field(default_factory=dict)
    closing: bool = False

    def load(self, args) -> None:
        from .engine import Settings
        from .loading import load_models
        from .pool import EnginePool

        loaded = load_models(args, parallel=args.parallel)
        pool = EnginePool(loaded, args.parallel, max_queue=args.queue)
        first = pool.first
        mode = args.mode or first.default_mode()
        defaults = Settings(mode=mode, block=args.block, theta=args.theta, tau=args.tau, draft_k=args.draft_k,
                            temperature=args.temperature)
        first.check(replace(defaults, temperature=0.0))    # a bad --mode/--block is a start-up error
        first.prepare(defaults)     # --block auto: pass costs calibrated (or read from the cache) before serving
        for m in modes.NAMES:
            try:
                first.check(Settings(mode=m))
            except ModeError as e:
                self.mode_errors[m] = str(e)
        for role, m in (("proposer", loaded.proposer), ("verifier", loaded.verifier), ("draft", loaded.draft)):
            if m is not None:       # the file name; made unique when two roles use like-named files
                mid = Path(m.path).stem
                self.model_ids[role] = mid if mid not in self.model_ids.values() else f"{mid}-{role}"
        self.created = int(Path(loaded.proposer.path).stat().st_mtime) if Path(loaded.proposer.path).exists() else 0
        self.defaults = defaults
        self.pool = pool                         # last: /health turns 200 now

    def describe(self) -> str:
        models = ", ".join(f"{r} {i}" for r, i in self.model_ids.items())
        return f"{models}; mode {self.defaults.mode}, {self.pool.parallel} parallel, queue {self.pool.max_queue}"

    @property
    def model_id(self) -> str:
        return self.model_ids.get("proposer", "prove-local")

    def shutdown(self) -> None:
        self.closing = True
        for job in list(self.jobs):
            job.cancel.set()


# ------------------------------------------------------------------------------ text
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


class Job:
    """One generation: runs in its own thread (the engine is synchronous), hands events to the
    request's event loop: ("start", slot), ("text", str), ("done", None) or ("error", exc)."""

    def __init__(self, state: State, prompt: list[int], settings, stops: list[str], notes: list[str]):
        self.state, self.prompt, self.settings, self.stops, self.notes = state, prompt, settings, stops, notes
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.cycles: list = []
        self.request = None                  # the engine's Request (prefill, block)
        self.slot = -1
        self.finish: str | None = None       # stop, length, cancelled, error
        self.seconds = 0.0
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
        from .engine import TextStream

        pool = self.state.pool
        try:
            with pool.engine(prefer=self._affinity, abandoned=self.cancel.is_set) as (slot, engine):
                self.slot = slot
                t0 = time.perf_counter()
                gen = engine.generate(self.prompt, self.settings)
                self.request = gen.request
                self._emit("start", slot)
                stream, stop = TextStream(pool.loaded.proposer), StopText(self.stops)
                with contextlib.closing(gen):
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
                self.seconds = time.perf_counter() - t0
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
        """The `prove` extension object: what the cycles of this answer did."""
        from .engine import summarize

        s = summarize(self.cycles, self.seconds)
        mode = modes.MODES[self.settings.mode]
        d_n, d_acc = draft_counts(self.cycles)
        prefill = self.request.prefill if self.request is not None else (0, 0.0)
        return {
            "mode": self.settings.mode,
            "block": (("auto" if self.request.auto else self.request.block)
                      if self.request is not None and mode.width == "block" else None),
            "widths": planner.widths_histogram(self.cycles),
            "draft_k": self.settings.draft_k if mode.width == "draft_k" else None,
            "n_cycles": s["n_cycles"],
            "tokens_per_cycle": round(s["tokens_per_cycle"], 4),
            "passes": s["n_passes"],
            "draft_n": d_n,
            "draft_n_accepted": d_acc,
            "decode_seconds": {r: round(t, 6) for r, t in s["decode_seconds"].items()},
            "seconds": round(self.seconds, 6),
            "prefill": {"tokens": prefill[0], "seconds": round(prefill[1], 6)},
            "slot": self.slot,
            # eog, length, context (the engine's), stop_string, or cancelled (the client went away)
            "stop": (self.finish if self.finish in ("cancelled", "stop_string") else
                     self.request.stop if self.request is not None else None),
            "notes": self.notes,
        }

    def usage(self) -> dict:
        n = sum(len(c.committed) for c in self.cycles)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}


# ------------------------------------------------------------------------------ requests
@functools.cache
def schemas():
    """The request bodies (pydantic, strict types: "5" is not a number; unknown fields ignored as
    OpenAI clients expect)."""
    from typing import Annotated, Literal, Union

    from pydantic import BaseModel, ConfigDict, Field

    class Body(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)

    class TextPart(Body):
        type: Literal["text"]
        text: str

    class Message(Body):
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Union[str, list[TextPart], None] = None

    class StreamOptions(Body):
        include_usage: bool = False

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

    class Chat(Common):
        messages: list[Message] = Field(min_length=1)

    class Completion(Common):
        prompt: Union[str, list[str]]
        echo: bool | None = False
        suffix: str | None = None

    return Chat, Completion


def parse(raw: bytes, kind):
    """Body bytes -> validated request, or a 400 naming the field."""
    from pydantic import ValidationError

    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON in the request body: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union[")))
        raise ApiError(400, f"{where}: {err['msg']}" if where else err["msg"], param=where or None) from None


def settings_for(state: State, body, n_prompt: int):
    """engine.Settings from a request: the server defaults, the OpenAI fields, the extensions.
    Returns (settings, notes)."""
    from .engine import Settings

    notes: list[str] = []
    if body.n not in (None, 1):
        raise ApiError(400, f"n={body.n}: only n=1 is supported", param="n")
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            notes.append(f"{name} is not supported and was ignored (use repeat_penalty)")
    if body.mode is not None:
        if body.mode not in modes.MODES:
            raise ApiError(400, f"unknown mode {body.mode!r}; choose from {', '.join(modes.NAMES)}", param="mode")
        if body.mode in state.mode_errors:
            raise ApiError(400, state.mode_errors[body.mode], param="mode")
    n_ctx = state.pool.first.n_ctx
    if n_prompt >= n_ctx:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; the context holds {n_ctx} (start the server "
                            "with a larger --ctx, or shorten the prompt)", code="context_length_exceeded")
    room = n_ctx - n_prompt
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"max_tokens={max_tokens} is beyond the context: the prompt has {n_prompt} tokens, "
                            f"the context holds {n_ctx}, so at most {room} can be generated",
                       param="max_tokens", code="context_length_exceeded")
    d = state.defaults
    s = Settings(
        mode=body.mode or d.mode, max_new=max_tokens or room,      # default: until the context is full
        block=body.block if body.block is not None else d.block,
        theta=d.theta if body.theta is None else body.theta, tau=d.tau if body.tau is None else body.tau,
        draft_k=d.draft_k if body.draft_k is None else body.draft_k,
        temperature=d.temperature if body.temperature is None else body.temperature,
        top_k=d.top_k if body.top_k is None else body.top_k, top_p=d.top_p if body.top_p is None else body.top_p,
        min_p=d.min_p if body.min_p is None else body.min_p,
        repeat_penalty=d.repeat_penalty if body.repeat_penalty is None else body.repeat_penalty,
        repeat_last_n=d.repeat_last_n if body.repeat_last_n is None else body.repeat_last_n,
        seed=body.seed)
    first = state.pool.first
    try:
        first.check(s)
    except ModeError as e:
        raise ApiError(400, str(e), param="mode") from None
    from .engine import seed_note
    note = seed_note(s)
    if note:
        notes.append(note)
    return s, notes


def stop_list(body) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings", param="stop")
    return [s for s in stops if s]


def chat_prompt(model, messages) -> list[int]:
    """Messages rendered by the GGUF's chat template, tokenized as chat.Conversation.prompt_tokens
    does (BOS added unless the template wrote it)."""
    from jinja2 import TemplateError

    from .chat import render

    template = model.chat_template
    if not template:
        raise ApiError(400, f"{Path(model.path).name} has no chat template (tokenizer.chat_template): "
                            "use /v1/completions with a raw prompt")
    msgs = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    bos = model.special_text("bos")
    try:
        text = render(template, msgs, add_generation_prompt=True, bos_token=bos, eos_token=model.special_text("eos"))
    except TemplateError as e:
        raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
    return model.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)


def completion_prompt(model, body) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request (a list of one string at most)", param="prompt")
        prompt = prompt[0]
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    return model.tokenize(prompt, add_special=True)


# ------------------------------------------------------------------------------ the app
def create_app(state: State):
    """The FastAPI app on `state` (models loaded or loading)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from fastapi.sse import EventSourceResponse, format_sse_event
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.shutdown()                     # open generations stop at their next cycle

    app = FastAPI(title="prove-local", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    Chat, Completion = schemas()

    def error_response(e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

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

    def ready() -> None:
        if state.pool is None:
            raise ApiError(503, "Loading model", "unavailable_error")

    def authorize(request: Request) -> None:
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

    async def read_body(request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > state.max_body:
            raise ApiError(413, f"the request body has {size} bytes; the limit is {state.max_body} (--max-body)",
                           code="body_too_large")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > state.max_body:
                raise ApiError(413, f"the request body is over the limit of {state.max_body} bytes (--max-body)",
                               code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        if state.error is not None:
            raise ApiError(503, f"the models failed to load: {state.error}", "unavailable_error")
        ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        authorize(request)
        ready()
        data = []
        for role, mid in state.model_ids.items():
            entry = {"id": mid, "object": "model", "created": state.created, "owned_by": "prove-local",
                     "prove": {"role": role}}
            if role == "proposer":
                entry["prove"]["modes"] = [m for m in modes.NAMES if m not in state.mode_errors]
                entry["prove"]["default_mode"] = state.defaults.mode
                entry["prove"]["n_ctx"] = state.pool.first.n_ctx
            data.append(entry)
        state.metrics.request("/v1/models", 200)
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        ready()
        state.metrics.request("/metrics", 200)
        return PlainTextResponse(state.metrics.render(state.pool.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(request: Request, kind: str):
        authorize(request)
        ready()
        body = parse(await read_body(request), Chat if kind == "chat" else Completion)
        model = state.pool.loaded.proposer
        prompt = chat_prompt(model, body.messages) if kind == "chat" else completion_prompt(model, body)
        settings, notes = settings_for(state, body, len(prompt))
        stops = stop_list(body)
        if state.closing:
            raise ApiError(503, "the server is shutting down", "unavailable_error")
        job = Job(state, prompt, settings, stops, notes).start()
        try:
            kind_, value = await job.next(request)       # engine taken (or an error: 4xx/503 before any byte)
        except BaseException:
            job.cancel.set()
            raise
        if kind_ == "error":
            raise api_error_of(value)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        base = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": created, "model": state.model_id}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if kind == "chat":
                delta = ({"role": "assistant", "content": ""} if first else
                         {"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice]}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def sse(obj) -> bytes:
                return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False, separators=(",", ":")))

            async def events():
                try:
                    if kind == "chat":
                        yield sse(chunk(None, None, first=True))
                    while True:
                        ev, value = await job.next()
                        if ev == "text":
                            yield sse(chunk(value, None))
                        elif ev == "done":
                            yield sse({**chunk(None, finish_reason(job)), "prove": job.stats()})
                            if include_usage:     # OpenAI: a last chunk with no choices, only usage
                                yield sse({**base, "choices": [], "usage": job.usage(), "prove": job.stats()})
                            break
                        elif ev == "error":
                            err = api_error_of(value)
                            yield sse(err.body())
                            break
                    yield format_sse_event(data_str="[DONE]")
                finally:                          # the client went away (or we are done): stop decoding
                    job.cancel.set()

            state.metrics.request(endpoint, 200)
            return EventSourceResponse(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        text = []
        try:
            while True:
                ev, value = await job.next(request)
                if ev == "text":
                    text.append(value)
                elif ev == "done":
                    break
                elif ev == "error":
                    raise api_error_of(value)
        finally:
            job.cancel.set()
        content = "".join(text)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                      "finish_reason": finish_reason(job)}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason(job)}
        state.metrics.request(endpoint, 200)
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": created, "model": state.model_id, "choices": [choice], "usage": job.usage(),
                "prove": job.stats()}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    return app


def finish_reason(job: Job) -> str:
    """OpenAI's names: "stop" (end of generation or a stop string), "length" (max_tokens or the
    context full)."""
    return "length" if job.finish == "length" else "stop"


__all__ = ["add_parser", "cmd_serve", "create_app", "State", "StopText", "is_loopback", "read_api_keys"]
