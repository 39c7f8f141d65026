"""GET /metrics: counters over every generation and request, in Prometheus' text format: our own
`prove_*` names, and llama-server's speculative-decoding counters under its names and meanings
(`llamacpp:spec_decode_*`, llama.cpp PR #26389, after vLLM's `vllm:spec_decode_*`). Drafted tokens
are what modes.draft_counts counts: lookup tokens, a draft model's tokens and the MARS slots after
the first; slot 1 of a lossless / prove / mars block is the model's own token and is no draft, so
accepted ÷ drafted here is the acceptance rate llama-server reports."""
from __future__ import annotations

import threading

from .. import modes


class Metrics:
    """Counters for GET /metrics (Prometheus text format), updated under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}     # (endpoint, status) -> count
        self.finished: dict[str, int] = {}                 # finish reason -> count
        self.prompt_tokens = self.tokens = self.cycles = self.draft_n = self.draft_n_accepted = 0
        self.accepted_by_slot: dict[int, int] = {}
        self.tokens_by_slot: dict[int, int] = {}
        self.passes: dict[str, int] = {}
        self.decode_seconds: dict[str, float] = {}
        self.drafts: dict[str, list[int]] = {}              # source -> [drafted, accepted]
        self.n_drafts = 0                                   # cycles that drafted (llama.cpp's drafts)
        self.accepted_by_pos: dict[int, int] = {}           # position in a cycle's draft -> times accepted

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def generation(self, job) -> None:
        """Count a finished (or failed) jobs.Job."""
        with self.lock:
            self.finished[job.finish] = self.finished.get(job.finish, 0) + 1
            self.prompt_tokens += len(job.prompt)
            for c in job.cycles:
                self.tokens += len(c.committed)
                self.cycles += 1
                self.accepted_by_slot[job.slot] = self.accepted_by_slot.get(job.slot, 0) + c.n_accepted
                self.tokens_by_slot[job.slot] = self.tokens_by_slot.get(job.slot, 0) + len(c.committed)
                for r, n in c.passes.items():
                    self.passes[r] = self.passes.get(r, 0) + n
                for r, t in c.decode_seconds.items():
                    self.decode_seconds[r] = self.decode_seconds.get(r, 0.0) + t
            d = modes.draft_counts(job.cycles)
            self.n_drafts += d.n_drafts
            for pos, n in d.accepted_by_pos.items():
                self.accepted_by_pos[pos] = self.accepted_by_pos.get(pos, 0) + n
            for src, (n, acc) in d.items():
                s = self.drafts.setdefault(src, [0, 0])
                s[0] += n
                s[1] += acc
            self.draft_n += d.drafted
            self.draft_n_accepted += d.accepted

    def render(self, pool_stats: dict | None) -> str:
        out: list[str] = []

        def metric(name, kind, help_, samples, prefix="prove_"):
            out.append(f"# HELP {prefix}{name} {help_}")
            out.append(f"# TYPE {prefix}{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                out.append(f"{prefix}{name}{{{lab}}} {value}" if lab else f"{prefix}{name} {value}")

        with self.lock:
            metric("requests_total", "counter", "HTTP requests answered, by endpoint and status",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            metric("generations_total", "counter",
                   "generations by how they ended (stop, length, cancelled = client gone, error)",
                   [({"finish": f}, n) for f, n in sorted(self.finished.items())])
            metric("prompt_tokens_total", "counter", "prompt tokens of the generations", [({}, self.prompt_tokens)])
            metric("tokens_generated_total", "counter", "tokens committed", [({}, self.tokens)])
            metric("cycles_total", "counter", "decoding cycles", [({}, self.cycles)])
            metric("tokens_per_cycle", "gauge", "tokens committed per cycle, over all generations",
                   [({}, self.tokens / self.cycles if self.cycles else 0.0)])
            metric("accepted_tokens_total", "counter", "accepted proposals (Cycle.n_accepted) per engine slot",
                   [({"slot": s}, n) for s, n in sorted(self.accepted_by_slot.items())])
            metric("slot_tokens_total", "counter", "tokens committed per engine slot",
                   [({"slot": s}, n) for s, n in sorted(self.tokens_by_slot.items())])
            metric("draft_n_total", "counter", "tokens drafted (llama.cpp's draft_n; slot 1 of a MARS block is none)",
                   [({}, self.draft_n)])
            metric("draft_n_accepted_total", "counter", "drafted tokens accepted (draft_n_accepted)",
                   [({}, self.draft_n_accepted)])
            metric("drafts_total", "counter", "tokens drafted, by source (mask: MARS slots after the first, "
                   "lookup: copied from the prompt and answer, draft: a draft model)",
                   [({"source": s}, d[0]) for s, d in sorted(self.drafts.items())])
            metric("drafts_accepted_total", "counter", "drafted tokens accepted, by source",
                   [({"source": s}, d[1]) for s, d in sorted(self.drafts.items())])
            metric("passes_total", "counter", "forward passes (llama_decode calls) per model",
                   [({"model": r}, n) for r, n in sorted(self.passes.items())])
            metric("decode_seconds_total", "counter", "seconds in llama_decode per model",
                   [({"model": r}, round(t, 6)) for r, t in sorted(self.decode_seconds.items())])
            # llama-server's names (the same counts as draft_n_total / draft_n_accepted_total above)
            ll = "llamacpp:"
            metric("spec_decode_num_drafts_total", "counter", "drafts: cycles that drafted at least one token",
                   [({}, self.n_drafts)], ll)
            metric("spec_decode_num_draft_tokens_total", "counter", "drafted tokens",
                   [({}, self.draft_n)], ll)
            metric("spec_decode_num_accepted_tokens_total", "counter", "drafted tokens accepted",
                   [({}, self.draft_n_accepted)], ll)
            metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "accepted tokens by their position in the draft (0: the first drafted token)",
                   [({"position": i}, n) for i, n in sorted(self.accepted_by_pos.items())], ll)
        if pool_stats is not None:
            metric("slots", "gauge", "engines (--parallel)", [({}, pool_stats["slots"])])
            metric("slots_busy", "gauge", "engines decoding now", [({}, pool_stats["busy"])])
            metric("queue_length", "gauge", "requests waiting for an engine", [({}, pool_stats["waiting"])])
            metric("queue_capacity", "gauge", "most requests that may wait (--queue)",
                   [({}, pool_stats["queue_capacity"])])
            metric("queue_peak", "gauge", "most requests that waited at once", [({}, pool_stats["peak_waiting"])])
            metric("requests_rejected_total", "counter", "requests refused with 503 (queue full)",
                   [({}, pool_stats["rejected"])])
            b = pool_stats.get("batch")
            if b is not None:        # a batched pool (batching.py): every slot's passes in one decode per step
                metric("batch_steps_total", "counter", "batched steps (each slot's next pass, decoded together)",
                       [({}, b["steps"])])
                metric("batch_decodes_total", "counter", "llama_decode calls of the batched steps", [({}, b["decodes"])])
                metric("batch_tokens_total", "counter", "tokens those decodes evaluated", [({}, b["tokens"])])
                metric("batch_decode_seconds_total", "counter", "seconds inside those llama_decode calls",
                       [({}, round(b["decode_seconds"], 6))])
                metric("batch_step_seconds_total", "counter",
                       "seconds the decode thread spent in steps (over wall time: how busy it was)",
                       [({}, round(b["step_seconds"], 6))])
            c = pool_stats.get("prompt_cache")
            if c is not None:        # the batched pool's saved prompt states (batching.PromptCache)
                metric("prompt_cache_bytes", "gauge", "host memory held by saved prompt states", [({}, c["bytes"])])
                metric("prompt_cache_entries", "gauge", "saved prompt states", [({}, c["entries"])])
                metric("prompt_cache_hits_total", "counter", "requests that started from a saved state",
                       [({}, c["hits"])])
                metric("prompt_cache_tokens_total", "counter", "prompt tokens restored instead of prefilled",
                       [({}, c["tokens_restored"])])
        return "\n".join(out) + "\n"


def _label(value) -> str:
    """A Prometheus label value, escaped as the text format requires."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
