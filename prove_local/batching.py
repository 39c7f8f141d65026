"""Several requests decoded in one `llama_decode` per step (continuous batching, as llama-server's slots).

The engines of a pool (pool.py) share one llama.cpp context per role (target, verifier, draft),
made with `n_seq` sequences (llama.Context(n_seq=...): `n_seq_max` = the slots, `kv_unified` off, so
each sequence has KV cells of its own and attention reads only them). Each engine gets a `SeqView`
per role: the interface of a one-sequence `llama.Context` (`n_past`, `eval`, `eval_view`, `truncate`,
`n_stock`, the adapter flag, the counters), so the decoding rules (rules.py, modes.py) and the engine
are the same functions over it as over a context of their own: the batching lives below them.

A view's `eval` submits its pass (tokens, positions, sequence id, the rows it reads, adapter on or
off) to the pool's `Batcher` and blocks. A *step* starts when every engine that is in the middle of
its generation's code has a pass waiting (an engine whose generation handed a cycle to its consumer
is waited for `PARK_GRACE_S` at most; an idle one, not at all). The batcher's one decode thread then
puts every waiting pass into one `llama_batch` per context (each token with its sequence id, logits
only on the rows asked for), calls `llama_decode` once, and hands each view its rows: a copy, or for a
rule's `eval_view` in a generation a view into llama.cpp's buffer, which no decode overwrites before
the engine's next pass or the end of its cycle (Batcher._step; every decode on one OS thread: see
Batcher). The adapter switch (`llama_set_adapters_lora`) is per context, so passes with the adapter on
and passes with it off go into separate decodes of the same step; a step whose passes exceed the
context's `n_batch` is several decodes. `truncate` is `llama_memory_seq_rm` on the view's sequence
only; an engine keeps its committed sequence between requests (prefix reuse per sequence, as with a
context of its own).

Isolation: a decode that fails is retried pass by pass, alone, so only the pass that fails gets the
error; a thread that gives up while its pass waits (an exception, an interrupt) takes the pass out
of the step, or, when the step has it already, the positions it wrote are dropped; an engine whose
generation ends (finished, closed, failed) leaves the barrier at once (Engine._run). Nothing of one
request's decoding depends on which others share its steps: with F32 weights each sequence's rows
are bitwise those of the same request alone (tests/test_batching.py).

Limits (llama.cpp's, in the vendored version): with `kv_unified` off llama.cpp splits a batch into
ubatches of *equal* token counts over *consecutive* sequence ids (`split_equal`), so a step of passes of
different widths, or of sequences 0 and 2 without 1, is computed as several graphs inside the one
`llama_decode`; a step of one-token passes of sequences 0..k-1 is one (the pool keeps its busy
sequences consecutive where it can: pool.EnginePool._contiguous).
"""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from .errors import ContextFull, LlamaError
from .llama import Context

PARK_GRACE_S = 0.005      # how long a step waits for an engine whose generation handed a cycle to its consumer
PROMPT_CACHE_MIB = 256    # host memory for the pool's saved prompt states (PromptCache)
PROMPT_CACHE_MIN = 16     # tokens a saved state must spare a prefill, at least, to be saved or used

IDLE, RUNNING, PENDING, PARKED = "idle", "running", "pending", "parked"


class _Pass:
    """One pass of one view: what to decode, and what came of it."""
    __slots__ = ("view", "seq", "pos", "tokens", "rows", "adapter", "lend", "result", "error", "taken", "abandoned",
                 "done", "batch", "seconds")

    def __init__(self, view: "SeqView", pos: int, tokens: list[int], rows: list[int], adapter: bool,
                 lend: bool = False):
        self.view, self.seq, self.pos, self.tokens, self.rows, self.adapter = view, view.seq, pos, tokens, rows, adapter
        self.lend = lend             # its rows may be a view into llama.cpp's buffer (SeqView.eval_view; Batcher._step)
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None
        self.taken = False           # a step has it (it is no longer in the waiting list)
        self.abandoned = False       # its thread gave up waiting for it
        self.done = False            # result or error handed over (set with the lock held, when its step ends)
        self.batch = (0, 0)          # (sequences, tokens) of the llama_decode it was in
        self.seconds = 0.0           # its share of that decode's time, by tokens


