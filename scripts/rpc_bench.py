"""Pass cost and tokens/s over llama.cpp's RPC backend on loopback, next to the same model run locally.

    python scripts/rpc_bench.py --out rpc_bench.json                      # Qwen2.5-0.5B shape, Q8_0
    python scripts/rpc_bench.py --out rpc_bench.json --shape tiny         # a minute: a 4-layer toy shape

It writes a random-weight GGUF (scripts/gpu_check.py's writer: random weights decode at the speed of
real ones), starts `--servers` `prove-local rpc-server` processes on free loopback ports (stopped by
PID at the end), loads the model locally and split evenly across the servers, and measures for both:

- the pass cost t(n): median seconds inside llama_decode of one pass of n tokens with logits on every
  row, after a 256-token context (prove_local.bench.runner.measure_pass_cost, the curve `bench` shows);
  the difference t_rpc(n) - t_local(n) is the per-pass cost of the RPC hops (each pass sends the
  activations to every server in turn and the last server's logits back) that the planner's
  measured curve will include;
- tokens/s of `ar` and `lossless` (any token id as the mask: random weights accept little, so this
  measures cost per pass, not the speed-up of a trained proposer) over a few prompts of random ids.

On loopback the servers share this machine's cores with the client: the numbers show the protocol's
overhead, not what two real machines would do over a network (add the network's round trip per
server per pass, and the activations' transfer: n x hidden x 4 bytes per hop).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from prove_local.shapes import SHAPES, Shape  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help=f"tiny, or one of {', '.join(SHAPES)} (default qwen2.5-0.5b)")
    ap.add_argument("--quant", default="q8_0", choices=("q8_0", "q4_k_m", "f16"), help="weights (default q8_0)")
    ap.add_argument("--servers", type=int, default=2, help="rpc-server processes on loopback (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="threads of the client and of each server (default 1)")
    ap.add_argument("--ns", default="1,2,4,8,16,32", help="pass widths (default 1,2,4,8,16,32)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per width (default 3)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts for tokens/s (default 3)")
    ap.add_argument("--max-new", type=int, default=32, help="new tokens per prompt (default 32)")
    ap.add_argument("--block", type=int, default=8, help="lossless block (default 8)")
    ap.add_argument("--n-gpu-layers", type=int, default=-1,
                    help="layers on the servers (default -1: all and the output head; the number of layers "
                         "keeps the output head local, so logits do not cross the network)")
    ap.add_argument("--work", help="folder for the GGUF and server logs (default: a temp folder)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()   # --help and bad arguments end here, before llama.cpp is loaded


from prove_local import rpc  # noqa: E402
from prove_local.bench.runner import measure_pass_cost  # noqa: E402
from prove_local.engine import Engine, Settings, summarize  # noqa: E402
from prove_local.llama import Model  # noqa: E402

TINY = Shape(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=4096, tied=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "prove_local.cli", "rpc-server", "--port", str(port),
                                 "--threads", str(threads)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not rpc.alive(endpoint, timeout=0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"rpc_bench: the rpc-server on {endpoint} did not start: {log.read_text()[-500:]}")
        time.sleep(0.1)
    return proc, endpoint


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def lo_bytes() -> int | None:
    """Bytes received on the loopback interface so far (/proc/net/dev); None off Linux."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    except OSError:
        return None
    return None


def bytes_per_pass(model: Model, threads: int, fill: list[int], ns, passes: int = 8) -> dict:
    """Loopback bytes per pass of n tokens (logits of every row) after len(fill) tokens: what would
    cross the network (both directions, with TCP/IP headers; other loopback traffic on a shared
    machine adds to it, so the smallest of three rounds is kept)."""
    from prove_local.llama import Context

    ctx = Context(model, n_ctx=len(fill) + max(ns) + 8, n_threads=threads, type_k="f16", type_v="f16")
    ctx.eval(fill, rows=[])
    out = {}
    for n in ns:
        rounds = []
        for _ in range(3):
            b0 = lo_bytes()
            for _ in range(passes):
                ctx.eval(fill[:n], rows=list(range(n)))
                ctx.truncate(len(fill))
            b1 = lo_bytes()
            if b0 is None or b1 is None:
                return {}
            rounds.append((b1 - b0) / passes)
        out[n] = int(min(rounds))
    ctx.close()
    return out


