"""This node's workers in one room: the supervisor that runs them and the standby, the hang
detector and its watchdog, the generations local workers broke, and what the agent does with
their reports. It is the worker service's host (daemon/node/worker_service.py).

Its decisions are `daemon/node/node_decision.py`'s, a pure function of `facts()`; this class
gathers the facts and applies the actions: starting and killing processes, reporting failures
to the leader, metrics, and global rank 0's progress, checkpoints and restores, which the agent
records in etcd (daemon/node/progress.py).

A failure report is a `failure` control request in etcd, put until etcd acknowledges it or a
newer generation makes it moot; the first report of a peer's failure in a generation also has
the leader's agent checked for life (daemon/control/leader_failover.py), since a dead leader
would never read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from daemon.config import AgentConfig
from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.job_state import job_state
from daemon.control.keys import Keys
from daemon.control.leader_failover import Probe, revoke_dead_leader
from daemon.control.records import ControlOp, ControlRequest, FailureKind, RestoreRecord
from daemon.control.snapshot_steps import newest_complete
from daemon.control.view import ClusterView
from daemon.metrics import Metrics
from daemon.node.node_decision import Hung, NodeFacts, decide_node, exit_failure, must_exit
from daemon.node.progress import ProgressWriter
from daemon.node.snapshot_keeper import SnapshotKeeper
from daemon.node.supervisor import Supervisor, WorkerExit
from daemon.node.watchdog import HangDetector, Watchdog
from daemon.recovery_phases import RecoveryPhases
from daemon.tasks import Backoff, TaskSupervisor
from parallel.job import FaultConfig
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb

log = logging.getLogger(__name__)

ReadPeer = Callable[[str, pb.SnapshotRanges], Awaitable[list[list[bytes]]]]


class NodeWorkers:
    def __init__(self, config: AgentConfig, view: ClusterView, etcd: Etcd, keys: Keys,
                 metrics: Metrics, progress: ProgressWriter, recovery: RecoveryPhases,
                 snapshots: SnapshotKeeper | None, read_peer_snapshot: ReadPeer, probe: Probe,
                 draining: Callable[[], bool], stopping: asyncio.Event,
                 tasks: TaskSupervisor) -> None:
        self.config, self.node_id, self.devices = config, config.node_id, config.devices
        self.view, self.etcd, self.keys = view, etcd, keys
        self.metrics, self.progress, self.recovery = metrics, progress, recovery
        self.snapshots, self.probe = snapshots, probe
        self.read_peer_snapshot = read_peer_snapshot
        self._draining, self._stopping, self._tasks = draining, stopping, tasks
        self.hangs = HangDetector()
        self.supervisor: Supervisor | None = None
        # The newest generation a local worker failed in: it is broken, never hand it out again.
        self.broken_generation = 0
        # local ranks killed as hung: the verdict and their stacks
        self._hung: dict[int, tuple[Hung, str]] = {}
        self._leader_checked = 0  # the newest generation a peer's failure had the leader checked

    # -- the facts and the actions -------------------------------------------------------------

    def facts(self, hung: tuple[Hung, ...] = ()) -> NodeFacts:
        view = self.view
        sup = self.supervisor
        return NodeFacts(node=self.node_id, devices=self.devices, plan=view.plan,
                         progress=view.progress, job=job_state(view)[0],
                         draining=self._draining(), stopping=self._stopping.is_set(),
                         broken_generation=self.broken_generation,
                         workers=frozenset(sup.alive()) if sup else frozenset(),
                         standby_ready=sup is not None and sup.standby_pid() is not None,
                         hung=hung)

    def start(self, socket_path: Path, env: dict[str, str]) -> Watchdog | None:
        """Start supervising (when this agent runs workers); the watchdog to run."""
        cfg = self.config
        if not cfg.workers:
            return None
        self.supervisor = Supervisor(self.node_id, socket_path, cfg.state_dir / "logs",
                                     self._on_exit, cfg.worker_module, extra_env=env,
                                     standby=cfg.standby_worker)
        return Watchdog(self.hangs, self._fault, self._kill_hung, lambda: self.view.generation,
                        cfg.ttl, stopped=self.supervisor.stopped)

    async def follow(self, new_generation: bool) -> None:
        """After a change of the view: start the plan's workers (when its generation is new to
        this node, which is in it) and keep or drop the standby."""
        if self.supervisor is None:
            return
        actions = decide_node(self.facts())
        if new_generation and actions.start:
            await self._start(actions.start, actions.adopt)
        if actions.standby is True:
            await self.supervisor.keep_standby()
        elif actions.standby is False:
            await self.supervisor.drop_standby()

    def fenced(self, reason: str) -> None:
        """This node fenced itself: the world its workers were in is broken, and the leader is
        told so (a report delivered once the node is back, or dropped when the generation is
        replaced): re-joining within the leader's debounce our key only blinks, and without a
        report the leader keeps a generation this node no longer runs while the others wait out
        join_timeout_s."""
        self.broken_generation = max(self.broken_generation, self.view.generation)
        plan, progress = self.view.plan, self.view.progress
        if plan is not None and self.node_id in plan.nodes:
            g = plan.generation
            self.report_failure(f"failure-{self.node_id}-{g}-fenced", g, FailureKind.LOST,
                                progress.step if progress.generation == g else -1,
                                f"{self.node_id} fenced itself: {reason}")

    async def kill_all(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.kill_all()

    async def stop(self, grace: float) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop(grace=grace)

    async def _start(self, ranks: tuple[int, ...], adopt: int | None) -> None:
        assert self.supervisor is not None
        started = await self.supervisor.ensure(ranks, adopt)
        now = time.monotonic()
        for rank in started:
            self.hangs.started(rank, now)

    def _fault(self) -> FaultConfig:
        plan = self.view.plan
        return plan.job.fault if plan is not None else FaultConfig()

    def _on_exit(self, exit_: WorkerExit) -> None:
        self.hangs.forget(exit_.local_rank)
        hung = self._hung.pop(exit_.local_rank, None)
        facts = self.facts()
        failure = exit_failure(facts, exit_.local_rank, exit_.returncode, exit_.error,
                               exit_.expected, hung[0] if hung else None)
        if failure is None:
            return
        self.on_worker_failure(exit_.local_rank, failure.generation, failure.kind,
                               failure.step, failure.message,
                               stacks=hung[1] if hung else exit_.stacks)
        actions = decide_node(facts)  # taken after the worker exited: its rank has none
        if actions.start:  # at once: the next generation will want this local rank again
            self._tasks.spawn(self._start(actions.start, actions.adopt),
                              f"respawn-{exit_.local_rank}", long_lived=False)

    async def _kill_hung(self, local_rank: int, reason: str, generation: int) -> None:
        hung = Hung(local_rank, reason, generation)
        if self.supervisor is None or not decide_node(self.facts((hung,))).kill:
            return  # its worker is gone already: that exit is reported as one
        # Asking takes a bounded wait; None: the worker exited meanwhile (an exit then).
        stacks = await self.supervisor.ask_stacks(local_rank)
        if stacks is not None:
            self._hung[local_rank] = (hung, stacks)
            await self.supervisor.stop([local_rank], grace=0)

    # -- the worker service's host (daemon/node/worker_service.py) -------------------------------

    def worker_should_exit(self, local_rank: int) -> bool:
        return must_exit(self.facts(), local_rank)

    def on_worker_failure(self, local_rank: int, generation: int, kind: FailureKind, step: int,
                          message: str, detect_s: float = 0.0, stacks: str = "") -> None:
        self.recovery.failed(generation, time.monotonic(), detect_s)
        self.broken_generation = max(self.broken_generation, generation)
        log.error("worker local_rank=%d failed in generation %d (%s): %s", local_rank,
                  generation, kind.value, message[:500])
        self.report_failure(f"failure-{self.node_id}-{generation}-{local_rank}", generation,
                            kind, step, message, stacks)

    def report_failure(self, request_id: str, generation: int, kind: FailureKind, step: int,
                       message: str, stacks: str = "") -> None:
        """Report a failure of `generation` to the leader, in the background."""
        request = ControlRequest(op=ControlOp.FAILURE, node=self.node_id, generation=generation,
                                 kind=kind, step=step, message=message[:2000], time=time.time(),
                                 stacks=stacks[-4096:])
        self._tasks.spawn(put_until_acknowledged(
            self.etcd, self.keys.control_request(request_id), request,
            lambda: self.view.generation <= generation and not self._stopping.is_set()),
            f"report-{request_id}", long_lived=False)
        if kind == FailureKind.PEER and self._leader_checked < generation:
            self._leader_checked = generation  # once per broken generation
            self._tasks.spawn(revoke_dead_leader(self.view, self.etcd, self.keys, self.probe,
                                                 self.node_id), "leader-check", long_lived=False)

    def handed(self, local_rank: int, generation: int) -> None:
        self.hangs.beat(local_rank, generation, "idle" if not generation else "join", 0,
                        time.monotonic())

    def on_heartbeat(self, beat: pb.HeartbeatRequest) -> None:
        self.hangs.beat(beat.local_rank, beat.generation, beat.phase, beat.step,
                        time.monotonic())

    def _reporting_rank(self, local_rank: int) -> bool:
        """This node's first local rank in the plan: the one whose reports become metrics."""
        plan = self.view.plan
        mine = plan.ranks_of(self.node_id) if plan else ()
        return local_rank == min((r.local_rank for r in mine), default=0)

    def on_step(self, report: pb.StepReport) -> None:
        now = time.monotonic()
        self.hangs.step_done(report.local_rank, report.step, report.step_seconds, now)
        if self._reporting_rank(report.local_rank):
            self.metrics.observe_step(report)
            recovered = self.recovery.stepped(report.generation, now)
            if recovered is not None:
                self.metrics.observe_recovery(recovered)
        if report.global_rank == 0:
            skipped = {"skipped_step": report.step, "skipped_reason": report.skipped[:64]} \
                if report.skipped else {}
            evaluated = {"eval_step": report.step, "eval_loss": report.eval_loss} \
                if report.HasField("eval_loss") else {}
            self.progress.report(report.generation, urgent=bool(skipped or evaluated),
                                 step=report.step,
                                 consumed_samples=report.consumed_samples, loss=report.loss,
                                 snapshot_complete=self._snapshot_complete(), **skipped,
                                 **evaluated)

    def _snapshot_complete(self) -> int:
        """The newest snapshot step of the running generation two live nodes or more hold
        entirely (-1: none known)."""
        view, plan = self.view, self.view.plan
        if plan is None or plan.generation != view.generation:
            return -1
        revision = view.spec.mod_revision if view.spec else 0
        return newest_complete({n: h for n, h in view.snapshots.items()
                                if n in view.nodes and h.spec_revision == revision},
                               plan.generation, plan.nodes)

    def on_checkpoint(self, report: pb.CheckpointReport) -> None:
        if report.global_rank == 0:
            self.metrics.observe_checkpoint(report)
            self.progress.checkpoint(report.generation, report.step, report.path)

    def on_restore(self, report: pb.RestoreReport) -> None:
        if self._reporting_rank(report.local_rank):
            self.recovery.restored(report.generation, time.monotonic())
            if self.snapshots is not None:  # that rank freed the newer snapshots first
                self.snapshots.restored(report.generation, report.step)
        if report.global_rank == 0:
            record = restore_record(report, self.view.plan)
            self.metrics.observe_restore(record)
            self.progress.restored(record)

    def on_done(self, report: pb.DoneReport) -> None:
        if report.global_rank == 0:
            self.progress.report(report.generation, urgent=True, step=report.step,
                                 consumed_samples=report.consumed_samples,
                                 finished=not report.stopped, stopped=report.stopped)


async def put_until_acknowledged(etcd: Etcd, key: bytes, request: ControlRequest,
                                 still_wanted: Callable[[], bool]) -> None:
    """Put `request`, retried until etcd acknowledges it or `still_wanted()` turns false."""
    backoff = Backoff(initial=0.1, maximum=2.0)
    while still_wanted():
        try:
            await etcd.put(key, request.to_json())
            return
        except ETCD_ERRORS as exc:
            log.warning("request %s not recorded yet (%s); retrying", key.decode(errors="replace"),
                        type(exc).__name__)
            await backoff.sleep()


def restore_record(report: pb.RestoreReport, plan: Plan | None) -> RestoreRecord:
    """Global rank 0's restore report as the generation's `restore` record."""
    planned = f"{plan.restore.source}@{plan.restore.step}" \
        if plan is not None and plan.generation == report.generation else ""
    return RestoreRecord(generation=report.generation, source=report.source, step=report.step,
                         planned=planned, skipped=report.skipped[:1000], seconds=report.seconds,
                         snapshot_bytes=report.snapshot_bytes)
