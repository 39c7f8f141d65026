"""What this machine has free: GPU memory (nvidia-smi) and RAM (/proc/meminfo)."""
from __future__ import annotations

import os
import shutil
import subprocess

from .shapes import MiB


def nvidia_smi_rows(fields: str, timeout: float = 20) -> list[list[str]] | None:
    """`nvidia-smi --query-gpu=FIELDS` as one list of stripped values per GPU, or None when
    nvidia-smi is not there or does not answer."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def free_gpu_bytes() -> int | None:
    """Free memory of the visible NVIDIA GPUs together (llama.cpp splits layers across them), or None
    when nvidia-smi is not there or does not answer."""
    rows = nvidia_smi_rows("index,memory.free", timeout=10)
    if rows is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = None
    if visible is not None and all(x.strip().isdigit() for x in visible.split(",") if x.strip()):
        wanted = {int(x) for x in visible.split(",") if x.strip()}
    total, seen = 0, False
    for row in rows:
        try:
            index, free = (int(float(x)) for x in row)
        except ValueError:
            continue
        if wanted is None or index in wanted:
            total += free * MiB
            seen = True
    return total if seen else None


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (free + reclaimable cache), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


