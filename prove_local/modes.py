"""The decoding modes, declared once. The engine, the planner, the command lines, the UI, the server
and the bench read this table instead of keeping mode lists or comparing mode names.

A mode names the contexts it decodes with, whether it needs a mask token, whether its output is
exactly ar's, which width it takes (`block` or `draft_k`), which setting its gate reads (θ, τ), how
its cycles commit (the AR token free in slot 1, a correction token after the run), the cycle function
of rules.py it runs, and the width of every pass that cycle makes. What a cycle costs is one
function of those widths (`cycle_cost`): the planner, the bench and the UI's explanation use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import rules
from .errors import ModeError
from .rules import AR_PLAN, Plan
from .sampling import GREEDY_ARGMAX

DEFAULT_BLOCK = 16          # proposal slots when neither the request nor the GGUF (prove.block_size) says
DEFAULT_DRAFT_K = 4         # spec's drafted tokens per cycle when fixed widths are asked for


@dataclass(frozen=True)
class Mode:
    name: str
    title: str                      # for people: "ProVe-lossless"
    summary: str
    roles: tuple[str, ...]          # contexts the mode decodes with; "target" first
    needs_mask: bool
    exact: bool                     # greedy output equals ar's token for token; sampled output too, for
                                    # the seed (coupled sampler), or in distribution (rejection sampler)
    width: str | None               # the width the mode takes: "block", "draft_k" or None (ar)
    gate: str | None                # the setting its gate reads: "theta", "tau", or None (an equality test)
    gate_text: str                  # the gate, for people ({theta}/{tau} filled in)
    q_text: str                     # what p̃ and q are in this mode, for people
    free_first: bool                # slot 1 is the target's own AR token: always committed
    correction: bool                # commits the target's own token after the accepted run
    verify_choice: bool             # the verify pass reads a chosen number of the proposed tokens
    # run one cycle (the named *_cycle functions below): (contexts by role, committed tokens, plan, settings,
    # mask token, sampler, hooks) -> Cycle
    cycle: Callable
    # widths of its passes per role, given the tokens pending in each context: {role: [n, ...]} (*_widths)
    widths: Callable[[dict, Plan], dict]
    # the Plan field that is a cycle's width (the planner's options, `plan_width`): "block", "draft_k", "lookup"
    width_field: str
    # a cycle's label for people, from its plan's fields ({block}, {verify}: the verified slots, {draft_k},
    # {lookup}); a filled proposal's lookup tokens go in front ("L=2+B=8 v=4")
    label_text: str
    lookup: bool = False            # takes lookup drafts (lookup.py), verified exactly: needs no mask token
    source: str | None = None       # where its proposed slots come from: "mask", "draft", "lookup" (Cycle.source);
                                    # None: its cycles propose nothing (ar)

    @property
    def partner(self) -> str | None:
        """The second model's role ("verifier", "draft"), if the mode needs one."""
        return self.roles[1] if len(self.roles) > 1 else None

    @property
    def proposes(self) -> bool:
        """Whether this kind's cycles propose tokens (False: a plain ar cycle)."""
        return self.source is not None

    def width_of(self, plan: Plan) -> int:
        """A plan's width: k for spec, the lookup draft for lookup, the block otherwise."""
        return getattr(plan, self.width_field)

    def filled(self, plan: Plan) -> bool:
        """Whether the plan is a MARS proposal whose first slots lookup tokens fill (lossless_fill_cycle)."""
        return self.source == "mask" and plan.lookup > 0

    def tested(self, plan: Plan) -> int:
        """Proposed tokens up for acceptance: the drafted ones (spec, lookup), or the block's verified
        slots (the whole block in prove and mars) after a filled proposal's lookup tokens."""
        if self.width_field != "block":
            return self.width_of(plan)
        return plan.lookup + (plan.block if plan.verify is None else plan.verify)

    def label(self, plan: Plan) -> str:
        """'ar', 'B=4 v=2' (lossless), 'B=4' (prove, mars), 'k=3' (spec), 'L=3' (lookup),
        'L=3+B=4 v=2' (a filled proposal)."""
        fill = f"L={plan.lookup}+" if self.filled(plan) else ""
        v = plan.block if plan.verify is None else plan.verify
        return fill + self.label_text.format(block=plan.block, verify=v, draft_k=plan.draft_k, lookup=plan.lookup)

    def plan(self, block: int, draft_k: int) -> Plan:
        """The plan of a cycle at fixed widths."""
        if self.width is None:
            return Plan(self.name)                  # (ar: AR_PLAN; lookup: no draft, its rule runs ar)
        return Plan(self.name, block=block if self.width == "block" else 1,
                    draft_k=draft_k if self.width == "draft_k" else 0)

    def key(self, settings) -> str:
        """The planner's statistics key: acceptance depends on the gate's setting (prove@0.05)."""
        return f"{self.name}@{getattr(settings, self.gate):g}" if self.gate else self.name

    def expected_tokens(self, slot_rates, n_max: int, gated: bool = False) -> list[float]:
        """Expected tokens committed by a cycle testing n = 0..n_max proposed tokens whose
        (conditional) acceptance per slot is slot_rates (slot 1 included; ignored where it is free):
        the expected accepted run, plus the free first slot and the correction token where the mode
        has them."""
        first = 1 if self.free_first and not gated else 0    # a gated adapter's slot 1 is a guess
        base = first + (1.0 if self.correction else 0.0)
        out, prod, run = [base] * min(first + 1, n_max + 1), 1.0, 0.0
        for r in slot_rates[first:n_max]:
            prod *= r
            run += prod
            out.append(base + run)
        return out


