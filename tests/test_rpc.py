"""llama.cpp's RPC backend: a tiny F32 model's layers on two `prove-local rpc-server` processes on
loopback ports. Every server is started by a test and stopped by the test, by its PID.

What crosses a process boundary here is what would cross the network between two machines; the
exact modes over RPC must equal `ar` run locally token for token, and each KV cache must hold only
committed tokens after every cycle. A server that dies mid-generation makes ggml abort the client
process: the test checks that it ends promptly, with one clear line and the committed text kept.
"""
import gc
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from prove_local import rpc
from prove_local.engine import Engine, Settings
from prove_local.errors import UsageError
from prove_local.llama import Context, Model
from tests.reference import greedy_ar, next_logits
from tests.tiny import tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "PROVE_NO_MEMORY_CHECK": "1"}
F32 = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")
PROMPTS = ["Hello world", "def f(x): return x * 2", "The cat sat on the mat.", "12345 + 678 = ?",
           "Natalia sold clips to 48 of her friends.", "a a a a a"]

pytestmark = pytest.mark.skipif(not rpc.supported(), reason="llama-cpp-python built without -DGGML_RPC=ON")


def closed_port() -> socket.socket:
    """A socket bound to a loopback port of the system's choosing, not listening: connecting to its
    port is refused, and no other process can take the port while the socket is open."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


class Server:
    """One `prove-local rpc-server` subprocess on a loopback port: port 0 (the server names the
    port it got on its `serving ... on HOST:PORT` line), or a given port (a restart on the same one)."""

    def __init__(self, tmp: Path, port: int = 0, extra: tuple = ()):
        self.tmp, self.port, self.extra = tmp, port, extra
        self.endpoint = None
        self.log = None
        self.proc = None

    def start(self) -> "Server":
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix="rpc-server-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prove_local.cli", "rpc-server", "--port", str(self.port), "--threads", "1",
                 *self.extra], cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:                     # the line is printed once ggml's server listens
            found = re.search(r"serving .* on (127\.0\.0\.1:(\d+)) ", self.log.read_text())
            if found:
                break
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"rpc-server did not start:\n{self.log.read_text()}"
            time.sleep(0.05)
        self.endpoint, self.port = found.group(1), int(found.group(2))
        assert rpc.alive(self.endpoint, timeout=5), self.log.read_text()
        return self

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("rpc-models")
    return {"prop": tiny_gguf(d, seed=0, layers=4),
            "draft": tiny_gguf(d, seed=2, hidden=32, mask=False, role="verifier")}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rpc-servers")
    started = []
    try:
        for _ in range(2):
            started.append(Server(tmp).start())
        yield started
    finally:
        for s in started:
            s.kill(signal.SIGTERM)
            assert s.proc.returncode == 0, s.log.read_text()     # SIGTERM ends the server cleanly


@pytest.fixture(scope="module")
def models(paths, servers):
    """The proposer twice: local, and split 1:1 across the two servers (nothing local but the
    token embeddings); the draft stays local. Freed before the servers stop."""
    local = Model(paths["prop"])
    devices = rpc.add_servers([s.endpoint for s in servers])
    remote = Model(paths["prop"], n_gpu_layers=-1, devices=devices, tensor_split=[1, 1])
    draft = Model(paths["draft"])
    made = {"local": local, "remote": remote, "draft": draft, "contexts": []}
    yield made
    for c in made["contexts"]:
        c.close()
    for m in (remote, local, draft):
        m.close()
    gc.collect()        # nothing may free remote buffers after the servers are gone (ggml would abort)


def engine(models, which, **kw):
    e = Engine.load(models[which], draft=models["draft"], **F32, **kw)
    models["contexts"] += e.contexts.values()
    return e


def generate(e, prompt, **kw):
    return [t for c in e.generate(prompt, Settings(**kw)) for t in c.committed]


# ----------------------------------------------------------------------------- errors, one line
def test_endpoint_syntax():
    assert rpc.parse_endpoints("10.0.0.2:50052, host:1") == ["10.0.0.2:50052", "host:1"]
    for bad in ["10.0.0.2", "host:", ":50052", "host:99999", "host:x", "a:1,a:1", "[::1]:50052", "::1:50052"]:
        with pytest.raises(UsageError, match="--rpc"):
            rpc.parse_endpoints(bad)


def test_unreachable_endpoint_is_one_line_and_fast():
    with closed_port() as s:
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(rpc.RpcUnreachable, match=f"127.0.0.1:{port}: cannot connect"):
            rpc.probe(f"127.0.0.1:{port}")
        assert time.monotonic() - t0 < rpc.CONNECT_TIMEOUT + 5


def _fake_server(answer):
    """A socket server on a free loopback port that answers one connection with `answer(conn)`."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10)
            answer(conn)
        srv.close()
    threading.Thread(target=run, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}"


