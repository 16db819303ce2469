"""Hang detection for this node's workers, from their heartbeats and observed step times.

Every worker beats about once a second from a thread of its own, naming its phase (idle, join,
restore, step, checkpoint) and its step. A worker is hung when
- its heartbeat is silent for `fault.heartbeat_timeout_s`: it is stopped (SIGSTOP), or stuck
  holding the interpreter, so it cannot even say so; or
- it beats, but its phase has a deadline and it made no progress within it: join, restore and
  the first step have fixed deadlines; later steps max(hang_floor_s, hang_step_factor × the
  median of its recent step times), so a job with 30 s steps is not killed for being slow and
  a job with 0.05 s steps is not left stalled for minutes.
A worker that has not beaten yet (still importing torch) has the join deadline; one stopped
by a signal before its first beat (its process in state T) is hung once it has stayed stopped
for `heartbeat_timeout_s`, as a stopped worker that beats already is.
A hung worker is killed and handled like a dead one. Peers blocked in a collective with it keep
beating (gloo releases the interpreter) and get their error as soon as it dies, so only the
culprit is killed.

A worker still busy (joining, restoring, stepping, checkpointing) in a generation older than the
newest one is waiting on a world that has moved on: a peer cut off by the network sends no
reset, and a gloo collective cannot be aborted, so it would sit until its process-group timeout.
Once the newer generation is `obsolete_grace` old (and the worker made no progress in that
time) it is killed too. Generations are only replaced after the old one stopped or failed, so
this never kills a worker whose world could still finish the step.

`HangDetector` is pure (time is an argument); `Watchdog` applies it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from parallel.job import FaultConfig

log = logging.getLogger(__name__)

_RECENT_STEPS = 16


@dataclass
class _Rank:
    started_at: float
    beat_at: float = 0.0
    generation: int = 0
    phase: str = "idle"
    step: int = 0
    progress_at: float = 0.0  # last phase change or completed step
    stopped_at: float = 0.0  # before its first beat: when it was first seen stopped (0: not)
    step_times: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_RECENT_STEPS))


class HangDetector:
    def __init__(self) -> None:
        self._ranks: dict[int, _Rank] = {}
        self._current = 0  # the newest generation seen by hung()
        self._current_since = 0.0

    def started(self, local_rank: int, now: float) -> None:
        """A new worker process: it has until its first heartbeat like any other deadline."""
        self._ranks[local_rank] = _Rank(started_at=now, progress_at=now)

    def generation_of(self, local_rank: int) -> int:
        """The generation the rank last said it was in (0: none yet)."""
        r = self._ranks.get(local_rank)
        return r.generation if r is not None else 0

    def forget(self, local_rank: int) -> None:
        self._ranks.pop(local_rank, None)

    def beat(self, local_rank: int, generation: int, phase: str, step: int, now: float) -> None:
        r = self._ranks.setdefault(local_rank, _Rank(started_at=now, progress_at=now))
        if (generation, phase) != (r.generation, r.phase) or step > r.step:
            r.progress_at = now
        r.beat_at, r.generation, r.phase, r.step = now, generation, phase, step

    def step_done(self, local_rank: int, step: int, seconds: float, now: float) -> None:
        r = self._ranks.get(local_rank)
        if r is None:
            return
        r.step_times.append(max(0.0, seconds))
        if step > r.step:
            r.step, r.progress_at = step, now

    def deadline(self, r: _Rank, fault: FaultConfig) -> float | None:
        """Seconds of no progress allowed in the rank's current phase (None: unbounded)."""
        if r.phase == "join":
            return fault.join_timeout_s
        if r.phase in ("restore", "checkpoint"):
            return fault.restore_timeout_s
        if r.phase == "step":
            if not r.step_times:
                return fault.first_step_timeout_s
            return max(fault.hang_floor_s,
                       fault.hang_step_factor * statistics.median(r.step_times))
        return None  # idle: waiting for a generation is not a hang

    def hung(self, now: float, fault: FaultConfig, current: int = 0,
             obsolete_grace: float = float("inf"),
             stopped: Callable[[int], bool] = lambda _rank: False) -> list[tuple[int, str]]:
        """Ranks to kill. `current` is the newest generation: a rank still busy in an older one
        waits for peers that have moved on, and learns of it only at a timeout, so it is
        replaced `obsolete_grace` after `current` was first seen here instead. `stopped(rank)`:
        whether the rank's process is stopped by a signal now (asked only before its first
        beat)."""
        if current > self._current:
            self._current, self._current_since = current, now
        out = []
        for rank, r in sorted(self._ranks.items()):
            if r.phase != "idle" and 0 < r.generation < current \
                    and now - max(r.progress_at, self._current_since) > obsolete_grace:
                out.append((rank, f"still in phase {r.phase} of generation {r.generation} "
                                  f"{now - self._current_since:.1f}s after generation "
                                  f"{current} began"))
                continue
            if r.beat_at == 0.0:
                # Still starting (importing torch): the join deadline covers it, unless it is
                # stopped, which no import explains.
                r.stopped_at = (r.stopped_at or now) if stopped(rank) else 0.0
                if r.stopped_at and now - r.stopped_at > fault.heartbeat_timeout_s:
                    out.append((rank, f"stopped for {now - r.stopped_at:.1f}s before its first "
                                      f"heartbeat"))
                elif now - r.started_at > fault.join_timeout_s:
                    out.append((rank, f"no heartbeat {now - r.started_at:.1f}s after start"))
                continue
            silent = now - r.beat_at
            if silent > fault.heartbeat_timeout_s:
                out.append((rank, f"heartbeat silent for {silent:.1f}s in phase {r.phase} "
                                  f"(stopped, or stuck holding the interpreter)"))
                continue
            limit = self.deadline(r, fault)
            if limit is not None and now - r.progress_at > limit:
                out.append((rank, f"no progress for {now - r.progress_at:.1f}s in phase "
                                  f"{r.phase} (deadline {limit:.1f}s) at step {r.step}"))
        return out


# (local_rank, reason, the generation it hung in; 0 when it never said)
Kill = Callable[[int, str, int], Awaitable[None]]


class Watchdog:
    """Checks the detector a few times a second; kills what it reports, once per hang."""

    def __init__(self, detector: HangDetector, fault: Callable[[], FaultConfig], kill: Kill,
                 current: Callable[[], int] = lambda: 0, obsolete_grace: float = float("inf"),
                 period: float = 0.25,
                 stopped: Callable[[int], bool] = lambda _rank: False) -> None:
        self.detector = detector
        self.stopped = stopped
        self.fault = fault
        self.kill = kill
        self.current = current
        self.obsolete_grace = obsolete_grace
        self.period = period

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            hung = self.detector.hung(time.monotonic(), self.fault(), self.current(),
                                      self.obsolete_grace, self.stopped)
            for rank, reason in hung:
                log.error("worker local_rank=%d is hung: %s; killing it", rank, reason)
                generation = self.detector.generation_of(rank)
                self.detector.forget(rank)
                await self.kill(rank, reason, generation)