@dataclass(frozen=True)
class Hooks:
    """What a cycle calls back into, next to its plan (which is data): the engine's and the planner's
    decisions that need the cycle's own figures or the committed tokens."""
    # p̃ -> the verify width of a MARS block, called between its two passes (the planner's marginal
    # choice); None: the plan's `verify`
    choose_verify: Callable | None = None
    # k -> (tokens, scores): a lookup draft of at most k tokens from the engine's index, synced to the
    # committed tokens; None: no lookup draft
    propose_lookup: Callable | None = None


NO_HOOKS = Hooks()


# The cycle of each mode: (contexts by role, committed tokens, plan, settings, mask token, sampler, hooks)
# -> Cycle, and the widths of its passes: (tokens pending per role, plan) -> {role: [tokens fed per pass]}.

def _lookup_draft(plan: Plan, hooks: Hooks) -> tuple[list, list]:
    """The lookup draft a plan asks for (none: ([], []))."""
    if plan.lookup and hooks.propose_lookup is not None:
        return hooks.propose_lookup(plan.lookup)
    return [], []


def _sampler(sampler, s):
    """The sampler a rule gets: the request's, or, greedy, `GREEDY_ARGMAX` where nobody reads the
    cycle's probabilities that decide nothing (Settings.p_tilde off: `run`, `serve`; an `ar` token's
    p̃, a verified draft's q): the same tokens without an exp pass over the vocabulary per row (None:
    the rules' GREEDY)."""
    if sampler is None and not getattr(s, "p_tilde", True):
        return GREEDY_ARGMAX
    return sampler


def ar_cycle(c, t, plan, s, mask, sampler=None, hooks=NO_HOOKS):
    return rules.ar_cycle(c["target"], t, sampler=_sampler(sampler, s))


def ar_widths(pend: dict, plan: Plan) -> dict:
    return {"target": [pend["target"]]}


def lossless_cycle(c, t, plan, s, mask, sampler=None, hooks=NO_HOOKS):
    """A MARS block verified by its own model; a proposal filled by lookup tokens where the plan has them
    and the index drafts some (the lookup's draft, else a plain block)."""
    verify = hooks.choose_verify if hooks.choose_verify is not None else plan.verify
    draft, scores = _lookup_draft(plan, hooks)
    sampler = _sampler(sampler, s)
    if draft:
        return rules.lossless_fill_cycle(c["target"], t, draft, scores, plan.block, mask, verify=verify,
                                         sampler=sampler)
    return rules.lossless_cycle(c["target"], t, plan.block, mask, verify=verify, sampler=sampler)


GATED = "gated"             # a key of the pending counts: the target proposes through a gated adapter


def lossless_widths(pend: dict, plan: Plan) -> dict:
    """The proposal pass ([pending, lookup tokens of a filled proposal, masks]) and the verify pass
    (none when a filled proposal's lookup token was rejected: verify = 0). With a gated adapter
    (`pend[GATED]`: rules.gated_lossless_cycle) the verify pass re-feeds the pending and lookup tokens
    and tests every slot; it always runs (pass 1 runs the adapter and cannot judge lookup tokens)."""
    v = plan.block if plan.verify is None else plan.verify
    first = pend["target"] + plan.lookup + plan.block - 1
    if pend.get(GATED):
        # (the adapter's pass under its own key: in a batched step it is a llama_decode of its own,
        # apart from the stock passes: planner.Costs.t)
        return {GATED: [first], "target": [pend["target"] + plan.lookup + max(1, v)]}
    return {"target": [first, v] if v else [first]}


def prove_cycle(c, t, plan, s, mask, sampler=None, hooks=NO_HOOKS):
    return rules.prove_cycle(c["target"], c["verifier"], t, plan.block, mask, s.theta, sampler=sampler)


def prove_widths(pend: dict, plan: Plan) -> dict:
    return {"target": [pend["target"] + plan.block - 1], "verifier": [pend["verifier"] + plan.block - 1]}


