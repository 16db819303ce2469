"""Workers' log files: where the supervisor writes them and how `ultractl logs` reads them.

Each worker's stdout and stderr go to `<state dir>/logs/worker-<local rank>.log` (created 0600:
a traceback may quote data or paths). When a worker is started and its file has grown past
`MAX_LOG_BYTES`, the file is rotated to `worker-<rank>.log.1` (one old file kept), so a node
that restarts workers often keeps a bounded amount of logs.

Reading (the ReadWorkerLog RPC) is bounded: the last `tail_lines` lines (at most `MAX_TAIL_LINES`)
of the last `MAX_TAIL_BYTES` of the file, then, when following, new whole lines in chunks of at
most `CHUNK_BYTES`. The path is built here from the log directory and an integer local rank, never
from the caller's text, and opened with O_NOFOLLOW: a request cannot read another file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

MAX_LOG_BYTES = 64 * 1024 * 1024
MAX_TAIL_LINES = 10_000
DEFAULT_TAIL_LINES = 100
MAX_TAIL_BYTES = 1024 * 1024
CHUNK_BYTES = 64 * 1024
POLL_S = 0.2


def log_path(log_dir: Path, name: str) -> Path:
    """The log of local rank `name` (a number, or "standby")."""
    return log_dir / f"worker-{name}.log"


def rotate(path: Path, max_bytes: int = MAX_LOG_BYTES) -> None:
    """Move a log over `max_bytes` to `<name>.1` (replacing the older one)."""
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))


def open_log(path: Path, max_bytes: int = MAX_LOG_BYTES) -> int:
    """An append fd for a worker's output, 0600, after rotating a file over `max_bytes`."""
    rotate(path, max_bytes)
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)


class LogNotFound(LookupError):
    pass


def _open_for_reading(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise LogNotFound(f"no log {path.name} on this node") from None
    except OSError as exc:
        raise LogNotFound(f"cannot read {path.name}: {exc.strerror}") from None


def tail(path: Path, lines: int) -> tuple[bytes, int]:
    """The last `lines` whole lines (bounded as above) and the offset after them."""
    lines = DEFAULT_TAIL_LINES if lines <= 0 else min(lines, MAX_TAIL_LINES)
    fd = _open_for_reading(path)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - MAX_TAIL_BYTES)
        raw = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    data, base = raw, start
    if start > 0:  # the first line read is probably cut: drop it
        cut = raw.find(b"\n") + 1
        data, base = (raw[cut:], start + cut) if cut else (b"", size)
    # A last line without its newline yet is sent once it is complete (follow).
    end = data.rfind(b"\n") + 1
    kept = data[:end].splitlines(keepends=True)[-lines:]
    return b"".join(kept), base + end


async def follow(path: Path, offset: int, stopped: Callable[[], bool]) -> AsyncIterator[bytes]:
    """New whole lines from `offset` on, as they are written; from the start of a new file when
    the log is rotated or truncated. Ends when `stopped()`."""
    pending = b""
    inode = -1
    while not stopped():
        try:
            fd = _open_for_reading(path)
        except LogNotFound:
            await asyncio.sleep(POLL_S)
            continue
        try:
            st = os.fstat(fd)
            if inode not in (-1, st.st_ino) or st.st_size < offset:
                offset, pending = 0, b""  # rotated or truncated: the new file from its start
            inode = st.st_ino
            data = os.pread(fd, CHUNK_BYTES, offset) if st.st_size > offset else b""
        finally:
            os.close(fd)
        if not data:
            await asyncio.sleep(POLL_S)
            continue
        offset += len(data)
        pending += data
        end = pending.rfind(b"\n") + 1
        if end:
            yield pending[:end]
            pending = pending[end:]
        elif len(pending) >= CHUNK_BYTES:  # a line longer than a chunk goes out in pieces
            yield pending
            pending = b""
