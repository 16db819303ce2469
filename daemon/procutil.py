"""Process and port helpers shared by the etcd launcher, the supervisor and `ultrad local`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


# Ports handed out by `free_ports` come from below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default), never from it: a port chosen now and
# bound later (etcd restarted on the ports it had, a rank's MASTER_PORT) must not be taken in
# between by an outgoing connection's source port, and source ports only come from that range.
_LOWEST_PICKED_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago and that no outgoing connection will take."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that were free a moment ago, picked at random below the ephemeral range
    (so that no outgoing connection takes one before its user binds it) and checked by binding
    them together. Where that range leaves no room below it, the kernel's choice."""
    span = _unclaimed_span()
    if span is None:
        return _kernel_ports(n, host)
    pick = random.SystemRandom()  # not the seeded `random`: forked ranks would pick alike
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(64 * n):
            port = pick.randrange(*span)
            if port in ports:
                continue
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((host, port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    return _kernel_ports(n, host)


def _unclaimed_span() -> tuple[int, int] | None:
    """[first, end) of the ports below the ephemeral range, or None where there are too few."""
    try:
        first_ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_LOWEST_PICKED_PORT, first_ephemeral) if first_ephemeral - _LOWEST_PICKED_PORT >= 4096 else None


def _kernel_ports(n: int, host: str) -> list[int]:
    """`n` distinct ports of the kernel's choice, bound together (two calls of a one-port
    version in a row can return the same port, the first socket being closed by then)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                   for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


def die_with_parent_prefix(signame: str = "KILL") -> list[str]:
    """A command prefix making a child (any program, not only ours) receive SIG`signame` when
    its parent dies: `setpriv --pdeathsig`, which sets it and execs the program. Empty where
    setpriv is missing (not Linux, or util-linux without it).

    A preexec_fn doing the same would force fork() in the parent, and forking a process that
    runs gRPC lets gRPC's fork handlers crash the child before exec (seen as etcd "exiting"
    with SIGABRT). Without a preexec_fn, subprocess spawns with vfork, which runs no fork
    handlers.
    """
    if not sys.platform.startswith("linux"):
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, f"--pdeathsig={signame}", "--"] if setpriv else []


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


def terminate(proc: subprocess.Popen[bytes], timeout: float = 5.0,
              before_kill: Callable[[], None] | None = None) -> int | None:
    """SIGTERM, then SIGKILL after `timeout` (calling `before_kill` first, if given); returns
    the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if before_kill is not None:
                before_kill()
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