def mars_cycle(c, t, plan, s, mask, sampler=None, hooks=NO_HOOKS):
    return rules.mars_cycle(c["target"], t, plan.block, mask, s.tau, sampler=sampler)


def mars_widths(pend: dict, plan: Plan) -> dict:
    return {"target": [pend["target"] + plan.block - 1]}


def spec_cycle(c, t, plan, s, mask, sampler=None, hooks=NO_HOOKS):
    return rules.spec_cycle(c["target"], c["draft"], t, plan.draft_k, sampler=_sampler(sampler, s))


def spec_widths(pend: dict, plan: Plan) -> dict:
    """k one-token draft passes (the first also feeds the draft's pending tokens) and one target pass."""
    return {"draft": ([pend["draft"]] + [1] * (plan.draft_k - 1)) if plan.draft_k else [],
            "target": [pend["target"] + plan.draft_k]}


def lookup_cycle(c, t, plan, s, mask, sampler=None, hooks=NO_HOOKS):
    """The index's draft verified in one pass (no draft: a plain ar cycle)."""
    draft, scores = _lookup_draft(plan, hooks)
    return rules.lookup_cycle(c["target"], t, draft, scores, sampler=_sampler(sampler, s))


def lookup_widths(pend: dict, plan: Plan) -> dict:
    return {"target": [pend["target"] + plan.lookup]}


LOOKUP = "lookup"           # the kind of a lookup-verify cycle, and the planner's statistics key of lookup drafts


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("ar", "AR (greedy)", "plain decoding (greedy, or sampled), one token per pass",
         ("target",), needs_mask=False, exact=True, width=None, gate=None,
         gate_text="no gate: one token per cycle", q_text="no verifier", free_first=True, correction=False,
         verify_choice=False,
         cycle=ar_cycle, widths=ar_widths, width_field="block", label_text="ar"),
    Mode("lossless", "ProVe-lossless",
         "ProVe-lossless: the target verifies its own MARS block (and lookup drafts); output identical to ar "
         "(sampled: the same text for the seed)",
         ("target",), needs_mask=True, exact=True, width="block", gate=None,
         gate_text="gate: proposed token = the target's greedy token (verify pass)",
         q_text="p̃: the MARS slot's confidence; q: the target's own probability of the token in its verify pass",
         free_first=True, correction=True, verify_choice=True, cycle=lossless_cycle, widths=lossless_widths,
         width_field="block", label_text="B={block} v={verify}", lookup=True, source="mask"),
    Mode("prove", "ProVe", "ProVe: a stock verifier gates the block, commit while p*q >= theta (lossy)",
         ("target", "verifier"), needs_mask=True, exact=False, width="block", gate="theta",
         gate_text="gate: p̃·q ≥ θ = {theta:g}", q_text="p̃: the MARS slot's confidence; q: the verifier's probability of the token, teacher-forced",
         free_first=True, correction=False, verify_choice=False, cycle=prove_cycle, widths=prove_widths,
         width_field="block", label_text="B={block}", source="mask"),
    Mode("mars", "MARS rule", "MARS confidence rule, commit while p >= tau (lossy)",
         ("target",), needs_mask=True, exact=False, width="block", gate="tau",
         gate_text="gate: p̃ ≥ τ = {tau:g}", q_text="no verifier: the rule looks at p̃ only",
         free_first=True, correction=False, verify_choice=False, cycle=mars_cycle, widths=mars_widths,
         width_field="block", label_text="B={block}", source="mask"),
    Mode("spec", "speculative", "speculative decoding with a draft model (and lookup drafts); output identical to ar "
         "(sampled: the same text for the seed)",
         ("target", "draft"), needs_mask=False, exact=True, width="draft_k", gate=None,
         gate_text="gate: drafted token = the target's greedy token",
         q_text="p̃: the draft's confidence; q: the target's probability of the drafted token",
         free_first=False, correction=True, verify_choice=False, cycle=spec_cycle, widths=spec_widths,
         width_field="draft_k", label_text="k={draft_k}", lookup=True, source="draft"),
    Mode(LOOKUP, "lookup", "lookup drafts alone: continuations copied from the prompt and the answer (n-gram "
         "matches), verified in one pass; any GGUF; output identical to ar (sampled: the same text for the seed)",
         ("target",), needs_mask=False, exact=True, width=None, gate=None,
         gate_text="gate: drafted token = the target's greedy token (one verify pass)",
         q_text="p̃: the lookup's score m/(m+1) (m tokens matched); q: the target's probability of the drafted token",
         free_first=False, correction=True, verify_choice=False, cycle=lookup_cycle, widths=lookup_widths,
         width_field="lookup", label_text="L={lookup}", lookup=True, source="lookup"),
)}

NAMES = tuple(MODES)


