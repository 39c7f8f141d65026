"""Pure projection of the runtime's `Cycle` events to what the page shows.

No decoding happens here: the rules' decisions are read back from the events (`plan`, `gate`,
`committed`, `n_accepted`, `p`, `q`); the modes' names and gates come from modes.py.

- `AnswerView`: one answer's cycles -> colored spans (alternating per cycle; the lossless / spec
  correction or bonus token is a span of its own kind). The spans' texts concatenate to the
  runtime's own text (the `TextStream` detokenization of the committed tokens).
- `inspect_cycle`: one cycle -> one `SlotRow` per proposed slot (+ one for a correction / bonus
  token): token, p̃, q, p̃·q, the gate's verdict and whether the token was committed or dropped.
- `*_html`: HTML for the page (every piece of model or user text is escaped).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from prove_local.engine import TextStream
from prove_local.modes import MODES, filled, label, proposes, tested

# a threshold gate's quantity and threshold symbol, by the setting it reads (Mode.gate)
GATE_SYMBOLS = {"theta": ("p̃·q", "θ"), "tau": ("p̃", "τ")}


def title(mode: str) -> str:
    return MODES[mode].title if mode in MODES else mode


def mode_choice(mode: str) -> str:
    """The mode menu's entry: name, title, and what it guarantees or gates on."""
    m = MODES[mode]
    if m.width is None:
        return f"{m.name} · one token per pass"
    return f"{m.name} · {m.title} (" + ("exact" if m.exact else m.gate_text.split(": ", 1)[1].split(" = ")[0]) + ")"


# ----------------------------------------------------------------------------------- spans
@dataclass
class Span:
    text: str
    cycle: int     # the cycle's index within its answer
    kind: str      # "run": accepted proposals; "lookup": accepted lookup drafts; "fix": correction or bonus token


@dataclass
class AnswerView:
    """Spans of one answer, built incrementally as cycles arrive. `piece_model` is anything with
    `.piece(token) -> bytes` (a `prove_local.llama.Model`), used through the runtime's TextStream."""
    piece_model: object
    cycles: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    done: bool = False

    def __post_init__(self):
        self._stream = TextStream(self.piece_model)

    def add(self, cycle) -> None:
        self.cycles.append(cycle)
        k = len(self.cycles) - 1
        na = cycle.n_accepted
        src = cycle.source or []
        n_l = sum(1 for s in src[:na] if s == "lookup")       # accepted lookup drafts lead the run
        for kind, ids in (("lookup", cycle.committed[:n_l]), ("run", cycle.committed[n_l:na]),
                          ("fix", cycle.committed[na:])):
            if ids:
                text = self._stream.feed(ids)
                if text:
                    self.spans.append(Span(text, k, kind))

    def finish(self) -> None:
        if not self.done:
            tail = self._stream.flush()
            if tail:
                self.spans.append(Span(tail, max(0, len(self.cycles) - 1), "run"))
            self.done = True
            self._stream = None          # drop the model reference

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.spans)

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.cycles for t in c.committed]

    def __deepcopy__(self, memo):        # session state may be deep-copied; the model is shared
        new = AnswerView.__new__(AnswerView)
        new.piece_model, new.cycles, new.spans, new.done = self.piece_model, list(self.cycles), list(self.spans), self.done
        new._stream = self._stream
        return new


# ------------------------------------------------------------------------------- inspector
@dataclass
class SlotRow:
    slot: int | None        # 1-based block slot; None for a correction / bonus token
    token: int
    text: str               # display text of the token
    p: float | None         # p̃: the proposal's probability of the token (MARS slot, draft model, lookup score)
    q: float | None         # the target's (prove: the verifier's) probability of it
    pq: float | None
    gate: bool | None       # the rule's test for this slot: True pass, False fail, None not evaluated
    verdict: str            # the gate's verdict in words
    status: str             # "committed", "dropped", "correction" or "bonus"
    accept: float | None = None   # sampling (lossless, spec): min(1, q/p̃), the slot's acceptance probability
    source: str | None = None     # where the proposed token came from: "mask", "lookup", "draft" (Cycle.source)



