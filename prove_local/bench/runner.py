"""Running the benchmark: models, pass-cost curves, and every run interleaved per prompt."""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from ..calibrate import measure
from ..engine import Engine, Settings
from ..llama import Model, gpu_offload_supported
from ..modes import MODES
from .. import rules
from ..rules import Cycle, propose, proposal_logits, top1
from .data import Prompt

PASS_COST_NS = tuple(range(1, 17)) + tuple(range(20, 65, 4))


@dataclass
class Run:
    """One measured configuration: a mode and its knobs. `name` keys results.json's `modes`."""
    name: str
    settings: Settings
    samples: int = 1              # generations per prompt, seeds settings.seed + 1000 * prompt + j (sampled runs)


@dataclass
class Record:
    prompt: int                   # index into the prompt list
    run: str
    tokens: list[int]             # generated token ids (committed, including a final EOG)
    cycles: list[Cycle]
    seconds: float                # decode time: first cycle's start to last cycle's end (Request.decode_seconds)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    text: str = ""
    sample: int = 0               # which of the run's repeated seeds (0 for the first)
    seed: int | None = None


@dataclass
class Batch:
    """One group of generations of a run decoded together on a batched pool (bench --parallel N): one
    prompt per engine, every step of them one llama_decode per model (batching.py)."""
    run: str
    prompts: list[int]            # indices into the prompt list, one per engine
    sample: int
    tokens: int                   # tokens they generated
    seconds: float                # the first decode start to the last decode end (tokens/s; the prompts were
                                  # prefilled before, untimed)
    steps: int = 0                # batched steps and llama_decode calls the group took (Batcher.stats)
    decodes: int = 0


@dataclass
class BenchData:
    prompts: list[Prompt]
    prompt_tokens: list[list[int]]
    runs: list[Run]
    generations: list[Record] = field(default_factory=list)
    pass_cost: dict = field(default_factory=dict)     # role -> {n: seconds}
    warmup_seconds: float = 0.0
    interrupted: bool = False     # Ctrl-C: only the prompts whose runs all finished are kept
    planner: dict = field(default_factory=dict)       # the engine's planner state after the runs
    oracle_match: dict = field(default_factory=dict)  # prompt index -> matched slots at every position
    external: dict = field(default_factory=dict)      # llama-speculative-simple: {"runs": {prompt: {...}}, ...}
    parallel: int = 1             # requests decoded at once (bench --parallel: a batched pool)
    batches: list[Batch] = field(default_factory=list)


def make_runs(modes: list[str], *, max_new: int, block, thetas: list[float], tau: float, draft_k,
              temps: list[float] = (0.0,), sampling: dict | None = None, samples: int = 1,
              lookup="auto") -> list[Run]:
    """One run per mode (and θ), width and temperature. `block` and `draft_k` are a value or a list of
    values ("auto" or N); with several, each gets its own run named mode@auto, mode@B4 (spec: spec@k4),
    so that auto and fixed widths are measured side by side, interleaved per prompt. Runs at
    temperature > 0 are named `...@T<t>` and generate `samples` times per prompt (the exactness check
    compares their distributions). `lookup` likewise ("auto", 0 or K, or a list): modes that take lookup
    drafts get one run per value, named ...@Lauto, @L0, @L4, when there are several."""
    blocks = block if isinstance(block, list) else [block]
    lookups = lookup if isinstance(lookup, list) else [lookup]
    ks = draft_k if isinstance(draft_k, list) else [draft_k]
    sampling = dict(sampling or {})
    sampling.setdefault("seed", 0)
    runs = []

    def tag(mode, b, k):
        width = MODES[mode].width
        if width == "draft_k":
            return "" if len(ks) == 1 else ("@auto" if k == "auto" else f"@k{k}")
        if width is None or len(blocks) == 1:
            return ""
        return "@auto" if b == "auto" else f"@B{b}"

    for t in temps:
        suffix = f"@T{t:g}" if t > 0 else ""
        n = samples if t > 0 else 1
        for mode in modes:
            width = MODES[mode].width
            widths = [(blocks[0], k) for k in ks] if width == "draft_k" else \
                ([(blocks[0], ks[0])] if width is None else [(b, ks[0]) for b in blocks])
            looks = lookups if MODES[mode].lookup else [lookups[0]]
            if MODES[mode].width is None and MODES[mode].lookup:     # the lookup mode: 0 would draft nothing
                looks = [x for x in looks if x != 0] or looks
            for (b, k), lk in ((w, lk) for w in widths for lk in looks):
                common = dict(max_new=max_new, block=b, tau=tau, draft_k=k, lookup=lk, temperature=t, **sampling,
                              recall=False)       # (each run alone: none copies another's answer)
                ltag = f"@L{lk}" if len(looks) > 1 else ""
                if MODES[mode].gate == "theta":             # one run per θ
                    for th in thetas:
                        name = (mode if len(thetas) == 1 else f"{mode}@{th:g}") + tag(mode, b, k) + ltag + suffix
                        runs.append(Run(name, Settings(mode=mode, theta=th, **common), n))
                else:
                    runs.append(Run(mode + tag(mode, b, k) + ltag + suffix,
                                    Settings(mode=mode, theta=thetas[0] if thetas else 0.05, **common), n))
    return runs


