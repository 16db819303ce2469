"""The Agent gRPC service: what ultractl calls (bearer token required)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from daemon.api import job_lifecycle, worker_log_service
from daemon.api.events import history
from daemon.config import AgentConfig
from daemon.control.etcd_client import Etcd
from daemon.control.job_state import job_state
from daemon.control.job_submit import prepare_spec, write_spec
from daemon.control.keys import Keys
from daemon.control.records import ENDED, ControlOp, ControlRequest, JobState, NodeState
from daemon.control.view import ClusterView
from daemon.state import StateMachine
from parallel import job as jobmod
from parallel import mesh_dims
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class AdminContext:
    """What the service reads and writes: this agent's config, its view of the cluster, etcd,
    and its own state machine."""

    node_id: str
    config: AgentConfig
    view: ClusterView
    etcd: Etcd
    keys: Keys
    state: StateMachine

    @property
    def agent_state(self) -> str:
        return self.state.state.value

    @property
    def ttl(self) -> float:
        return float(self.config.ttl)


class AdminService(pb_grpc.AgentServicer):
    def __init__(self, host: AdminContext) -> None:
        self.host = host

    async def GetStatus(self, request: pb.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> pb.Status:
        view = self.host.view
        plan, progress = view.plan, view.progress
        layout = pb.Layout()
        if plan is not None:
            layout = pb.Layout(**mesh_dims.sizes(plan.layout))
        state, reason = job_state(view)
        config = view.job_spec.config if view.spec else {}
        job = config.get("job", {}).get("name", "")
        total = config.get("train", {}).get("steps", 0)
        return pb.Status(
            job=str(job), node=self.host.node_id, state=state.value, reason=reason,
            agent_state=self.host.agent_state, generation=view.generation,
            step=progress.step, world_size=plan.world_size if plan else 0, layout=layout,
            leader=view.leader_node, consumed_samples=progress.consumed_samples,
            loss=progress.loss, finished=state == JobState.FINISHED, nodes=len(view.nodes),
            total_steps=total if isinstance(total, int) else 0,
        )

    async def ListNodes(self, request: pb.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListNodesResponse:
        view = self.host.view
        leader = view.leader_node
        return pb.ListNodesResponse(nodes=[
            pb.Node(node=name, address=m.record.address, metrics_url=m.record.metrics_url,
                    devices=m.record.devices,
                    state=NodeState.CORDONED.value if name in view.cordons
                    else m.record.state.value,
                    pid=m.record.pid, leader=name == leader, version=m.record.version)
            for name, m in sorted(view.nodes.items())
        ])

    async def GetPlan(self, request: pb.GetPlanRequest,
                      context: grpc.aio.ServicerContext) -> pb.Plan:
        view = self.host.view
        plan = view.plan
        state, reason = job_state(view)
        return pb.Plan(generation=plan.generation if plan else 0,
                       plan_json=plan.to_json() if plan else "", state=state.value,
                       reason=reason)

    async def SubmitJob(self, request: pb.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        try:
            spec = prepare_spec(request.spec_toml, request.overrides, source="job spec",
                                roots=self.host.config.job_roots)
        except jobmod.ConfigError as exc:
            # Bounded: a message quoting what a spec holds must fit gRPC's status metadata.
            message = str(exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message if len(message) < 2000
                                else f"{message[:2000]}... ({len(message)} characters)")
        # A job that has ended (finished, failed, cancelled) gives way to a new one.
        view = self.host.view
        ended = view.spec.mod_revision if view.spec is not None and \
            job_state(view)[0] in ENDED else 0
        revision = await write_spec(self.host.etcd, self.host.keys, spec, request.replace,
                                    ended)
        if revision is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "a job is already submitted and has not ended; pass --replace "
                                "to replace it (or cancel it: ultractl job cancel)")
        return pb.SubmitJobResponse(job=str(spec.config["job"]["name"]), revision=revision)

    async def _node_op(self, op: ControlOp, request: pb.NodeRequest,
                       context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        view, node = self.host.view, request.node
        if node not in view.nodes:
            members = ", ".join(sorted(view.nodes)) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"node: unknown node {node!r} (members: {members})")
        target = op.node_state
        request_id = f"{op.value}-{uuid.uuid4().hex[:12]}"
        key = self.host.keys.control_request(request_id)
        await self.host.etcd.put(key, ControlRequest(op=op, node=node, time=time.time())
                                 .to_json())

        def applied() -> bool:
            # A node briefly absent (re-joining after fencing) applies the request when back.
            member = view.nodes.get(node)
            cordon_gone = op != ControlOp.UNCORDON or node not in view.cordons
            return member is not None and member.record.state == target and cordon_gone

        if not await view.wait_for(applied, timeout=2 * self.host.ttl) \
                and view.nodes.get(node) is not None:
            await self.host.etcd.delete(key)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"node {node!r} did not apply {op.value} in time; request "
                                f"withdrawn")
        member = view.nodes.get(node)
        return pb.NodeResponse(node=node, state=member.record.state.value if member else "gone",
                               request_id=request_id)

    async def Drain(self, request: pb.NodeRequest,
                    context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        return await self._node_op(ControlOp.DRAIN, request, context)

    async def Cordon(self, request: pb.NodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        return await self._node_op(ControlOp.CORDON, request, context)

    async def Uncordon(self, request: pb.NodeRequest,
                       context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        return await self._node_op(ControlOp.UNCORDON, request, context)

    async def Checkpoint(self, request: pb.CheckpointRequest,
                         context: grpc.aio.ServicerContext) -> pb.CheckpointResponse:
        if self.host.view.plan is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no generation is running: nothing to checkpoint")
        request_id = f"checkpoint-{uuid.uuid4().hex[:12]}"
        await self.host.etcd.put(self.host.keys.control_request(request_id),
                                 ControlRequest(op=ControlOp.CHECKPOINT, time=time.time())
                                 .to_json())
        return pb.CheckpointResponse(request_id=request_id)

    async def WatchEvents(self, request: pb.WatchEventsRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Event]:
        async for ev in history(self.host.etcd, self.host.keys, request.follow):
            yield pb.Event(revision=ev.revision, kind=ev.kind, node=ev.node,
                           generation=ev.generation, message=ev.message)

    async def CancelJob(self, request: pb.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
        h = self.host
        return await job_lifecycle.cancel_job(h.view, h.etcd, h.keys, request, context)

    async def GetJob(self, request: pb.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> pb.JobSpec:
        return await job_lifecycle.get_job(self.host.view, context)

    async def ReadWorkerLog(self, request: pb.WorkerLogRequest,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkerLogChunk]:
        h = self.host
        async for chunk in worker_log_service.read(h.node_id, h.config, request, context):
            yield chunk
