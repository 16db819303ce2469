"""Worker processes of this node: spawn, watch, stop.

Workers persist across generations (docs/architecture.md, "Processes"): the supervisor only starts a
worker for a local rank that has none, and kills one only when asked (fencing, a worker stuck
in a collective past its deadline, shutdown). *What* a worker does next (join generation g,
stop after step s) travels over the worker-facing gRPC service, not through signals.

A worker is `python -m <worker_module>` with:
  ULTRA_AGENT_SOCKET   unix socket of this agent's WorkerControl service
  ULTRA_LOCAL_RANK     its device index on this node
  ULTRA_NODE_ID        this node's id
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   never host or share a store: the agent hosts it
  TORCHELASTIC_ERROR_FILE                where torch.distributed.elastic's @record writes the error
  ULTRA_AGENT_PID                        the agent's pid: the worker arms PR_SET_PDEATHSIG itself
and dies with its agent, so a killed node leaves no orphan holding devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerExit:
    local_rank: int
    pid: int
    returncode: int
    expected: bool  # we asked it to go (stop/kill), or it exited 0
    log_path: Path
    error: str = ""  # the first lines of its error file, if it wrote one


@dataclass
class _Worker:
    local_rank: int
    proc: asyncio.subprocess.Process
    log_path: Path
    error_path: Path
    task: asyncio.Task[None] | None = None
    stopping: bool = False


@dataclass
class Supervisor:
    node_id: str
    socket_path: Path
    log_dir: Path
    on_exit: Callable[[WorkerExit], None]
    worker_module: str = "trainer.worker"
    python: str = sys.executable
    extra_env: dict[str, str] = field(default_factory=dict)
    _workers: dict[int, _Worker] = field(default_factory=dict)

    def alive(self) -> dict[int, int]:
        """local rank → pid of the running workers."""
        return {r: w.proc.pid for r, w in self._workers.items() if w.proc.returncode is None}

    async def ensure(self, local_ranks: Iterable[int]) -> list[int]:
        """Start a worker for each local rank that has none; returns the ranks started."""
        started = []
        for rank in sorted(set(local_ranks) - set(self.alive())):
            await self._spawn(rank)
            started.append(rank)
        return started

    async def _spawn(self, rank: int) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"worker-{rank}.log"
        error_path = self.log_dir / f"worker-{rank}.error.json"
        error_path.unlink(missing_ok=True)
        env = {
            **os.environ, **self.extra_env,
            "ULTRA_AGENT_SOCKET": str(self.socket_path),
            "ULTRA_LOCAL_RANK": str(rank),
            "ULTRA_NODE_ID": self.node_id,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "TORCHELASTIC_ERROR_FILE": str(error_path),
            "PYTHONUNBUFFERED": "1",
            # The worker arms its own parent-death signal against this pid (first thing in
            # trainer.worker). A preexec_fn would force fork() instead of vfork(): gRPC's
            # fork handlers then restart its poller in the child, which crashes (SIGSEGV or
            # SIGABRT) when the child closes fds before exec.
            "ULTRA_AGENT_PID": str(os.getpid()),
        }
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-m", self.worker_module, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
            )
        worker = _Worker(rank, proc, log_path, error_path)
        worker.task = asyncio.create_task(self._reap(worker), name=f"reap-worker-{rank}")
        self._workers[rank] = worker
        log.info("started worker local_rank=%d pid=%d (%s)", rank, proc.pid, self.worker_module)

    async def _reap(self, worker: _Worker) -> None:
        code = await worker.proc.wait()
        if self._workers.get(worker.local_rank) is worker:
            del self._workers[worker.local_rank]
        error = ""
        with contextlib.suppress(OSError):
            error = worker.error_path.read_text()[:2000]
        exit_ = WorkerExit(worker.local_rank, worker.proc.pid, code,
                           worker.stopping or code == 0, worker.log_path, error)
        (log.info if exit_.expected else log.error)(
            "worker local_rank=%d pid=%d exited with %d", exit_.local_rank, exit_.pid, code)
        self.on_exit(exit_)

    async def stop(self, local_ranks: Iterable[int] | None = None, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace`; waits until the workers are gone."""
        ranks = set(self._workers) if local_ranks is None else set(local_ranks)
        victims = [w for r, w in self._workers.items() if r in ranks]
        for w in victims:
            w.stopping = True
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        tasks = [w.task for w in victims if w.task is not None]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace if grace > 0 else None)
        for w in victims:
            if w.task in pending:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
        if pending:
            await asyncio.wait(pending)

    async def kill_all(self) -> None:
        """At once (fencing: another agent may already be using our devices' places)."""
        await self.stop(None, grace=0)
