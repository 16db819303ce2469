"""The worker-facing gRPC service (unix socket `$ULTRA_AGENT_SOCKET`).

A worker's whole contract with its agent (see `proto/ultrascale/v1/agent.proto`):

1. `GetGeneration(after_generation=g, local_rank=$ULTRA_LOCAL_RANK)` long-polls for the first
   generation newer than g: the plan JSON, this rank's global rank (-1: no place in it, ask
   again), and the c10d store (host, port) that the plan names. `exit` means leave the loop.
2. Join the process group through that store (a `PrefixStore` of the generation), restore
   `plan.restore`, train.
3. After each step: `ReportStep`. Obey the reply: `checkpoint_now` (write a durable checkpoint
   of that step, then `ReportCheckpoint`), `stop_after_step` (finish that step, then leave the
   generation), `stop_now` (leave at once: a newer generation exists).
4. A failed collective: `ReportFailure`, leave the process group, go to 1.
5. After the last step: `ReportDone`, then go to 1 (the agent answers `exit`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import grpc

from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from daemon.agent import Agent


class WorkerControlService(pb_grpc.WorkerControlServicer):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def _local_rank(self, request: Any) -> int:
        if request.WhichOneof("rank") == "global_rank":
            plan = self.agent.view.plan
            for r in plan.ranks if plan else ():
                if r.global_rank == request.global_rank and r.node == self.agent.node_id:
                    return r.local_rank
            return -1
        return int(request.local_rank)

    async def GetGeneration(self, request: pb.GenerationRequest,
                            context: grpc.aio.ServicerContext) -> pb.GenerationPlan:
        view, after = self.agent.view, request.after_generation
        local = self._local_rank(request)
        if local < 0 or local >= self.agent.config.devices:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rank: no local rank {local} on node {self.agent.node_id}")
        wait = request.wait_seconds if request.wait_seconds > 0 else None
        self.agent.worker_asking(local, True)
        try:
            await view.wait_for(
                lambda: view.generation > after or self.agent.worker_should_exit(local), wait)
        finally:
            self.agent.worker_asking(local, False)
        plan = view.plan
        exit_ = self.agent.worker_should_exit(local)
        if plan is None or plan.generation <= after:
            return pb.GenerationPlan(generation=view.generation, changed=False, global_rank=-1,
                                     local_rank=local, exit=exit_)
        mine = [r for r in plan.ranks_of(self.agent.node_id) if r.local_rank == local]
        self.agent.worker_asking(local, False, handed=plan.generation)
        return pb.GenerationPlan(
            generation=plan.generation, plan_json=plan.to_json(), changed=True,
            global_rank=mine[0].global_rank if mine else -1, local_rank=local,
            world_size=plan.world_size, store_host=plan.store.host, store_port=plan.store.port,
            exit=exit_,
        )

    async def ReportStep(self, request: pb.StepReport,
                         context: grpc.aio.ServicerContext) -> pb.StepReply:
        agent = self.agent
        agent.on_step(request)
        stop_after, checkpoint = -1, False
        directive = agent.view.directive
        if directive.get("generation") == request.generation:
            stop_after = int(directive.get("stop_after_step", -1))
            checkpoint = request.step == directive.get("checkpoint_at_step", -1)
        return pb.StepReply(stop_after_step=stop_after, checkpoint_now=checkpoint,
                            stop_now=agent.view.generation > request.generation)

    async def ReportFailure(self, request: pb.FailureReport,
                            context: grpc.aio.ServicerContext) -> pb.FailureReply:
        await self.agent.on_worker_failure(request.local_rank, request.generation,
                                           request.message)
        return pb.FailureReply()

    async def ReportDone(self, request: pb.DoneReport,
                         context: grpc.aio.ServicerContext) -> pb.DoneReply:
        if request.global_rank == 0:
            self.agent.forward_progress({"generation": request.generation, "step": request.step,
                                         "finished": True, "time": time.time()}, urgent=True)
        return pb.DoneReply()

    async def ReportCheckpoint(self, request: pb.CheckpointReport,
                               context: grpc.aio.ServicerContext) -> pb.CheckpointReportReply:
        if request.global_rank == 0:
            self.agent.forward_progress({"generation": request.generation,
                                         "checkpoint_step": request.step,
                                         "checkpoint_path": request.path}, urgent=True)
        return pb.CheckpointReportReply()
