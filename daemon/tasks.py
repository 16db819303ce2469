"""Supervised asyncio tasks and the one retry backoff every loop of the agent uses.

A long-lived task that raises anything unexpected must not die silently: a leaderless agent
whose lease still holds the leader key would stall every other agent. `TaskSupervisor` logs
the traceback and records the failure; the agent then exits non-zero, so systemd or
Kubernetes restarts it and its lease lapses.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Backoff:
    """Jittered exponential backoff: `next()` returns the delay to sleep before the next try."""

    initial: float = 0.1
    maximum: float = 5.0
    factor: float = 2.0
    jitter: float = 0.2  # each delay is scaled by a uniform factor in [1 - jitter, 1 + jitter]
    rng: random.Random = field(default_factory=random.Random)
    _current: float = 0.0

    def next(self) -> float:
        self._current = self.initial if self._current == 0 else min(
            self.maximum, self._current * self.factor)
        return self._current * self.rng.uniform(1 - self.jitter, 1 + self.jitter)

    def reset(self) -> None:
        self._current = 0.0

    async def sleep(self) -> None:
        await asyncio.sleep(self.next())


class TaskSupervisor:
    """Owns the agent's long-lived tasks; the first unexpected exit is fatal to the agent."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.failure = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, *, long_lived: bool = True
              ) -> asyncio.Task[Any]:
        """Run `coro`; a long-lived task must never return, a short one may (not raise)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, long_lived))
        return task

    def _done(self, task: asyncio.Task[Any], long_lived: bool) -> None:
        self._tasks.discard(task)
        if self._closing or task.cancelled():
            return
        exc = task.exception()
        if exc is None and not long_lived:
            return
        if exc is None:
            message = f"task {task.get_name()} returned unexpectedly"
            log.error("%s", message)
        else:
            message = f"task {task.get_name()} failed: {type(exc).__name__}: {exc}"
            log.error("%s", message, exc_info=exc)
        if not self.failed.is_set():
            self.failure = message
            self.failed.set()

    def closing(self) -> None:
        """From now on a task that ends is part of the shutdown, not a failure."""
        self._closing = True

    async def close(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait for them (safe to call more than once).

        The cancellation is repeated until each task is gone: Python 3.11's `asyncio.wait_for`
        can swallow a cancellation that arrives as its inner wait completes, and a loop that
        then goes on waiting (for a lease that `leave()` just dropped) would keep the agent
        alive, silent, until systemd or the kubelet SIGKILLs it.
        """
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending = set(self._tasks)
        while pending:
            for task in pending:
                task.cancel()
            done, pending = await asyncio.wait(pending, timeout=0.1)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: the shutdown does not report it
            if pending and loop.time() > deadline:
                log.error("tasks still running after %.0fs of cancellation: %s", timeout,
                          ", ".join(sorted(t.get_name() for t in pending)))
                return
