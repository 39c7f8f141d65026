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
Schemas: their `pattern` regexes are weighed the same way (`regex_weight`) before conversion; the
converter's own output (bounded by grammar.MAX_REPEAT per count) is not weighed again, so that an
array of up to 1000 strings of up to 1000 characters, which is unambiguous, stays allowed.
"""
from __future__ import annotations

import re

MAX_NESTING = 2048          # parenthesis depth (the converter writes x{0,1000} as 1000 nested groups)
MAX_NESTED_REPEAT = 1000    # product of the counts of nested repetitions
UNBOUNDED = 2               # the weight of * and +


class BoundError(ValueError):
    """A grammar or pattern over a bound; the message says which and where."""


def _skip_literal(text: str, i: int, close: str) -> int:
    """The index after the literal or class that starts at text[i] (its opening quote/bracket)."""
    n = len(text)
    i += 1
    while i < n and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def nesting(text: str) -> int:
    """The deepest parenthesis nesting of GBNF text (outside literals, classes and comments)."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = _skip_literal(text, i, '"')
            continue
        if c == "[":
            i = _skip_literal(text, i, "]")
            continue
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
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
    """A grammar item: its weight, the depth of the optional-group chain it ends (0: none), and for a
    group the weight of what that chain repeats."""
    __slots__ = ("w", "chain", "ref")

    def __init__(self, w: int = 1, chain: int = 0, ref=None):
        self.w, self.chain, self.ref = w, chain, ref


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
        elif c in "*+":
            i += 1
            yield "quant", UNBOUNDED
        elif c == "?":
            i += 1
            yield "quant", "?"
        elif c == "{":
            m = _COUNT.match(body, i)
            if not m:
                i += 1
                continue
            i = m.end()
            yield "quant", _count(m)
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
    line_start = True
    while i < n:
        c = text[i]
        if c == '"':
            i = _skip_literal(text, i, '"')
            continue
        if c == "[":
            i = _skip_literal(text, i, "]")
            continue
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        m = _DEF.match(text, i) if (c.isalnum() or c in "_-") and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] in "_-")) else None
        if m:
            starts.append((m.group(1), m.start(), m.end()))
            i = m.end()
            continue
        i += 1
    out = {}
    for k, (name, _, body_start) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else n
        out[name] = out.get(name, "") + " | " * (name in out) + text[body_start:end]
    return out


def gbnf_weight(text: str) -> tuple[int, str]:
    """(the heaviest repeated item's weight, the rule it is in) of GBNF text."""
    rules = _rules(text)
    memo: dict[str, int] = {}
    worst = [1, "root"]

    def rule_weight(name: str, active: set) -> int:
        if name in memo:
            return memo[name]
        if name in active or name not in rules:
            return 1                       # recursion (a * of its own) or an unknown name: the parser decides
        active.add(name)
        w = body_weight(rules[name], name, active)
        active.discard(name)
        memo[name] = w
        return w

    def body_weight(body: str, name: str, active: set) -> int:
        # a stack of groups; each group: (its items so far, max weight of closed alternatives)
        stack: list[list] = [[[], 1]]
        for kind, value in _tokens(body):
            items = stack[-1][0]
            if kind == "lit":
                items.append(_Item())
            elif kind == "ref":
                items.append(_Item(rule_weight(value, active)))
            elif kind == "open":
                stack.append([[], 1])
            elif kind == "alt":
                stack[-1][1] = max(stack[-1][1], *(it.w for it in items)) if items else stack[-1][1]
                stack[-1][0] = []
                stack[-1].append(max((it.chain for it in items), default=0))
            elif kind == "close" and len(stack) > 1:
                group = stack.pop()
                g_items, g_w = group[0], group[1]
                chains = group[2:] + [max((it.chain for it in g_items), default=0)]
                w = max([g_w] + [it.w for it in g_items])
                # what a chain of optional groups repeats: the items beside the nested chain
                content = max([1] + [it.w for it in g_items if not it.chain])
                stack[-1][0].append(_Item(w, max(chains), content))
            elif kind == "quant" and items:
                it = items[-1]
                if value == "?":
                    # a chain of nested optional groups is a repetition written out: x{0,k}
                    it.chain += 1
                    base = it.ref if isinstance(it.ref, int) else 1
                    it.w = max(it.w, it.chain * base if base > 1 else it.chain)
                else:
                    it.w = value * it.w if it.w > 1 else value
                    it.chain = 0
                if it.w > worst[0]:
                    worst[:] = [it.w, name]
        ws = [stack[0][1]] + [it.w for it in stack[0][0]]
        for it in stack[0][0]:
            if it.w > worst[0]:
                worst[:] = [it.w, name]
        return max(ws)

    for name in rules:
        rule_weight(name, set())
    return worst[0], worst[1]


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
    """BoundError if GBNF text nests too deeply or repeats repetitions too heavily."""
    depth = nesting(text)
    if depth > MAX_NESTING:
        raise BoundError(f"the grammar nests parentheses {depth} levels deep; the limit is {MAX_NESTING}")
    w, rule = gbnf_weight(text)
    if w > MAX_NESTED_REPEAT:
        raise BoundError(f"rule {rule!r} repeats a repetition {w} times over (nested repetition counts "
                         f"multiply); the limit is {MAX_NESTED_REPEAT}")


def check_pattern(pattern: str) -> None:
    w = regex_weight(pattern)
    if w > MAX_NESTED_REPEAT:
        raise BoundError(f"the pattern nests repetitions {w} times over (nested counts multiply, as in "
                         f"(a{{0,n}}){{0,m}}: n*m); the limit is {MAX_NESTED_REPEAT}")
