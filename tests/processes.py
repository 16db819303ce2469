"""The process tree of agents and workers, read from /proc (Linux), for tests that kill them."""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

from daemon.cli.local import LocalCluster


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(p) for p in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    seen: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in seen:
                seen.append(child)
                todo.append(child)
    return seen


def worker_pids(agent_pid: int) -> list[int]:
    """The agent's workers: its `trainer.worker` children, less a standby that has not taken a
    local rank (started with ULTRA_LOCAL_RANK=standby, named `ultra-w<rank>` once it has)."""
    out = []
    for pid in descendants(agent_pid):
        try:
            if b"trainer.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            standby = b"\0ULTRA_LOCAL_RANK=standby\0" in b"\0" + Path(
                f"/proc/{pid}/environ").read_bytes()
            if standby and not Path(f"/proc/{pid}/comm").read_text().startswith("ultra-w"):
                continue
        except OSError:
            continue
        out.append(pid)
    return out


def alive(pid: int) -> bool:
    """Running (a zombie is not)."""
    try:
        # The command name in parentheses may hold spaces: the state follows its ")".
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Held:
    """Processes held by a pidfd each: a signal later reaches the process a pid named when it
    was held, or none once that process is gone, never another that took the number since.

    Tests note an agent's descendants, wait (a cluster's stop, a drain), then kill what is
    left. By pid, a number freed meanwhile and taken by another test's process would be
    killed instead: pid_max is 32768 on such machines, every thread takes a number, and the
    suite starts thousands of them a minute. `kill(pid)` also accepts a thread's id, so the
    victim could be any rank of a concurrent test."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self._fds: dict[int, int] = {}
        self.add(pids)

    def add(self, pids: Iterable[int]) -> None:
        for pid in pids:
            if pid in self._fds and not self._gone(self._fds[pid]):
                continue
            with contextlib.suppress(ProcessLookupError):
                fd = os.pidfd_open(pid)
                if pid in self._fds:  # the held one is gone and a new one has its number
                    os.close(self._fds[pid])
                self._fds[pid] = fd

    @property
    def pids(self) -> list[int]:
        return list(self._fds)

    @staticmethod
    def _gone(fd: int) -> bool:
        # A pidfd reads as ready once its process has exited (a zombie included).
        return bool(select.select([fd], [], [], 0)[0])

    def running(self) -> list[int]:
        """The held processes that have not exited."""
        return [pid for pid, fd in self._fds.items() if not self._gone(fd)]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, sig)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextlib.contextmanager
def running(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Start a LocalCluster; on exit stop it and kill any worker its agents left behind."""
    try:
        cluster.start()
        yield cluster
    finally:
        workers = Held(w for p in cluster.agents.values() if p.poll() is None
                       for w in descendants(p.pid))
        try:
            cluster.stop()
            workers.kill()
        finally:
            workers.close()
