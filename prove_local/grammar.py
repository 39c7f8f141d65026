"""Grammars for constrained output: GBNF text (llama.cpp's grammar format) parsed by llama.cpp for a
model's vocabulary, JSON schemas turned into GBNF, and the grammar's state after a run of tokens.

Like llama.py, this module calls llama.cpp (its grammar sampler, `llama_sampler_init_grammar`); the
decoding side (constrain.py) sees a state through three methods a test fake can implement:
    state.allows(token) -> bool        the token may come next
    state.mask() -> bool[n_vocab]      every token that may come next
    state.then(token) -> state | None  the state after the token (None: the grammar forbids it)
A state is one llama.cpp grammar sampler; `then` clones it and accepts the token (llama.cpp's own
speculative path clones its sampler per draft position the same way), so the states of a cycle's
proposals branch off the committed one, and dropping a rejected branch frees it.

Schema -> GBNF: llama-cpp-python's `llama_cpp.llama_grammar.json_schema_to_gbnf`, the Python port of
llama.cpp's examples/json_schema_to_grammar.py that llama-cpp-python maintains and uses for its own
`response_format` (LlamaGrammar.from_json_schema is the same function wrapped in an object that does
not parse the text). The C++ `json_schema_to_grammar` (common/) is not exported by libllama. The
resulting text is parsed by llama.cpp itself, so a schema and a hand-written grammar go through the
same parser and the same sampler. `json_object` uses llama-cpp-python's JSON_GBNF (any JSON object).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import tempfile
import threading
import time

import numpy as np

import llama_cpp as ll
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from .errors import DeadlineExceeded, ProveError
from .grammar_bounds import BoundError, check_gbnf, check_pattern, check_schema_gbnf
from .llama import _log_tail

# Bounds on what a request may ask the converter and the parser to build (a schema such as
# {"minItems": 10**9} expands into a grammar of that many repetitions).
MAX_SCHEMA_CHARS = 64 * 1024
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_GRAMMAR_FILE = 4 * MAX_GRAMMAR_CHARS     # bytes of a --grammar / --json-schema file (UTF-8: <= 4 per character)
MAX_REPEAT = 1000           # largest minItems/maxItems/minLength/maxLength/min/maxProperties a schema may give


class GrammarError(ProveError):
    """A grammar or schema that cannot be used; the message is the parser's, on one line."""


_parse_lock = threading.Lock()


def _parse(vocab, text: str):
    """llama_sampler_init_grammar, with the parser's complaint as a GrammarError. llama.cpp prints
    the parser's message ("parse: error parsing grammar: ...") to stderr itself, and logs only
    "failed to parse grammar": stderr is read from a temporary file for the duration of the call (a
    parse takes milliseconds; what other threads print meanwhile is passed on when the parse succeeds,
    and dropped with the parser's dump of the grammar when it fails)."""
    with _parse_lock, tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            _log_tail.clear()
            smpl = ll.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        printed = tmp.read().decode("utf-8", "replace")
    if smpl:
        if printed:                   # another thread's output during the call: passed on
            os.write(2, printed.encode("utf-8", "replace"))
        return smpl
    lines = [ln.strip() for ln in printed.splitlines() if ln.strip()]
    said = [ln.split("error parsing grammar:", 1)[1].strip() for ln in lines if "error parsing grammar:" in ln]
    logged = [ln for ln in _log_tail if "grammar" in ln and ln != "failed to parse grammar"]
    reason = (said or logged or ["llama.cpp could not parse it"])[0]
    raise GrammarError(f"invalid grammar: {reason}")


