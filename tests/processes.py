"""The process tree of agents and workers, read from /proc (Linux), for tests that kill them."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
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


@contextlib.contextmanager
def running(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Start a LocalCluster; on exit stop it and kill any worker its agents left behind."""
    try:
        cluster.start()
        yield cluster
    finally:
        workers = [w for p in cluster.agents.values() if p.poll() is None
                   for w in descendants(p.pid)]
        cluster.stop()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
