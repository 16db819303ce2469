"""One generation on a worker: build its world, restore, train until told to stop or done.

`run_one` is what the worker's loop (trainer/worker.py) calls with the agent's answer: it
builds the world from a `GenerationSpec` (trainer/world.py), restores the plan's snapshot or
checkpoint, trains, and turns any error into a failed `Outcome` reported to the agent with its
kind ("peer" or "local", trainer/failure_kind.py). Nothing here outlives the generation: once
`run_one` returns, nothing references the model, the optimizer or the process group.

- Inside every step all ranks agree on the agent's reply to the previous step's report, on a
  collective the step performs anyway; the step never waits on its agent (trainer.agreement).
- Every call to the agent has a deadline; an agent that misses one ends the generation like a
  failed collective: this rank leaves the world, and its peers' collectives fail at once
  instead of waiting for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.snapshot_store import SnapshotStore
from models.model_config import ModelConfig
from proto.ultrascale.v1 import agent_pb2 as pb
from trainer.agent_link import AgentLink, AgentUnreachable
from trainer.agreement import decide
from trainer.driver import GenerationDriver
from trainer.failure_kind import classify_failure
from trainer.heartbeat import Heartbeat
from trainer.loop import StepResult
from trainer.model_ahead import ModelAhead
from trainer.teardown import Teardown, sever_connections
from trainer.telemetry import expert_telemetry
from trainer.worker_log import log
from trainer.world import GenerationSpec, WorkerEnv, build_world


@dataclass(frozen=True)
class Outcome:
    kind: str  # "done" | "stopped" (planned) | "left" (stop_now) | "failed"
    step: int  # steps completed
    message: str = ""
    failure_kind: str = ""  # "peer" | "local" when failed
    failed_at: float = 0.0  # Unix time the failure reached this rank's top level


class Generation:
    """This rank's part in one generation. Holds no reference to the world once `run` returns."""

    def __init__(self, link: AgentLink, beat: Heartbeat, gp: pb.GenerationPlan, env: WorkerEnv,
                 teardown: Teardown, ahead: ModelAhead | None = None) -> None:
        self.link, self.beat, self.gp, self.env = link, beat, gp, env
        self.faults = env.faults
        self.teardown = teardown
        self.ahead = ahead
        self.step = 0  # steps completed, for a failure report
        self.model_cfg: ModelConfig | None = None  # the plan's, once decoded

    def run(self) -> Outcome:
        gp = self.gp
        spec = GenerationSpec.of(gp, self.env)
        self.model_cfg = spec.plan.job.model
        plan, layout, node, snapshot_root = spec.plan, spec.plan.layout, self.env.node, \
            self.env.snapshot_root
        self.link.use(plan.job.fault)
        self.beat.update(gp.generation, "join", 0)
        world = build_world(spec, self.link.snapshot_fetch,
                            lambda phase: self.beat.update(gp.generation, phase, 0), log,
                            self.ahead)
        driver = world.driver
        restored = driver.restore_planned(plan.restore, world.fetch)
        self.step = driver.step
        mine = [r.local_rank for r in plan.ranks_of(node)]
        if snapshot_root is not None and mine and gp.local_rank == min(mine):
            # Newer snapshots on this node belong to a history the restore went back from.
            # Before the report: from it, the agent counts newer steps as this generation's.
            SnapshotStore(snapshot_root).free_after(driver.step)
        self.link.report_restore(gp, restored)
        if gp.global_rank == 0:
            log(
                f"generation {gp.generation}: world {gp.world_size}, layout dp={layout.dp}; "
                f"{world.started.describe()}; "
                f"restored {restored.describe()} in {restored.seconds:.3f}s"
            )
        try:
            return self._train(driver)
        finally:
            driver.close()

    def _train(self, driver: GenerationDriver) -> Outcome:
        gp, beat, link = self.gp, self.beat, self.link
        checkpoint_seq_done = 0  # checkpoint requests are counted per generation
        first = True
        while driver.step < driver.last_step:
            beat.update(gp.generation, "step", driver.step)
            # The reply to the previous step's report is read inside this step, where the
            # ranks agree on it (trainer.agreement): the step never waits on the agent.
            result = driver.train_step(link.settle)
            self.step = result.step
            beat.update(gp.generation, "step", result.step)
            if self.faults is not None:
                self.faults.check(result.step)
            agreed = result.agreed
            action = decide(agreed, checkpoint_seq_done)
            if action.leave_now:
                self._report_step(driver, result)
                return Outcome("left", result.step)
            driver.commit(result)
            if action.stop:
                if driver.job.checkpoint.storage == "node":
                    # The next generation can then restore this step from memory: its durable
                    # checkpoint is in pieces, one per node (docs/snapshots.md).
                    driver.snapshot()
                self._report_step(driver, result)
                break
            requested = action.checkpoint and not result.skipped  # else the next step's
            if requested:
                checkpoint_seq_done = agreed.checkpoint_seq
            if driver.snapshot_due(result.step) and driver.snapshot_is_full():
                # A generation's first snapshot is a full DCP save (collective, on the step):
                # the agent hears of the step first (a recovery ends at its report), and the
                # save takes the checkpoint phase's deadline.
                self._report_step(driver, result)
                beat.phase("checkpoint")
                driver.snapshot()
                beat.phase("step")
            else:
                # A rewrite is a memory copy within the step's own progress deadline (each
                # phase change is a heartbeat sent at once: two calls a step for nothing).
                # The report goes out after it and carries its time: sent before, the agent's
                # reply came back during the copy and its handling on gRPC's thread took the
                # GIL from it (0.04 ms of a 0.29 ms snapshot in `bench.overhead --pin`); it
                # lands in the next step instead.
                if driver.snapshot_due(result.step):
                    driver.snapshot()
                self._report_step(driver, result)
            if result.step < driver.last_step and (
                requested or driver.checkpoint_due(result.step)
            ):
                beat.phase("checkpoint")  # staging, and waiting for the previous save
                driver.save()
                beat.phase("step")
            self._report_commits(driver)
            if first:  # the step is in: free the worlds left before, learn new caches
                first = False
                self.teardown.release()
                self.teardown.refresh()
        finished = driver.step >= driver.last_step
        beat.phase("checkpoint")
        driver.drain_snapshots()  # written before the agent plans from what the node holds
        driver.save_durably()
        self._report_commits(driver)
        link.report_done(gp, driver.step, driver.consumed_samples, stopped=not finished)
        return Outcome("done" if finished else "stopped", driver.step)

    def _report_step(self, driver: GenerationDriver, result: StepResult) -> None:
        self.link.report_step(self.gp, result, driver.layout.dp, driver.take_blocked(),
                              expert_telemetry(result, driver.job))

    def _report_commits(self, driver: GenerationDriver) -> None:
        for step, path, seconds in driver.new_commits():  # rank 0 only
            self.link.report_checkpoint(self.gp, step, str(path), seconds)