def _hello_reply(version):
    def answer(conn):
        conn.recv(1 + 8 + rpc.RPC_CONN_CAPS_SIZE)
        conn.sendall((4 + rpc.RPC_CONN_CAPS_SIZE).to_bytes(8, "little") + bytes(version) + bytes(1 + rpc.RPC_CONN_CAPS_SIZE))
    return answer


def test_version_mismatch():
    with pytest.raises(rpc.RpcVersionMismatch, match=r"speaks RPC protocol 6\.0\.0, this client 7\.0\.0"):
        rpc.probe(_fake_server(_hello_reply((6, 0, 0))))
    with pytest.raises(rpc.RpcVersionMismatch, match=r"speaks RPC protocol 7\.9\.0"):
        rpc.probe(_fake_server(_hello_reply((7, 9, 0))))       # newer minor: ggml refuses it too
    assert rpc.probe(_fake_server(_hello_reply((7, 0, 3)))) == (7, 0, 3)
    with pytest.raises(rpc.RpcVersionMismatch, match="closed the connection at the handshake"):
        rpc.probe(_fake_server(lambda conn: None))              # not an RPC server (or an old one)


def test_silent_server_times_out():
    done = threading.Event()
    endpoint = _fake_server(lambda conn: done.wait(10))
    with pytest.raises(rpc.RpcUnreachable, match="no RPC handshake answer within 0.5 s"):
        rpc.probe(endpoint, timeout=0.5)
    done.set()


