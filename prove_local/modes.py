"""The decoding modes, declared once. The engine, the command lines, the UI, the server, the bench
and the cost model read this table instead of keeping mode lists of their own.

A mode names the contexts it decodes with, whether it needs a mask token, whether its output is
exactly ar's (greedy: token for token), the cycle function of rules.py it runs, and the width of
every pass that cycle makes (what a pass costs depends on its width: t(n)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import rules
from .errors import ModeError


@dataclass(frozen=True)
class Plan:
    """The widths of one cycle: chosen from the request's settings, or by a planner."""
    block: int = 16                 # proposal slots (lossless, prove, mars)
    verify: object = None           # lossless: proposed tokens verified, 1..block (None: all), or a
                                    # function of the slot confidences p returning that number
    draft_k: int = 4                # spec: tokens drafted
    mode: str | None = None         # run this cycle as another mode ("ar": the planner's fallback)


@dataclass(frozen=True)
class Mode:
    name: str
    roles: tuple[str, ...]          # contexts the mode decodes with; "proposer" first
    needs_mask: bool
    exact: bool                     # greedy output equals ar's token for token; sampled output is
                                    # distributed exactly as ar sampling with the same settings
    uses_block: bool
    summary: str
    # run one cycle: (contexts by role, committed tokens, plan, settings, mask token, sampler=None) -> Cycle
    # (sampler: the request's sampling.Sampler; None = greedy)
    cycle: Callable
    # widths of its passes per role, given the tokens pending in each context: {role: [n, ...]}
    widths: Callable[[dict, Plan], dict]


def _verify(plan: Plan) -> int:
    """Verify width of a lossless cycle (a planner's function of p counts as the whole block)."""
    return plan.block if plan.verify is None or callable(plan.verify) else plan.verify


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("ar", ("proposer",), False, True, False, "plain decoding (greedy, or sampled), one token per pass",
         lambda c, t, plan, s, mask, sampler=None: rules.ar_cycle(c["proposer"], t, sampler=sampler),
         lambda pend, plan: {"proposer": [pend["proposer"]]}),
    Mode("lossless", ("proposer",), True, True, True,
         "ProVe-lossless: the proposer verifies its own block; output identical to ar (in distribution when sampling)",
         lambda c, t, plan, s, mask, sampler=None: rules.lossless_cycle(c["proposer"], t, plan.block, mask,
                                                                     verify=plan.verify, sampler=sampler),
         lambda pend, plan: {"proposer": [pend["proposer"] + plan.block - 1, _verify(plan)]}),
    Mode("prove", ("proposer", "verifier"), True, False, True,
         "ProVe: a stock verifier gates the block, commit while p*q >= theta (lossy)",
         lambda c, t, plan, s, mask, sampler=None: rules.prove_cycle(c["proposer"], c["verifier"], t, plan.block, mask,
                                                                  s.theta, sampler=sampler),
         lambda pend, plan: {"proposer": [pend["proposer"] + plan.block - 1],
                             "verifier": [pend["verifier"] + plan.block - 1]}),
    Mode("mars", ("proposer",), True, False, True, "MARS confidence rule, commit while p >= tau (lossy)",
         lambda c, t, plan, s, mask, sampler=None: rules.mars_cycle(c["proposer"], t, plan.block, mask, s.tau,
                                                                 sampler=sampler),
         lambda pend, plan: {"proposer": [pend["proposer"] + plan.block - 1]}),
    Mode("spec", ("proposer", "draft"), False, True, False,
         "speculative decoding with a draft model; output identical to ar (in distribution when sampling)",
         lambda c, t, plan, s, mask, sampler=None: rules.spec_cycle(c["proposer"], c["draft"], t, plan.draft_k,
                                                                 sampler=sampler),
         lambda pend, plan: {"draft": ([pend["draft"]] + [1] * (plan.draft_k - 1)) if plan.draft_k else [],
                             "proposer": [pend["proposer"] + plan.draft_k]}),
)}

NAMES = tuple(MODES)


def get(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ModeError(f"unknown mode {name!r}; choose from {', '.join(NAMES)}") from None
