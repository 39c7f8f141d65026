"""Files written whole or not at all (a temporary file in the same folder, then a rename), and files
read with a size limit, regular files only (`read_limited`)."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: Path, data: bytes | str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise



class NotReadable(OSError):
    """A path that is not a regular file, or a file over the size limit (the message says which)."""


def read_limited(path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Opened without blocking (a FIFO would
    wait for a writer forever) and checked with fstat before any read (/dev/zero would never end),
    then read up to limit + 1 bytes: a file that grows meanwhile is still refused, never read whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise NotReadable(e.errno, e.strerror) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise NotReadable(f"not a regular file ({kind})")
        if st.st_size > limit:
            raise NotReadable(f"{st.st_size} bytes; the limit is {limit}")
        os.set_blocking(fd, True)
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > limit:
            raise NotReadable(f"over the limit of {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
