"""Static bounds on what a grammar makes llama.cpp do, checked before its text reaches the parser.

Two shapes pass a size limit on the text and still hurt:
- nesting: llama.cpp's GBNF parser recurses once per parenthesis level; 20,000 nested parentheses
  (40 KB) overflow its stack and kill the process (SIGSEGV). `nesting` measures the depth outside
  string literals, character classes and comments; a grammar deeper than MAX_NESTING is refused.
- nested repetitions: llama.cpp keeps one parse stack per way the text so far can be read, and a
  repetition of a repetition can be read in about n·m ways: `("a"{0,n}){0,m}`, or the pattern
  `^(a{0,1000}){0,1000}$` (36 characters), whose grammar step took minutes (n³ in the bounds: 0.8 s at
  n = 100, 21 s at 300). The weight of a repeated item is its count times the weight of what it
  repeats (counts of nested repetitions multiply, through rule references too); a chain of k nested
  optional groups `(x (x (x)?)?)?` is x{0,k} written out, as JSON-schema converters write it. An
  item heavier than MAX_NESTED_REPEAT is refused. `*` and `+` are recursive rules, not copies: they
  weigh 2 (so `(a+){0,1000}` is refused, `(\\d+\\.)*` is not), `?` alone 1.
- positions without reading (eps): a run of optional items `"a"? "a"? ...` (also through rule
  references) puts a parse stack on every item at every step: 100 in a row cost 0.1 s per step,
  200 0.8 s, 1000 over 100 s. More than MAX_EPS is refused.
- alternatives at one point (fan): each is a parse stack; an enum of 7,000 values cost 0.5 s per
  step, 20,000 GBNF alternatives 2.2 s. More than MAX_FAN is refused, in schemas too.
- rule-reference chains deeper than MAX_NESTING (llama.cpp recurses along them as well).
All of it is measured without recursion (an explicit stack), so hostile text cannot overflow Python.
Schemas: their `pattern` regexes are weighed like GBNF (`regex_weight`) before conversion; the
converter's own output (bounded by grammar.MAX_REPEAT per count) is checked for nesting and fan but
not weighed again, so that an array of up to 1000 strings of up to 1000 characters, which is
unambiguous, stays allowed. Figures: the tiny test vocabulary on this 2-core machine.
"""
from __future__ import annotations

import re

MAX_NESTING = 2048          # parenthesis depth (the converter writes x{0,1000} as 1000 nested groups)
MAX_NESTED_REPEAT = 1000    # product of the counts of nested repetitions
UNBOUNDED = 2               # the weight of * and +
MAX_EPS = 64                # positions reachable without reading a character (runs of optional items)
MAX_FAN = 1024              # parse stacks at one point: alternatives add up (a 1024-value enum: fine)


class BoundError(ValueError):
    """A grammar or pattern over a bound; the message says which and where."""


def _skip_literal(text: str, i: int, close: str) -> int:
    """The index after the literal or class that starts at text[i] (its opening quote/bracket)."""
    n = len(text)
    i += 1
    while i < n and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _past_non_code(text: str, i: int) -> int | None:
    """If text[i] opens a literal, a character class or a comment, the index after it; else None."""
    c = text[i]
    if c == '"':
        return _skip_literal(text, i, '"')
    if c == "[":
        return _skip_literal(text, i, "]")
    if c == "#":
        j = text.find("\n", i)
        return len(text) if j < 0 else j
    return None


