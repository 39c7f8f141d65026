"""llama.cpp's RPC backend (ggml-rpc): models whose layers live on other machines.

Both sides go through the ggml libraries that llama-cpp-python installed (built with -DGGML_RPC=ON),
via ctypes on the functions of the vendored `ggml/include/ggml-rpc.h`:

- `prove-local rpc-server` calls `ggml_backend_rpc_start_server(endpoint, cache_dir, n_threads,
  n_devices, devices)`: the same server loop as llama.cpp's `rpc-server` tool, without building that
  tool (llama-cpp-python does not build llama.cpp's tools, and a second build of the vendored tree
  would take another 10 minutes and could drift from the library the client uses; one library on
  both sides keeps the protocol version equal by construction).
- the client registers each `HOST:PORT` with `ggml_backend_rpc_add_server(endpoint)` and passes the
  returned devices to `llama_model_params.devices`; llama.cpp then places layers on them like on GPUs
  (`n_gpu_layers`, `tensor_split`), and `llama_memory_seq_rm` rollback is unchanged (the KV cells of
  a remote layer live on its server).

ggml's RPC client ends the process with `abort()` when a server is unreachable, answers with another
protocol version, or goes away later (`GGML_ABORT` in ggml-rpc.cpp). So before ggml sees an
endpoint, `probe` connects with a short timeout and does the protocol's HELLO itself; before every
pass, `check` looks whether a server closed ggml's connection (then: RpcServerLost, one line, the
process lives on); and for a server lost during a pass, which cannot be caught,
`install_abort_guard` turns the abort into one line on stderr (naming the endpoint that went away)
and exit status 3, after flushing the text already streamed. The RPC protocol has no
authentication and no encryption.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from .errors import LlamaError, UsageError
from .hosts import is_loopback  # noqa: F401  (also this module's API)

PROTOCOL = (7, 0, 0)            # RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of the vendored ggml-rpc.h
DEFAULT_PORT = 50052            # llama.cpp's rpc-server default
CONNECT_TIMEOUT = 3.0           # seconds for the TCP connect and the HELLO answer
RPC_CMD_HELLO = 14              # static_assert(RPC_CMD_HELLO == 14) in ggml-rpc.cpp
RPC_CONN_CAPS_SIZE = 24         # transport.h: the HELLO request/answer carries connection capabilities
LOST_EXIT = 3                   # exit status when a server goes away and ggml aborts
INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_RPC=ON" pip install --no-cache-dir --force-reinstall '
           'llama-cpp-python==0.3.36')
# llama.cpp's rpc-server prints this when it listens beyond loopback (tools/rpc/rpc-server.cpp)
WARNING = ("WARNING: the RPC server listens on {host}, not on loopback.\n"
           "         The RPC protocol has no authentication and no encryption: anyone who can reach\n"
           "         this port can read and write this machine's backend memory.\n"
           "         Never expose it to an open network; use it only on a trusted network.")
GGML_DEV_CPU, GGML_DEV_GPU, GGML_DEV_IGPU = 0, 1, 2   # enum ggml_backend_dev_type


class RpcError(LlamaError):
    """An RPC endpoint or the RPC library cannot be used."""


class RpcUnavailable(RpcError):
    """llama-cpp-python was built without -DGGML_RPC=ON."""


class RpcUnreachable(RpcError):
    """Nothing answers at an endpoint (or it does not speak the RPC protocol)."""


class RpcVersionMismatch(RpcError):
    """The server speaks another version of the RPC protocol."""


class RpcServerLost(RpcError):
    """A server closed its connection (it stopped or crashed) after the model was loaded."""


# ----------------------------------------------------------------------------------- library
_lib = None


def library() -> ctypes.CDLL:
    """libggml (which links ggml-rpc in llama-cpp-python's build), with the RPC signatures declared.
    Raises RpcUnavailable with the reinstall command when the build has no RPC backend."""
    global _lib
    if _lib is not None:
        return _lib
    import llama_cpp as ll

    lib_dir = Path(ll.__file__).parent / "lib"
    if not ll.llama_supports_rpc() or not (lib_dir / "libggml-rpc.so").exists():
        raise RpcUnavailable("this llama-cpp-python was built without the RPC backend (pip's wheel cache may "
                             f"have served an older build); reinstall it: {INSTALL}")
    # By soname, so that these are the copies libllama already loaded: the wheel holds libggml.so and
    # libggml.so.0 as two files, and a second copy would have its own registry and abort callback.
    lib = ctypes.CDLL("libggml.so.0")
    base = ctypes.CDLL("libggml-base.so.0")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, res, args in [
        ("ggml_backend_rpc_start_server", None, [ctypes.c_char_p, ctypes.c_char_p, sz, sz, ctypes.POINTER(vp)]),
        ("ggml_backend_rpc_add_server", vp, [ctypes.c_char_p]),
        ("ggml_backend_rpc_get_device_memory", None, [ctypes.c_char_p, ctypes.c_uint32,
                                                      ctypes.POINTER(sz), ctypes.POINTER(sz)]),
        ("ggml_backend_dev_count", sz, []),
        ("ggml_backend_dev_get", vp, [sz]),
    ]:
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    for name, res, args in [
        ("ggml_backend_reg_dev_count", sz, [vp]),
        ("ggml_backend_reg_dev_get", vp, [vp, sz]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_type", ctypes.c_int, [vp]),
        ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
        ("ggml_set_abort_callback", vp, [vp]),
    ]:
        f = getattr(base, name)
        f.restype, f.argtypes = res, args
    lib.base = base
    _lib = lib
    return lib


def supported() -> bool:
    try:
        library()
        return True
    except RpcUnavailable:
        return False


# ----------------------------------------------------------------------------------- endpoints
def parse_endpoints(text: str, option: str = "--rpc") -> list[str]:
    """'HOST:PORT[,HOST:PORT...]' -> ['HOST:PORT', ...]; UsageError naming the bad item."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{option}: {item!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
        if ":" in host or "[" in host:
            # ggml-rpc's parse_endpoint splits at the first ':' and would abort the process
            raise UsageError(f"{option}: {item!r}: llama.cpp's RPC backend takes IPv4 addresses or host names, not IPv6")
        if item in out:
            raise UsageError(f"{option}: {item} is given twice")
        out.append(item)
    return out


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def probe(endpoint: str, timeout: float = CONNECT_TIMEOUT) -> tuple[int, int, int]:
    """Connect and do the protocol's HELLO ourselves; returns the server's (major, minor, patch).
    Raises RpcUnreachable / RpcVersionMismatch with one line. (ggml would abort the process.)"""
    host, port = _split(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise RpcUnreachable(f"--rpc {endpoint}: no answer within {timeout:g} s (host down or port filtered?)") from None
    except OSError as e:
        raise RpcUnreachable(f"--rpc {endpoint}: cannot connect ({e.strerror or e}); is "
                             f"`prove-local rpc-server --port {port}` running there?") from None
    with sock:
        try:
            # request: | cmd (1 byte) | size (8 bytes) | conn_caps (24 bytes, zero: plain TCP) |
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
            # answer: | size (8 bytes) | major, minor, patch, padding | conn_caps (24 bytes) |
            head = _recv(sock, 8)
            size = struct.unpack("<Q", head)[0] if head is not None else None
            body = _recv(sock, min(size, 64)) if size else None
        except (ConnectionResetError, BrokenPipeError):
            body = None         # closed on us: treated like a close without an answer, below
        except socket.timeout:
            raise RpcUnreachable(f"--rpc {endpoint}: connected, but no RPC handshake answer within {timeout:g} s "
                                 "(is it serving another client? a llama.cpp RPC server serves one at a time)") from None
        except OSError as e:
            raise RpcUnreachable(f"--rpc {endpoint}: connection dropped during the handshake ({e.strerror or e})") from None
    if not body or len(body) < 3:
        raise RpcVersionMismatch(
            f"--rpc {endpoint}: the server closed the connection at the handshake: it is not an RPC "
            f"server, or speaks an older protocol than {'.'.join(map(str, PROTOCOL))} (run the same "
            "llama-cpp-python version on both machines)")
    version = tuple(body[:3])
    if version[0] != PROTOCOL[0] or version[1] > PROTOCOL[1]:   # the rule of negotiate_hello in ggml-rpc.cpp
        raise RpcVersionMismatch(
            f"--rpc {endpoint}: the server speaks RPC protocol {'.'.join(map(str, version))}, this client "
            f"{'.'.join(map(str, PROTOCOL))}; install the same llama-cpp-python version on both machines")
    return version


def _recv(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def alive(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at the endpoint (a listening server does, even
    while it serves another client: the connection waits in its backlog)."""
    try:
        with socket.create_connection(_split(endpoint), timeout=timeout):
            return True
    except OSError:
        return False


class Device:
    """One ggml backend device (a remote one from an RPC server, or a local GPU)."""

    def __init__(self, ptr: int, endpoint: str | None = None, index: int = 0):
        lib = library()
        self.ptr, self.endpoint, self.index = ptr, endpoint, index
        self.name = lib.base.ggml_backend_dev_name(ptr).decode()
        self.description = lib.base.ggml_backend_dev_description(ptr).decode()

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes, asked of the server for a remote device."""
        lib = library()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        if self.endpoint is not None:
            lib.ggml_backend_rpc_get_device_memory(self.endpoint.encode(), self.index, ctypes.byref(free),
                                                   ctypes.byref(total))
        else:
            lib.base.ggml_backend_dev_memory(self.ptr, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    @property
    def label(self) -> str:
        return f"{self.endpoint} ({self.name})" if self.endpoint else self.name

    def __repr__(self):
        return f"Device({self.label})"


_servers: dict[str, list[Device]] = {}


def add_servers(endpoints: list[str]) -> list[Device]:
    """Check every endpoint (connect + HELLO, one-line errors), then register it with ggml; the
    remote devices in order. Installs the abort guard. Registering twice returns the same devices."""
    library()
    for e in endpoints:
        if e not in _servers:
            probe(e)
    # the guard goes in before ggml's first call: a server that answers our HELLO and then closes
    # (or answers ggml's next command with garbage) makes ggml abort inside registration already
    install_abort_guard(list(dict.fromkeys([*_servers, *endpoints])))
    devices = []
    for e in endpoints:
        if e not in _servers:
            reg = library().ggml_backend_rpc_add_server(e.encode())
            if not reg:
                raise RpcError(f"--rpc {e}: the server offers no device")
            n = library().base.ggml_backend_reg_dev_count(reg)
            _servers[e] = [Device(library().base.ggml_backend_reg_dev_get(reg, i), e, i) for i in range(n)]
        devices += _servers[e]
    install_abort_guard(list(_servers))
    return devices


def local_gpus() -> list[Device]:
    """This machine's GPU devices (llama.cpp offloads to them next to the RPC ones)."""
    lib = library()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        ptr = lib.ggml_backend_dev_get(i)
        if lib.base.ggml_backend_dev_type(ptr) in (GGML_DEV_GPU, GGML_DEV_IGPU) and \
                not lib.base.ggml_backend_dev_name(ptr).startswith(b"RPC"):
            out.append(Device(ptr))
    return out


# ----------------------------------------------------------------------------------- lost servers
# Two ways to notice that a server went away. Between passes (the common case: a server stopped
# while the program waits for the next request, or between two cycles): its end of ggml's TCP
# connection is closed, which a non-blocking MSG_PEEK on that socket shows without sending anything
# (the server never sends unsolicited data). `check` raises RpcServerLost then, before ggml writes to
# the dead socket and aborts; the process lives on and says why on every later use of that model.
# During a pass, ggml aborts in its own thread and nothing can continue: the abort guard below.
_lost: dict[str, str] = {}          # endpoint -> why
_fds: dict[str, int] = {}           # endpoint -> fd of ggml's connection to it (re-found if it changes)


_peers: dict[str, tuple[str, int]] = {}


def _peer(endpoint: str) -> tuple[str, int]:
    """(IPv4 address, port) as getpeername() reports it; resolved once (no DNS lookup per pass)."""
    if endpoint not in _peers:
        host, port = _split(endpoint)
        _peers[endpoint] = (socket.gethostbyname(host), port)
    return _peers[endpoint]


def _socket_fds() -> list[int]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.append(int(name))
        except OSError:
            continue
    return out


def _connected(fd: int, peer: tuple[str, int]) -> bool | None:
    """None: fd is not a TCP socket connected to peer; else whether the peer still has it open."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM or s.getpeername() != peer:
            return None
        try:
            return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True                 # nothing to read: open
        except OSError:
            return False                # reset
    except OSError:
        return None                     # not connected
    finally:
        s.close()                       # the duplicate only; ggml's fd stays open


def check(endpoints: list[str]) -> None:
    """Raise RpcServerLost (one line) if a server of these endpoints closed ggml's connection, now
    or earlier in this process. Cheap (a few system calls per server); Linux only (/proc)."""
    for e in endpoints:
        if e in _lost:
            raise RpcServerLost(_lost[e])
        if not os.path.isdir("/proc/self/fd"):
            return
        peer = _peer(e)
        state = _connected(_fds[e], peer) if e in _fds else None
        if state is None:
            for fd in _socket_fds():
                state = _connected(fd, peer)
                if state is not None:
                    _fds[e] = fd
                    break
        if state is False:
            _lost[e] = (f"lost the RPC server {e} (it closed the connection); the model on it cannot be used "
                        "any more: restart the server, then prove-local")
            raise RpcServerLost(_lost[e])


def lost(endpoints: list[str]) -> bool:
    """Whether any of these servers was found gone (its remote buffers must then not be freed:
    ggml would write to the dead connection and abort)."""
    return any(e in _lost for e in endpoints)


_abort_cb = None
_guarded: list[str] = []


def _on_abort(message: bytes) -> None:  # pragma: no cover - runs in ggml's dispatcher thread, then exits
    # "path/to/ggml-rpc.cpp:569: Remote RPC server crashed ..." -> the message after "file:line: "
    text = [re.sub(r"^\S+:\d+: ", "", line) for line in (message or b"").decode("utf-8", "replace").strip().splitlines()]
    gone = [e for e in _guarded if not alive(e)]
    try:
        sys.stdout.flush()
    except Exception:
        pass
    rpc_lost = bool(gone) or any("RPC" in line for line in text)
    if rpc_lost:
        what = (f"lost the RPC server{'s' if len(gone) > 1 else ''} {', '.join(gone)}" if gone
                else f"an RPC server ({', '.join(_guarded)}) broke the connection")
        line = (f"prove-local: error: {what}; llama.cpp cannot continue without it and ends the process "
                f"(ggml: {text[-1] if text else 'abort'}). Text already printed was committed; restart the "
                "server and run again.")
    else:
        line = f"prove-local: error: llama.cpp aborted: {' '.join(text) or 'no message'}"
    os.write(2, ("\n" + line + "\n").encode())
    os._exit(LOST_EXIT if rpc_lost else 134)      # 134: what a shell reports for abort()


def install_abort_guard(endpoints: list[str]) -> None:
    """Make ggml's abort() (which a lost RPC server triggers in its dispatcher thread, and which no
    Python code can catch) end the process with one clear line and exit status LOST_EXIT."""
    global _abort_cb
    _guarded[:] = endpoints
    if _abort_cb is None:
        _abort_cb = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_on_abort)
        library().base.ggml_set_abort_callback(ctypes.cast(_abort_cb, ctypes.c_void_p))


# ----------------------------------------------------------------------------------- server
def server_devices() -> list[int]:
    """What `rpc-server` serves by default: this machine's GPUs, else its CPU."""
    lib = library()
    devs = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    gpus = [d for d in devs if lib.base.ggml_backend_dev_type(d) in (GGML_DEV_GPU, GGML_DEV_IGPU)]
    cpus = [d for d in devs if lib.base.ggml_backend_dev_type(d) == GGML_DEV_CPU]
    return gpus or cpus[:1]


def serve(host: str, port: int, threads: int | None = None, cache: str | None = None) -> int:
    """Serve this machine's backend until SIGINT/SIGTERM. ggml's server loop blocks forever in C, so
    it runs in a daemon thread and the main thread waits for a signal, then ends the process."""
    lib = library()
    import llama_cpp as ll
    ll.llama_backend_init()
    if not is_loopback(host):
        print(WARNING.format(host=host), file=sys.stderr, flush=True)
    try:  # ggml's server prints nothing useful when the port is taken; find out first
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise UsageError(f"rpc-server: cannot listen on {host}:{port} ({e.strerror or e})") from None
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    devs = server_devices()
    arr = (ctypes.c_void_p * len(devs))(*devs)
    names = ", ".join(f"{lib.base.ggml_backend_dev_name(d).decode()} ({lib.base.ggml_backend_dev_description(d).decode()})"
                      for d in devs)
    endpoint = f"{host}:{port}"
    done = threading.Event()

    def run():
        lib.ggml_backend_rpc_start_server(endpoint.encode(), cache.encode() if cache else None, threads, len(devs), arr)
        done.set()

    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: stop.append(s))
    threading.Thread(target=run, daemon=True, name="ggml-rpc-server").start()
    if port == 0:                   # ggml bound a port of the system's choosing: find out which, to print it
        port = _listening_port(host, done)
        if port is None:
            print(f"prove-local: error: llama.cpp's RPC server on {endpoint} did not start listening "
                  "(see its messages above)", file=sys.stderr, flush=True)
            os._exit(1)
        endpoint = f"{host}:{port}"
    print(f"prove-local rpc-server: serving {names} on {endpoint} (RPC protocol "
          f"{'.'.join(map(str, PROTOCOL))}, {threads} threads, cache {cache or 'off'}); Ctrl-C stops it",
          file=sys.stderr, flush=True)
    while not stop and not done.wait(0.2):
        pass
    sys.stdout.flush()
    if done.is_set() and not stop:
        print(f"prove-local: error: llama.cpp's RPC server on {endpoint} stopped (see its messages above)",
              file=sys.stderr, flush=True)
        os._exit(1)
    print(f"prove-local rpc-server: stopped ({signal.Signals(stop[0]).name})", file=sys.stderr, flush=True)
    # the server thread is blocked in accept()/recv() inside C and cannot be joined: leave without it
    os._exit(0)


def _listening_port(host: str, done: threading.Event, timeout: float = 30.0) -> int | None:
    """The port of this process's listening TCP socket on `host`: ggml's server, started on port 0
    (ggml does not say which port the system gave it). None if the server ended or never listened."""
    want = socket.gethostbyname(host)
    deadline = time.monotonic() + timeout
    while not done.is_set() and time.monotonic() < deadline:
        for fd in _socket_fds():
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if (s.family == socket.AF_INET and s.type == socket.SOCK_STREAM
                        and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and s.getsockname()[0] in (want, "0.0.0.0")):
                    return s.getsockname()[1]
            except OSError:
                pass
            finally:
                s.close()               # the duplicate only; ggml's socket stays open
        time.sleep(0.01)
    return None


def add_parser(sub) -> None:
    p = sub.add_parser("rpc-server", help="serve this machine's CPU/GPU to another prove-local (--rpc)",
                       description="Serve this machine's backend (its GPUs, else its CPU) over llama.cpp's RPC "
                                   "protocol, for `prove-local run/ui/bench --rpc HOST:PORT` on another machine. "
                                   "The protocol has no authentication or encryption: loopback or a trusted "
                                   "network only.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one, named on the `serving ... on` line)")
    p.add_argument("--threads", type=int, help="CPU threads for the CPU backend (default: all cores)")
    p.add_argument("--cache", metavar="DIR",
                   help="cache large tensors here, so a client that loads the same model again sends only hashes")
    p.set_defaults(func=cmd_rpc_server)


def cmd_rpc_server(args: argparse.Namespace) -> int:
    if ":" in args.host:
        raise UsageError(f"rpc-server: --host {args.host}: llama.cpp's RPC server listens on IPv4 addresses only")
    if not 0 <= args.port < 65536:
        raise UsageError(f"rpc-server: --port {args.port} is not a TCP port (0..65535; 0: a free one)")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"rpc-server: --threads {args.threads} must be >= 1")
    return serve(args.host, args.port, args.threads, args.cache)
