"""One generation of training on a formed world, shared by both entries.

The torchrun entry (`trainer.run`) and the agent's persistent worker (`trainer.worker`) differ
in how they join a world and who decides when to stop; everything between (where checkpoints
live, restoring the newest valid one, periodic and final saves, the steps.jsonl record) is
here, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from checkpoint.durable import CheckpointManager
from checkpoint.manifest import checkpoint_dir
from checkpoint.snapshot_reader import Fetch
from models.hf_config import hf_dir
from parallel import mesh_dims
from parallel.job import JobConfig
from parallel.job_paths import job_path
from parallel.layout import Layout
from parallel.planner import Restore
from trainer.agreement import Agreement
from trainer.fault_injection import NonFiniteInjection
from trainer.loop import StepResult, Trainer
from trainer.memory_meter import MemoryMeter
from trainer.pretrained import load_pretrained
from trainer.profiling import StepProfiler
from trainer.restore_order import Restored, Served, first_served
from trainer.shared_storage import CheckpointFragmented
from trainer.snapshots import Snapshots, restore_snapshot
from trainer.telemetry import TensorBoard, finite_or_none, step_record


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def select_device(local_rank: int) -> tuple[torch.device, str, str]:
    """(device, process-group backend, mesh device type) for this local rank."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo for the CPU side too: async checkpoint uploads collect on CPU.
        return device, "cpu:gloo,cuda:nccl", "cuda"
    return torch.device("cpu"), "gloo", "cpu"


def output_dir(job: JobConfig) -> Path | None:
    """job.output_dir, or None when the job does not set one."""
    return job_path(job, "job.output_dir")


def checkpoint_root(job: JobConfig) -> Path | None:
    """Where the job's checkpoints live; None when checkpointing is off.

    A relative checkpoint.dir is under job.output_dir when the job sets one (a daemon-run job's
    output stays together), else relative to the working directory. The agents check this
    same path against their allowed_paths (parallel.job_paths).
    """
    return job_path(job, "checkpoint.dir")