class Member:
    """One engine's place in the steps (the same sequence id in every shared context). The engine
    calls `resume` when its generation's code runs (a step then waits for its next pass), `park`
    when the generation hands a cycle to its consumer, and `leave` when the generation ends."""

    def __init__(self, batcher: "Batcher", seq: int):
        self.batcher, self.seq = batcher, seq
        self.state = IDLE
        self.generating = False
        self.parked_at = 0.0

    def resume(self) -> None:
        self.batcher._set(self, RUNNING, True)

    def park(self) -> None:
        self.batcher._set(self, PARKED, True)

    def leave(self) -> None:
        self.batcher._set(self, IDLE, False)


class Batcher:
    """The step barrier of a pool's engines, and the one thread that decodes their steps.

    This thread runs the steps (builds each batch, hands out the rows); their llama_decode calls, like
    every other of the process, run on llama.py's compute thread (llama.decode: one OpenMP team for the
    whole process, or ggml's barriers stop spinning). `grace`: seconds a step waits for a parked engine."""

    def __init__(self, grace: float = PARK_GRACE_S):
        self._cond = threading.Condition(threading.Lock())
        self._llama = threading.RLock()          # llama.cpp calls on the shared contexts: one at a time
        self.members: list[Member] = []
        self._waiting: list[_Pass] = []
        self.grace = grace
        self.steps = 0                           # steps run, and llama_decode calls made in them
        self.decodes = 0
        self.tokens = 0                          # tokens those decodes evaluated
        self.decode_seconds = 0.0                # time inside them (llama_decode)
        self.step_seconds = 0.0                  # time in steps (the decodes and the batches' host work)
        self.closed = False
        self._thread: threading.Thread | None = None

    def stats(self) -> dict:
        """Counters since start: steps, llama_decode calls, tokens they evaluated, seconds inside them
        and seconds in steps (a front end's metrics; step seconds over wall time is how busy the
        decode thread was, decode over step seconds how much of a step llama.cpp took)."""
        with self._cond:
            return {"steps": self.steps, "decodes": self.decodes, "tokens": self.tokens,
                    "decode_seconds": self.decode_seconds, "step_seconds": self.step_seconds}

    def member(self, seq: int) -> Member:
        m = Member(self, seq)
        with self._cond:
            self.members.append(m)
        return m

    def _set(self, m: Member, state: str, generating: bool) -> None:
        with self._cond:
            m.generating = generating
            if m.state != PENDING:               # (a pending member is blocked in run(): its own thread)
                m.state = state
                if state == PARKED:
                    m.parked_at = time.monotonic()
            # only the decode thread cares, and only while passes wait for a step (threads waiting for
            # their pass wait for its `done`): a lone request's resume and park per cycle must not wake it
            if self._waiting:
                self._cond.notify_all()

    def _blocked(self) -> tuple[bool, float | None]:
        """Whether a step must wait (lock held), and for how long at most (None: until notified)."""
        now, wait = time.monotonic(), None
        for m in self.members:
            if m.state == RUNNING:
                return True, None
            if m.state == PARKED and m.generating:
                left = m.parked_at + self.grace - now
                if left > 0:
                    wait = left if wait is None else min(wait, left)
        return wait is not None, wait

    def run(self, p: _Pass) -> np.ndarray:
        """Decode pass `p` in the next step (its view's thread; blocks); its rows, or its error raised."""
        m = p.view.member
        cond = self._cond
        with cond:
            if self.closed:
                raise LlamaError(f"{p.view.model.path}: this context is closed")
            if not self._waiting and not self.others_generating(m):
                return self._alone(p)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="prove-local batch", daemon=True)
                self._thread.start()
            back = RUNNING if m.generating else IDLE
            m.state = PENDING
            self._waiting.append(p)
            cond.notify_all()
            try:
                while not p.done:
                    cond.wait()
            except BaseException:
                if p in self._waiting:
                    self._waiting.remove(p)
                p.abandoned = True
                if m.state == PENDING:
                    m.state = back
                cond.notify_all()
                raise
        if p.error is not None:
            raise p.error
        return p.result

    def _alone(self, p: _Pass) -> np.ndarray:
        """Decode pass `p` as a step of its own on the calling thread (the lock held on entry and on
        return): no other engine is in a generation, so no pass could join it, and the two thread
        switches to the decode thread and back are spared (what that saves was within this machine's
        noise: docs/server.md). The `_llama` lock orders it with a step the decode thread may still be running.
        An engine that starts a generation meanwhile finds this one RUNNING and waits for its next pass,
        which then goes through the decode thread with its own: batching resumes by itself."""
        p.taken = True
        self._cond.release()
        t0 = time.perf_counter()
        try:
            self._step([p])
        except Exception as e:       # noqa: BLE001 - as in _loop
            if p.result is None and p.error is None:
                p.error = e
        finally:
            self._cond.acquire()
            self.steps += 1
            self.step_seconds += time.perf_counter() - t0
            p.done = True
        if p.error is not None:
            raise p.error
        return p.result

    def close(self) -> None:
        """Stop the decode thread; a pass still waiting gets LlamaError."""
        with self._cond:
            self.closed = True
            for q in self._waiting:
                q.error, q.done = LlamaError(f"{q.view.model.path}: this context was closed"), True
            self._waiting = []
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(30)

    def _loop(self) -> None:
        """The decode thread: one step whenever the barrier allows, until closed."""
        cond = self._cond
        with cond:
            while not self.closed:
                blocked, wait = self._blocked() if self._waiting else (True, None)
                if blocked:
                    cond.wait(wait)
                    continue
                step, self._waiting = self._waiting, []
                for q in step:
                    q.taken = True
                cond.release()
                t0 = time.perf_counter()
                try:
                    self._step(step)
                except Exception as e:       # noqa: BLE001 - a bug here must not hang the requests
                    for q in step:
                        if q.result is None and q.error is None:
                            q.error = e
                finally:
                    cond.acquire()
                    self.steps += 1
                    self.step_seconds += time.perf_counter() - t0
                    for q in step:
                        if q.result is not None or q.error is not None:
                            q.done = True        # its thread runs on from here: the next step waits for it
                            mem = q.view.member
                            if mem.state == PENDING:
                                mem.state = RUNNING if mem.generating else IDLE
                        elif not q.abandoned:    # (not reached: every pass of a step ends with one)
                            q.taken = False
                            self._waiting.append(q)
                    cond.notify_all()

    def _step(self, step: list[_Pass]) -> None:
        """Decode the passes of a step: one llama_decode per context, or more where adapter and stock passes
        meet or the tokens exceed n_batch. Rows are copied out of llama.cpp's buffer, except those of the
        passes that may borrow them (`lend`: a rule's `eval_view` of an engine in a generation) in the last
        decode of their context in the step: no decode of that context comes before their engine's next
        pass or the end of its cycle, because a step waits for every engine in the middle of its cycle
        (`_blocked`), and a pass of an engine that is not in a generation, which no step waits for, never
        borrows. A 17-row verify pass over a 151,936-token vocabulary is 10 MB of copies otherwise."""
        groups: dict[tuple[int, bool], list[_Pass]] = {}
        for q in step:
            if not q.abandoned:
                groups.setdefault((id(q.view.shared), q.adapter), []).append(q)
        decodes = []                                 # (context, passes, adapter), in order
        for (_, adapter), qs in groups.items():
            qs.sort(key=lambda q: q.seq)
            ctx = qs[0].view.shared
            part, n = [], 0
            for q in qs:
                if part and n + len(q.tokens) > ctx.n_batch:
                    decodes.append((ctx, part, adapter))
                    part, n = [], 0
                part.append(q)
                n += len(q.tokens)
            decodes.append((ctx, part, adapter))
        last = {id(ctx): i for i, (ctx, _, _) in enumerate(decodes)}
        with self._llama:
            try:
                for i, (ctx, part, adapter) in enumerate(decodes):
                    self._decode(ctx, part, adapter, lend=last[id(ctx)] == i)
            finally:
                for q in step:                   # what a pass nobody waits for, or an unfinished one, wrote
                    if q.abandoned or (q.result is None and q.error is None):
                        q.view.shared.drop(q.seq, q.pos)

    def _decode(self, ctx: Context, qs: list[_Pass], adapter: bool, lend: bool = False) -> None:
        """One llama_decode of passes `qs` on `ctx` (the _llama lock held); a failure is retried pass by
        pass, so that only the pass that fails gets the error. `lend`: no later decode of `ctx` in this
        step, so the passes that may borrow their rows get views (`_step`)."""
        before = ctx.decode_seconds
        views = [q.lend and q.view.member.generating for q in qs] if lend else None
        try:
            outs = ctx.decode_batch([(q.seq, q.pos, q.tokens, q.rows) for q in qs], adapter, views)
        except Exception as e:       # noqa: BLE001 - handed to the pass's own thread
            self.decodes += 1
            if len(qs) == 1:
                qs[0].error = e
            else:
                for q in qs:                     # (copies: each retry is a decode of its own)
                    self._decode(ctx, [q], adapter)
            return
        self.decodes += 1
        seconds = ctx.decode_seconds - before
        n = sum(len(q.tokens) for q in qs)
        self.tokens += n
        self.decode_seconds += seconds
        for q, out in zip(qs, outs):
            q.batch, q.seconds = (len(qs), n), seconds * len(q.tokens) / n
            q.result = out

    def others_generating(self, m: Member) -> bool:
        """Whether an engine other than `m`'s is in the middle of a generation (its passes join the steps)."""
        return any(o.generating for o in self.members if o is not m)


