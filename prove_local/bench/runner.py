"""Running the benchmark: models, pass-cost curves, and every run interleaved per prompt."""
from __future__ import annotations

import gc
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from statistics import median

from ..engine import Engine, Settings
from ..llama import Context, Model
from ..rules import Cycle
from .data import Prompt

PASS_COST_NS = tuple(range(1, 17)) + tuple(range(20, 65, 4))


@dataclass
class Run:
    """One measured configuration: a mode and its knobs. `name` keys results.json's `modes`."""
    name: str
    settings: Settings
    samples: int = 1              # generations per prompt, seeds settings.seed + 1000 * prompt + j (sampled runs)


@dataclass
class Generation:
    prompt: int                   # index into the prompt list
    run: str
    tokens: list[int]             # generated token ids (committed, including a final EOG)
    cycles: list[Cycle]
    seconds: float                # wall time of the generation without the prompt prefill
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    text: str = ""
    sample: int = 0               # which of the run's repeated seeds (0 for the first)
    seed: int | None = None


@dataclass
class BenchData:
    prompts: list[Prompt]
    prompt_tokens: list[list[int]]
    runs: list[Run]
    generations: list[Generation] = field(default_factory=list)
    pass_cost: dict = field(default_factory=dict)     # role -> {n: seconds}
    warmup_seconds: float = 0.0
    interrupted: bool = False     # Ctrl-C: only the prompts whose runs all finished are kept


def make_runs(modes: list[str], *, max_new: int, block: int | None, thetas: list[float], tau: float,
              draft_k: int, temps: list[float] = (0.0,), sampling: dict | None = None, samples: int = 1) -> list[Run]:
    """One run per mode (and θ) and temperature. Runs at temperature > 0 are named `mode@T<t>` and
    generate `samples` times per prompt (the exactness check compares their distributions)."""
    runs = []
    sampling = dict(sampling or {})
    sampling.setdefault("seed", 0)
    for t in temps:
        suffix = f"@T{t:g}" if t > 0 else ""
        n = samples if t > 0 else 1
        for mode in modes:
            if mode == "prove":
                for th in thetas:
                    name = ("prove" if len(thetas) == 1 else f"prove@{th:g}") + suffix
                    runs.append(Run(name, Settings(mode="prove", max_new=max_new, block=block, theta=th, tau=tau,
                                                   draft_k=draft_k, temperature=t, **sampling), n))
            else:
                runs.append(Run(mode + suffix, Settings(mode=mode, max_new=max_new, block=block,
                                                        theta=thetas[0] if thetas else 0.05, tau=tau, draft_k=draft_k,
                                                        temperature=t, **sampling), n))
    return runs