class StepLog:
    """steps.jsonl: one line per completed step, appended by global rank 0 only.

    A step re-run after a failure is appended again; its last line is the committed one.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "steps.jsonl"

    def append(self, r: StepResult, generation: int, world_size: int, layout: Layout) -> None:
        line = json.dumps(
            {
                "step": r.step,
                "loss": finite_or_none(r.loss),
                "consumed_samples": r.consumed_samples,
                "generation": generation,
                "world_size": world_size,
                **mesh_dims.sizes(layout),
                "step_seconds": round(r.step_seconds, 6),
                **step_record(r),
                "time": time.time(),
            }
        )
        with self.path.open("a") as f:
            f.write(line + "\n")


@dataclasses.dataclass
class Blocked:
    """Seconds checkpoints held this rank's step loop since the last `take_blocked()`, per
    tier (None: none taken): the in-memory snapshot, and a durable checkpoint's staging
    (with the wait for the previous checkpoint's upload)."""

    memory: float | None = None
    durable: float | None = None


class GenerationDriver:
    """Build, restore, step and checkpoint one generation; the caller decides when to stop.

    `last_step` is where this run ends (train.steps for the daemon, --steps for torchrun): its
    state is always checkpointed when checkpointing is on, so nothing trained is lost.
    """

    def __init__(
        self,
        job: JobConfig,
        layout: Layout,
        mesh: DeviceMesh,
        device: torch.device,
        *,
        timeout: timedelta,
        last_step: int,
        generation: int = 0,
        step_log: Path | None = None,
        log: Callable[[str], None] = _stderr,
        snapshot_root: Path | None = None,
        node: str = "",
        inject: NonFiniteInjection | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self.job, self.layout, self.last_step, self.generation = job, layout, last_step, generation
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.node = node or os.uname().nodename  # named in a fragmented-checkpoint failure
        # The weights are drawn only if the restore comes to a tier that needs them (the
        # pretrained weights, or random ones): a snapshot or checkpoint loads every parameter.
        self.trainer = Trainer(job, layout, mesh, device, inject=inject, initial_weights=False,
                               model=model)  # `model`: built ahead (trainer.model_ahead)
        self.memory = MemoryMeter(self.trainer.model, self.trainer.optimizer, device)
        root = checkpoint_root(job)
        self.ckpt = (
            CheckpointManager(
                root, job.checkpoint.keep, layout=layout.to_dict(), timeout=timeout, log=log,
                fragments=job.checkpoint.storage == "node",
                extra={"model": dataclasses.asdict(job.model)},
            )
            if root is not None
            else None
        )
        self.steps = StepLog(step_log) if step_log is not None and self.rank == 0 else None
        out = output_dir(job)
        self.tensorboard = TensorBoard(out / "tensorboard") \
            if job.metrics.tensorboard and out is not None and self.rank == 0 else None
        every = job.checkpoint.snapshot_every
        self.snapshots = (
            Snapshots(snapshot_root, every, layout.to_dict(), log)
            if snapshot_root is not None and every > 0
            else None
        )
        if self.snapshots is not None:
            self.trainer.before_update = self.snapshots.fence
        self.profiler = StepProfiler(job.profile, self.rank, output_dir(job) or Path("."), device)
        self._saved_step = -1
        self._skipped = False  # the last step was skipped (trainer.nonfinite): not a good state
        self._reported = 0  # commits returned by new_commits
        self._blocked = Blocked()

    @property
    def step(self) -> int:
        """Steps completed (restored ones included)."""
        return self.trainer.progress.step

    @property
    def consumed_samples(self) -> int:
        return self.trainer.progress.consumed_samples

    def restore(self) -> Path | None:
        """Load the newest valid checkpoint, if any; every rank loads rank 0's choice."""
        if self.ckpt is None:
            return None
        loaded = self.ckpt.load_latest(self.trainer.state)
        if loaded is not None:
            self._saved_step = self.step
        return loaded

    def restore_planned(self, planned: Restore, fetch: Fetch | None) -> Restored:
        """Restore in the order of trainer/restore_order.py: the snapshot the plan names (from
        this node's memory or a peer's, through `fetch`), the newest valid durable checkpoint,
        the job's pretrained weights, random weights. Every rank takes the same branch.

        On node-local directories (checkpoint.storage "node") the durable tier is the recorded
        checkpoint or nothing: when one is recorded and the ranks cannot all load it, every rank
        raises `CheckpointFragmented` rather than start from older state."""
        started = time.perf_counter()
        skipped = ""

        def snapshot() -> Served | str:
            nonlocal skipped
            if planned.source != "snapshot":
                return f"the plan names {planned.source}" + (
                    f" ({planned.reason})" if planned.reason else "")
            if fetch is None:
                skipped = "snapshots are off on this node"
                return skipped
            skipped, fetched = restore_snapshot(self.trainer.state, planned.step, fetch)
            return skipped or Served(f"snapshot@{planned.step}", fetched)

        def checkpoint() -> Served | str:
            recorded = planned.step if planned.source == "checkpoint" else planned.checkpoint_step
            if self.ckpt is not None and self.ckpt.fragments and recorded > 0:
                memory = (f"the planned snapshot@{planned.step} was skipped: {skipped[:300]}"
                          if planned.source == "snapshot"
                          else planned.reason or "no snapshot the live nodes hold whole is as new")
                return Served(self._restore_recorded(recorded, memory).name)
            return self._checkpoint_tier()

        tier, served, passed = first_served({
            "snapshot": snapshot, "checkpoint": checkpoint, "pretrained": self._pretrained_tier,
            "init": self._init_tier,
        })
        return Restored(tier, self.step, skipped, time.perf_counter() - started,
                        served.snapshot_bytes, served.name, passed)

    def restore_start(self, resume: bool) -> Restored:
        """The torchrun entry's restore: the newest checkpoint when resuming, else the job's
        pretrained weights, else random weights (trainer/restore_order.py)."""
        started = time.perf_counter()
        tier, served, passed = first_served({
            "snapshot": lambda: "in-memory snapshots need the daemon",
            "checkpoint": self._checkpoint_tier if resume else (lambda: "--resume not given"),
            "pretrained": self._pretrained_tier,
            "init": self._init_tier,
        })
        return Restored(tier, self.step, "", time.perf_counter() - started, served.snapshot_bytes,
                        served.name, passed)

    def _checkpoint_tier(self) -> Served | str:
        if self.ckpt is None:
            return "checkpointing is off (no checkpoint.dir)"
        loaded = self.restore()
        return Served(loaded.name) if loaded is not None else \
            f"no valid checkpoint under {self.ckpt.root}"

    def _pretrained_tier(self) -> Served | str:
        if not self.job.init.hf:
            return "the job sets no init.hf"
        directory = hf_dir(self.job.init.hf)
        self.trainer.draw_initial_weights()  # buffers (a routing bias) are not in its files
        load_pretrained(self.trainer.model, directory)
        return Served(str(directory))

    def _init_tier(self) -> Served:
        # Drawn here, not when the model was built: every other tier loads all of them (and
        # one that failed part-way through writing the state is overwritten whole here).
        self.trainer.draw_initial_weights()
        return Served()

    def _restore_recorded(self, step: int, memory: str) -> Path:
        """Load durable checkpoint `step` from node-local directories, or fail every rank alike
        naming the nodes and directories that lack its files."""
        assert self.ckpt is not None
        problem, ranks = self.ckpt.load_step(self.trainer.state, step)
        if not problem:
            self._saved_step = self.step
            return checkpoint_dir(self.ckpt.root, step)
        where: list[tuple[str, str]] = [("", "")] * self.world_size
        dist.all_gather_object(where, (self.node, str(self.ckpt.root)))
        nodes = ", ".join(sorted({where[r][0] for r in ranks}))
        dirs = ", ".join(sorted({where[r][1] for r in ranks}))
        raise CheckpointFragmented(
            f"cannot restore checkpoint step {step}: checkpoint.storage is \"node\" and node(s) "
            f"{nodes} lack its files in checkpoint.dir {dirs} ({problem}); {memory}. Gather "
            f"every node's checkpoint.dir into one shared directory to restore it")

    def snapshot_due(self, step: int) -> bool:
        return (self.snapshots is not None and step < self.last_step and not self._skipped
                and self.snapshots.due(step))

    def snapshot_is_full(self) -> bool:
        """Whether the next snapshot is a full DCP save (else a rewrite in place)."""
        return self.snapshots is not None and self.snapshots.next_is_full

    def snapshot(self) -> None:
        """Snapshot the current step into the node's shared memory (collective)."""
        if self.snapshots is not None:
            self.snapshots.take(self.trainer.state)
            # Summed: a generation's first snapshot (after its step's report) and the next
            # step's rewrite go out in one report.
            self._blocked.memory = (self._blocked.memory or 0.0) + self.snapshots.blocking_seconds

    def drain_snapshots(self) -> None:
        """Wait until the last snapshot is written (its write runs off the step)."""
        if self.snapshots is not None:
            self.snapshots.drain()

    def train_step(self, seen: Callable[[], Agreement] | None = None) -> StepResult:
        """One step; `seen`: the agent's requests (Trainer.train_step)."""
        with self.profiler.step(self.step + 1), self.memory.measure():
            result = self.trainer.train_step(seen)
        self._skipped = bool(result.skipped)
        return dataclasses.replace(result, memory=self.memory.last)

    def close(self) -> None:
        """Whatever outlives the generation otherwise: an open profiler window, the last
        snapshot's write still under way."""
        self.profiler.close()
        self.drain_snapshots()

    def commit(self, result: StepResult) -> None:
        """Record a step the ranks agreed to keep (a step abandoned for a newer generation is
        not committed: the next generation runs it again from its restore point)."""
        if self.steps is not None:
            self.steps.append(result, self.generation, self.world_size, self.layout)
        if self.tensorboard is not None:
            self.tensorboard.add(result)

    def checkpoint_due(self, step: int) -> bool:
        """A periodic (checkpoint.every) or final checkpoint is due after `step`."""
        every = self.job.checkpoint.every
        # A periodic one waits for a step that was not skipped; the last step's is always taken
        # (its state is exactly where the run would continue: docs/observability.md).
        return self.ckpt is not None and (
            step == self.last_step or bool(every and step % every == 0 and not self._skipped)
        )

    def save(self) -> None:
        """Checkpoint the current step in the background (once per step)."""
        if self.ckpt is not None and self._saved_step != self.step:
            started = time.perf_counter()
            self.ckpt.save_async(self.trainer.state)
            self._blocked.durable = (self._blocked.durable or 0.0) + time.perf_counter() - started
            self._saved_step = self.step

    def save_durably(self) -> None:
        """Checkpoint the current step and return once its manifest is written.

        The closing barrier makes that true on every rank, not just rank 0 (which writes the
        manifest), so any rank may report the checkpoint as durable.
        """
        if self.ckpt is None:
            return
        self.save()
        self.ckpt.wait()
        dist.barrier()

    def wait(self) -> None:
        """Let the pending background checkpoint finish."""
        if self.ckpt is not None:
            self.ckpt.wait()

    def take_blocked(self) -> Blocked:
        """What checkpoints blocked since the last call (for the next step report)."""
        blocked, self._blocked = self._blocked, Blocked()
        return blocked

    def new_commits(self) -> list[tuple[int, Path, float]]:
        """(step, path, seconds the save took) of each checkpoint committed since the last call;
        rank 0 only."""
        if self.ckpt is None:
            return []
        commits = self.ckpt.commits[self._reported :]
        self._reported += len(commits)
        return commits
