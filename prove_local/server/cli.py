"""`prove-local serve` on the command line: its arguments, the API keys, binding the socket, and
running the app under uvicorn while the models load in the background."""
from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

from .. import modes, sampling
from ..batching import PROMPT_CACHE_MIB
from ..errors import MissingExtra, ProveError, UsageError
from ..files import read_limited
from ..hosts import is_loopback
from ..loading import PARALLEL, TAU, THETA, add_model_args, add_width_args, finite_float, int_in
from .guard import KEEP_ALIVE, MAX_HEAD, Policy, h11_protocol, hosts_from, origins_from
from .state import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT, DEFAULT_REQUEST_TIMEOUT, State

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE = 16
MAX_KEY_FILE = 1 << 20           # bytes of --api-key-file


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
    p.add_argument("--parallel", type=PARALLEL, default=1,
                   help="requests decoded at the same time, batched into one llama_decode per step (default 1)")
    p.add_argument("--no-batching", action="store_true",
                   help="with --parallel N: an engine with contexts of its own per request instead of one batch "
                        "per step (for comparison)")
    p.add_argument("--cache-ram", type=int_in(0), default=PROMPT_CACHE_MIB, metavar="MIB",
                   help="host memory for saved prompt states, as llama-server's --cache-ram: a request starts from "
                        f"the longest saved prefix of its prompt instead of prefilling it (default {PROMPT_CACHE_MIB}; 0: off)")
    p.add_argument("--no-recall", action="store_true",
                   help="lookup drafts copy only the request's own tokens (default: also the earlier requests' that "
                        "the server's engines served, so a repeated question or a regenerated answer is drafted from them; "
                        "the text is the same either way, but a client could tell from the speed that someone "
                        "asked the same before)")
    p.add_argument("--queue", type=int_in(0), default=DEFAULT_QUEUE,
                   help=f"requests that may wait for a free engine; beyond that: 503 (default {DEFAULT_QUEUE})")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    keys.add_argument("--api-key-file", metavar="F", help="like --api-key, one accepted key per line")
    p.add_argument("--max-body", type=int_in(1), default=DEFAULT_MAX_BODY,
                   help=f"largest request body in bytes (default {DEFAULT_MAX_BODY})")
    p.add_argument("--read-timeout", type=finite_float(0.0), default=DEFAULT_READ_TIMEOUT, metavar="S",
                   help=f"seconds a request's head, and then its body, may take to arrive; else the connection "
                        f"closes / 408 (default {DEFAULT_READ_TIMEOUT:g}; 0: none)")
    p.add_argument("--request-timeout", type=finite_float(0.0), default=DEFAULT_REQUEST_TIMEOUT, metavar="S",
                   help="seconds a generation may hold its engine, queueing included: past it the answer ends "
                        f"(finish_reason length, prove.stop 'deadline') and the engine is freed (default "
                        f"{DEFAULT_REQUEST_TIMEOUT:g}; 0: none)")
    p.add_argument("--allowed-origins", metavar="O[,O...]",
                   help="web page origins that may call the server, patterns with * (e.g. https://app.example, "
                        "http://192.168.1.*:*), added to PROVE_LOCAL_ORIGINS and the defaults (pages on localhost); "
                        "'*': any. Others get 403")
    p.add_argument("--allowed-hosts", metavar="H[,H...]",
                   help="Host header names to answer besides loopback names (and, beyond loopback, IP "
                        "addresses and this machine's name), patterns with *; added to PROVE_LOCAL_ALLOWED_HOSTS; "
                        "'*': any. Guards against DNS rebinding")
    p.add_argument("--mode", choices=modes.NAMES,
                   help="decoding rule when a request names none (default: lossless if the model has a "
                        "mask token, else ar)")
    add_width_args(p)       # --block / --draft-k: 'auto' (the planner) unless a request or this fixes them
    p.add_argument("--theta", type=THETA, default=0.05, help="default ProVe gate (default 0.05)")
    p.add_argument("--tau", type=TAU, default=0.95, help="default MARS threshold (default 0.95)")
    p.add_argument("--temperature", type=sampling.temperature_arg, default=sampling.TEMPERATURE,
                   help=f"temperature when a request gives none (default {sampling.TEMPERATURE:g}: greedy, so that the exact modes "
                        "answer exactly as greedy decoding; OpenAI's default would be 1.0, llama-server's 0.8)")
    p.add_argument("--sampler", choices=sampling.SAMPLERS, default=sampling.SAMPLER,
                   help="how tokens are drawn at T > 0 when a request names none: 'coupled' (default: a seed gives "
                        "ar's text in every exact mode, at any width) or 'rejection' (exact speculative sampling)")
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
    try:        # a regular file of bounded size (/dev/zero, a FIFO: refused before any read)
        text = read_limited(path, MAX_KEY_FILE).decode("utf-8")
        keys = [line.strip() for line in text.splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--api-key-file {path}: cannot read it ({e})") from None
    if not keys:
        raise UsageError(f"--api-key-file {path}: no key in it (one key per line)")
    return keys


def listen(host: str, port: int) -> socket.socket:
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
    # FastAPI (with pydantic) and uvicorn are the optional `server` extra: imported only when serve
    # runs, so that the rest of the command line works without them and says which extra is missing
    try:
        import fastapi  # noqa: F401
        import pydantic  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise MissingExtra("server", e.name or "fastapi") from None
    from .app import create_app             # (the app module imports FastAPI at its top)

    if args.parallel < 1 or args.queue < 0 or args.max_body < 1:
        raise UsageError("--parallel must be >= 1, --queue >= 0 and --max-body >= 1")
    keys = read_api_keys(args)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    warning = exposure_warning(args.host, port, keys)
    if warning:
        print(f"prove-local serve: warning: {warning}", file=sys.stderr)
    state = State(keys=keys, max_body=args.max_body, read_timeout=args.read_timeout,
                  request_timeout=args.request_timeout,
                  policy=Policy(args.host, hosts_from(args.allowed_hosts), origins_from(args.allowed_origins)))
    server = _uvicorn_server(uvicorn, create_app(state), state)
    shown = f"[{host}]" if ":" in host else host
    print(f"prove-local serve: listening on http://{shown}:{port}/v1 (loading the models)", file=sys.stderr, flush=True)
    threading.Thread(target=_load, args=(state, args, server), name="load-models", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        state.shutdown()
        sock.close()
    if state.error is not None:
        raise state.error
    return 0


def _uvicorn_server(uvicorn, app, state: State):
    """A uvicorn server whose Ctrl-C / SIGTERM stops the open generations at once, so that the
    graceful shutdown does not wait for them."""
    # read timeouts: the request head within --read-timeout (guard.h11_protocol), idle keep-alive
    # connections closed after KEEP_ALIVE s, a head of at most MAX_HEAD bytes; the body: app.read_body
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3, http=h11_protocol(state.read_timeout),
                            timeout_keep_alive=KEEP_ALIVE, h11_max_incomplete_event_size=MAX_HEAD)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.shutdown()
            super().handle_exit(sig, frame)

    return Server(config)


def _load(state: State, args, server) -> None:
    """Load the models while the server already answers /health with 503; a failure stops the
    server, and cmd_serve reports it as one line."""
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
