"""The agent's Prometheus metrics, in a registry of its own (served on --metrics-listen by
daemon/api/servers.py).

At the bottom of the daemon: every layer may import it, and it imports only the records it
observes (daemon/control/records.py, daemon/recovery_phases.py), which import nothing of the
daemon.

Names and labels are listed in the README's metrics table. Training metrics count the job's
global progress as seen by this node's local rank 0 (every rank reports the same global loss and token count),
so any one agent's /metrics tells the job's story. The job's state and its newest checkpoint come
from etcd (the agent's view), so every agent exports them, in or out of the generation; the
dashboards and rules in deploy/ aggregate over agents with max().
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
)

from daemon import __version__
from daemon.control.records import CheckpointRecord, JobState, Progress, RestoreRecord
from daemon.expert_metrics import ExpertMetrics
from daemon.recovery_phases import PHASES, Recovery
from parallel import mesh_dims
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb

MEMORY_KINDS = ("params", "grads", "optimizer", "activations")
_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Phases last from milliseconds (detect) to minutes; 60 s is the UltraRecoverySlow threshold.
_RECOVERY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120)
RECOVERY_PHASES = (*PHASES, "total")
_CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# A snapshot of a small model blocks for milliseconds, a large one's for seconds.
_BLOCKING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
CHECKPOINT_TIERS = ("memory", "durable")
REASONS = ("start", "join", "leave", "drain", "failure", "job", "layout")
SKIP_REASONS = ("nonfinite_loss", "nonfinite_grad")  # trainer.nonfinite.REASONS


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.steps = Counter("ultra_train_steps_total", "Training steps completed", registry=r)
        self.tokens = Counter("ultra_train_tokens_total", "Tokens trained on (global)",
                              registry=r)
        self.loss = Gauge("ultra_train_loss", "Loss of the last completed step", registry=r)
        self.learning_rate = Gauge("ultra_train_learning_rate",
                                   "Learning rate of the last completed step", registry=r)
        self.grad_norm = Gauge("ultra_train_grad_norm",
                               "Gradient norm (before clipping) of the last applied step",
                               registry=r)
        self.mfu = Gauge("ultra_train_mfu_ratio",
                         "Model FLOPs utilisation of the last step (0-1; NaN: the device's "
                         "peak is unknown, e.g. CPU)", registry=r)
        self.eval_loss = Gauge("ultra_eval_loss",
                               "Mean token loss of the [eval] held-out set at the last "
                               "evaluation (NaN until one ran)", registry=r)
        self.eval_loss.set(math.nan)
        self.skipped_steps = Counter("ultra_train_skipped_steps_total",
                                     "Steps whose update every rank skipped (non-finite loss "
                                     "or gradient norm), by reason", ["reason"], registry=r)
        self.step_duration = Histogram("ultra_train_step_duration_seconds",
                                       "Wall time of one training step", buckets=_STEP_BUCKETS,
                                       registry=r)
        self.world_size = Gauge("ultra_world_size", "Devices in the current generation",
                                registry=r)
        self.mesh_size = Gauge("ultra_mesh_size", "Size of each mesh dimension", ["dim"],
                               registry=r)
        self.generation = Gauge("ultra_generation", "Current generation number", registry=r)
        self.membership_changes = Counter("ultra_membership_changes_total",
                                          "New generations, by what caused them", ["reason"],
                                          registry=r)
        self.recovery = Histogram("ultra_recovery_duration_seconds",
                                  "Failure to first step of the new generation, by phase "
                                  "(detect, rendezvous, restore, first_step; total: their sum)",
                                  ["phase"], buckets=_RECOVERY_BUCKETS, registry=r)
        self.is_leader = Gauge("ultra_agent_is_leader", "1 while this agent leads", registry=r)
        self.bubble = Gauge("ultra_pipeline_bubble_ratio", "Pipeline idle fraction (0-1)",
                            ["source"], registry=r)
        self.recompute_seconds = Counter("ultra_recompute_seconds_total",
                                         "Time spent recomputing activations", registry=r)
        self.recompute_ratio = Gauge("ultra_recompute_ratio",
                                     "Recompute share of step time (0-1)", registry=r)
        self.memory = Gauge("ultra_memory_bytes", "Memory per device", ["kind", "source"],
                            registry=r)
        self.lost_steps = Counter("ultra_lost_steps_total",
                                  "Steps trained again after a restore (their work was lost)",
                                  registry=r)
        self.job_state = Gauge("ultra_job_state", "1 for the job's current state", ["state"],
                               registry=r)
        self.checkpoint_step = Gauge("ultra_checkpoint_last_step",
                                     "Step of the newest durable checkpoint (-1: none)",
                                     registry=r)
        self.checkpoint_time = Gauge("ultra_checkpoint_last_timestamp_seconds",
                                     "Unix time the newest durable checkpoint committed (0: none)",
                                     registry=r)
        self.checkpoint_duration = Histogram(
            "ultra_checkpoint_duration_seconds",
            "Checkpoint time: save started to manifest written (reported by global rank 0)",
            ["tier", "op"], buckets=_CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_blocking = Histogram(
            "ultra_checkpoint_blocking_seconds",
            "Time a checkpoint held the training step loop of this node's first local rank: "
            "the in-memory snapshot (memory) or a durable checkpoint's staging (durable)",
            ["tier"], buckets=_BLOCKING_BUCKETS, registry=r)
        self.snapshot_bytes = Gauge("ultra_snapshot_bytes",
                                    "Bytes of in-memory snapshots this node holds (own shards "
                                    "and buddy copies)", registry=r)
        self.snapshot_age = Gauge("ultra_snapshot_age_steps",
                                  "Steps since the newest snapshot step this node holds whole "
                                  "(-1: none)", registry=r)
        self.snapshot_room = Gauge("ultra_snapshot_host_bytes",
                                   "Host memory for this node's snapshots: the plan's "
                                   "prediction, and what the snapshot directory has room for",
                                   ["kind"], registry=r)
        self.experts = ExpertMetrics(r)
        self.build = Info("ultra_build", "Build information", registry=r)
        self.build.info({"version": __version__, "python": platform.python_version()})
        # process_start_time_seconds: how alerts see an agent that keeps restarting.
        ProcessCollector(registry=r)
        for dim in mesh_dims.NAMES:
            self.mesh_size.labels(dim=dim).set(0)
        for reason in REASONS:
            self.membership_changes.labels(reason=reason)
        for reason in SKIP_REASONS:
            self.skipped_steps.labels(reason=reason)
        self.mfu.set(math.nan)
        self.checkpoint_duration.labels(tier="durable", op="save")
        for tier in CHECKPOINT_TIERS:
            self.checkpoint_duration.labels(tier=tier, op="restore")
            self.checkpoint_blocking.labels(tier=tier)
        for phase in RECOVERY_PHASES:
            self.recovery.labels(phase=phase)
        self.snapshot_age.set(-1)
        self.is_leader.set(0)
        self.observe_job(JobState.NONE, CheckpointRecord())
        # The generation last observed and the newest step seen in it: what a restore to an
        # earlier step makes the next generation train again.
        self._generation, self._last_step = 0, 0

    def observe_plan(self, plan: Plan, progress: Progress | None = None) -> None:
        """A new generation. `progress` is the job's progress recorded in etcd: it covers steps
        of generations this node took no part in."""
        last = self._last_step
        if progress is not None and self._generation <= progress.generation < plan.generation:
            last = max(last, progress.step)
        # A new job starts over at step 0: nothing of the old job's progress is lost.
        if plan.reason != "job" and last > plan.restore.step:
            self.lost_steps.inc(last - plan.restore.step)
        self._generation, self._last_step = plan.generation, plan.restore.step
        self.generation.set(plan.generation)
        self.world_size.set(plan.world_size)
        for dim in mesh_dims.NAMES:
            self.mesh_size.labels(dim=dim).set(getattr(plan.layout, dim))
        self.bubble.labels(source="predicted").set(plan.predicted.bubble_ratio)
        for kind in MEMORY_KINDS:
            self.memory.labels(kind=kind, source="predicted").set(
                getattr(plan.predicted.memory_bytes, kind))
        self.membership_changes.labels(reason=plan.reason or "start").inc()

    def observe_step(self, report: pb.StepReport) -> None:
        """One step, as reported by this node's first local rank."""
        self.steps.inc()
        if report.generation >= self._generation:  # not a straggler of a replaced generation
            self._last_step = max(self._last_step, report.step)
        self.tokens.inc(max(0, report.tokens))
        self.step_duration.observe(max(0.0, report.step_seconds))
        if report.HasField("learning_rate"):
            self.learning_rate.set(report.learning_rate)
        self.mfu.set(report.mfu if report.HasField("mfu") else math.nan)
        if report.HasField("eval_loss"):
            self.eval_loss.set(report.eval_loss)
        if report.skipped:
            # The loss and norm of a skipped step are not finite: the gauges keep the last
            # applied step's, and the counter says what happened.
            if report.skipped in SKIP_REASONS:  # a fixed label set, whatever a worker sends
                self.skipped_steps.labels(reason=report.skipped).inc()
        else:
            self.loss.set(report.loss)
            if report.HasField("grad_norm"):
                self.grad_norm.set(report.grad_norm)
        for kind in MEMORY_KINDS:
            name = f"memory_{kind}_bytes"
            if report.HasField(name):
                self.memory.labels(kind=kind, source="measured").set(getattr(report, name))
        self.experts.observe(report)
        if report.HasField("bubble_ratio"):
            self.bubble.labels(source="measured").set(report.bubble_ratio)
        if report.HasField("recompute_seconds"):
            self.recompute_seconds.inc(report.recompute_seconds)
        if report.HasField("recompute_ratio"):
            self.recompute_ratio.set(report.recompute_ratio)
        if report.HasField("snapshot_blocking_seconds"):
            self.checkpoint_blocking.labels(tier="memory").observe(
                max(0.0, report.snapshot_blocking_seconds))
        if report.HasField("checkpoint_blocking_seconds"):
            self.checkpoint_blocking.labels(tier="durable").observe(
                max(0.0, report.checkpoint_blocking_seconds))

    def observe_recovery(self, recovery: Recovery) -> None:
        for phase, seconds in recovery.by_phase().items():
            self.recovery.labels(phase=phase).observe(seconds)

    def observe_job(self, state: JobState, checkpoint: CheckpointRecord) -> None:
        """The job's state and newest durable checkpoint, as recorded in etcd."""
        for s in JobState:
            self.job_state.labels(state=s.value).set(1 if s == state else 0)
        self.checkpoint_step.set(checkpoint.step)
        self.checkpoint_time.set(checkpoint.time if checkpoint.step >= 0 else 0)

    def observe_checkpoint(self, report: pb.CheckpointReport) -> None:
        if report.HasField("seconds"):
            self.checkpoint_duration.labels(tier="durable", op="save").observe(
                max(0.0, report.seconds))

    def observe_restore(self, record: RestoreRecord) -> None:
        """What the generation's rank 0 restored. A fallback to an older durable checkpoint
        loses the steps between it and the snapshot the plan named."""
        if record.generation != self._generation:
            return
        if record.step < self._last_step:
            self.lost_steps.inc(self._last_step - record.step)
            self._last_step = record.step
        tier = {"snapshot": "memory", "checkpoint": "durable"}.get(record.source)
        if tier is not None:
            self.checkpoint_duration.labels(tier=tier, op="restore").observe(
                max(0.0, record.seconds))

    def observe_snapshot_room(self, predicted: int, available: int) -> None:
        self.snapshot_room.labels(kind="predicted").set(predicted)
        self.snapshot_room.labels(kind="available").set(available)

    def observe_snapshots(self, held_bytes: int, newest_whole: int, step: int) -> None:
        self.snapshot_bytes.set(held_bytes)
        self.snapshot_age.set(step - newest_whole if newest_whole >= 0 else -1)