class Grammar:
    """GBNF text parsed by llama.cpp for `model`'s vocabulary; `start()` is the state before any
    token. `text` is what was parsed (a schema's GBNF, for the record)."""

    def __init__(self, model, text: str, *, weigh: bool = True):
        """`weigh`: refuse nested repetitions too heavy for llama.cpp's parse stacks (grammar_bounds);
        off for the JSON-schema converter's output, whose patterns and counts are bounded before
        (its nesting and its alternatives are checked either way)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("invalid grammar: it is empty")
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GrammarError(f"invalid grammar: not UTF-8 text (a lone surrogate at character {e.start})") from None
        try:        # before llama.cpp's parser sees it: a deep nesting overflows its stack (SIGSEGV)
            if weigh:
                check_gbnf(text)
            else:
                check_schema_gbnf(text)
        except BoundError as e:
            raise GrammarError(f"invalid grammar: {e}") from None
        self.text = text
        self.deadline: float | None = None      # time.monotonic() past which a step raises DeadlineExceeded
        self.n_vocab = model.n_vocab
        self._root = _parse(model._vocab, text)
        eos = ll.llama_vocab_eos(model._vocab)
        # the token a row offers when the grammar allows nothing (a dead end): an end-of-generation
        # token, which the grammar then forbids too, so the engine stops there (constrain.py)
        self.sentinel = int(eos) if eos >= 0 else int(np.flatnonzero([model.is_eog(i) for i in range(model.n_vocab)])[0])
        self._one = _Candidates(1)
        self._all = _Candidates(self.n_vocab)

    @classmethod
    def from_schema(cls, model, schema) -> "Grammar":
        return cls(model, schema_to_gbnf(schema), weigh=False)

    @classmethod
    def json_object(cls, model) -> "Grammar":
        return cls(model, JSON_GBNF, weigh=False)

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceeded("the request ran past its deadline during a grammar step")

    def start(self) -> "GrammarState":
        return GrammarState(self, ll.llama_sampler_clone(self._root))

    def __del__(self):
        if getattr(self, "_root", None):
            with contextlib.suppress(Exception):
                ll.llama_sampler_free(self._root)
            self._root = None


class _Candidates:
    """A llama_token_data_array over a numpy buffer (id, logit, p), reused by every apply call."""

    DTYPE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

    def __init__(self, n: int):
        assert self.DTYPE.itemsize == ctypes.sizeof(ll.llama_token_data)
        self.buf = np.zeros(n, dtype=self.DTYPE)
        self.buf["id"] = np.arange(n)
        self.arr = ll.llama_token_data_array(data=self.buf.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
                                             size=n, selected=-1, sorted=False)
        self.ref = ctypes.byref(self.arr)


class GrammarState:
    """The grammar after some tokens: one llama.cpp grammar sampler, owned by this object."""
    __slots__ = ("grammar", "_smpl", "_mask")

    def __init__(self, grammar: Grammar, smpl):
        self.grammar, self._smpl, self._mask = grammar, smpl, None

    def allows(self, token: int) -> bool:
        if self._mask is not None:
            return bool(self._mask[token])
        self.grammar.check_deadline()
        c = self.grammar._one
        c.buf["id"][0], c.buf["logit"][0] = token, 0.0
        c.arr.size, c.arr.selected, c.arr.sorted = 1, -1, False
        ll.llama_sampler_apply(self._smpl, c.ref)
        return bool(np.isfinite(c.buf["logit"][0]))

    def mask(self) -> np.ndarray:
        """Every token the grammar allows next (an end-of-generation token only where it may end)."""
        if self._mask is None:
            self.grammar.check_deadline()
            c = self.grammar._all
            c.buf["logit"] = 0.0
            c.arr.size, c.arr.selected, c.arr.sorted = len(c.buf), -1, False
            ll.llama_sampler_apply(self._smpl, c.ref)
            self._mask = np.isfinite(c.buf["logit"])
        return self._mask

    def then(self, token: int) -> "GrammarState | None":
        self.grammar.check_deadline()
        if not self.allows(token):      # accepting a forbidden token would make llama.cpp throw
            return None
        nxt = ll.llama_sampler_clone(self._smpl)
        ll.llama_sampler_accept(nxt, int(token))
        return GrammarState(self.grammar, nxt)

    def __del__(self):
        if self._smpl:
            with contextlib.suppress(Exception):       # (at interpreter exit the bindings may be gone)
                ll.llama_sampler_free(self._smpl)
            self._smpl = None


# ------------------------------------------------------------------------------ schemas
def schema_to_gbnf(schema) -> str:
    """A JSON schema (a dict, or its JSON text) as GBNF; GrammarError names what is wrong."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"invalid JSON schema: a schema is an object, not {type(schema).__name__}")
    _check_bounds(schema, "schema")           # (depth first: the walk below recurses)
    schema = _booleans(schema, "schema")
    try:
        text = json.dumps(schema, allow_nan=False)
    except ValueError:
        raise GrammarError("invalid JSON schema: NaN or Infinity is not JSON") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"the JSON schema has {len(text)} characters; the limit is {MAX_SCHEMA_CHARS}")
    try:
        gbnf = json_schema_to_gbnf(text)
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply") from None
    except Exception as e:           # noqa: BLE001 - the converter raises bare ValueError/KeyError/TypeError
        raise GrammarError(f"invalid JSON schema: {type(e).__name__}: {e}".replace("\n", " ")) from None
    # llama-cpp-python's port lets a string hold raw control characters ([^"\\]), which JSON forbids
    # (RFC 8259 section 7; json.loads refuses them): llama.cpp's current converter excludes them, as here
    gbnf = gbnf.replace('char ::= [^"\\\\] |', 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |')
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the JSON schema's grammar has {len(gbnf)} characters; the limit is {MAX_GRAMMAR_CHARS}")
    return gbnf


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def _check_bounds(node, where: str, depth: int = 0) -> None:
    """Refuse repetition counts the converter would expand into huge grammars."""
    if depth > 64:
        raise GrammarError(f"invalid JSON schema: nested more than 64 levels deep at {where}")
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _COUNTS and isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_REPEAT:
                raise GrammarError(f"JSON schema {where}.{k} = {v}: the limit is {MAX_REPEAT}")
            if k == "pattern" and isinstance(v, str):       # a{n} / a{n,m} in a pattern expands likewise
                for m in re.finditer(r"\{(\d+)(?:,(\d*))?\}", v):
                    if max(int(x) for x in m.groups() if x) > MAX_REPEAT:
                        raise GrammarError(f"JSON schema {where}.pattern: the repetition {m.group(0)} is over "
                                           f"the limit of {MAX_REPEAT}")
                try:                 # (a{0,n}){0,m}: n*m parse stacks per grammar step (grammar_bounds)
                    check_pattern(v)
                except BoundError as e:
                    raise GrammarError(f"JSON schema {where}.pattern: {e}") from None
            _check_bounds(v, f"{where}.{k}", depth + 1)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_bounds(v, f"{where}[{i}]", depth + 1)


# keywords whose value is one schema / a list of schemas / a name -> schema map (JSON Schema 2020-12)
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _booleans(node, where: str):
    """The schema with JSON Schema's boolean schemas spelled out for the converter (which calls
    .get on every schema): `true` (anything) is {} (as items: no items keyword), `false` (nothing)
    is refused, except as additionalProperties, which the converter takes as a boolean."""
    if node is True:
        return {}
    if node is False:
        raise GrammarError(f"invalid JSON schema: {where} is false, which no value satisfies")
    if not isinstance(node, dict):
        raise GrammarError(f"invalid JSON schema: {where} must be an object or a boolean, not {type(node).__name__}")
    out = dict(node)
    for k, v in node.items():
        if k in _ONE:
            if v is True and k in ("items", "additionalItems"):
                del out[k]                                  # any items: the converter's default
            elif isinstance(v, list) and k == "items":      # (draft 4 tuple form)
                out[k] = [_booleans(x, f"{where}.{k}[{i}]") for i, x in enumerate(v)]
            else:
                out[k] = _booleans(v, f"{where}.{k}")
        elif k in _LIST:
            if not isinstance(v, list):
                raise GrammarError(f"invalid JSON schema: {where}.{k} must be a list of schemas")
            out[k] = [_booleans(x, f"{where}.{k}[{i}]") for i, x in enumerate(v)]
        elif k in _MAP:
            if not isinstance(v, dict):
                raise GrammarError(f"invalid JSON schema: {where}.{k} must be an object of schemas")
            out[k] = {name: _booleans(x, f"{where}.{k}.{name}") for name, x in v.items()}
        elif k == "additionalProperties" and v is not False and v is not True:
            out[k] = _booleans(v, f"{where}.{k}")
    return out