class SeqView:
    """Sequence `seq` of a shared context, as the decoding rules see a context: `n_past`, `eval(tokens,
    rows)`, `eval_view` (a view into llama.cpp's buffer where Batcher._step can lend one), `truncate(n)`,
    `n_stock` and `gated` (a gated MARS adapter), `n_decode` and `decode_seconds` (its share, by
    tokens, of each llama_decode its passes were in), `batches` ((sequences, tokens) of the recent ones),
    `others` ((other sequences, their tokens) in the decodes of its recent stock passes)."""

    def __init__(self, shared: Context, seq: int, member: Member):
        self.shared, self.seq, self.member, self.batcher = shared, seq, member, member.batcher
        self.model, self.adapter = shared.model, shared.adapter
        self.n_ctx, self.n_batch, self.n_vocab = shared.n_ctx, shared.n_batch, shared.n_vocab
        self.n_past = 0
        self.n_stock = 0            # as llama.Context.n_stock: positions [0, n_stock) hold stock KV
        self.n_decode = 0
        self.decode_seconds = 0.0
        self.wait_seconds = 0.0     # time in Batcher.run beyond its passes' share of the decodes (Cycle.waited)
        self.batches: collections.deque = collections.deque(maxlen=256)
        # (other sequences, their tokens) in the llama_decode of each recent stock pass (not the
        # adapter's: those decode apart from the stock passes): the load the planner prices widths in (Engine._load)
        self.others: collections.deque = collections.deque(maxlen=16)
        self.prompt_cache: PromptCache | None = None     # the pool's (target views only: Shared.views)
        self.closed = False

    @property
    def _ctx(self):
        """The llama context this view decodes on; None once the view or the shared context is closed
        (as llama.Context's, which the engine's and the tests' closing checks read)."""
        return None if self.closed else getattr(self.shared, "_ctx", None)

    @property
    def gated(self) -> bool:
        return self.adapter is not None

    @property
    def n_threads(self) -> int:
        return self.shared.n_threads

    @property
    def flash_attn(self):
        return getattr(self.shared, "flash_attn", None)

    def set_threads(self, n: int) -> None:
        """The shared context's threads (every sequence's passes: they are decoded together)."""
        with self.batcher._llama:
            self.shared.set_threads(n)

    def eval(self, tokens: list[int], rows: list[int] | None = None, adapter: bool = False) -> np.ndarray:
        """The rows of a pass of `tokens` (default: the last), a copy the caller owns."""
        return self._eval(tokens, rows, adapter, lend=False)

    def eval_view(self, tokens: list[int], rows: list[int] | None = None, adapter: bool = False) -> np.ndarray:
        """As `eval`, but during a generation the rows may be a view into llama.cpp's buffer (as
        llama.Context.eval_view's: valid until this view's next pass or the end of the engine's cycle,
        which is all a rule needs; Batcher._step)."""
        return self._eval(tokens, rows, adapter, lend=True)

    def _eval(self, tokens, rows, adapter: bool, lend: bool) -> np.ndarray:
        if not self._ctx:
            raise LlamaError(f"{self.model.path}: this context is closed")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise LlamaError(f"{self.model.path}: a pass of no tokens")
        rows = [len(tokens) - 1] if rows is None else [int(r) for r in rows]
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFull(f"{self.n_past} + {len(tokens)} tokens do not fit the {self.n_ctx}-token context")
        if adapter and self.adapter is None:
            raise LlamaError(f"{self.model.path}: an adapter pass on a context without an adapter")
        start = self.n_past
        if len(tokens) <= self.n_batch:          # one chunk: every pass of a cycle
            out = self._pass(tokens, rows, adapter, lend)
        else:
            outs, where = [], []
            for first in range(0, len(tokens), self.n_batch):
                chunk = tokens[first:first + self.n_batch]
                mine = [i for i, r in enumerate(rows) if first <= r < first + len(chunk)]
                outs.append(self._pass(chunk, [rows[i] - first for i in mine], adapter))
                where += mine
            out = np.empty((len(rows), self.n_vocab), dtype=np.float32)
            if rows:
                out[where] = np.concatenate(outs)
        if adapter:                              # (as llama.Context: an adapter pass writes no stock KV)
            self.n_stock = min(self.n_stock, start)
        elif self.n_stock == start:
            self.n_stock = start + len(tokens)
        return out

    def _pass(self, tokens: list[int], rows: list[int], adapter: bool, lend: bool = False) -> np.ndarray:
        p = _Pass(self, self.n_past, tokens, rows, adapter, lend)
        t0 = time.perf_counter()
        out = self.batcher.run(p)
        self.wait_seconds += max(0.0, time.perf_counter() - t0 - p.seconds)
        self.n_past += len(tokens)
        self.n_decode += 1
        self.decode_seconds += p.seconds
        self.batches.append(p.batch)
        if not adapter:
            self.others.append((p.batch[0] - 1, p.batch[1] - len(tokens)))
        return out

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of this sequence (`llama_memory_seq_rm` on it alone)."""
        if not self._ctx:
            return
        if n < 0 or n > self.n_past:
            raise LlamaError(f"cannot truncate a context of {self.n_past} tokens to {n}")
        with self.batcher._llama:
            self.shared.drop(self.seq, n)
        self.n_past = n
        self.n_stock = min(self.n_stock, n)

    def state(self, limit: int | None = None) -> bytes | None:
        """This sequence's KV state (llama.Context.seq_state; PromptCache.keep)."""
        with self.batcher._llama:
            return self.shared.seq_state(self.seq, limit=limit)

    def set_state(self, data: bytes, n: int) -> None:
        """Replace this sequence's KV with a `state()` of n positions (PromptCache.fill); empty on failure."""
        with self.batcher._llama:
            self.n_past = self.n_stock = 0
            self.shared.set_seq_state(self.seq, data)
            self.n_past = self.n_stock = n

    def close(self) -> None:
        """Empty this sequence and refuse later passes (the shared context is its owner's to close)."""
        if not self.closed:
            self.truncate(0)
            self.closed = True

    def __enter__(self) -> "SeqView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PromptCache:
    """Sequences' KV states kept in host memory by their tokens (llama-server's `--cache-ram`), shared
    by a pool's engines (batched or not: pool.py): when an engine is about to drop a committed
    sequence for a new request (the request shares a short prefix with it), the target's state is
    saved here first, unless a saved state holds those tokens already; when a request
    lands on an engine that holds less of its prompt than a saved state does, that state is written
    into the engine's sequence and only the rest is prefilled. The state is llama.cpp's own bytes
    (`llama_state_seq_get_data`), so the cache it gives back is the one the prefill would have
    computed, bit for bit (with flash attention off a token's KV does not depend on its batch-mates:
    tests/test_batching.py). Least recently used states go first beyond `capacity` bytes."""

    def __init__(self, capacity: int = PROMPT_CACHE_MIB << 20, min_tokens: int = PROMPT_CACHE_MIN):
        self.capacity, self.min_tokens = capacity, min_tokens
        self._entries: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.saved = self.hits = self.tokens_restored = 0

    def __len__(self) -> int:
        return len(self._entries)

    def save(self, tokens: list[int], data: bytes) -> None:
        key = tuple(tokens)
        if len(data) > self.capacity:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= len(old)
            self._entries[key] = data
            self.bytes += len(data)
            self.saved += 1
            while self.bytes > self.capacity:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= len(gone)

    def best(self, prompt: list[int]) -> tuple[int, bytes, int] | None:
        """(tokens of `prompt` a saved state holds, that state, its length) for the state sharing the
        longest prefix with `prompt` (the most recent on a tie), or None when there is none."""
        want = np.asarray(prompt, dtype=np.int64)
        best = None
        with self._lock:
            for key in reversed(self._entries):
                n = min(len(key), len(want))
                same = np.asarray(key[:n], dtype=np.int64) == want[:n]
                common = n if same.all() else int(np.argmin(same))
                if best is None or common > best[0]:
                    best = (common, key)
            if best is None or best[0] == 0:
                return None
            self._entries.move_to_end(best[1])
            return best[0], self._entries[best[1]], len(best[1])

    def keep(self, ctx, tokens: list[int]) -> None:
        """Save the first len(tokens) positions of `ctx` (a llama.Context or a SeqView, whose positions
        hold `tokens` as stock KV); what it holds beyond them is dropped first."""
        n = len(tokens)
        if n < self.min_tokens or n > min(ctx.n_past, ctx.n_stock):
            return
        held = self.best(tokens)
        if held is not None and held[0] == n:   # a saved state holds them all: no copy of it again
            return
        if n < ctx.n_past:
            ctx.truncate(n)
        data = ctx.state(limit=self.capacity)    # (a state larger than the whole cache is not copied at all)
        if data is not None:
            self.save(tokens, data)

    def fill(self, ctx, prompt: list[int], have: int) -> int:
        """Write into `ctx` the saved state sharing the longest prefix with `prompt` if it holds at least
        `min_tokens` more of it than the `have` positions `ctx` holds already; the positions `ctx` then
        holds (a prefix of `prompt`), `have`, or 0 when llama.cpp refused the state (`ctx` is empty then)."""
        hit = self.best(prompt[:-1])            # (the last prompt token is the first cycle's)
        if hit is None or hit[0] < have + self.min_tokens:
            return have
        common, data, length = hit
        try:
            ctx.set_state(data, length)
        except LlamaError:
            return 0
        if common < length:
            ctx.truncate(common)
        with self._lock:
            self.hits += 1
            self.tokens_restored += common - have
        return common

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "saved": self.saved, "hits": self.hits,
                    "tokens_restored": self.tokens_restored}


