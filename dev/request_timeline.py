"""Where a served request's time goes: `prove-local serve` with timestamps patched into its request
path, C clients each sending R chat requests one after another, and per stage the median over every
request (after one warm-up request).

    python dev/request_timeline.py [--clients 4] [--requests 3] [--rounds 3] [--parallel 4] [--threads 2]
                                   [--mode ar] [--max-tokens 64] [--json OUT]

Stages, on the one clock every process shares (time.monotonic, CLOCK_MONOTONIC): the client's send,
the route entered (`server.app.generate`), the job made and its thread running, the engine taken and
the answer set up (`Engine.generate`: the prompt cache's `keep` and `fill`, `_sync`, timed apart), the
first cycle out, the last, "done", the response handed back and received. Prefill and the request's
`decode_seconds` are the engine's own. SmolLM2-135M-Instruct Q4_1 (the server's default model), the
prompts of scripts/serve_bench.py, greedy. Timing: run it on an idle machine; compare stages within a
run, not across hours.
"""
from __future__ import annotations

import argparse
import contextvars
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

OUT_ENV = "REQUEST_TIMELINE_OUT"


def install_probes(out: str) -> None:
    """In the server's process: one JSON line per request to `out`, written as its route returns."""
    from prove_local import batching, engine
    from prove_local.server import app as appmod, jobs

    entered = contextvars.ContextVar("entered", default=None)
    local = threading.local()
    route = appmod.generate

    async def generate(state, request, kind):
        rec = {"enter": time.monotonic(), "dur": {}}
        entered.set(rec)
        try:
            return await route(state, request, kind)
        finally:
            rec["exit"] = time.monotonic()
            with open(out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    appmod.generate = generate            # (the routes call it by its module name)

    init, run, emit, decode = jobs.Job.__init__, jobs.Job._run, jobs.Job._emit, jobs.Job._decode

    def job_init(self, *a, **k):
        init(self, *a, **k)
        self._rec = entered.get() or {"dur": {}}
        self._rec["job"] = time.monotonic()

    def job_run(self):
        self._rec["run"] = time.monotonic()
        local.dur = self._rec["dur"]
        run(self)

    def job_emit(self, kind, value=None):
        self._rec.setdefault("emit_" + kind, time.monotonic())
        emit(self, kind, value)

    def job_decode(self, answer, model):
        rec = self._rec

        class Pieces:                       # the answer, its first and last cycles timed
            def __iter__(_):
                for piece in answer:
                    rec.setdefault("first_cycle", time.monotonic())
                    rec["last_cycle"] = time.monotonic()
                    yield piece

            def __getattr__(_, name):
                return getattr(answer, name)
        rec["decode_start"] = time.monotonic()
        decode(self, Pieces(), model)
        if self.request is not None:
            rec["prefill_s"], rec["decode_s"] = self.request.prefill[1], self.request.decode_seconds
    jobs.Job.__init__, jobs.Job._run, jobs.Job._emit, jobs.Job._decode = job_init, job_run, job_emit, job_decode

    def timed(cls, name):
        orig = getattr(cls, name)

        def f(*a, **k):
            t = time.monotonic()
            try:
                return orig(*a, **k)
            finally:
                dur = getattr(local, "dur", None)
                if dur is not None:
                    dur[name] = dur.get(name, 0.0) + time.monotonic() - t
        setattr(cls, name, f)
    for cls, name in ((engine.Engine, "generate"), (engine.Engine, "_cached_prefix"), (engine.Engine, "_sync"),
                      (batching.PromptCache, "keep"), (batching.PromptCache, "fill")):
        timed(cls, name)


STAGES = [
    ("send -> route", "send", "enter"), ("route -> job", "enter", "job"), ("job -> its thread", "job", "run"),
    ("thread -> engine taken, answer set up", "run", "emit_start"),
    ("set up -> first cycle out", "decode_start", "first_cycle"), ("first -> last cycle", "first_cycle", "last_cycle"),
    ("last cycle -> done", "last_cycle", "emit_done"), ("done -> route returns", "emit_done", "exit"),
    ("route returns -> received", "exit", "recv"),
]


def serve(args, out: str) -> tuple[subprocess.Popen, int]:
    """`serve` with install_probes(out) run in its process first; (process, port) once ready."""
    from load_test import start_server
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'dev')!r}); "
            "import request_timeline as t; t.install_probes(t.os.environ[t.OUT_ENV]); "
            "from prove_local.cli import main; sys.exit(main())")
    os.environ[OUT_ENV] = out                   # (the server's environment is a copy of this one)
    proc, base, _ = start_server(["--parallel", str(args.parallel), "--threads", str(args.threads)],
                                 time.monotonic() + 300, launcher=("-c", code))
    return proc, int(base.rsplit(":", 1)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="ar")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write every request's timestamps here too")
    a = ap.parse_args()
    from load_test import PROMPTS, stop_server

    out = tempfile.mkstemp(prefix="request-timeline-", suffix=".jsonl")[1]
    proc, port = serve(a, out)
    sent: list[dict] = []
    lock = threading.Lock()

    def ask(client: int, r: int, keep: bool) -> None:
        body = {"messages": [{"role": "user", "content": PROMPTS[(client + r) % len(PROMPTS)]}],
                "max_tokens": a.max_tokens, "temperature": 0, "mode": a.mode}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        t0 = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        t1 = time.monotonic()
        conn.close()
        if resp.status != 200:
            raise SystemExit(f"request_timeline: HTTP {resp.status}: {data[:300]!r}")
        if keep:
            with lock:
                sent.append({"send": t0, "recv": t1, "tokens": json.loads(data)["usage"]["completion_tokens"]})
    try:
        ask(0, 0, keep=False)               # warm-up
        for rnd in range(a.rounds):
            n0 = len(sent)
            threads = [threading.Thread(target=lambda c=c: [ask(c, r, True) for r in range(a.requests)])
                       for c in range(a.clients)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - t0
            print(f"round {rnd + 1}: {sum(s['tokens'] for s in sent[n0:]) / wall:.1f} tokens/s", flush=True)
    finally:
        stop_server(proc)
    records = [json.loads(line) for line in Path(out).read_text().splitlines()][1:]     # (the warm-up's first)
    pairs = []
    for s in sent:                          # each client request with the server record that began nearest
        rec = min(records, key=lambda r: abs(r["enter"] - s["send"]))
        pairs.append({**rec, **s})
    print(f"{len(pairs)} requests, {a.clients} client(s), --parallel {a.parallel}, {a.mode}; medians, ms:")
    print(f"  {'latency':40s} {statistics.median(p['recv'] - p['send'] for p in pairs) * 1e3:9.2f}")
    for name, t0, t1 in STAGES:
        print(f"  {name:40s} {statistics.median(p[t1] - p[t0] for p in pairs) * 1e3:9.2f}")
    for key in ("prefill_s", "decode_s"):
        print(f"  {key:40s} {statistics.median(p.get(key) or 0.0 for p in pairs) * 1e3:9.2f}")
    for key in sorted({k for p in pairs for k in p["dur"]}):
        vals = [p["dur"].get(key, 0.0) for p in pairs]
        print(f"  in {key:37s} {statistics.median(vals) * 1e3:9.2f}   (mean {statistics.mean(vals) * 1e3:.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps(pairs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
