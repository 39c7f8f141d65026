"""Who may talk to the server, and how: the Host and Origin checks (DNS rebinding, web pages), the
JSON-only request bodies, and the connection read timeouts (uvicorn's HTTP protocol, with a deadline
for the request head). The server's promises: docs/server-limits.md.

- Host: a web page on evil.example can rebind its name to 127.0.0.1 and then talk to a loopback
  server as its own origin; the request still says `Host: evil.example`. A server listening on
  loopback answers only Hosts that name loopback (localhost, *.localhost, 127.x.y.z, [::1]) or are
  allowed (--allowed-hosts / PROVE_LOCAL_ALLOWED_HOSTS; '*': any); one listening beyond loopback
  also answers IP literals, its --host and this machine's host name (a key is what guards it).
- Origin: a request a browser sends for a page carries `Origin`; unless it is this server's own
  origin or allowed, it is refused (403) before anything runs, as Ollama does (OLLAMA_ORIGINS): by
  default pages on localhost / 127.0.0.1 / [::1] (any port) and app://, file://, tauri:// and
  vscode-webview:// origins; more with --allowed-origins / PROVE_LOCAL_ORIGINS ('*': any). Allowed
  origins get CORS headers, so a page there can read the answers.
- Content-Type: POST bodies must be JSON (application/json or application/*+json): a form or
  text/plain POST is a "simple" cross-site request a browser sends without asking (415).
"""
from __future__ import annotations

import fnmatch
import ipaddress
import json
import os
import socket

from ..hosts import is_loopback

ORIGINS_ENV = "PROVE_LOCAL_ORIGINS"
HOSTS_ENV = "PROVE_LOCAL_ALLOWED_HOSTS"
DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
                        for scheme in ("http", "https") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*")


def split_list(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def origins_from(option: str | None) -> list[str]:
    """The allowed origin patterns: the defaults, PROVE_LOCAL_ORIGINS and --allowed-origins."""
    return list(DEFAULT_ORIGINS) + split_list(os.environ.get(ORIGINS_ENV)) + split_list(option)


def hosts_from(option: str | None) -> list[str]:
    return split_list(os.environ.get(HOSTS_ENV)) + split_list(option)


def host_name(value: str) -> str:
    """'Example.com:8080' -> 'example.com'; '[::1]:80' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    name, sep, port = value.rpartition(":")
    return (name if sep and port.isdigit() and ":" not in name else value).rstrip(".")   # (localhost. = localhost)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _pattern(text: str) -> str:
    """An allow-list entry as an fnmatch pattern: only * is a wildcard ('[::1]' is literal)."""
    return text.strip().lower().replace("[", "[[]").replace("?", "[?]")


class Policy:
    """The Host and Origin rules of one server (`bound`: the --host it listens on)."""

    def __init__(self, bound: str = "127.0.0.1", hosts: list[str] | None = None, origins: list[str] | None = None):
        self.loopback = is_loopback(bound)
        self.hosts = [_pattern(h) for h in (hosts or [])]
        self.names = {host_name(bound)} if bound not in ("0.0.0.0", "::", "") else set()
        if not self.loopback:
            with_domain = socket.gethostname().lower()
            self.names |= {with_domain, with_domain.split(".")[0], with_domain.split(".")[0] + ".local"}
        self.origins = [_pattern(o) for o in (origins if origins is not None else list(DEFAULT_ORIGINS))]

    def host_ok(self, host: str | None) -> bool:
        if host is None or "*" in self.hosts:    # ('*' stays '*' through _pattern)
            return True
        name = host_name(host)
        if name == "localhost" or name.endswith(".localhost") or is_loopback(name):
            return True
        if name in self.names or any(fnmatch.fnmatchcase(name, h) for h in self.hosts):
            return True
        return not self.loopback and _is_ip(name)

    def origin_ok(self, origin: str | None, host: str | None) -> bool:
        if origin is None:
            return True                  # not a browser's request for a page
        o = origin.strip().lower()
        if host is not None and o.split("://", 1)[-1] == host.strip().lower():
            return True                  # this server's own origin (its Host was checked first)
        return any(fnmatch.fnmatchcase(o, p) for p in self.origins)


def json_content_type(value: str | None) -> bool:
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _refusal(status: int, message: str, code: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]}
    return start, body


class Guard:
    """ASGI middleware: the Host and Origin checks before the app, CORS headers for allowed origins."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host, origin = headers.get("host"), headers.get("origin")
        policy = self.state.policy
        refusal = None
        if not policy.host_ok(host):
            refusal = (403, f"Host {host!r} is not this server's (a DNS rebinding page?); allow it with "
                            "--allowed-hosts or PROVE_LOCAL_ALLOWED_HOSTS", "host_not_allowed")
        elif not policy.origin_ok(origin, host):
            refusal = (403, f"requests from the web page origin {origin!r} are refused; allow it with "
                            "--allowed-origins or PROVE_LOCAL_ORIGINS", "origin_not_allowed")
        if refusal is not None:
            self.state.metrics.request("other", refusal[0])
            start, body = _refusal(*refusal)
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        if origin is None:
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await send({"type": "http.response.start", "status": 204, "headers": [
                (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"Authorization, Content-Type"),
                (b"access-control-max-age", b"600")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + [
                    (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]}
            await send(message)
        return await self.app(scope, receive, send_cors)


MAX_HEAD = 16 * 1024            # bytes of a request line and headers (h11's incomplete-event limit)
KEEP_ALIVE = 5                  # seconds an idle keep-alive connection stays open


def h11_protocol(head_timeout: float):
    """uvicorn's h11 protocol with a deadline for each request's head: uvicorn times out idle
    keep-alive connections only, so a client that sends half a request line and then nothing held
    its connection for good (300 such connections stayed open). A connection whose request head is
    not complete `head_timeout` seconds after it opened (or after the previous answer) is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11(H11Protocol):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            if head_timeout and self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout, self._head_expired)

        def _head_expired(self):
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()   # nothing was answered: no response to write

        def data_received(self, data):
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()              # (a new request's head after a keep-alive answer)
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return TimedH11
