"""Model weights on 2 MiB pages (Linux transparent huge pages), where llama.cpp would map the file.

llama.cpp maps a GGUF file (`mmap`) and computes from the page cache's 4 KiB pages. Every token reads
all of the weights, so a 92 MiB model crosses ~23,500 pages a token, and on the machines measured here
the page walks behind those TLB misses cost 3-10 % of a token's time, most when the host is busy
(docs/run.md and docs/server.md, "Weights on huge pages"). Loaded into anonymous memory instead
(llama.cpp's `LLAMA_LOAD_MODE_NONE`, its `--no-mmap`) and advised `MADV_HUGEPAGE` before the file is
read into it, the same bytes sit on 2 MiB pages: ~50 TLB entries. The arithmetic is unchanged (the
same kernels on the same bytes), so every output is the same token for token.

`Model` asks `choose` and, when it says so, loads through `Load`: llama.cpp's progress callback, whose
first call (the buffers allocated, no tensor read yet) advises the anonymous mappings that appeared
since the load began (`Mappings`; `HeapHeld` makes sure the weight buffer is one); after the load,
`MADV_COLLAPSE` puts what was touched before the advice (the allocator's header page) on huge pages
too. Not Linux, or THP `never`: the mmap load.
"""
from __future__ import annotations

import ctypes
import errno
import sys
from pathlib import Path

from .system import available_ram_bytes

MADV_HUGEPAGE = 14          # <asm-generic/mman-common.h>
MADV_COLLAPSE = 25          # Linux >= 6.1; EINVAL before
HUGE = 2 << 20              # x86-64's and arm64's (4 KiB granule) transparent huge page
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SHARE = 0.5                 # auto: the weights may take at most this share of the available memory
SMALL = 32 << 20            # auto: smaller weights are nearer the TLB's reach on 4 KiB pages, and glibc may
                            # put a buffer below its largest mmap threshold (32 MiB) on its heap, where
                            # `Mappings` does not look
CHOICES = ("auto", "on", "off")


def thp_mode(path: Path = THP) -> str | None:
    """The kernel's transparent huge page setting ("always", "madvise", "never"), None where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def choose(setting: str, size: int, on_cpu: bool, *, thp: str | None = None,
           available: int | None = None) -> tuple[bool, str]:
    """Whether to load `size` bytes of weights onto huge pages, and why (one line).

    setting: "off" (llama.cpp's mmap), "on" (huge pages wherever the kernel has them), "auto" (the
    default: on when the weights stay on the CPU, are not small (`SMALL`) and take at most half of the
    available memory, so that a model that needs the page cache's paging keeps it)."""
    if setting not in CHOICES:
        raise ValueError(f"hugepages: {setting!r} is not one of {', '.join(CHOICES)}")
    if setting == "off":
        return False, "--hugepages off"
    if not sys.platform.startswith("linux"):
        return False, f"no transparent huge pages on {sys.platform}"
    thp = thp_mode() if thp is None else thp
    if thp not in ("always", "madvise"):
        return False, f"transparent huge pages are {thp or 'absent'} ({THP})"
    if setting == "on":
        return True, "--hugepages on"
    if not on_cpu:
        return False, "the weights are offloaded"
    if size < SMALL:
        return False, f"{size / 2**20:.1f} MiB of weights: small enough for 4 KiB pages"
    available = available_ram_bytes() if available is None else available
    if available is None or size > SHARE * available:
        have = "unknown" if available is None else f"{available / 2**20:.0f} MiB"
        return False, (f"{size / 2**20:.0f} MiB of weights is more than half of the available memory "
                       f"({have}): mmap keeps them pageable")
    return True, "auto"


class Mappings:
    """The process's anonymous read-write mappings (/proc/self/maps) when made, to find those made after."""

    def __init__(self):
        self.before = self._read()

    @staticmethod
    def _read() -> set[tuple[int, int]]:
        out = set()
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) == 5 and fields[1].startswith("rw"):     # no path: anonymous
                        lo, hi = (int(x, 16) for x in fields[0].split("-"))
                        out.add((lo, hi))
        except OSError:
            pass
        return out

    def new(self, at_least: int = 2 << 20) -> list[tuple[int, int]]:
        """Mappings of `at_least` bytes that were not there when this was made (a grown one counts as new)."""
        return sorted((lo, hi) for lo, hi in self._read() - self.before if hi - lo >= at_least)


_libc = None