def measure_pass_cost(model: Model, context_options: dict, fill: list[int], *, ns=PASS_COST_NS, reps: int = 3,
                      n_fill: int = 256, settle: int = 3, timed: int = 2, seed: int = 0) -> dict[int, float]:
    """Median seconds inside llama_decode of one pass of n tokens (logits on every row) after a
    context of `n_fill` tokens, for each n, in the steady state: per repetition `settle` untimed
    passes of that width, then `timed` timed ones. The n are shuffled within each repetition so
    that drift spreads over all of them."""
    opts = dict(context_options)
    opts["n_ctx"] = n_fill + max(ns) + 8
    ctx = Context(model, **opts)
    try:
        tokens = (fill * (n_fill // max(1, len(fill)) + 2))[:n_fill + max(ns)]
        ctx.eval(tokens[:n_fill], rows=[])
        ctx.eval(tokens[n_fill:n_fill + 8], rows=list(range(8)))   # warm-up pass
        ctx.truncate(n_fill)
        times: dict[int, list[float]] = {n: [] for n in ns}
        rng = random.Random(seed)
        for _ in range(reps):
            order = list(ns)
            rng.shuffle(order)
            for n in order:
                # untimed passes of the same width first: right after a pass of another width, a
                # pass costs up to 2x more (caches, graph re-planning) and settles over a few
                # passes. Decoding repeats the same shapes, so the steady state is what it pays.
                for k in range(settle + timed):
                    before = ctx.decode_seconds
                    ctx.eval(tokens[n_fill:n_fill + n], rows=list(range(n)))
                    if k >= settle:
                        times[n].append(ctx.decode_seconds - before)
                    ctx.truncate(n_fill)
        return {n: median(t) for n, t in times.items()}
    finally:
        ctx.close()


def generate_once(engine: Engine, tokens: list[int], settings: Settings) -> tuple[list[Cycle], float, tuple]:
    gc.collect()
    t0 = time.perf_counter()
    gen = engine.generate(tokens, settings)
    cycles = list(gen)
    wall = time.perf_counter() - t0
    return cycles, max(0.0, wall - gen.prefill[1]), gen.prefill


def run_bench(engine: Engine, models: dict[str, Model], prompts: list[Prompt], prompt_tokens: list[list[int]],
              runs: list[Run], *, context_options: dict, warmup: int = 16, pass_cost: bool = True,
              pass_cost_reps: int = 3, pass_cost_max: int = 64, progress: bool = True) -> BenchData:
    """Warm-up, pass-cost curves, then for each prompt every run once, the run order rotated from
    one prompt to the next (A B C, B C A, ...) so that drift hits all runs alike. Ctrl-C stops the
    runs: the data then holds the prompts whose runs all finished, and `interrupted` is set."""
    from tqdm import tqdm

    data = BenchData(prompts, prompt_tokens, runs)
    proposer = models["proposer"]
    if warmup > 0 and prompt_tokens:
        t0 = time.perf_counter()
        for run in runs:
            s = run.settings
            generate_once(engine, prompt_tokens[0], replace(s, max_new=warmup))
        data.warmup_seconds = time.perf_counter() - t0
    if pass_cost and prompt_tokens:
        ns = tuple(n for n in PASS_COST_NS if n <= pass_cost_max)
        seen: dict[int, dict] = {}
        roles = [r for r in ("proposer", "verifier", "draft") if r in models and r in engine.contexts]
        bar = tqdm(roles, desc="pass cost", unit="model", disable=not progress, file=sys.stderr, leave=False)
        for role in bar:
            m = models[role]
            if id(m) not in seen:
                seen[id(m)] = measure_pass_cost(m, context_options, prompt_tokens[0], ns=ns, reps=pass_cost_reps)
            data.pass_cost[role] = seen[id(m)]
    bar = tqdm(total=len(prompts) * sum(r.samples for r in runs), desc="bench", unit="gen", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    done = 0
    try:
        for i, tokens in enumerate(prompt_tokens):
            k = i % len(runs)
            for j in range(max(r.samples for r in runs)):
                for run in runs[k:] + runs[:k]:
                    if j >= run.samples:
                        continue
                    bar.set_postfix_str(f"{prompts[i].id} {run.name}", refresh=False)
                    # a seed of its own for every run, prompt and sample: the distribution check
                    # compares independent samples (ar and lossless with one seed draw the same first token)
                    seed = (run.settings.seed or 0) + 10 ** 8 * runs.index(run) + 1000 * i + j
                    cycles, seconds, (n_pre, t_pre) = generate_once(engine, tokens, replace(run.settings, seed=seed))
                    out = [t for c in cycles for t in c.committed]
                    data.generations.append(Generation(i, run.name, out, cycles, seconds, n_pre, t_pre,
                                                       proposer.detokenize([t for t in out if not proposer.is_eog(t)]),
                                                       sample=j, seed=seed))
                    bar.update(1)
            done = i + 1
    except KeyboardInterrupt:
        data.interrupted = True
        data.prompts, data.prompt_tokens = data.prompts[:done], data.prompt_tokens[:done]
        data.generations = [g for g in data.generations if g.prompt < done]
    finally:
        bar.close()
    return data


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
        info["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:  # pragma: no cover
        pass
    return info
