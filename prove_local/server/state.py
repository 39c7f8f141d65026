"""What the app serves: the engine pool once the models are loaded, the server's defaults, the API
keys, the counters and the open generations; at shutdown it stops the generations and frees the
engines, then the models (`close`)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import modes
from ..engine import Settings
from ..errors import ModeError, ProveError
from ..loading import load_models
from ..batching import PROMPT_CACHE_MIB
from ..pool import EnginePool
from .guard import Policy
from .metrics import Metrics

DEFAULT_MAX_BODY = 2 * 1024 * 1024     # bytes; a 32k-token conversation is ~130 kB of text
DEFAULT_READ_TIMEOUT = 30.0            # seconds for a request's head, and again for its body
DEFAULT_REQUEST_TIMEOUT = 600.0        # seconds a generation may hold its engine (0: no deadline)


@dataclass
class State:
    """What the app serves: the pool once loaded, the keys, the counters and the open jobs."""
    keys: list[str] = field(default_factory=list)
    max_body: int = DEFAULT_MAX_BODY
    pool: object = None
    error: ProveError | None = None
    defaults: object = None                  # engine.Settings a request starts from
    model_ids: dict = field(default_factory=dict)   # role -> id
    created: int = 0
    metrics: Metrics = field(default_factory=Metrics)
    jobs: set = field(default_factory=set)
    mode_errors: dict = field(default_factory=dict)
    closing: bool = False
    policy: Policy = field(default_factory=Policy)      # Host / Origin rules (guard.py)
    read_timeout: float = DEFAULT_READ_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    owns: bool = False                       # close frees the pool and the models (load sets it: it made them)

    def load(self, args) -> None:
        loaded = load_models(args, parallel=args.parallel)
        pool = EnginePool(loaded, args.parallel, max_queue=args.queue,
                          batched=not getattr(args, "no_batching", False),
                          prompt_cache_mib=getattr(args, "cache_ram", PROMPT_CACHE_MIB))
        first = pool.first
        mode = args.mode or first.default_mode()
        defaults = Settings(mode=mode, block=args.block, theta=args.theta, tau=args.tau, draft_k=args.draft_k,
                            lookup=args.lookup, recall=not getattr(args, "no_recall", False),
                            temperature=args.temperature, sampler=args.sampler)
        first.check(replace(defaults, temperature=0.0))    # a bad --mode/--block is a start-up error
        first.prepare(defaults)     # --block auto: pass costs calibrated (or read from the cache) before serving
        for m in modes.NAMES:
            try:
                first.check(Settings(mode=m))
            except ModeError as e:
                self.mode_errors[m] = str(e)
        self._name_models(loaded)
        self.created = int(Path(loaded.target.path).stat().st_mtime) if Path(loaded.target.path).exists() else 0
        self.defaults = defaults
        self.owns = True
        self.pool = pool                         # last: /health turns 200 now
        if self.closing:                         # the server stopped while the models loaded
            self.close()

    def _name_models(self, loaded) -> None:
        """The model ids of /v1/models: the file names, made unique when two roles use like-named files."""
        for role, m in (("target", loaded.target), ("verifier", loaded.verifier), ("draft", loaded.draft)):
            if m is not None:
                mid = Path(m.path).stem
                self.model_ids[role] = mid if mid not in self.model_ids.values() else f"{mid}-{role}"

    def describe(self) -> str:
        models = ", ".join(f"{r} {i}" for r, i in self.model_ids.items())
        batched = ", batched" if getattr(self.pool, "shared", None) is not None else ""
        target = getattr(getattr(self.pool, "loaded", None), "target", None)
        huge = getattr(target, "hugepages", None) or {}
        pages = "; weights on huge pages" if huge.get("on") else ""
        return (f"{models}; mode {self.defaults.mode}, {self.pool.parallel} parallel{batched}, "
                f"queue {self.pool.max_queue}{pages}")

    @property
    def model_id(self) -> str:
        return self.model_ids.get("target", "prove-local")

    def shutdown(self) -> None:
        """Stop the open generations at their next cycle; new requests are refused."""
        self.closing = True
        for job in list(self.jobs):
            job.cancel.set()

    def close(self, timeout: float = 5.0) -> bool:
        """At the server's shutdown (the app's lifespan): stop the open generations, free the engines
        (the pool waits up to `timeout` seconds for the requests holding them), then the models, where
        this state made them (`owns`: a pool handed in stays its owner's). With an engine still busy
        after that the models stay loaded (the process is ending). Whether all it owns was freed."""
        self.shutdown()
        pool = self.pool
        if pool is None or not self.owns:        # still loading (load closes what it loads), or not ours
            return True
        if not pool.close(timeout):
            return False
        pool.loaded.close()
        return True
