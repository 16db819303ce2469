"""The node side's decisions: a pure function of what this node knows, like the leader's
`decide()` (daemon/control/decide.py).

`NodeFacts` is what one agent knows about its own node at one moment: the plan, the job's
progress and state, whether the node drains or the agent stops, which local ranks have a live
worker, which generation a local worker broke, and what the hang detector (daemon/node/
watchdog.py, itself pure in time) found hung. `decide_node` turns that into `NodeActions`:
which workers to start (and which of them takes the standby worker), whether to keep or drop
the standby, which hung ones to kill;
`must_exit` says whether a local rank's worker must leave its loop, and `exit_failure` what a
worker's exit means (which generation it fails, of what kind, at which step). Nothing here
touches a process, etcd or the clock; `daemon/node/workers.py` applies the actions.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.control.records import FailureKind, JobState, Progress
from parallel.planner import Plan


@dataclass(frozen=True)
class Hung:
    """A local rank's worker the hang detector found hung: why, and the generation it last
    said it was in (0: it never said)."""

    local_rank: int
    reason: str
    generation: int


@dataclass(frozen=True)
class NodeFacts:
    node: str
    devices: int
    plan: Plan | None  # the newest plan, whether or not this node is in it
    progress: Progress  # the job's progress record
    job: JobState
    draining: bool  # this node was asked to drain
    stopping: bool  # this agent is shutting down
    broken_generation: int  # the newest generation a local worker failed in (or was fenced)
    workers: frozenset[int] = frozenset()  # local ranks with a live worker process
    standby_ready: bool = False  # a standby worker (torch imported) waits to be adopted
    hung: tuple[Hung, ...] = ()  # what the hang detector found just now

    @property
    def in_plan(self) -> bool:
        return self.plan is not None and self.node in self.plan.nodes

    @property
    def job_over(self) -> bool:
        """Failed, cancelled, or finished in the plan's generation: no worker has work left."""
        plan, progress = self.plan, self.progress
        return self.job in (JobState.FAILED, JobState.CANCELLED) or (
            plan is not None and progress.finished and progress.generation == plan.generation)


@dataclass(frozen=True)
class NodeActions:
    start: tuple[int, ...] = ()  # local ranks of the plan that have no worker: start one
    adopt: int | None = None  # the one of them that takes the standby worker (the rest spawn)
    standby: bool | None = None  # keep a standby worker (True), drop it (False), as is (None)
    kill: tuple[Hung, ...] = ()  # hung workers to kill (their exit then fails their generation)


def must_exit(f: NodeFacts, local_rank: int) -> bool:
    """Whether the worker of `local_rank` must leave its loop (GetGeneration answers `exit`, a
    step report `stop_now`): the agent stops, the rank is not one of this node's devices, the
    job is over, or the node drains and the plan no longer has it."""
    if f.stopping or local_rank >= f.devices or f.job_over:
        return True
    return f.draining and not f.in_plan


def decide_node(f: NodeFacts) -> NodeActions:
    """What to do with this node's workers now (module docstring)."""
    plan = f.plan
    start: tuple[int, ...] = ()
    if plan is not None and f.in_plan and not f.stopping and not f.job_over:
        start = tuple(r.local_rank for r in plan.ranks_of(f.node)
                      if r.local_rank not in f.workers and r.local_rank < f.devices)
    return NodeActions(start=start, adopt=start[0] if start and f.standby_ready else None,
                       standby=_standby(f),
                       kill=tuple(h for h in f.hung if h.local_rank in f.workers))


def _standby(f: NodeFacts) -> bool | None:
    """A standby worker is kept while this node trains in a job that goes on and the agent is
    neither stopping nor draining, once the generation trains (not while its workers start,
    restore and import torch, nor while a failure is recovered from)."""
    plan, progress = f.plan, f.progress
    if plan is None or not f.in_plan or f.stopping or f.draining or f.job_over:
        return False
    if progress.generation == plan.generation and progress.step > plan.restore.step \
            and f.broken_generation < plan.generation:
        return True
    return None


@dataclass(frozen=True)
class ExitFailure:
    """A worker's exit as the failure of a generation."""

    generation: int
    kind: FailureKind
    step: int  # the job's step in that generation (-1: not known)
    message: str


def exit_failure(f: NodeFacts, local_rank: int, returncode: int | None, error: str,
                 expected: bool, hung: Hung | None) -> ExitFailure | None:
    """What the exit of `local_rank`'s worker fails: None for an exit it was asked for. A
    worker killed as `hung` fails the generation it hung in when that is older than the
    current one: the current world waits for this local rank's fresh worker, it did not
    fail."""
    generation = f.plan.generation if f.plan is not None else 0
    if hung is not None:
        if hung.generation:
            generation = min(generation, hung.generation)
        kind = FailureKind.HANG
        message = f"worker local_rank={local_rank} hung: {hung.reason}"
    elif expected:
        return None
    else:
        kind = FailureKind.EXIT
        message = f"worker local_rank={local_rank} exited with {returncode}" \
                  + (f": {error}" if error else "")
    progress = f.progress
    step = progress.step if progress.generation == generation else -1
    return ExitFailure(generation, kind, step, message)