def measure_pass_cost(model: Model, context_options: dict, fill: list[int], *, ns=PASS_COST_NS, reps: int = 3,
                      n_fill: int = 256, seed: int = 0) -> dict[int, float]:
    """Median seconds inside llama_decode of one pass of n tokens (logits on every row) after a
    context of `n_fill` tokens: calibrate.measure (the planner's method) with `reps` repetitions
    and no time budget."""
    return measure(model, context_options, fill, ns=ns, n_fill=n_fill, budget_s=float("inf"), reps=reps, seed=seed)[1]


def oracle_runs(engine: Engine, tokens: list[int], reference: list[int], block: int) -> list[int]:
    """For the oracle bound: at every generated position s of the greedy `reference`, a full
    `block`-slot proposal of the proposer, and how many of its leading slots equal reference[s:]."""
    ctx = engine.contexts["target"]
    engine.tokens = []
    ctx.truncate(0)
    seq = list(tokens)
    ctx.eval(seq[:-1], rows=[])
    runs = []
    try:
        for s in range(len(reference)):
            if rules.gated(ctx):     # the adapter pass leaves nothing; the next token goes in stock
                d, _ = top1(proposal_logits(ctx, seq, block, engine.mask_token, keep=False))
                ctx.eval(seq[ctx.n_past:], rows=[])
            else:
                d, _ = propose(ctx, seq, block, engine.mask_token)
            want = reference[s:s + block]
            m = 0
            while m < len(want) and int(d[m]) == want[m]:
                m += 1
            runs.append(m)
            seq.append(reference[s])
    finally:
        ctx.truncate(0)
    return runs


def generate_once(engine: Engine, tokens: list[int], settings: Settings) -> tuple[list[Cycle], object]:
    """(cycles, Request) of one generation; the request's decode_seconds are engine.tokens_per_second's."""
    gc.collect()
    gen = engine.generate(tokens, settings)
    try:
        return list(gen), gen.request
    finally:
        gen.close()


def generate_together(engines: list[Engine], jobs: list[tuple[list[int], Settings]]) -> list[tuple]:
    """Generate jobs[k] on engines[k], all at once (the engines of a batched pool: their steps are
    batched). Per job (cycles, Request). Ctrl-C stops every generation after its current cycle (each
    closed: its caches cut back to its committed tokens) and is raised again; an error in one job is
    raised once all have ended. One job runs in the calling thread (generate_once)."""
    if len(jobs) == 1:
        return [generate_once(engines[0], *jobs[0])]
    gc.collect()
    out: list = [None] * len(jobs)
    stop = threading.Event()
    # Each job's end: a flag the worker sets once its generation is closed, and a bare lock it then
    # releases, which the caller waits on. Not Thread.join: on Python 3.11 a Ctrl-C that interrupts a
    # join's wait marks the thread stopped while it still runs (bpo-45274's handling releases the
    # thread's own state lock), so a later join() returned at once and the caller read an engine whose
    # generation was still decoding (tests/test_bench.py caught a sequence 4 positions past its tokens).
    done = [False] * len(jobs)
    ends = [threading.Lock() for _ in jobs]
    for lock in ends:
        lock.acquire()

    def work(k: int) -> None:
        gen = None
        try:
            gen = engines[k].generate(*jobs[k])
            cycles = []
            for c in gen:
                cycles.append(c)
                if stop.is_set():
                    break
            out[k] = (cycles, gen.request)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            out[k] = e
        finally:
            try:
                if gen is not None:
                    gen.close()
            finally:
                done[k] = True
                ends[k].release()

    threads = [threading.Thread(target=work, args=(k,), name=f"bench {k}", daemon=True) for k in range(len(jobs))]
    for t in threads:
        t.start()
    interrupted = None
    for k in range(len(jobs)):
        while not done[k]:                # (the flag decides: an interrupt may strike just after an acquire)
            try:
                ends[k].acquire(timeout=1.0)
            except KeyboardInterrupt as e:   # every job stops after its current cycle; raised once all have
                interrupted = e
                stop.set()
    if interrupted is not None:
        raise interrupted
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _record(i: int, run: Run, proposer: Model, cycles: list[Cycle], req, sample: int, seed: int) -> Record:
    out = [t for c in cycles for t in c.committed]
    return Record(i, run.name, out, cycles, req.decode_seconds, req.prefill[0], req.prefill[1],
                  proposer.detokenize([t for t in out if not proposer.is_eog(t)]), sample=sample, seed=seed)


