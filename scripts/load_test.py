"""A bounded load test of `prove-local serve`: C concurrent clients x R requests each, on loopback.

    python scripts/load_test.py --clients 4 --requests 5 --max-tokens 64 -- --parallel 2 --threads 1
    python scripts/load_test.py --url http://127.0.0.1:8080 --pid 12345 --clients 8 --requests 10

Without --url it starts its own server (`python -m prove_local.cli serve --port 0 ARGS...`, the
embedded pair unless ARGS name a model), waits for it, runs the load and stops it; with --url it
uses a running server on this machine (loopback addresses only) and reads its RSS from --pid.
Prints p50/p95 latency, tokens/s over the whole run, the 503s (queue full), the server's RSS
before and after, and one JSON line. Everything is bounded: --deadline seconds for the whole run,
a timeout per request; the script stops by itself.

Uses only the standard library on the client side (http.client), so the figures measure the
server, not a client library. RSS is read from /proc (Linux).
"""
from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
    "Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. "
    "How much more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
]


def rss_mib(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else None


def start_server(args: list[str], deadline: float,
                 launcher: tuple[str, ...] = ("-m", "prove_local.cli")) -> tuple[subprocess.Popen, str, Path]:
    """`prove-local serve ARGS` on a free loopback port, once it says it is ready: (process, base URL, log).
    `launcher`: the Python arguments that run the CLI (another: a dev tool that patches the server first)."""
    log = Path(tempfile.mkstemp(prefix="prove-serve-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, *launcher, "serve", "--host", "127.0.0.1",
                                 "--port", "0", *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    while True:
        text = log.read_text()
        if "ready (" in text:
            port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", text).group(1)
            return proc, f"http://127.0.0.1:{port}", log
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            sys.exit(f"load_test: the server did not start:\n{text}")
        time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def one_request(host: str, port: int, body: dict, key: str | None, timeout: float) -> dict:
    """One chat completion: status, seconds, completion tokens, text, the server's generation ms per token
    (and prove-local's tokens per cycle and llama_decode ms per token)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        data = r.read()
    except OSError as e:
        return {"status": None, "error": str(e), "seconds": time.perf_counter() - t0}
    finally:
        conn.close()
    out = {"status": r.status, "seconds": time.perf_counter() - t0}
    if r.status == 200:
        resp = json.loads(data)
        out["tokens"] = resp["usage"]["completion_tokens"]
        out["text"] = resp["choices"][0]["message"]["content"]
        # generation time per token as the server reports it (llama-server's `timings`, which prove-local
        # mirrors: from the first token's pass to the last, host time and the batch's other requests included)
        out["ms_per_token"] = (resp.get("timings") or {}).get("predicted_per_token_ms")
        if "prove" in resp:                 # prove-local's statistics (llama-server has none)
            out["tokens_per_cycle"] = resp["prove"].get("tokens_per_cycle")
            # of which inside llama_decode: this request's share of its passes' decodes, per token
            decode = sum((resp["prove"].get("decode_seconds") or {}).values())
            out["decode_ms_per_token"] = 1e3 * decode / out["tokens"] if out["tokens"] else None
    else:
        out["error"] = data[:300].decode("utf-8", "replace")
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", "-c", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", "-r", type=int, default=5, help="requests per client (default 5)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--mode", help="the request's ProVe mode (default: the server's)")
    p.add_argument("--url", help="a running server on this machine (default: start one)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    p.add_argument("--api-key", help="with --url: the server's key")
    p.add_argument("--timeout", type=float, default=120, help="seconds per request (default 120)")
    p.add_argument("--deadline", type=float, default=600, help="seconds for the whole run (default 600)")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--clients, --requests and --max-tokens must be >= 1")
    deadline = time.monotonic() + args.deadline

    proc = None
    if args.url:
        url = urlparse(args.url)
        try:
            loopback = url.hostname == "localhost" or ipaddress.ip_address(url.hostname).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            p.error("--url must be a loopback address (this script loads only this machine)")
        base, pid = args.url.rstrip("/"), args.pid
    else:
        proc, base, _ = start_server(server_args, deadline)
        pid = proc.pid
    u = urlparse(base)
    host, port = u.hostname, u.port or 80
    try:
        rss_before = rss_mib(pid) if pid else None
        results: list[dict] = []
        lock = threading.Lock()

        def client(c: int):
            for r in range(args.requests):
                if time.monotonic() > deadline:
                    return
                body = {"messages": [{"role": "user", "content": PROMPTS[(c + r) % len(PROMPTS)]}],
                        "max_tokens": args.max_tokens, "temperature": 0}
                if args.mode:
                    body["mode"] = args.mode
                timeout = min(args.timeout, max(1.0, deadline - time.monotonic()))
                res = one_request(host, port, body, args.api_key, timeout)
                with lock:
                    results.append(res)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        wall = time.perf_counter() - t0
        rss_after = rss_mib(pid) if pid else None
    finally:
        if proc is not None:
            stop_server(proc)

    ok = [r for r in results if r["status"] == 200]
    lat = [r["seconds"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    summary = {
        "clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
        "mode": args.mode, "server_args": server_args, "sent": len(results), "ok": len(ok),
        "rejected_503": sum(r["status"] == 503 for r in results),
        "failed": sum(r["status"] not in (200, 503) for r in results),
        "latency_p50_s": round(percentile(lat, 0.5), 3), "latency_p95_s": round(percentile(lat, 0.95), 3),
        "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "tokens_per_cycle_mean": round(statistics.fmean(r["tokens_per_cycle"] for r in ok), 3) if ok else None,
        "rss_mib_before": round(rss_before, 1) if rss_before else None,
        "rss_mib_after": round(rss_after, 1) if rss_after else None,
    }
    print(f"{summary['ok']}/{summary['sent']} ok ({summary['rejected_503']} x 503, {summary['failed']} failed); "
          f"latency p50 {summary['latency_p50_s']} s, p95 {summary['latency_p95_s']} s; "
          f"{tokens} tokens in {summary['wall_s']} s = {summary['tokens_per_s']} tokens/s; "
          f"server RSS {summary['rss_mib_before']} -> {summary['rss_mib_after']} MiB")
    print(json.dumps(summary))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
