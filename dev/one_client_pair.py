"""Is one client's time per token on `prove-local serve` and `llama-server` moved by the other server
being up, or by a burst of load just before? Both servers up as scripts/serve_bench.py keeps them
(--parallel 4, 2 threads, 2048 tokens a slot, SmolLM2-135M Q4_1), one client, 64-token greedy chat
requests (the prompts of scripts/load_test.py), medians of the servers' own ms per token.

    python dev/one_client_pair.py --llama-server BIN [--blocks 6]

1. neighbour: blocks of 6 requests to one server while the other is idle or stopped (SIGSTOP), the
   order alternating from block to block;
2. burst: 3 requests to one server, an 8-client burst (3 requests each) on it, 3 requests again.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--blocks", type=int, default=6)
    a = ap.parse_args()
    from load_test import PROMPTS, one_request, start_server, stop_server
    from serve_bench import start_llama_server
    from prove_local.loading import smollm2_path
    deadline = time.monotonic() + 900
    pp, pbase, _ = start_server(["--parallel", "4", "--threads", "2", "--ctx", "2048", "--queue", "16"], deadline)
    lp, lbase, _ = start_llama_server(a.llama_server, smollm2_path(), 4, 2, 2048, deadline, [])
    srv = {"prove-local": (pp, int(pbase.rsplit(":", 1)[1]), {"mode": "ar"}),
           "llama-server": (lp, int(lbase.rsplit(":", 1)[1]), {})}

    def ask(name: str, i: int) -> float:
        _, port, extra = srv[name]
        r = one_request("127.0.0.1", port, {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                            "max_tokens": 64, "temperature": 0, **extra}, None, 300)
        if r["status"] != 200:
            raise SystemExit(f"one_client_pair: {name}: HTTP {r['status']}: {r.get('error')}")
        return r["ms_per_token"]

    def burst(name: str) -> None:
        ths = [threading.Thread(target=lambda c=c: [ask(name, c + k) for k in range(3)]) for c in range(8)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()

    res: dict[tuple[str, str], list[float]] = {}
    names = list(srv)
    try:
        for name in names:
            for i in range(4):
                ask(name, i)
        for b in range(a.blocks):                       # 1. the neighbour idle or stopped
            for name, other in ((names[0], names[1]), (names[1], names[0])):
                states = ("stopped", "idle") if (b + (name == names[1])) % 2 == 0 else ("idle", "stopped")
                for st in states:
                    pid = srv[other][0].pid
                    if st == "stopped":
                        os.kill(pid, signal.SIGSTOP)
                    try:
                        res.setdefault((name, f"neighbour {st}"), []).extend(ask(name, b * 6 + i) for i in range(6))
                    finally:
                        if st == "stopped":
                            os.kill(pid, signal.SIGCONT)
        for b in range(a.blocks):                       # 2. before and after a burst
            for name in (names if b % 2 == 0 else names[::-1]):
                res.setdefault((name, "before a burst"), []).extend(ask(name, b * 3 + i) for i in range(3))
                burst(name)
                res.setdefault((name, "after a burst"), []).extend(ask(name, b * 3 + i) for i in range(3))
    finally:
        stop_server(pp)
        stop_server(lp)
    for (name, what), v in sorted(res.items()):
        print(f"{name:13s} {what:18s} ms/token median {statistics.median(v):6.2f}  (n={len(v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
