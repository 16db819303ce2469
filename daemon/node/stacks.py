"""The Python stacks of a hung worker, asked for just before the watchdog kills it, and those a
worker wrote as it died of a fatal signal.

The supervisor opens one file per worker in the agent's state directory and hands the worker
its descriptor (trainer/stack_dump.py is the worker's side): SIGUSR1 makes faulthandler append
every thread's stack to it. `ask_stacks` sends the signal and waits, at most `STACKS_WAIT_S`,
for the file to grow and settle. A stopped worker (SIGSTOP) cannot answer, so it is not waited
for; one that does not answer in time gets a note instead of stacks. Either way the kill is
delayed by at most the wait. A worker that dies of SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT
has written its stacks to the same file first (faulthandler); `crash_stacks` reads them back
(docs/observability.md, "Stacks of a hung or crashed worker").
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

STACKS_WAIT_S = 1.0
_POLL_S = 0.02
LOG_STACKS_BYTES = 64 * 1024  # the tail of a dump that goes to the agent log
_FATAL = b"Fatal Python error: "  # how faulthandler begins a dump on a fatal signal


def open_stacks_file(path: Path) -> int:
    """A new, empty file for one worker's stacks, created here (0600; never an existing file
    nor a link put in its place): a write descriptor for the worker to inherit."""
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


async def ask_stacks(pid: int, path: Path, stopped: bool, wait: float = STACKS_WAIT_S) -> str:
    """The worker's stacks (their last LOG_STACKS_BYTES), or one line saying why there are none."""
    if stopped:
        return "no stacks: the worker is stopped (SIGSTOP) and cannot answer"
    before = _size(path)
    if before < 0:
        return f"no stacks: {path} is gone"
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError as exc:
        return f"no stacks: cannot signal pid {pid}: {exc.strerror}"
    deadline, seen = time.monotonic() + wait, before
    while time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
        size = _size(path)
        if size > before and size == seen:  # grew, then stopped growing: the dump is whole
            break
        seen = size
    if seen <= before:
        return f"no stacks: the worker did not answer within {wait:.1f}s"
    with path.open("rb") as f:
        f.seek(max(before, seen - LOG_STACKS_BYTES))
        return f.read(seen - f.tell()).decode(errors="replace").rstrip("\n")


def crash_stacks(path: Path) -> str:
    """What the worker wrote to `path` as it died of a fatal signal (from faulthandler's "Fatal
    Python error" line on, at most LOG_STACKS_BYTES), or "" when it wrote nothing of the kind:
    a SIGKILL, a plain exit, an earlier SIGUSR1 answer only."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_STACKS_BYTES))
            tail = f.read()
    except OSError:
        return ""
    start = tail.rfind(_FATAL)
    return tail[start:].decode(errors="replace").rstrip("\n") if start >= 0 else ""
