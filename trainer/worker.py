"""The persistent worker an ultrad agent runs: one process per device, many generations.

`python -m trainer.worker` (started by the agent's supervisor, never by hand) loops:
ask the agent for the next generation, join its process group through the agent-hosted
TCPStore, rebuild the layout on the new mesh, restore the newest valid checkpoint, train until
told to stop or until the job is done, leave the process group, and ask again. A healthy
survivor of a failure therefore pays neither a process start nor a torch import on recovery.
The contract with the agent is in daemon/worker_service.py.

Stop decisions are agreed on by all ranks (one small all-reduce per step): agents learn of a
new generation at slightly different times, and a rank that leaves while the others run the
next step's collectives would turn a planned change into a timeout.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

from checkpoint.durable import CheckpointManager
from parallel.mesh import build_mesh
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from trainer.loop import StepResult, Trainer
from trainer.run import select_device
from trainer.teardown import leave_world

NO_STOP = 2**62
PR_SET_PDEATHSIG = 1


def _log(msg: str) -> None:
    print(
        f"[worker {os.environ.get('ULTRA_NODE_ID', '?')}/{os.environ.get('ULTRA_LOCAL_RANK', '?')}] {msg}",
        file=sys.stderr,
        flush=True,
    )


@dataclass(frozen=True)
class Outcome:
    kind: str  # "done" | "stopped" | "failed"
    step: int
    message: str = ""


class AgentLink:
    """The worker's side of the WorkerControl service on the agent's unix socket."""

    def __init__(self, socket_path: str, local_rank: int) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.stub = pb_grpc.WorkerControlStub(self.channel)
        self.local_rank = local_rank

    def next_generation(self, after: int) -> pb.GenerationPlan:
        while True:
            reply = self.stub.GetGeneration(
                pb.GenerationRequest(
                    after_generation=after, local_rank=self.local_rank, wait_seconds=30
                )
            )
            if reply.exit or reply.changed:
                return reply

    def report_step(self, gp: pb.GenerationPlan, r: StepResult, dp: int) -> pb.StepReply:
        report = pb.StepReport(
            generation=gp.generation,
            global_rank=gp.global_rank,
            local_rank=self.local_rank,
            step=r.step,
            loss=r.loss,
            tokens=r.tokens,
            consumed_samples=r.consumed_samples,
            step_seconds=r.step_seconds,
            world_size=gp.world_size,
            dp=dp,
            recompute_seconds=r.recompute_seconds,
            recompute_ratio=r.recompute_ratio,
        )
        if r.bubble_ratio_measured is not None:  # pipeline parallelism only
            report.bubble_ratio = r.bubble_ratio_measured
        return self.stub.ReportStep(report)

    def report_failure(self, gp: pb.GenerationPlan, message: str) -> None:
        self.stub.ReportFailure(
            pb.FailureReport(
                generation=gp.generation,
                global_rank=gp.global_rank,
                local_rank=self.local_rank,
                message=message,
            )
        )

    def report_checkpoint(self, gp: pb.GenerationPlan, step: int, path: str) -> None:
        self.stub.ReportCheckpoint(
            pb.CheckpointReport(
                generation=gp.generation,
                global_rank=gp.global_rank,
                local_rank=self.local_rank,
                step=step,
                path=path,
            )
        )

    def report_done(self, gp: pb.GenerationPlan, step: int) -> None:
        self.stub.ReportDone(
            pb.DoneReport(
                generation=gp.generation,
                global_rank=gp.global_rank,
                local_rank=self.local_rank,
                step=step,
            )
        )


def die_with_agent() -> None:
    """SIGKILL this process when the agent that spawned it dies (Linux PR_SET_PDEATHSIG).

    Armed here rather than in a preexec_fn, which would make the agent fork() (see
    daemon/supervisor.py). If the agent died before this ran, exit now.
    """
    agent_pid = int(os.environ.get("ULTRA_AGENT_PID", "0"))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if agent_pid and os.getppid() != agent_pid:
        raise SystemExit("the agent that started this worker is gone")


def join_world(gp: pb.GenerationPlan, backend: str, timeout: timedelta) -> None:
    """Join generation gp through the agent-hosted store, under a per-generation prefix."""
    store = dist.TCPStore(gp.store_host, gp.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"generation/{gp.generation}", store),
        rank=gp.global_rank,
        world_size=gp.world_size,
        timeout=timeout,
    )


def agree(reply: pb.StepReply, step: int) -> tuple[bool, bool]:
    """(stop, checkpoint) as agreed by every rank of the generation."""
    stop_at = reply.stop_after_step if reply.stop_after_step >= 0 else NO_STOP
    flags = torch.tensor(
        [-stop_at, int(reply.stop_now), int(reply.checkpoint_now)], dtype=torch.float64
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    earliest_stop, stop_now, checkpoint = -int(flags[0].item()), bool(flags[1]), bool(flags[2])
    planned_stop = step >= earliest_stop
    # A planned change (join, drain) leaves after a durable checkpoint, so no step is lost;
    # stop_now (another failure, a newer generation) leaves at once.
    return planned_stop or stop_now, checkpoint or (planned_stop and not stop_now)


class StepLog:
    """steps.jsonl in the job's output directory, appended by global rank 0 only."""

    def __init__(self, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "steps.jsonl"

    def append(self, r: StepResult, generation: int, world_size: int, dp: int) -> None:
        line = json.dumps(
            {
                "step": r.step,
                "loss": r.loss,
                "consumed_samples": r.consumed_samples,
                "generation": generation,
                "world_size": world_size,
                "dp": dp,
                "step_seconds": round(r.step_seconds, 6),
                "time": time.time(),
            }
        )
        with self.path.open("a") as f:
            f.write(line + "\n")


def train_generation(link: AgentLink, gp: pb.GenerationPlan, timeout: timedelta) -> Outcome:
    plan = Plan.from_json(gp.plan_json)
    job, layout = plan.job, plan.layout
    device, backend, device_type = select_device(link.local_rank)
    join_world(gp, backend, timeout)
    trainer = Trainer(job, layout, build_mesh(layout, device_type), device)
    rank0 = gp.global_rank == 0
    ckpt = None
    output_dir = Path(job.job.output_dir or ".").expanduser()
    if job.checkpoint.dir:
        # A relative checkpoint.dir lives under the job's output directory.
        ckpt = CheckpointManager(
            output_dir / Path(job.checkpoint.dir).expanduser(),
            job.checkpoint.keep,
            layout=layout.to_dict(),
            log=_log,
        )
        loaded = ckpt.load_latest(trainer.state)
        if rank0:
            _log(
                f"generation {gp.generation}: world {gp.world_size}, layout dp={layout.dp}; restored "
                + (
                    f"{loaded.name} (step {trainer.progress.step})"
                    if loaded
                    else "nothing: starting at step 0"
                )
            )
    steps = StepLog(output_dir) if rank0 else None
    reported_ckpt = ckpt.committed_step if ckpt else 0
    while trainer.progress.step < job.train.steps:
        result = trainer.train_step()
        if steps:
            steps.append(result, gp.generation, gp.world_size, layout.dp)
        stop, checkpoint = agree(link.report_step(gp, result, layout.dp), result.step)
        periodic = (
            ckpt is not None and job.checkpoint.every and result.step % job.checkpoint.every == 0
        )
        if ckpt and (checkpoint or periodic or result.step == job.train.steps):
            ckpt.save_async(trainer.state)
            if checkpoint or stop:
                ckpt.wait()
        if ckpt and rank0 and ckpt.committed_step > reported_ckpt:
            reported_ckpt = ckpt.committed_step
            link.report_checkpoint(gp, reported_ckpt, str(ckpt.committed_path))
        if stop:
            return Outcome("stopped", result.step)
    if ckpt:
        ckpt.wait()
        if rank0 and ckpt.committed_step > reported_ckpt:
            link.report_checkpoint(gp, ckpt.committed_step, str(ckpt.committed_path))
    link.report_done(gp, trainer.progress.step)
    return Outcome("done", trainer.progress.step)


def run_one(link: AgentLink, gp: pb.GenerationPlan, timeout: timedelta) -> Outcome:
    try:
        outcome = train_generation(link, gp, timeout)
    except Exception as exc:  # noqa: BLE001 - any error ends this rank's generation
        # Keep only the text: the exception's traceback pins the model and the old group.
        outcome = Outcome("failed", -1, f"{type(exc).__name__}: {exc}"[:2000])
    if outcome.kind == "failed":
        _log(
            f"generation {gp.generation} failed: {outcome.message.splitlines()[0] if outcome.message else ''}"
        )
        try:
            link.report_failure(gp, outcome.message)
        except grpc.RpcError as rpc:
            _log(f"could not report the failure to the agent: {rpc.code().name}")
    # train_generation's frame is gone: nothing references the model or the mesh any more.
    leave_world()
    return outcome


def main() -> int:
    die_with_agent()
    socket_path = os.environ["ULTRA_AGENT_SOCKET"]
    local_rank = int(os.environ.get("ULTRA_LOCAL_RANK", "0"))
    timeout = timedelta(seconds=float(os.environ.get("ULTRA_PG_TIMEOUT", "60")))
    torch.set_num_threads(int(os.environ.get("ULTRA_WORKER_THREADS", "1")))
    link = AgentLink(socket_path, local_rank)
    generation = 0
    while True:
        gp = link.next_generation(generation)
        if gp.exit:
            _log("the agent says exit")
            return 0
        generation = gp.generation
        if gp.global_rank < 0:
            continue
        outcome = run_one(link, gp, timeout)
        _log(f"generation {gp.generation} {outcome.kind} at step {outcome.step}")


if __name__ == "__main__":
    sys.exit(main())