def test_cli_errors_are_one_line(tmp_path, paths):
    with closed_port() as s:
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "prove_local.cli", "run", str(paths["prop"]), "--rpc",
                              f"127.0.0.1:{port}", "-p", "hi", "-n", "4"], cwd=ROOT, env=ENV, capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0, out.stderr
    assert f"127.0.0.1:{port}: cannot connect" in out.stderr
    with socket.socket() as blocker:          # rpc-server on a port that is taken
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        out = subprocess.run([sys.executable, "-m", "prove_local.cli", "rpc-server", "--port",
                              str(blocker.getsockname()[1])], cwd=ROOT, env=ENV, capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1 and "cannot listen on 127.0.0.1" in out.stderr and "Traceback" not in out.stderr


def test_build_without_rpc_says_how_to_reinstall(monkeypatch):
    import llama_cpp
    monkeypatch.setattr(rpc, "_lib", None)
    monkeypatch.setattr(llama_cpp, "llama_supports_rpc", lambda: False)
    with pytest.raises(rpc.RpcUnavailable, match=r"built without the RPC backend.*-DGGML_RPC=ON.*--no-cache-dir --force-reinstall"):
        rpc.add_servers(["127.0.0.1:1"])
    assert not rpc.supported()


def test_warning_beyond_loopback():
    assert rpc.is_loopback("127.0.0.1") and rpc.is_loopback("localhost") and rpc.is_loopback("::1")
    assert not rpc.is_loopback("0.0.0.0") and not rpc.is_loopback("192.168.1.20")
    # the CLI warns before it binds; a port taken on 0.0.0.0 keeps the test from serving anything
    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen(1)
        out = subprocess.run([sys.executable, "-m", "prove_local.cli", "rpc-server", "--host", "0.0.0.0", "--port",
                              str(blocker.getsockname()[1])], cwd=ROOT, env=ENV, capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1 and "cannot listen on 0.0.0.0" in out.stderr
    assert "WARNING" in out.stderr and "no authentication and no encryption" in out.stderr
    out = subprocess.run([sys.executable, "-m", "prove_local.cli", "rpc-server", "--port", "70000"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--port 70000 is not a TCP port" in out.stderr


# ----------------------------------------------------------------------------- exactness over RPC
def test_layers_are_on_both_servers(models, servers):
    placement = models["remote"].placement
    for s in servers:
        assert any(s.endpoint in name and mib > 0 for name, mib in placement.items()), placement
    # the servers report their memory through ggml_backend_rpc_get_device_memory
    free, total = rpc.add_servers([servers[0].endpoint])[0].memory()
    assert 0 < free <= total


@pytest.mark.parametrize("mode,extra", [("ar", {}), ("lossless", {}), ("lossless", {"block": 5}),
                                        ("spec", {"draft_k": 3})])
def test_exact_modes_over_rpc_equal_local_ar(models, mode, extra):
    """Every exact mode over RPC equals greedy decoding by hand on a local context (tests/reference.py)."""
    remote = engine(models, "remote")
    prop = models["local"]
    for p in PROMPTS:
        want = greedy_ar(prop, prop.tokenize(p), 48, **F32)
        got = generate(remote, prop.tokenize(p), mode=mode, max_new=48, **extra)
        assert got == want, (mode, p)


@pytest.mark.parametrize("mode", ["lossless", "spec"])
def test_kv_cache_holds_only_committed_tokens_over_rpc(models, mode):
    e = engine(models, "remote")
    prompt = models["local"].tokenize("Natalia sold clips to 48 of her friends.")
    checked = 0
    for _ in e.generate(prompt, Settings(mode=mode, max_new=40, block=6, draft_k=3)):
        for role, ctx in e.contexts.items():
            if ctx.n_past == 0:
                continue
            got = next_logits(ctx, e.tokens)
            fresh = Context(models["local"] if role == "target" else ctx.model, **F32)   # local, from scratch
            want = fresh.eval(e.tokens)[0]
            fresh.close()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"{mode}/{role}")
            checked += 1
    assert checked >= 5


# ----------------------------------------------------------------------------- a server that goes away
HARNESS = r"""
import json, sys
from prove_local import rpc
from prove_local.engine import Engine, Settings
from prove_local.errors import ProveError
from prove_local.llama import Model
path, endpoints, pause = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
m = Model(path, n_gpu_layers=-1, devices=rpc.add_servers(endpoints), tensor_split=[1, 1])
e = Engine.load(m, n_ctx=512, n_threads=1, type_k="f32", type_v="f32")
prompt = m.tokenize("Hello world")
try:
    for i, c in enumerate(e.generate(prompt, Settings(mode="lossless", max_new=48, block=4))):
        print(json.dumps(c.committed), flush=True)
        if i + 1 == pause:
            print("PAUSED", flush=True)
            sys.stdin.readline()          # the test stops or kills a server now
except ProveError as err:
    print("ERROR", err, flush=True)
    try:                                  # the next request on this engine says why, too
        list(e.generate(prompt, Settings(mode="ar", max_new=4)))
    except ProveError as err2:
        print("ERROR", err2, flush=True)
    sys.exit(1)
print("DONE", flush=True)
"""


class Lines:
    """A subprocess's stdout, line by line, with a timeout per line (a reader thread; no hang)."""

    def __init__(self, proc):
        self.queue = queue.Queue()
        threading.Thread(target=lambda: [self.queue.put(x) for x in iter(proc.stdout.readline, "")] + [self.queue.put("")],
                         daemon=True).start()

    def next(self, timeout=60) -> str:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout} s") from None

    def rest(self) -> str:
        out = []
        while (x := self.next()) != "":
            out.append(x)
        return "".join(out)


def harness(path, endpoints, pause=0):
    return subprocess.Popen([sys.executable, "-c", HARNESS, str(path), ",".join(endpoints), str(pause)], cwd=ROOT,
                            env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def until_paused(p) -> tuple[list[list[int]], Lines]:
    lines, reader = [], Lines(p)
    while (line := reader.next()) and line.strip() != "PAUSED":
        lines.append(json.loads(line))
    return lines, reader


def resume(p) -> None:
    p.stdin.write("go\n")
    p.stdin.flush()
    p.stdin.close()


def recv_queue(port: int) -> int:
    """Bytes waiting unread in the receive queue of the server side of a connection to `port`
    (/proc/net/tcp: a stopped server does not read what the client sends)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "01":          # local port, ESTABLISHED
            total += int(f[4].split(":")[1], 16)
    return total


def test_server_killed_mid_generation_then_restarted(tmp_path, paths, models):
    """Killed between two cycles: the pass that would use it stops with one line before ggml writes
    to the dead connection; the committed tokens are right; the next request on the same engine
    says why; the process ends normally. Restarted: a new client gets the same tokens."""
    own = [Server(tmp_path).start(), Server(tmp_path).start()]
    procs = []
    try:
        want = greedy_ar(models["local"], models["local"].tokenize("Hello world"), 48, **F32)

        p = harness(paths["prop"], [s.endpoint for s in own], pause=3)
        procs.append(p)
        lines, reader = until_paused(p)
        assert len(lines) == 3
        own[1].kill()                                  # mid-generation: between cycle 3 and 4
        resume(p)
        p.wait(timeout=60)                             # no hang
        out, err = reader.rest(), p.stderr.read()
        assert p.returncode == 1, err
        errors = [x for x in out.splitlines() if x.startswith("ERROR")]
        assert len(errors) == 2 and all(f"lost the RPC server {own[1].endpoint} (it closed the connection)" in x
                                        for x in errors), out + err
        assert "DONE" not in out and "Traceback" not in err and "abort" not in err.lower()
        committed = [t for c in lines for t in c]
        assert committed == want[:len(committed)]      # what was committed before the loss is right

        own[1] = Server(tmp_path, own[1].port).start()  # restart it on the same port: a new client works
        p = harness(paths["prop"], [s.endpoint for s in own])
        procs.append(p)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        got = [t for line in out.splitlines() if line.startswith("[") for t in json.loads(line)]
        assert got == want
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for s in own:
            s.kill(signal.SIGTERM)


def _stop(p, own) -> None:
    """Clean-up of a test with a client process `p` (killed if still running) and servers of its own."""
    if p is not None and p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
    for s in own:
        s.kill(signal.SIGTERM)


def test_server_killed_during_a_pass_ends_the_process_with_one_line(tmp_path, paths):
    """A server that dies while a pass waits for it: ggml aborts in its network thread, which no
    Python code survives; the abort guard turns it into one line naming the server, exit status 3,
    promptly. (The server is stopped first, so that the pass is surely waiting on it.)"""
    own = [Server(tmp_path).start(), Server(tmp_path).start()]
    p = None
    try:
        p = harness(paths["prop"], [s.endpoint for s in own], pause=2)
        lines, reader = until_paused(p)
        os.kill(own[1].proc.pid, signal.SIGSTOP)      # alive, but it reads nothing any more
        resume(p)
        deadline = time.monotonic() + 30
        while recv_queue(own[1].port) == 0:           # the next pass has sent it work: it waits on it
            assert time.monotonic() < deadline, "the pass never reached the stopped server"
            time.sleep(0.05)
        own[1].kill()                                  # SIGKILL works on a stopped process
        p.wait(timeout=60)
        out, err = reader.rest(), p.stderr.read()
        assert p.returncode == rpc.LOST_EXIT, err
        last = [x for x in err.splitlines() if x.strip()][-1]
        # the guard names the lost server when its socket already reads as closed at abort time, else
        # every server it guards (a race between ggml's abort and the kernel closing the socket)
        assert last.startswith("prove-local: error: ") and own[1].endpoint in last and len(err.splitlines()) <= 3, err
        assert "DONE" not in out and len(lines) == 2
    finally:
        _stop(p, own)


UI_SCRIPT = r"""
import argparse, sys
from prove_local.engine import Settings
from prove_local.loading import add_model_args, load_models
from prove_local.ui.runtime import Runtime, Session, UIError, run_turn
p = argparse.ArgumentParser()
add_model_args(p)
rt = Runtime(load_models(p.parse_args(sys.argv[1:] + ["--threads", "1", "--ctx", "512"])), parallel=1)
sess = Session()
turns = list(run_turn(rt, sess, "Hello", Settings(mode="lossless", max_new=16)))
print("TURN", len(turns[-1].view.tokens), flush=True)
sys.stdin.readline()                      # the test kills a server now
for _ in range(2):
    try:
        list(run_turn(rt, sess, "Again", Settings(mode="lossless", max_new=16)))
        print("NO ERROR", flush=True)
    except UIError as e:
        print("UIERROR", e, flush=True)
print("ALIVE", flush=True)
"""


def test_ui_runtime_survives_a_lost_server(tmp_path, paths):
    """The chat UI's runtime: after a server is lost, each request shows the one-line reason and the
    process keeps serving."""
    own = [Server(tmp_path).start(), Server(tmp_path).start()]
    p = None
    try:
        p = subprocess.Popen([sys.executable, "-c", UI_SCRIPT, str(paths["prop"]), "--rpc",
                              ",".join(s.endpoint for s in own)], cwd=ROOT, env=ENV, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = Lines(p)
        assert reader.next() == "TURN 16\n"
        own[0].kill()
        resume(p)
        p.wait(timeout=60)
        out, err = reader.rest(), p.stderr.read()
        assert p.returncode == 0, err
        lines = out.splitlines()
        assert lines[-1] == "ALIVE" and len(lines) == 3, out
        assert all(x.startswith(f"UIERROR llama.cpp error: lost the RPC server {own[0].endpoint}") for x in lines[:2]), out
    finally:
        _stop(p, own)


def test_cli_run_over_rpc_equals_local(tmp_path, paths):
    """`prove-local run --rpc` end to end, on servers of its own (a llama.cpp RPC server serves one
    client at a time, and this test process is connected to the module's servers)."""
    own = []

    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "prove_local.cli", "run", str(paths["prop"]), "--raw", "--json",
                              "-p", "The quick brown fox", "-n", "32", "--threads", "1", *extra], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        if "--rpc" in extra:     # the weights really went to both servers
            assert all(f"RPC0[{s.endpoint}]" in out.stderr for s in own), out.stderr
        return json.loads(out.stdout)["token_ids"]
    try:
        own += [Server(tmp_path).start(), Server(tmp_path).start()]
        want = run("--mode", "ar")
        eps = ",".join(s.endpoint for s in own)
        assert run("--mode", "lossless", "--rpc", eps, "--tensor-split", "3,1") == want
        assert run("--mode", "ar", "--rpc", eps, "--n-gpu-layers", "2") == want    # 3 of 4 layers stay local
    finally:
        for s in own:
            s.kill(signal.SIGTERM)


# ----------------------------------------------------------------------------- memory across machines
def test_memory_check_counts_remote_memory(paths):
    from prove_local.memory import Offload, WontFit, check_fits
    prop = paths["prop"]
    whole = check_fits([prop, prop], 512, "f32", 0, gpu=False, ram_free=1 << 40).cpu     # two contexts, all local
    big = 1 << 40
    # what stays local with every layer on the servers: embeddings and a host copy of the logits
    local_part = lambda ram: check_fits([], 512, "f32", 0, gpu=False, ram_free=ram,
                                        offload=Offload(prop, 2, -1, [("A", big), ("B", big)]))
    with pytest.raises(WontFit, match="RAM"):
        check_fits([prop, prop], 512, "f32", 0, gpu=False, ram_free=int(whole * 0.6))
    local_part(int(whole * 0.6))                      # the same model fits across machines
    with pytest.raises(WontFit, match="for the --rpc model's local part"):
        local_part(1)
    # a server without room for its share is named, with the options that move layers
    with pytest.raises(WontFit, match=r"its share on B \(50% of the offloaded layers\).*--tensor-split \(order: A, B\)"):
        check_fits([], 512, "f32", 0, gpu=False, ram_free=big,
                   offload=Offload(prop, 1, -1, [("A", big), ("B", 1024)], split=[1, 1]))
    check_fits([], 512, "f32", 0, gpu=False, ram_free=big,                               # all of it on A
               offload=Offload(prop, 1, -1, [("A", big), ("B", 1024)], split=[1, 0]))
    # default split: proportional to free memory, as llama.cpp does
    assert Offload(prop, 1, -1, [("A", 3 * 2**30), ("B", 2**30)]).shares() == [0.75, 0.25]
    # a local GPU in the device list: what the local models put there is not free for the split model
    on_gpu = check_fits([prop], 512, "f32", -1, gpu=True, gpu_free=big, ram_free=big).gpu
    devs = [("A", big), ("CUDA0", int(on_gpu))]
    check_fits([prop], 512, "f32", -1, gpu=True, gpu_free=big, ram_free=big,
               offload=Offload(prop, 1, -1, devs, [1, 1], [False, False]))
    with pytest.raises(WontFit, match="its share on CUDA0"):
        check_fits([prop], 512, "f32", -1, gpu=True, gpu_free=big, ram_free=big,
                   offload=Offload(prop, 1, -1, devs, [1, 1], [False, True]))


# ----------------------------------------------------------------------------- the front ends' loader
def test_load_models_puts_only_the_proposer_on_the_servers(paths, servers, models):
    """The loader `run` and `ui` share: with --rpc the proposer's weights are on the servers, the
    verifier's and draft's stay local; parallel contexts share the one remote model."""
    import argparse
    from prove_local.loading import add_model_args, load_models

    p = argparse.ArgumentParser()
    add_model_args(p)
    eps = ",".join(s.endpoint for s in servers)
    args = p.parse_args([str(paths["prop"]), "--draft", str(paths["draft"]), "--rpc", eps, "--threads", "1",
                         "--ctx", "512"])
    loaded = load_models(args, parallel=2, draft_required=True)
    try:
        assert all(any(s.endpoint in k for k in loaded.target.placement) for s in servers)
        assert not any("RPC" in k for k in loaded.draft.placement)
        e = loaded.engine()
        models["contexts"] += e.contexts.values()
        want = greedy_ar(models["local"], models["local"].tokenize("Hello world"), 24, **F32)
        assert generate(e, models["local"].tokenize("Hello world"), mode="spec", max_new=24, draft_k=3) == want
        with pytest.raises(UsageError, match="--tensor-split has 3 shares for 2 devices"):
            load_models(p.parse_args([str(paths["prop"]), "--rpc", eps, "--tensor-split", "1,1,1"]))
        with pytest.raises(UsageError, match="--n-gpu-layers 0 would put nothing on the servers"):
            load_models(p.parse_args([str(paths["prop"]), "--rpc", eps, "--n-gpu-layers", "0"]))
        with pytest.raises(UsageError, match="--tensor-split '1,x': expected numbers"):
            load_models(p.parse_args([str(paths["prop"]), "--rpc", eps, "--tensor-split", "1,x"]))
    finally:
        for c in models["contexts"]:
            c.close()
        models["contexts"].clear()
        loaded.target.close()
        loaded.draft.close()


def test_bench_over_rpc(tmp_path, paths):
    """`prove-local bench --rpc`: the exact modes over RPC reproduce ar (servers of its own)."""
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "x\n#### 3"}) + "\n"
                            for q in ("What is 1 + 2?", "Natalia sold 48 clips.")))
    own = []
    try:
        own += [Server(tmp_path).start(), Server(tmp_path).start()]
        out = subprocess.run([sys.executable, "-m", "prove_local.cli", "bench", "--proposer", str(paths["prop"]),
                              "--draft", str(paths["draft"]), "--modes", "ar,lossless,spec", "--data", str(data),
                              "--max-new", "16", "--threads", "1", "--ctx", "512", "--kv-type", "f32", "--warmup", "0",
                              "--no-pass-cost", "--no-plots", "-q", "--out", str(tmp_path / "out"),
                              "--rpc", ",".join(s.endpoint for s in own)],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        res = json.loads((tmp_path / "out" / "results.json").read_text())
        assert res["modes"]["lossless"]["exact_match_vs_ar"] == 1.0 and res["modes"]["spec"]["exact_match_vs_ar"] == 1.0
        note = [x for x in out.stderr.splitlines() if x.startswith("note:")]
        assert note and all(f"RPC0[{s.endpoint}]" in note[0] for s in own), out.stderr
    finally:
        for s in own:
            s.kill(signal.SIGTERM)


def test_server_cache_keeps_large_tensors(tmp_path):
    """`rpc-server --cache DIR`: tensors over 10 MiB (ggml-rpc's HASH_THRESHOLD) are stored by hash,
    and a second load of the same file finds them there; the output is unchanged."""
    path = tiny_gguf(tmp_path, seed=3, vocab_rows=48_000)      # tied 64 x 48000 F32 head: 12.3 MB
    cache = tmp_path / "cache"
    server = Server(tmp_path, extra=("--cache", str(cache)))
    outs = []
    try:
        server.start()
        for _ in range(2):
            m = Model(path, n_gpu_layers=-1, devices=rpc.add_servers([server.endpoint]))
            try:
                e = Engine.load(m, **F32)
                outs.append(generate(e, m.tokenize("Hello world"), mode="ar", max_new=16))
                # after a pass (the server handles commands in order, so the upload is done)
                files = sorted(cache.iterdir())
                assert len(files) == 1 and files[0].stat().st_size == 64 * 48_000 * 4
                for c in e.contexts.values():
                    c.close()
            finally:
                m.close()
        assert outs[0] == outs[1]
    finally:
        server.kill(signal.SIGTERM)


def test_cli_chat_server_killed_between_answers(tmp_path, paths):
    """`prove-local run --rpc` as a chat: the first answer comes, a server dies, the next answer
    stops with one line naming the server and exit status 1 (no hang, no abort)."""
    own = [Server(tmp_path).start(), Server(tmp_path).start()]
    p = None
    try:
        p = subprocess.Popen([sys.executable, "-m", "prove_local.cli", "run", str(paths["prop"]), "--raw", "--json",
                              "-n", "16", "--threads", "1", "--mode", "lossless",
                              "--rpc", ",".join(s.endpoint for s in own)], cwd=ROOT, env=ENV, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.stdin.write("Hello world\n")
        p.stdin.flush()
        reader = Lines(p)
        first = json.loads(reader.next().lstrip("> "))      # input() writes its "> " prompt to stdout
        assert len(first["token_ids"]) == 16
        own[0].kill()
        p.stdin.write("The cat sat\n")
        p.stdin.flush()
        p.stdin.close()
        p.wait(timeout=60)
        err = p.stderr.read()
        assert p.returncode == 1, err
        assert err.strip().splitlines()[-1].startswith(
            f"prove-local: error: lost the RPC server {own[0].endpoint} (it closed the connection)"), err
    finally:
        _stop(p, own)