def run_one(link: AgentLink, beat: Heartbeat, gp: pb.GenerationPlan, env: WorkerEnv,
            teardown: Teardown, ahead: ModelAhead | None = None) -> Outcome:
    """Run this rank's part in generation `gp`; a failure is reported to the agent first.
    Unless the job is done, `ahead` then builds the model the next generation will likely
    take (the same job's), while the agent plans it."""
    generation = Generation(link, beat, gp, env, teardown, ahead)
    try:
        outcome = generation.run()
    # DCP's CheckpointException derives from BaseException, not Exception.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any error ends it
        failed_at = time.time()
        if dist.is_initialized() and dist.get_backend() == "gloo":
            sever_connections()  # peers blocked on this rank fail now (trainer/teardown.py)
        # Keep only the text: the exception's traceback pins the model and the old group.
        text = f"{type(exc).__name__}: {exc}"[:2000]
        outcome = Outcome("failed", generation.step, text, classify_failure(text), failed_at)
    # Generation.run's frame is gone: nothing references the model or the mesh any more.
    if outcome.kind == "failed":
        # Report first: the leader's decision then overlaps the teardown below. The report is
        # one call to the local agent, so peers blocked on this rank still fail at once.
        first_line = outcome.message.splitlines()[0] if outcome.message else ""
        log(f"generation {gp.generation} failed ({outcome.failure_kind}): {first_line}")
        try:
            link.report_failure(gp, outcome.message, outcome.failure_kind, outcome.step,
                                outcome.failed_at)
        except AgentUnreachable as exc:
            log(f"could not report the failure: {exc}")
    teardown.leave()  # what a next generation needs; freeing the old world can wait
    if outcome.kind == "done":
        teardown.release()  # the job is over: no next generation to wait for
    elif ahead is not None and generation.model_cfg is not None:
        try:
            ahead.build(generation.model_cfg)
        except Exception as exc:  # noqa: BLE001 - the next generation builds its own then
            log(f"could not build the model ahead: {type(exc).__name__}: {exc}"[:500])
    beat.update(0, "idle", 0)
    return outcome
