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
  ULTRA_STACKS_FD                        a file of the agent's (worker-<rank>.stacks beside its
log, 0600) where SIGUSR1 makes the worker write its Python stacks: `ask_stacks` before a hung
worker is killed, `crash_stacks` after one died of a fatal signal (daemon/node/stacks.py).

With `standby`, the supervisor also keeps one spare worker per node, started once the node's
workers have trained a step: it has imported torch and waits on its stdin (ULTRA_LOCAL_RANK is
`standby`). A local rank that needs a worker takes the standby at once (one JSON line names the
rank, its log and its error file) and a new standby is started later; a worker killed alone
then costs its world no cold start (seconds of `import torch`) in the next generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from daemon.node.stacks import ask_stacks, crash_stacks, open_stacks_file
from daemon.node.worker_logs import log_path as worker_log_path
from daemon.node.worker_logs import open_log, rotate
from daemon.procutil import is_stopped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerExit:
    local_rank: int
    pid: int
    returncode: int
    expected: bool  # we asked it to go (stop/kill), or it exited 0
    log_path: Path
    error: str = ""  # the first lines of its error file, if it wrote one
    stacks: str = ""  # its Python stacks, when it died of a fatal signal (SIGSEGV, ...)


STANDBY = -1  # the local rank of the standby worker until it is adopted
_STANDBY_FAILURES = 3  # standbys that die unadopted in a row before there is no more standby