def speeds(model: Model, threads: int, prompts: list[list[int]], max_new: int, block: int) -> dict:
    e = Engine.load(model, mask_token=model.n_vocab - 1, n_ctx=1024, n_threads=threads, type_k="f16", type_v="f16")
    out = {}
    for mode in ("ar", "lossless"):
        s = Settings(mode=mode, max_new=max_new, block=block)
        list(e.generate(prompts[0], s))                       # warm-up
        seconds, tokens, passes, outputs = 0.0, 0, 0, []
        for p in prompts:
            e.tokens = []                                     # each prompt from scratch
            e._sync()
            t0 = time.perf_counter()
            cyc = list(e.generate(p, s))
            dt = time.perf_counter() - t0
            r = summarize(cyc, dt)
            seconds, tokens = seconds + dt, tokens + r["n_tokens"]
            passes += sum(r["n_passes"].values())
            outputs.append([t for c in cyc for t in c.committed])
        out[mode] = {"tokens": tokens, "seconds": round(seconds, 4), "passes": passes,
                     "tokens_per_second": round(tokens / seconds, 2), "outputs": outputs}
    for c in e.contexts.values():
        c.close()
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from gpu_check import write_random_gguf

    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    work = Path(args.work or tempfile.mkdtemp(prefix="rpc-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{args.shape}.{args.quant}.gguf"
    if not path.exists():
        write_random_gguf(path, shape, args.quant, name=f"random {args.shape}")
    ns = tuple(int(x) for x in args.ns.split(","))
    if max(ns) < 8:     # measure_pass_cost warms up with a pass of 8 tokens taken after the fill
        ap.error("--ns: the largest width must be at least 8")
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, 256, 48)] for _ in range(args.prompts)]
    fill = [int(x) for x in rng.integers(0, 256, 256)]
    opts = dict(n_threads=args.threads, type_k="f16", type_v="f16")
    result = {"model": {"shape": args.shape, "quant": args.quant, "file_bytes": path.stat().st_size},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_before": os.getloadavg()},
              "servers": args.servers, "n_gpu_layers": args.n_gpu_layers, "threads": args.threads, "ns": list(ns), "reps": args.reps}

    local = Model(path)
    procs = []
    try:
        endpoints = []
        for i in range(args.servers):
            proc, endpoint = start_server(args.threads, work / f"server-{i}.log")
            procs.append(proc)
            endpoints.append(endpoint)
        t0 = time.perf_counter()
        remote = Model(path, n_gpu_layers=args.n_gpu_layers, devices=rpc.add_servers(endpoints),
                       tensor_split=[1] * args.servers)
        result["rpc"] = {"endpoints": endpoints, "load_seconds": round(time.perf_counter() - t0, 2),
                         "placement_mib": remote.placement}
        # pass cost: local and RPC alternate, one repetition each, so that the machine's load drifts
        # over both alike; the median over the repetitions
        samples = {"local": {n: [] for n in ns}, "rpc": {n: [] for n in ns}}
        for _ in range(args.reps):
            for name, m in (("local", local), ("rpc", remote)):
                for n, t in measure_pass_cost(m, opts, fill, ns=ns, reps=1).items():
                    samples[name][n].append(t)
        result["local"] = {"pass_ms": {n: round(statistics.median(v) * 1e3, 3) for n, v in samples["local"].items()}}
        result["rpc"]["pass_ms"] = {n: round(statistics.median(v) * 1e3, 3) for n, v in samples["rpc"].items()}
        result["rpc"]["loopback_bytes_per_pass"] = bytes_per_pass(remote, args.threads, fill, ns)
        result["local"].update(speeds(local, args.threads, prompts, args.max_new, args.block))
        result["rpc"].update(speeds(remote, args.threads, prompts, args.max_new, args.block))
        remote.close()
    finally:
        for p in procs:
            stop(p)
    local.close()
    loc, rem = result["local"], result["rpc"]
    for r in (loc, rem):
        r["ratio"] = {n: round(t / r["pass_ms"][1], 3) for n, t in r["pass_ms"].items()}
    rem["extra_ms_per_pass"] = {n: round(rem["pass_ms"][n] - loc["pass_ms"][n], 3) for n in ns}
    for mode in ("ar", "lossless"):    # RPC changes nothing: the same tokens as the same mode run locally
        rem[mode]["same_as_local"] = rem[mode].pop("outputs") == loc[mode]["outputs"]
    loc["lossless"]["same_as_ar"] = loc["lossless"]["outputs"] == loc["ar"]["outputs"]   # F16 KV: may differ
    for mode in ("lossless", "ar"):
        loc[mode].pop("outputs")
    result["machine"]["load_avg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))

    print(f"{args.shape} {args.quant}, {args.servers} loopback servers, {args.threads} thread(s) each "
          f"(load average {result['machine']['load_avg_before'][0]:.1f}: a shared machine, noisy)")
    print(f"{'n':>4} {'local ms':>10} {'ratio':>6} {'rpc ms':>10} {'ratio':>6} {'rpc - local':>12} {'KiB/pass':>9}")
    for n in ns:
        kib = rem["loopback_bytes_per_pass"].get(n)
        print(f"{n:>4} {loc['pass_ms'][n]:>10.2f} {loc['ratio'][n]:>6.2f} {rem['pass_ms'][n]:>10.2f} "
              f"{rem['ratio'][n]:>6.2f} {rem['extra_ms_per_pass'][n]:>12.2f} {kib / 1024 if kib else float('nan'):>9.1f}")
    for mode in ("ar", "lossless"):
        print(f"{mode:>8}: local {loc[mode]['tokens_per_second']:.1f} tokens/s, rpc {rem[mode]['tokens_per_second']:.1f} "
              f"tokens/s, same tokens as local {mode}: {rem[mode]['same_as_local']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