def nesting(text: str) -> int:
    """The deepest parenthesis nesting of GBNF text (outside literals, classes and comments)."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        j = _past_non_code(text, i)
        if j is not None:
            i = j
            continue
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_DEF = re.compile(r"([a-zA-Z0-9_-]+)\s*::=")
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")


def _count(m: re.Match) -> int:
    lo, comma, hi = m.group(1), m.group(2), m.group(3)
    if not comma:
        return int(lo)
    return int(hi) if hi else int(lo) + UNBOUNDED


class _Item:
    """A grammar item: `w` its weight (nested repetition counts multiplied), `nullable` whether it
    can match nothing, `eps` how many positions the parser reaches through it without reading a
    character (llama.cpp keeps a parse stack per position: `"a"? "a"? ... "a"?` 1000 times cost
    100 s per step, 100 times 0.1 s), `chain` the depth of the optional-group chain it ends, and
    `content` the weight of what that chain repeats."""
    __slots__ = ("w", "nullable", "eps", "chain", "content", "fan", "fan_max")

    def __init__(self, w: int = 1, nullable: bool = False, eps: int = 0, chain: int = 0, content: int = 1,
                 fan: int = 1, fan_max: int = 1):
        self.w, self.nullable, self.eps, self.chain, self.content = w, nullable, eps, chain, content
        # fan: the parse stacks at the item's start (alternatives add up: an enum of 7000 strings
        # cost 0.5 s per grammar step, 20,000 GBNF alternatives 2.2 s); fan_max: the most anywhere in it
        self.fan, self.fan_max = fan, max(fan, fan_max)


def _tokens(body: str):
    """GBNF body -> ('lit'|'ref'|'open'|'close'|'alt'|'quant', value)."""
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c.isspace():
            i += 1
        elif c == "#":
            j = body.find("\n", i)
            i = n if j < 0 else j
        elif c == '"':
            i = _skip_literal(body, i, '"')
            yield "lit", None
        elif c == "[":
            i = _skip_literal(body, i, "]")
            yield "lit", None
        elif c == ".":
            i += 1
            yield "lit", None
        elif c == "(":
            i += 1
            yield "open", None
        elif c == ")":
            i += 1
            yield "close", None
        elif c == "|":
            i += 1
            yield "alt", None
        elif c in "*+?":
            i += 1
            yield "quant", (c, 0, 0)
        elif c == "{":
            m = _COUNT.match(body, i)
            if not m:
                i += 1
                continue
            i = m.end()
            yield "quant", ("{", int(m.group(1)), _count(m))
        else:
            m = _NAME.match(body, i)
            if not m:
                i += 1
                continue
            i = m.end()
            yield "ref", m.group(0)


def _rules(text: str) -> dict[str, str]:
    """Rule name -> body text (a rule runs until the next `name ::=` outside literals)."""
    starts = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        j = _past_non_code(text, i)
        if j is not None:
            i = j
            continue
        if (c.isalnum() or c in "_-") and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] in "_-")):
            m = _DEF.match(text, i)
            if m:
                starts.append((m.group(1), m.start(), m.end()))
                i = m.end()
                continue
        i += 1
    out: dict[str, str] = {}
    for k, (name, _, body_start) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else n
        out[name] = (out[name] + " | " if name in out else "") + text[body_start:end]
    return out


def _alt(items: list) -> _Item:
    """A sequence of items as one item: its eps counts the positions of its runs of nullable items
    (a run of k is x{0,k} written flat, and costs more than written nested)."""
    w = max([1] + [it.w for it in items])
    eps = run_eps = 0
    for it in items:
        if it.nullable:
            run_eps += max(1, it.eps)
            eps = max(eps, run_eps)
        else:
            eps = max(eps, it.eps)
            run_eps = 0
    chain = max([0] + [it.chain for it in items])
    content = max([1] + [it.w for it in items if not it.chain])
    # the stacks at each point: the items of the nullable run from there, and the first item after it
    fans, following = [], 0
    for it in reversed(items):
        following = it.fan + (following if it.nullable else 0)
        fans.append(following)
    fan = fans[-1] if fans else 1
    fan_max = max([fan] + fans + [it.fan_max for it in items])
    return _Item(w, all(it.nullable for it in items), eps, chain, content, fan, fan_max)


def _quantified(it: _Item, op: str, lo: int, hi: int) -> _Item:
    f, fm = it.fan, it.fan_max
    if op == "?":
        chain = it.chain + 1      # a chain of nested optional groups is a repetition written out: x{0,k}
        w = max(it.w, chain * it.content if it.content > 1 else chain)
        return _Item(w, True, (1 + it.eps) if it.nullable else 1, chain, it.content, f, fm)
    if op == "*":
        return _Item(UNBOUNDED * it.w if it.w > 1 else UNBOUNDED, True, (1 + it.eps) if it.nullable else 1, 0, 1, f, fm)
    if op == "+":
        return _Item(UNBOUNDED * it.w if it.w > 1 else UNBOUNDED, it.nullable, it.eps, 0, 1, f, fm)
    w = hi * it.w if it.w > 1 else hi
    if it.nullable:               # every copy's start is reachable without reading
        return _Item(w, True, hi * max(1, it.eps), 0, 1, hi * f, hi * fm)
    return _Item(w, lo == 0, 1 if lo == 0 else it.eps, 0, 1, f, fm)


def _body(body: str, known: dict) -> _Item:
    frames: list[tuple[list, list]] = [([], [])]          # per open group: (finished alternatives, items)
    for kind, value in _tokens(body):
        alts, items = frames[-1]
        if kind == "lit":
            items.append(_Item())
        elif kind == "ref":
            r = known.get(value)
            items.append(_Item(r.w, r.nullable, r.eps, 0, r.w, r.fan, r.fan_max) if r is not None else _Item())
        elif kind == "open":
            frames.append(([], []))
        elif kind == "alt":
            alts.append(_alt(items))
            frames[-1] = (alts, [])
        elif kind == "close" and len(frames) > 1:
            frames.pop()
            group = _group(alts + [_alt(items)])
            frames[-1][1].append(group)
        elif kind == "quant" and items:
            items[-1] = _quantified(items[-1], *value)
    while len(frames) > 1:                                  # unbalanced: the parser will refuse it
        alts, items = frames.pop()
        frames[-1][1].append(_group(alts + [_alt(items)]))
    alts, items = frames[0]
    return _group(alts + [_alt(items)])


def _group(alts: list) -> _Item:
    return _Item(max(a.w for a in alts), any(a.nullable for a in alts), max(a.eps for a in alts),
                 max(a.chain for a in alts), max(a.content for a in alts), sum(a.fan for a in alts),
                 max(a.fan_max for a in alts))


def measure(text: str) -> tuple[dict, int]:
    """Every rule's item (weight, nullable, eps), and the deepest chain of rule references; rules
    are measured after the rules they reference (an explicit stack: no recursion on hostile input),
    a reference back into a rule being measured (recursion) counts as a plain item."""
    rules = _rules(text)
    refs = {name: [v for k, v in _tokens(body) if k == "ref" and v in rules] for name, body in rules.items()}
    known: dict[str, _Item] = {}
    depth: dict[str, int] = {}
    state: dict[str, int] = {}                             # 1: on the stack, 2: done
    deepest = 0
    for root in rules:
        if root in state:
            continue
        stack = [(root, 0)]
        state[root] = 1
        while stack:
            name, i = stack[-1]
            if i < len(refs[name]):
                stack[-1] = (name, i + 1)
                nxt = refs[name][i]
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, 0))
                continue
            stack.pop()
            known[name] = _body(rules[name], known)
            depth[name] = 1 + max([depth.get(r, 0) for r in refs[name]] + [0])
            deepest = max(deepest, depth[name])
            state[name] = 2
    return known, deepest


def gbnf_weight(text: str) -> tuple[int, str]:
    """(the heaviest rule's weight, its name) of GBNF text."""
    known, _ = measure(text)
    if not known:
        return 1, "root"
    name = max(known, key=lambda k: known[k].w)
    return known[name].w, name


def regex_weight(pattern: str) -> int:
    """The heaviest nested repetition of a regex (a schema's `pattern`), as `gbnf_weight` weighs GBNF."""
    stack = [[1, 1]]                 # per group: [max weight inside, weight of the last atom]
    i, n = 0, len(pattern)
    worst = 1
    while i < n:
        c = pattern[i]
        if c == "\\":
            stack[-1][1] = 1
            i += 2
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            stack[-1][1] = 1
            continue
        if c == "(":
            stack.append([1, 1])
            i += 1
            if pattern.startswith("?:", i):
                i += 2
            continue
        if c == ")" and len(stack) > 1:
            inner = stack.pop()[0]
            stack[-1][1] = inner
            i += 1
            continue
        count = None
        if c in "*+":
            count, i = UNBOUNDED, i + 1
        elif c == "?":
            count, i = 1, i + 1
        elif c == "{":
            m = _COUNT.match(pattern, i)
            if m:
                count, i = _count(m), m.end()
            else:
                i += 1
        else:
            stack[-1][1] = 1
            i += 1
            continue
        if count is not None:
            atom = stack[-1][1]
            w = count * atom if atom > 1 else count
            stack[-1][0] = max(stack[-1][0], w)
            stack[-1][1] = w            # (a quantifier after a quantifier: a{2}{3} nests)
            worst = max(worst, w)
        continue
    for g in stack:
        worst = max(worst, g[0])
    return worst


def check_gbnf(text: str) -> None:
    """BoundError if GBNF text nests too deeply, chains rule references too deeply, reaches too many
    positions without reading (eps), or repeats repetitions too heavily."""
    depth = nesting(text)
    if depth > MAX_NESTING:
        raise BoundError(f"the grammar nests parentheses {depth} levels deep; the limit is {MAX_NESTING}")
    known, chain = measure(text)
    if chain > MAX_NESTING:
        raise BoundError(f"the grammar's rules reference each other {chain} levels deep; the limit is {MAX_NESTING}")
    check_fan(known)
    for name, it in known.items():
        if it.eps > MAX_EPS:
            raise BoundError(f"rule {name!r} has {it.eps} optional items in a row (each a parse stack at every "
                             f"step); the limit is {MAX_EPS}")
        if it.w > MAX_NESTED_REPEAT:
            raise BoundError(f"rule {name!r} repeats {it.w} times over (the counts of nested repetitions "
                             f"multiply); the limit is {MAX_NESTED_REPEAT}")


def check_fan(known: dict) -> None:
    for name, it in known.items():
        if it.fan_max > MAX_FAN:
            raise BoundError(f"rule {name!r} offers {it.fan_max} alternatives at one point (a parse stack each, "
                             f"at every step); the limit is {MAX_FAN}")


def check_schema_gbnf(text: str) -> None:
    """What a JSON schema's grammar must satisfy: the nesting and the alternatives (an enum of
    thousands of values), not the repetition weights (see the module doc)."""
    depth = nesting(text)
    if depth > MAX_NESTING:
        raise BoundError(f"the grammar nests parentheses {depth} levels deep; the limit is {MAX_NESTING}")
    check_fan(measure(text)[0])


def check_pattern(pattern: str) -> None:
    w = regex_weight(pattern)
    if w > MAX_NESTED_REPEAT:
        raise BoundError(f"the pattern nests repetitions {w} times over (nested counts multiply, as in "
                         f"(a{{0,n}}){{0,m}}: n*m); the limit is {MAX_NESTED_REPEAT}")