def run_bench(engine: Engine, models: dict[str, Model], prompts: list[Prompt], prompt_tokens: list[list[int]],
              runs: list[Run], *, context_options: dict, warmup: int = 16, pass_cost: bool = True,
              pass_cost_reps: int = 3, pass_cost_max: int = 64, progress: bool = True, oracle: bool = False,
              external: "LlamaSpec | None" = None, batch: "tuple[list[Engine], object] | None" = None) -> BenchData:
    """Pass-cost curves, warm-up, then for each prompt every run once, the run order rotated from
    one prompt to the next (A B C, B C A, ...) so that drift hits all runs alike. Ctrl-C stops the
    runs: the data then holds the prompts whose runs all finished, and `interrupted` is set.

    `batch`: (engines, batcher) of a batched pool (engine is engines[0]): the prompts then go in
    groups of len(engines), every run generating a group's prompts at once (generate_together),
    and each group's throughput is recorded (data.batches)."""
    from tqdm import tqdm

    engines, batcher = batch if batch is not None else ([engine], None)
    width = len(engines)
    data = BenchData(prompts, prompt_tokens, runs, parallel=width)
    proposer = models["target"]
    for e in engines:
        for r in runs:
            e.prepare(r.settings)     # pass costs measured (or read from the cache) before any timing
    if pass_cost and prompt_tokens:
        # (before the warm-up, which is what the timed runs should follow: measured after it, its fresh
        # contexts and wide passes left the next passes slower for a while; the embedded pair's first
        # question's first run decoded in 58 ms, median of 10 fresh processes, against 46 ms without it)
        ns = tuple(n for n in PASS_COST_NS if n <= pass_cost_max)
        seen: dict[int, dict] = {}
        roles = [r for r in ("target", "verifier", "draft") if r in models and r in engine.contexts]
        bar = tqdm(roles, desc="pass cost", unit="model", disable=not progress, file=sys.stderr, leave=False)
        for role in bar:
            m = models[role]
            if id(m) not in seen:
                seen[id(m)] = measure_pass_cost(m, context_options, prompt_tokens[0], ns=ns, reps=pass_cost_reps)
            data.pass_cost[role] = seen[id(m)]
    if warmup > 0 and prompt_tokens:
        t0 = time.perf_counter()
        for run in runs:
            generate_together(engines, [(prompt_tokens[0], replace(run.settings, max_new=warmup))] * width)
        data.warmup_seconds = time.perf_counter() - t0
    bar = tqdm(total=len(prompts) * sum(r.samples for r in runs), desc="bench", unit="gen", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    done = 0
    try:
        for g0 in range(0, len(prompt_tokens), width):
            group = list(range(g0, min(g0 + width, len(prompt_tokens))))
            k = (g0 // width) % len(runs)
            for j in range(max(r.samples for r in runs)):
                for run in runs[k:] + runs[:k]:
                    if j >= run.samples:
                        continue
                    bar.set_postfix_str(f"{prompts[g0].id} {run.name}", refresh=False)
                    # a seed of its own for every run, prompt and sample: the distribution check
                    # compares independent samples (ar and lossless with one seed draw the same first token)
                    seeds = [(run.settings.seed or 0) + 10 ** 8 * runs.index(run) + 1000 * i + j for i in group]
                    jobs = [(prompt_tokens[i], replace(run.settings, seed=sd)) for i, sd in zip(group, seeds)]
                    # the prompts prefilled first, untimed (the run then reuses them from the caches):
                    # batched, one request's decode steps would otherwise wait for the others' prefills, and
                    # the first run of a group, which prefills, would pay for the runs after it; alone, the
                    # first run after a prompt's prefill decoded ~1.5 % slower than the next (the embedded
                    # pair, one process, 48 answers: a penalty for whichever mode the rotation put first)
                    generate_together(engines, [(t, replace(st, max_new=1)) for t, st in jobs])
                    if batcher is not None:
                        before = batcher.stats()
                    outs = generate_together(engines, jobs)
                    for i, sd, (cycles, req) in zip(group, seeds, outs):
                        data.generations.append(_record(i, run, proposer, cycles, req, j, sd))
                    if batcher is not None:
                        after = batcher.stats()
                        reqs = [req for _, req in outs if req.decode_start is not None]
                        window = max(r.decode_end for r in reqs) - min(r.decode_start for r in reqs) if reqs else 0.0
                        data.batches.append(Batch(run.name, group, j, sum(len(c.committed) for cs, _ in outs for c in cs),
                                                  window, after["steps"] - before["steps"],
                                                  after["decodes"] - before["decodes"]))
                    bar.update(len(group))
            for i in group:
                if external is not None:          # the external baseline, on the same prompt
                    data.external.setdefault("runs", {})[i] = external.run(proposer.detokenize(prompt_tokens[i], special=True))
                done = i + 1
    except KeyboardInterrupt:
        data.interrupted = True
        data.prompts, data.prompt_tokens = data.prompts[:done], data.prompt_tokens[:done]
        data.generations = [g for g in data.generations if g.prompt < done]
        data.batches = [b for b in data.batches if max(b.prompts) < done]
        for i in list(data.external.get("runs", {})):
            if i >= done:
                data.external["runs"].pop(i)
    finally:
        bar.close()
    data.planner = engine.planner.summary()
    if external is not None:
        data.external.update(external.describe())
    if oracle and engine.mask_token is not None:
        ref = {g.prompt: g.tokens for g in data.generations if g.run == "ar"}
        for i, tokens in enumerate(prompt_tokens):
            if i in ref:
                data.oracle_match[i] = oracle_runs(engine, tokens, ref[i], engine.block_size)
    return data


@dataclass
class LlamaSpec:
    """llama.cpp's own `llama-speculative-simple` as an external baseline (target = the proposer, draft
    = the draft model), run once per prompt on the same rendered prompt text, greedy. Its "decoded N
    tokens in S seconds" line (decoding only, without the prompt) gives the figures."""
    binary: str
    target: str
    draft: str
    max_new: int
    threads: int | None = None
    ctx: int = 4096
    n_gpu_layers: int = 0
    extra: tuple = ("--spec-type", "draft-simple", "--spec-draft-n-max", "4")
    timeout: float = 600.0

    def command(self, prompt_file: str) -> list[str]:
        cmd = [self.binary, "-m", self.target, "-md", self.draft, "-f", prompt_file, "-n", str(self.max_new),
               "-c", str(self.ctx), "--temp", "0", "-ngl", str(self.n_gpu_layers), "-ngld", str(self.n_gpu_layers)]
        if self.threads:
            cmd += ["-t", str(self.threads), "-td", str(self.threads)]
        return cmd + list(self.extra)

    def run(self, prompt_text: str) -> dict:
        import re
        import subprocess
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
            f.write(prompt_text)
            path = f.name
        try:
            r = subprocess.run(self.command(path), capture_output=True, text=True, timeout=self.timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            os.unlink(path)
        log = r.stdout + "\n" + r.stderr
        m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([0-9.]+)\s+seconds", log)
        if r.returncode != 0 or not m:
            tail = " | ".join(log.strip().splitlines()[-3:])
            return {"error": f"exit {r.returncode}, no 'decoded N tokens in S seconds' line ({tail[-300:]})"}
        out = {"tokens": int(m.group(1)), "seconds": float(m.group(2))}
        acc = re.search(r"accept\s*=\s*([0-9.]+)%", log)
        if acc:
            out["accept_percent"] = float(acc.group(1))
        return out

    def describe(self) -> dict:
        return {"name": "llama-speculative-simple", "binary": self.binary, "target": self.target, "draft": self.draft,
                "args": list(self.extra), "threads": self.threads}


def machine_info(threads: int | None) -> dict:
    import platform
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "threads": threads or os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import llama_cpp
        info["llama_cpp_python"] = llama_cpp.__version__
        info["gpu_offload"] = gpu_offload_supported()     # a local GPU, not only a GPU-capable (RPC) build
    except Exception:  # pragma: no cover
        pass
    return info