class Shared:
    """The shared contexts of `n_seq` engines on the same models: one llama.Context with `n_seq`
    sequences per role, one Batcher, a Member per sequence. `views(i)`: sequence i's contexts (what
    Engine.load takes as `contexts`); `close` frees the contexts (after the engines: Engine.close
    empties its sequences)."""

    def __init__(self, models: dict, n_seq: int, *, adapter=None, grace: float = PARK_GRACE_S,
                 prompt_cache: "PromptCache | None" = None, **context_options):
        if n_seq < 1:
            raise LlamaError(f"a shared context needs at least one sequence, not {n_seq}")
        self.n_seq = n_seq
        self.batcher = Batcher(grace)
        self.contexts: dict[str, Context] = {}
        try:
            for role, m in models.items():
                if m is not None:
                    self.contexts[role] = Context(m, adapter=adapter if role == "target" else None,
                                                  n_seq=n_seq, **context_options)
        except BaseException:
            self.close()
            raise
        self.members = [self.batcher.member(i) for i in range(n_seq)]
        self.prompt_cache = prompt_cache         # the pool's (pool.py), given to the target views; None: none

    @property
    def flash_attn(self) -> str:
        """The shared contexts' flash attention ("on" or "off": llama.Context.flash_attn)."""
        return next(iter(self.contexts.values())).flash_attn

    def views(self, i: int) -> dict[str, SeqView]:
        if not 0 <= i < self.n_seq:
            raise LlamaError(f"sequence {i} of a {self.n_seq}-sequence shared context")
        views = {role: SeqView(ctx, i, self.members[i]) for role, ctx in self.contexts.items()}
        if "target" in views and self.prompt_cache is not None:
            views["target"].prompt_cache = self.prompt_cache
        return views

    def close(self) -> None:
        self.batcher.close()
        with self.batcher._llama:
            for ctx in self.contexts.values():
                ctx.close()