def _lib():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
        libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
        _libc = libc
    return _libc


def _madvise(lo: int, hi: int, advice: int) -> int:
    """madvise over [lo, hi): 0, or the errno."""
    return 0 if _lib().madvise(lo, hi - lo, advice) == 0 else ctypes.get_errno()


class HeapHeld:
    """Free heap blocks of at least `size` bytes, held while a model loads (a context manager), so that
    llama.cpp's allocation of its weight buffer gets a fresh mapping that `Mappings` can find: glibc's
    malloc serves a large request from a free block of its heap first, and after other models and
    contexts have come and gone (a test run, a server) its heap can hold one as large as a model.
    Blocks are taken until malloc answers with a new mapping (which is freed at once); they are not
    touched, so this costs no memory, and they are freed when the load is over."""

    def __init__(self, size: int, limit: int = 64):
        self.size, self.limit, self.held = size, limit, []

    def __enter__(self) -> "HeapHeld":
        libc = _lib()
        maps = Mappings()
        for _ in range(self.limit):
            p = libc.malloc(self.size)
            if not p:
                break
            if any(lo <= p < hi for lo, hi in maps.new(at_least=self.size)):
                libc.free(p)                 # a fresh mapping: no free block this large is left
                break
            self.held.append(p)
        return self

    def __exit__(self, *exc) -> None:
        libc = _lib()
        for p in self.held:
            libc.free(p)
        self.held = []


class Load:
    """One model load onto huge pages, around llama.cpp's `llama_model_load_from_file` (a context
    manager): `progress` is its progress callback, whose first call (the buffers allocated, no tensor
    read yet) advises the mappings made since (`Mappings`); on exit what was touched before the advice
    is collapsed (`collapse`), and `mib` is how much of the load's memory is on huge pages then."""

    def __init__(self, size: int):
        self.maps = Mappings()
        self.heap = HeapHeld(size // 2)
        self.regions: list[tuple[int, int]] = []
        self.error: int | None = None
        self.mib = 0.0
        self.interrupted = False

    def progress(self, _progress, _user) -> bool:
        """llama.cpp's progress callback: True goes on loading. Ctrl-C while it runs (Python's signal
        handler raises in whatever Python code runs next, which is this) cancels the load instead, and
        `interrupted` tells Model to raise KeyboardInterrupt once llama.cpp has returned: a callback's
        exception would otherwise be printed and dropped, and the load end as "could not load"."""
        try:
            if not self.regions:
                self.regions.extend(self.maps.new())
                advise(self.regions)
            return True
        except KeyboardInterrupt:
            self.interrupted = True
            return False
        except Exception:       # noqa: BLE001 - advice only: the load goes on without it
            return True

    def __enter__(self) -> "Load":
        self.heap.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.heap.__exit__()
        self.error = collapse(self.regions)
        self.mib = huge_bytes(self.regions) / 2**20


def advise(regions: list[tuple[int, int]]) -> None:
    """MADV_HUGEPAGE: pages touched from now on in these regions come as 2 MiB pages where they can."""
    for lo, hi in regions:
        _madvise(lo, hi, MADV_HUGEPAGE)


def collapse(regions: list[tuple[int, int]]) -> int:
    """MADV_COLLAPSE: put what is already touched in these regions on huge pages now, 2 MiB at a time
    (over a whole region the kernel gives up at the first part it cannot collapse, such as a part
    nothing has touched yet, which the advice then covers). 0, or the errno of the parts that failed
    when none succeeded (EINVAL: a kernel before 6.1, or nothing touched; EAGAIN/ENOMEM: no huge page
    free: those parts stay on 4 KiB pages)."""
    ok, err = 0, 0
    for lo, hi in regions:
        at = (lo + HUGE - 1) // HUGE * HUGE
        while at + HUGE <= hi:
            e = _madvise(at, at + HUGE, MADV_COLLAPSE)
            ok, err = (ok + 1, err) if not e else (ok, err or e)
            at += HUGE
    return 0 if ok or not err else err


def huge_bytes(regions: list[tuple[int, int]]) -> int:
    """Bytes of these regions on huge pages now (AnonHugePages in /proc/self/smaps)."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = any(lo < b and a < hi for a, b in regions)
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def explain(err: int | None) -> str:
    """The errno's name in brackets for the load's one line, or nothing."""
    return "" if not err else f" ({errno.errorcode.get(err, err)})"