@dataclass
class _Worker:
    local_rank: int  # STANDBY while it waits
    proc: asyncio.subprocess.Process
    log_path: Path
    error_path: Path
    stacks_path: Path
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
    standby: bool = False
    _workers: dict[int, _Worker] = field(default_factory=dict)
    _standby: _Worker | None = None
    _standby_failures: int = 0

    def alive(self) -> dict[int, int]:
        """local rank → pid of the running workers (the standby is none of them)."""
        return {r: w.proc.pid for r, w in self._workers.items() if w.proc.returncode is None}

    def stopped(self, local_rank: int) -> bool:
        """Whether the worker of `local_rank` is stopped by a signal now (SIGSTOP)."""
        pid = self.alive().get(local_rank)
        return pid is not None and is_stopped(pid)

    def standby_pid(self) -> int | None:
        w = self._standby
        return w.proc.pid if w is not None and w.proc.returncode is None else None

    async def ensure(self, local_ranks: Iterable[int], adopt: int | None = None) -> list[int]:
        """Give each local rank that has no worker one: `adopt` the standby (if it is still
        there), the others a new process. Returns the ranks given one."""
        started = []
        for rank in sorted(set(local_ranks) - set(self.alive())):
            if rank != adopt or not await self._adopt(rank):
                await self._spawn(rank)
            started.append(rank)
        return started

    async def keep_standby(self) -> None:
        """Start the standby worker if there is none (and standbys are on)."""
        if self.standby and self._standby is None and self._standby_failures < _STANDBY_FAILURES:
            await self._spawn(STANDBY)

    async def drop_standby(self) -> None:
        """End the standby worker, if any (it exits at the end of its input)."""
        w = self._standby
        if w is None or w.stopping:
            return
        w.stopping = True
        if w.proc.stdin is not None:
            w.proc.stdin.close()
        log.info("stopping the standby worker pid=%d", w.proc.pid)

    def _paths(self, rank: int) -> tuple[Path, Path]:
        name = "standby" if rank == STANDBY else str(rank)
        return worker_log_path(self.log_dir, name), self.log_dir / f"worker-{name}.error.json"

    def _stacks_path(self, rank: int) -> Path:
        return self.log_dir / f"worker-{'standby' if rank == STANDBY else rank}.stacks"

    async def ask_stacks(self, local_rank: int) -> str | None:
        """The Python stacks of the worker of `local_rank` (or why there are none), logged;
        waits a bounded time (daemon/node/stacks.py). None when it has no worker by the end."""
        w = self._workers.get(local_rank)
        if w is None or w.proc.returncode is not None:
            return None
        stacks = await ask_stacks(w.proc.pid, w.stacks_path, is_stopped(w.proc.pid))
        if self._workers.get(local_rank) is not w or w.proc.returncode is not None:
            return None
        log.warning("worker local_rank=%d pid=%d stacks:\n%s", local_rank, w.proc.pid, stacks)
        return stacks

    async def _adopt(self, rank: int) -> bool:
        w = self._standby
        if w is None or w.proc.returncode is not None or w.proc.stdin is None:
            return False
        self._standby = None
        log_path, error_path = self._paths(rank)
        error_path.unlink(missing_ok=True)
        rotate(log_path)
        role = {"local_rank": rank, "log": str(log_path), "error_file": str(error_path)}
        try:
            w.proc.stdin.write(json.dumps(role).encode() + b"\n")
            await w.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False  # it died meanwhile; its reaper logs it
        w.local_rank, w.log_path, w.error_path = rank, log_path, error_path
        # The next standby's file takes the standby name: this worker's keeps its rank's.
        stacks_path = self._stacks_path(rank)
        with contextlib.suppress(OSError):
            os.replace(w.stacks_path, stacks_path)
            w.stacks_path = stacks_path
        self._workers[rank] = w
        self._standby_failures = 0
        log.info("standby worker pid=%d takes local_rank=%d", w.proc.pid, rank)
        return True

    async def _spawn(self, rank: int) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path, error_path = self._paths(rank)
        error_path.unlink(missing_ok=True)
        stacks_path = self._stacks_path(rank)
        stacks_fd = open_stacks_file(stacks_path)
        env = {
            **os.environ, **self.extra_env,
            "ULTRA_AGENT_SOCKET": str(self.socket_path),
            "ULTRA_LOCAL_RANK": "standby" if rank == STANDBY else str(rank),
            "ULTRA_NODE_ID": self.node_id,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "TORCHELASTIC_ERROR_FILE": str(error_path),
            "PYTHONUNBUFFERED": "1",
            # The worker arms its own parent-death signal against this pid (first thing in
            # trainer.worker). A preexec_fn would force fork() instead of vfork(): gRPC's
            # fork handlers then restart its poller in the child, which crashes (SIGSEGV or
            # SIGABRT) when the child closes fds before exec.
            "ULTRA_AGENT_PID": str(os.getpid()),
            "ULTRA_STACKS_FD": str(stacks_fd),
        }
        try:
            out = open_log(log_path)  # 0600, rotated when over its cap (worker_logs.py)
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.python, "-m", self.worker_module,
                    stdin=asyncio.subprocess.PIPE if rank == STANDBY
                    else asyncio.subprocess.DEVNULL,
                    stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, pass_fds=(stacks_fd,),
                )
            finally:
                os.close(out)
        finally:
            os.close(stacks_fd)  # the worker holds its own copy
        worker = _Worker(rank, proc, log_path, error_path, stacks_path)
        worker.task = asyncio.create_task(self._reap(worker), name=f"reap-worker-{rank}")
        if rank == STANDBY:
            self._standby = worker
            log.info("started the standby worker pid=%d (%s)", proc.pid, self.worker_module)
            return
        self._workers[rank] = worker
        log.info("started worker local_rank=%d pid=%d (%s)", rank, proc.pid, self.worker_module)

    async def _reap(self, worker: _Worker) -> None:
        code = await worker.proc.wait()
        if self._standby is worker:  # died unadopted: no rank's failure
            self._standby = None
            if not worker.stopping:
                self._standby_failures += 1
                log.warning("the standby worker pid=%d exited with %d (see %s)%s",
                            worker.proc.pid, code, worker.log_path,
                            "; no more standbys" if self._standby_failures >= _STANDBY_FAILURES
                            else "")
            return
        if self._workers.get(worker.local_rank) is worker:
            del self._workers[worker.local_rank]
        error = ""
        with contextlib.suppress(OSError):
            error = worker.error_path.read_text()[:2000]
        # Killed by a signal it did not ask for: a crash leaves its stacks (trainer/stack_dump.py).
        stacks = crash_stacks(worker.stacks_path) if code < 0 and not worker.stopping else ""
        exit_ = WorkerExit(worker.local_rank, worker.proc.pid, code,
                           worker.stopping or code == 0, worker.log_path, error, stacks)
        (log.info if exit_.expected else log.error)(
            "worker local_rank=%d pid=%d exited with %d%s", exit_.local_rank, exit_.pid, code,
            f"; its stacks:\n{stacks}" if stacks else "")
        self.on_exit(exit_)

    async def stop(self, local_ranks: Iterable[int] | None = None, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace`; waits until the workers are gone."""
        ranks = set(self._workers) if local_ranks is None else set(local_ranks)
        victims = [w for r, w in self._workers.items() if r in ranks]
        if local_ranks is None and self._standby is not None:
            victims.append(self._standby)
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
