"""What the agent does with its workers' reports (the WorkerHost side of
daemon/node/worker_service.py): hang bookkeeping, metrics, and global rank 0's progress,
checkpoints and restores, which its agent records in etcd (daemon/node/progress.py)."""

from __future__ import annotations

import time

from daemon.control.records import RestoreRecord
from daemon.control.snapshot_steps import newest_complete
from daemon.control.view import ClusterView
from daemon.metrics import Metrics
from daemon.node.progress import ProgressWriter
from daemon.node.snapshot_keeper import SnapshotKeeper
from daemon.node.watchdog import HangDetector
from daemon.recovery_phases import RecoveryPhases
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb


class WorkerReports:
    """Mixed into the Agent, which owns these attributes."""

    node_id: str
    view: ClusterView
    hangs: HangDetector
    metrics: Metrics
    progress: ProgressWriter
    recovery: RecoveryPhases
    snapshots: SnapshotKeeper | None

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


def restore_record(report: pb.RestoreReport, plan: Plan | None) -> RestoreRecord:
    """Global rank 0's restore report as the generation's `restore` record."""
    planned = f"{plan.restore.source}@{plan.restore.step}" \
        if plan is not None and plan.generation == report.generation else ""
    return RestoreRecord(generation=report.generation, source=report.source, step=report.step,
                         planned=planned, skipped=report.skipped[:1000], seconds=report.seconds,
                         snapshot_bytes=report.snapshot_bytes)
