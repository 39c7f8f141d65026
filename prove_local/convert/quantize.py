"""llama.cpp's quantizer in a child process: `python -m prove_local.convert.quantize SRC DST FTYPE`.

`llama_model_quantize` is one long C call; a Python signal handler runs only after it returns, so
Ctrl-C or SIGTERM could not stop it in-process. The converter runs it here instead, waits in Python
(where signals are handled), and kills this process when interrupted.
Exit 0 on success; otherwise the last stderr line is the error message.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time


def quantize(src: str, dst: str, ftype: int) -> str | None:
    """Run llama_model_quantize; None on success, else the reason (quoted from llama.cpp's log)."""
    import llama_cpp as ll

    lines: list[str] = []

    @ll.llama_log_callback
    def collect(level, text, user_data):  # pragma: no cover - called from C
        lines.append(text.decode("utf-8", "replace").rstrip())

    ll.llama_log_set(collect, ctypes.c_void_p(0))
    ll.llama_backend_init()
    params = ll.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    rc = ll.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc == 0:
        return None
    why = "; ".join(line for line in lines if "error" in line.lower() or "failed" in line.lower())[-300:]
    return f"code {rc}{': ' + why if why else ''}"


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the converter that started it exits. A signal can reach the
    converter in another thread (tqdm's monitor) while Popen is still starting this process, and the
    interrupt then leaves Popen before the converter holds a handle to kill it with: without this,
    the quantizer would run on as an orphan (seen in about one test run in eight)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):                        # not Linux: the converter's kill must do
        return
    parent = os.environ.get("PROVE_QUANTIZE_PARENT")
    if parent and os.getppid() != int(parent):               # the converter was gone before prctl
        os._exit(1)


def main(argv: list[str]) -> int:
    src, dst, ftype = argv
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})   # blocked by the parent's start
    # fault injection for the tests: hold the quantizer long enough to interrupt it
    time.sleep(float(os.environ.get("PROVE_TEST_QUANTIZE_DELAY", "0")))
    error = quantize(src, dst, int(ftype))
    if error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