def token_label(raw: bytes) -> str:
    """Display text of one token's bytes: visible whitespace, escaped partial UTF-8."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        s = "".join(f"\\x{b:02x}" if b >= 0x80 else chr(b) for b in raw)
    if not s:
        return "∅"
    return s.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")


def inspect_cycle(cycle, mode: str, theta: float = 0.05, tau: float = 0.95, token_text=str) -> list[SlotRow]:
    """One row per proposed slot, then one for the correction / bonus token (lossless, spec).
    The cycle says what it ran (`plan`: an ar cycle when the planner fell back) and what its gate
    decided per slot (`gate`); this only puts that into words.
    `token_text(id) -> str` names a token (e.g. `lambda t: token_label(model.piece(t, True))`)."""
    m = MODES[cycle.plan.kind]
    d, p, q = cycle.proposed, cycle.p, cycle.q
    k, na = len(d), cycle.n_accepted
    sources = list(cycle.source or []) + [m.source] * (k - len(cycle.source or []))
    gate = list(cycle.gate or []) + [None] * (k - len(cycle.gate or []))
    n_checked = tested(cycle.plan)                  # the planner's verify width (lossless)
    extra = cycle.committed[na:]
    sampled = cycle.accept_prob is not None
    who = "target's"                               # the exact modes' reference: the target verifies
    # the equality test's reference token: the greedy token, or (coupled sampling) the target's sample
    # with the noise of the seed at that position
    greedy = "coupled sample" if getattr(cycle, "coupled", False) else "greedy token"
    cut = f"cut: the answer stopped here ({cycle.stop})"
    if m.gate:
        name, sym = GATE_SYMBOLS[m.gate]
        thr = f"{sym} = {theta if m.gate == 'theta' else tau:g}"
        first_fail = gate.index(False) if False in gate else k
        run = max(1, first_fail)
    rows = []
    for i in range(k):
        qi = q[i] if q is not None and i < len(q) else None
        pq = p[i] * qi if qi is not None else None
        committed = i < na
        a = cycle.accept_prob[i] if sampled and i < len(cycle.accept_prob) else None
        lookup_slot = sources[i] == "lookup"
        if m.width is None and not cycle.plan.lookup:
            verdict = "the AR token: always committed"
        elif m.gate:                                  # a threshold on every slot (prove, mars)
            ok = gate[i]
            if committed:
                verdict = f"{name} ≥ {thr}" if ok else f"{name} < {thr}, committed anyway: slot 1 is the target's AR token"
            elif i < run:
                verdict = cut
            elif i == first_fail:
                verdict = f"{name} < {thr}: the run ends here"
            else:
                verdict = (f"{name} ≥ {thr}, but after the first failure" if ok
                           else f"{name} < {thr}, after the first failure")
        else:  # lossless, spec: matched against the target's greedy token, or (sampled) tested by
            # exact speculative sampling with probability min(1, q/p̃)
            if committed:
                if lookup_slot:
                    verdict = (f"copied by lookup, accepted (probability p(x) = {_fmt(a)}: the draft is a point mass)"
                               if sampled else f"copied by lookup, = the {who} {greedy}")
                elif m.free_first and i == 0 or (filled(cycle.plan) and i == cycle.plan.lookup):
                    verdict = ("slot 1 is an exact sample of the target: always accepted" if sampled
                               else "slot 1 is the AR token: always matches")
                else:
                    verdict = f"accepted (probability min(1, q/p̃) = {_fmt(a)})" if sampled else f"= the {who} {greedy}"
            elif i >= n_checked:
                verdict = f"not verified: the planner verified the first {n_checked} of {k} slots"
            elif gate[i] is False and extra:
                verdict = (f"rejected (acceptance probability {_fmt(a)}): replaced by a draw from the residual"
                           if sampled else f"≠ the {who} {greedy} {token_text(extra[0])}: replaced")
                if lookup_slot:
                    verdict = "copied by lookup, " + verdict
            elif not extra and cycle.stop:
                verdict = cut
            else:
                verdict = ("not tested: after the first rejection" if sampled
                           else "not checked: after the first mismatch")
        rows.append(SlotRow(i + 1, d[i], token_text(d[i]), p[i], qi, pq, gate[i], verdict,
                            "committed" if committed else "dropped", a, sources[i]))
    for t in extra:
        bonus = not cycle.residual
        if sampled:
            why = (f"drawn from the {who} distribution after a full match" if bonus
                   else "drawn from norm(max(0, q − p)) at the first rejection")
        else:
            why = (f"the {who} own next token after a full match" if bonus
                   else f"the {who} {greedy} at the first mismatch")
        rows.append(SlotRow(None, t, token_text(t), None, None, None, None, why, "bonus" if bonus else "correction"))
    return rows


# ------------------------------------------------------------------------------------ HTML
def esc(s: str) -> str:
    return html.escape(s, quote=True).replace("\t", "&#9;").replace("\r", "&#13;")


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    if x >= 0.001 or x == 0:
        return f"{x:.3f}"
    return f"{x:.0e}"


def spans_html(turn: int, spans: list[Span], selected: int | None = None) -> str:
    out = []
    for s in spans:
        cls = f"cyc {'fix' if s.kind == 'fix' else 'c' + str(s.cycle % 2)}" + (" lk" if s.kind == "lookup" else "")
        if selected is not None and s.cycle == selected:
            cls += " sel"
        out.append(f'<span class="{cls}" data-pick="{turn}:{s.cycle}" title="cycle {s.cycle + 1}">{esc(s.text)}</span>')
    return "".join(out)


def stats_line(stats: dict | None, mode: str) -> str:
    if not stats:
        return ""
    passes = ", ".join(f"{r} {n}" for r, n in stats["n_passes"].items())
    stop = stats.get("stop")
    return (f"{title(mode)} · {stats['n_tokens']} tokens · {stats['n_cycles']} cycles · "
            f"{stats['tokens_per_cycle']:.2f} tokens/cycle · passes: {passes or '—'} · "
            f"{stats['tokens_per_second']:.1f} tokens/s" + (f" · stop: {stop}" if stop else ""))


@dataclass
class ChatItem:
    """One exchange as the chat shows it."""
    user: str
    spans: list[Span]
    footer: str = ""
    running: bool = False
    note: str = ""          # e.g. an error for this turn
    hint: str = ""          # e.g. why the planner decoded plain ar cycles, and how to see ProVe cycles


def chat_html(messages: list[ChatItem], selected: tuple[int, int] | None = None, placeholder: str = "") -> str:
    if not messages:
        return f'<div class="chat-scroll"><div class="chat-empty">{esc(placeholder)}</div></div>'
    parts = []
    for t, m in enumerate(messages):
        sel = selected[1] if selected and selected[0] == t else None
        state = "running" if m.running else "done"
        parts.append(f'<div class="msg user"><div class="bubble">{esc(m.user)}</div></div>')
        body = spans_html(t, m.spans, sel) or ('<span class="typing">…</span>' if m.running else "")
        note = f'<div class="note">{esc(m.note)}</div>' if m.note else ""
        note += f'<div class="hint">{esc(m.hint)}</div>' if m.hint else ""
        footer = f'<div class="footer">{esc(m.footer)}</div>' if m.footer else ""
        parts.append(f'<div class="msg bot"><div class="bubble answer {state}" data-turn="{t}">'
                     f'<div class="text">{body}</div>{note}{footer}</div></div>')
    return f'<div class="chat-scroll"><div class="chat-inner">{"".join(parts)}</div></div>'


def legend_html() -> str:
    return ('<div class="legend"><span class="cyc c0">cycle n</span><span class="cyc c1">cycle n+1</span>'
            '<span class="cyc fix">correction / bonus token</span>'
            '<span class="cyc c0 lk">copied by lookup</span>'
            '<span class="hint">click any colored run to inspect its cycle</span></div>')


def inspector_html(cycle, rows: list[SlotRow], mode: str, *, theta: float, tau: float, context: str = "",
                   turn: int = 0, n_cycles: int = 1, planner_note: str | None = None) -> str:
    """The inspector for one cycle. A plain ar cycle inside an answer of another mode (the planner's
    choice under --block auto) says why, with `planner_note` (Engine.explain) when there is one."""
    """The cycle as a table, slots left to right: token, p̃, q, p̃·q, gate, committed / dropped."""
    par = cycle.index % 2
    head = ['<th class="rowhead">slot</th>']
    tok = ['<th class="rowhead">token</th>']
    pr = ['<th class="rowhead">p̃</th>']
    qr = ['<th class="rowhead">q</th>']
    pqr = ['<th class="rowhead">p̃·q</th>']
    acr = ['<th class="rowhead" title="acceptance probability of exact speculative sampling">min(1, q/p̃)</th>']
    src = ['<th class="rowhead" title="where the proposed token came from">source</th>']
    gr_ = ['<th class="rowhead">gate</th>']
    st = ['<th class="rowhead">result</th>']
    for r in rows:
        status_cls = {"committed": f"c{par}", "dropped": "drop"}.get(r.status, "fix")
        head.append(f'<th>{r.slot if r.slot is not None else "+1"}</th>')
        lk = " lk" if r.source == "lookup" else ""
        tok.append(f'<td><span class="tok {status_cls}{lk}" title="id {r.token}">{esc(r.text)}</span></td>')
        src.append(f'<td class="src {r.source or ""}">{esc(r.source or "")}</td>')
        pr.append(f"<td>{_fmt(r.p)}</td>")
        qr.append(f"<td>{_fmt(r.q)}</td>")
        pqr.append(f"<td>{_fmt(r.pq)}</td>")
        acr.append(f"<td>{_fmt(r.accept)}</td>")
        mark = {True: '<span class="pass">✓</span>', False: '<span class="fail">✗</span>', None: '<span class="na">·</span>'}[r.gate]
        gr_.append(f'<td title="{esc(r.verdict)}">{mark}</td>')
        st.append(f'<td class="status {r.status}">{r.status}</td>')
    sampled = cycle.accept_prob is not None or any(r.accept is not None for r in rows)
    mixed = any(r.source == "lookup" for r in rows)        # lookup drafts: say where each slot came from
    table = "".join(f"<tr>{''.join(row)}</tr>" for row in
                    ((head, tok) + ((src,) if mixed else ()) +
                     ((pr, qr, acr, gr_, st) if sampled else (pr, qr, pqr, gr_, st))))
    n_prop = sum(1 for r in rows if r.slot is not None)
    n_comm = sum(1 for r in rows if r.status == "committed")
    extra = [r for r in rows if r.slot is None]
    summary = f"committed {n_comm} of {n_prop} proposed tokens"
    if extra:
        summary += f" + the {extra[0].status} token {esc(extra[0].text)}"
    m = MODES[cycle.plan.kind]
    gate = m.gate_text.format(theta=theta, tau=tau)
    if getattr(cycle, "coupled", False) and m.exact and m.width is not None:
        gate = ("gate: proposed token = the target's coupled sample, argmax of log p + g with noise g keyed by the "
                "seed and the token's position: the text is ar's for this seed, at any width")
    if sampled and m.exact and m.width is not None:
        gate = ("gate: exact speculative sampling, accept the sampled token x with probability min(1, p(x)/q(x)); "
                "p̃ and q are the processed (sampled-from) probabilities of the proposal and the target")
    if cycle.plan.lookup:
        gate = ("lookup draft: the tokens that followed the longest recent match of the text's end, copied; "
                "p̃ is the lookup's score m/(m+1) (m tokens matched), the verify pass accepts a copied token "
                + ("with probability p(x) (the draft is a point mass)" if sampled else
                   "when it is the model's coupled sample" if getattr(cycle, "coupled", False)
                   else "when it is the model's greedy token")
                + (". After the copied run: the MARS slots, verified as usual" if filled(cycle.plan) else ""))
    if not proposes(cycle.plan) and (MODES[mode].width is not None or MODES[mode].lookup):
        gate = ("no proposal in this cycle: the planner (--block auto) ran a plain ar cycle, because on this "
                "machine a proposal is expected to cost more than it commits. "
                + (planner_note + "." if planner_note else "Fix the block length to watch proposals."))
    passes = ", ".join(f"{r} {n}" for r, n in cycle.passes.items())
    widths = "; ".join(f"{r} {'+'.join(map(str, w))}" for r, w in (cycle.widths or {}).items() if w)
    verdicts = "".join(
        f'<li><b>{r.slot if r.slot is not None else "+1"}</b> <span class="tok {"drop" if r.status == "dropped" else ("fix" if r.slot is None else "c" + str(par))}">'
        f"{esc(r.text)}</span> {esc(r.verdict)}</li>" for r in rows)
    ctx = (f'<div class="ctx"><span class="ctx-label">context</span> …{esc(context[-80:])}'
           f'<span class="cursor">▌</span></div>') if context else ""
    return (f'<div class="inspector" data-cycle="{turn}:{cycle.index}">'
            f'<div class="insp-head"><b>answer {turn + 1}, cycle {cycle.index + 1} of {n_cycles}</b> · '
            f'{esc(title(mode))} · {summary} · passes: {esc(passes)} · '
            f'<span class="widths" title="tokens fed per pass (the planner picks them with --block auto)">'
            f'widths: {esc(widths or "—")} ({esc(label(cycle.plan))})</span> · '
            f'{cycle.seconds * 1000:.1f} ms</div>{ctx}'
            f'<div class="insp-table"><table>{table}</table></div>'
            f'<div class="insp-foot">{esc(gate)} · {esc(m.q_text)}</div>'
            f'<details class="verdicts"><summary>verdict per slot</summary><ol>{verdicts}</ol></details></div>')


def compare_html(mode: str, mode_text: str, mode_spans: list[Span], mode_stats: dict, ar_text: str,
                 ar_stats: dict, speedup: float | None, turn: int = 0, temperature: float = 0.0,
                 coupled: bool = False) -> str:
    """`coupled`: sampled with the coupled sampler (ar rerun with the same seed), where an exact mode's
    text must be ar's token for token, as when greedy."""
    same = mode_text == ar_text
    if temperature > 0 and MODES[mode].exact and coupled:
        verdict = ('<span class="pass">texts identical ✓ (the same seed: coupled sampling gives ar\'s text)</span>'
                   if same else '<span class="fail">texts differ ✗ (exact mode with coupled sampling and the same '
                   'seed: a near-tie flipped by llama.cpp batch rounding can do this)</span>')
    elif temperature > 0:
        verdict = (f'texts {"identical" if same else "differ"} (sampled at temperature {temperature:g}: exact modes match '
                   'ar sampling in distribution, not token for token)')
    elif MODES[mode].exact:
        verdict = ('<span class="pass">texts identical ✓</span>' if same else
                   '<span class="fail">texts differ ✗ (exact mode: llama.cpp batch rounding on quantized '
                   'weights or an f16 KV cache can do this)</span>')
    else:
        verdict = (f'texts {"identical" if same else "differ"} ({esc(title(mode))} is lossy; '
                   f'differences are expected)')
    sp = f"{speedup:.2f}×" if speedup else "—"
    return (f'<div class="compare"><div class="cmp-head"><b>speedup {sp}</b> '
            f'(decode tokens/s, {esc(title(mode))} vs AR) · {verdict}</div>'
            f'<div class="cmp-cols"><div class="cmp-col"><div class="cmp-title">{esc(title(mode))}</div>'
            f'<div class="text">{spans_html(turn, mode_spans)}</div><div class="footer">{esc(stats_line(mode_stats, mode))}</div></div>'
            f'<div class="cmp-col"><div class="cmp-title">AR (greedy)</div><div class="text ar">{esc(ar_text)}</div>'
            f'<div class="footer">{esc(stats_line(ar_stats, "ar"))}</div></div></div></div>')


def banner_html(message: str | None, level: str = "error") -> str:
    if not message:
        return ""
    return f'<div class="banner {level}" role="alert">{esc(message)}</div>'