def sources(cycle) -> list[str]:
    """Where each proposed slot of a cycle came from (Cycle.source, else its kind's Mode.source)."""
    if cycle.source is not None:
        return cycle.source
    if not proposes(cycle.plan):
        return []
    return [of(cycle.plan).source or "mask"] * len(cycle.proposed)


def drafted_slots(cycle) -> list[tuple[int, str]]:
    """The proposed slots of a cycle that are drafts, as (index in cycle.proposed, source), in order.

    A draft is a token guessed before the target has scored its prefix: lookup tokens, a draft
    model's tokens, and the MARS slots after the first. Slot 1 of a MARS block (the first "mask"
    slot: the block's own first slot, or the one after a filled proposal's lookup tokens) is read
    from the ordinary next-token row, i.e. it is the model's own token, not a draft; llama-server
    counts only drafted tokens in draft_n and `llamacpp:spec_decode_*`, and so do we. A rule whose
    slot 1 is not read from the model's own next-token row (a proposal through a gated adapter) is
    a draft there and must not label it "mask". The planner's plain ar cycles propose nothing."""
    if not proposes(cycle.plan):
        return []
    out, seen_mask = [], False
    for i, src in enumerate(sources(cycle)):
        if src == "mask" and not seen_mask:
            seen_mask = True                # slot 1 of the MARS block: the model's own token
            continue
        out.append((i, src))
    return out


class Drafts(dict):
    """source ("mask", "lookup", "draft") -> (drafted, accepted), with the totals over sources as
    llama.cpp's draft_n / draft_n_accepted, and the cycle and position counts of llama-server's
    `llamacpp:spec_decode_*` counters."""

    def __init__(self, by_source: dict[str, tuple[int, int]], n_drafts: int, accepted_by_pos: dict[int, int]):
        super().__init__(by_source)
        self.n_drafts = n_drafts                    # cycles with at least one drafted token
        self.accepted_by_pos = accepted_by_pos      # position in the cycle's draft (0: first) -> accepted

    @property
    def drafted(self) -> int:
        return sum(n for n, _ in self.values())

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.values())


def draft_counts(cycles) -> Drafts:
    """Drafted and accepted tokens per source over cycles (drafted_slots: slot 1 of a MARS block is
    not a draft). A drafted slot is accepted when it lies in the cycle's accepted run
    (committed[:n_accepted]). The one count behind `--json`'s drafts, the server's draft_n and
    /metrics, the UI and the bench."""
    out: dict[str, list[int]] = {}
    n_drafts, by_pos = 0, {}
    for c in cycles:
        slots = drafted_slots(c)
        n_drafts += bool(slots)
        for pos, (i, src) in enumerate(slots):
            n = out.setdefault(src, [0, 0])
            n[0] += 1
            if i < c.n_accepted:
                n[1] += 1
                by_pos[pos] = by_pos.get(pos, 0) + 1
    return Drafts({k: (v[0], v[1]) for k, v in out.items()}, n_drafts, by_pos)


def get(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ModeError(f"unknown mode {name!r}; choose from {', '.join(NAMES)}") from None


def of(plan: Plan) -> Mode:
    """The mode a plan runs (an "ar" plan: a plain ar cycle, whatever the request's mode)."""
    return MODES[plan.kind]


# What a plan means, from its kind's row of the table (Mode.proposes, width_of, filled, tested, label).

def proposes(plan: Plan) -> bool:
    """Whether the plan's cycle proposes tokens (False: a plain ar cycle)."""
    return of(plan).proposes


def plan_width(plan: Plan) -> int:
    """The plan's width: k for spec, the lookup draft for lookup, the block otherwise."""
    return of(plan).width_of(plan)


def filled(plan: Plan) -> bool:
    """Whether the plan is a MARS proposal whose first slots lookup tokens fill."""
    return of(plan).filled(plan)


def tested(plan: Plan) -> int:
    """Proposed tokens up for acceptance in the plan's cycle (Mode.tested)."""
    return of(plan).tested(plan)


def label(plan: Plan) -> str:
    """The plan for people: 'ar', 'B=4 v=2', 'B=4', 'k=3', 'L=3', 'L=3+B=4 v=2' (Mode.label)."""
    return of(plan).label(plan)


def cycle_cost(t: Callable[[str, int], float], pending: dict, plan: Plan) -> float:
    """What one cycle of `plan` costs: the sum of t(role, n) over the passes it makes (the one cost
    model: the planner's rates, the bench's projections and the UI's explanation call it)."""
    return pass_cost(t, of(plan).widths(pending, plan))


def pass_cost(t: Callable[[str, int], float], widths: dict) -> float:
    """The cost of passes {role: [tokens fed per pass]}: the sum of t(role, n)."""
    return sum(t(role, n) for role, ws in widths.items() for n in ws)
