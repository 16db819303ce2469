"""Process and port helpers shared by the etcd launcher, the supervisor and `ultrad local`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel's choice, so parallel runs don't collide)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that were free a moment ago. They are bound together: two calls of
    `free_port` in a row can return the same port, since the first socket is closed by then."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                   for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A preexec_fn making the child receive `sig` when its parent dies (Linux only).

    A killed agent must leave no orphans: its workers hold devices and sockets that the next
    generation needs.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The parent may have died between fork and prctl.
        if os.getppid() != parent:
            os._exit(1)

    return preexec


PARENT_PID_ENV = "ULTRA_PARENT_PID"


def arm_parent_death(sig: int = signal.SIGKILL) -> None:
    """In a child started with `PARENT_PID_ENV` set: receive `sig` when that parent dies.

    The child arms this itself because a preexec_fn forces fork() in the parent, and forking a
    process that runs gRPC lets gRPC's fork handlers crash the child before exec.
    """
    expected = int(os.environ.pop(PARENT_PID_ENV, "0"))
    if not expected or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != expected:
        os._exit(1)


def parent_death_env() -> dict[str, str]:
    """Environment for a child that should call `arm_parent_death` at start."""
    return {PARENT_PID_ENV: str(os.getpid())}


def terminate(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> int | None:
    """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    return proc.returncode


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer now; False
    when it is gone or this is not Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")
