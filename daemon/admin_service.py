"""The Agent gRPC service: what ultractl and peer agents call (bearer token required)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from daemon.election import NotLeader
from daemon.etcd_client import ETCD_ERRORS
from daemon.events import history
from daemon.keys import dumps
from parallel import job as jobmod
from parallel.layout import resolve
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from daemon.agent import Agent

_NODE_OPS = {"drain": "draining", "cordon": "cordoned", "uncordon": "ready"}


class AdminService(pb_grpc.AgentServicer):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def GetStatus(self, request: pb.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> pb.Status:
        view, agent = self.agent.view, self.agent
        plan, progress = view.plan, view.progress
        job = ""
        if view.spec is not None:
            job = json.loads(view.spec.value).get("config", {}).get("job", {}).get("name", "")
        layout = pb.Layout()
        if plan is not None:
            layout = pb.Layout(dp=plan.layout.dp, tp=plan.layout.tp, pp=plan.layout.pp,
                               cp=plan.layout.cp)
        same_gen = plan is not None and progress.get("generation", 0) <= plan.generation
        return pb.Status(
            job=job, node=agent.node_id, state=agent.state.state.value,
            generation=view.generation, step=int(progress.get("step", 0)) if same_gen else 0,
            world_size=plan.world_size if plan else 0, layout=layout, leader=view.leader_node,
            consumed_samples=int(progress.get("consumed_samples", 0)),
            loss=float(progress.get("loss", 0.0)), finished=bool(progress.get("finished")),
            nodes=len(view.nodes),
        )

    async def ListNodes(self, request: pb.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListNodesResponse:
        leader = self.agent.view.leader_node
        return pb.ListNodesResponse(nodes=[
            pb.Node(node=name, address=m.record.address, metrics_url=m.record.metrics_url,
                    devices=m.record.devices, state=m.record.state, pid=m.record.pid,
                    leader=name == leader, version=m.record.version)
            for name, m in sorted(self.agent.view.nodes.items())
        ])

    async def GetPlan(self, request: pb.GetPlanRequest,
                      context: grpc.aio.ServicerContext) -> pb.Plan:
        plan = self.agent.view.plan
        return pb.Plan(generation=plan.generation if plan else 0,
                       plan_json=plan.to_json() if plan else "")

    async def SubmitJob(self, request: pb.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        try:
            job = jobmod.loads(request.spec_toml, list(request.overrides), source="job spec")
            p = job.parallel
            # Check the layout on the smallest world it could run on, so an unsupported or
            # inconsistent parallelism is refused now rather than when nodes are planned.
            resolve(job, (p.dp if isinstance(p.dp, int) else 1) * p.tp * p.pp * p.cp)
        except jobmod.ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        keys, etcd = self.agent.keys, self.agent.etcd
        value = dumps({"config": job.to_dict(), "toml": request.spec_toml,
                       "overrides": list(request.overrides), "submitted_at": time.time()})
        compare = [] if request.replace else [etcd.tx.version(keys.spec) == 0]
        # A new job starts from nothing: the previous job's progress and orders go with it.
        ok, responses = await etcd.txn(
            compare,
            [etcd.tx.put(keys.spec, value), etcd.tx.delete(keys.progress),
             etcd.tx.delete(keys.directive)],
        )
        if not ok:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "a job is already submitted; pass --replace to replace it")
        return pb.SubmitJobResponse(job=job.job.name,
                                    revision=responses[0].response_put.header.revision)

    async def _node_op(self, op: str, request: pb.NodeRequest,
                       context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        view, node = self.agent.view, request.node
        if node not in view.nodes:
            members = ", ".join(sorted(view.nodes)) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"node: unknown node {node!r} (members: {members})")
        target = _NODE_OPS[op]
        request_id = f"{op}-{uuid.uuid4().hex[:12]}"
        key = self.agent.keys.control_request(request_id)
        await self.agent.etcd.put(key, dumps({"op": op, "node": node, "time": time.time()}))

        def applied() -> bool:
            # A node briefly absent (re-joining after fencing) applies the request when back.
            member = view.nodes.get(node)
            return member is not None and member.record.state == target

        if not await view.wait_for(applied, timeout=2 * self.agent.config.ttl) \
                and view.nodes.get(node) is not None:
            await self.agent.etcd.delete(key)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"node {node!r} did not apply {op} in time; request withdrawn")
        member = view.nodes.get(node)
        return pb.NodeResponse(node=node, state=member.record.state if member else "gone",
                               request_id=request_id)

    async def Drain(self, request: pb.NodeRequest,
                    context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        return await self._node_op("drain", request, context)

    async def Cordon(self, request: pb.NodeRequest,
                     context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        return await self._node_op("cordon", request, context)

    async def Uncordon(self, request: pb.NodeRequest,
                       context: grpc.aio.ServicerContext) -> pb.NodeResponse:
        return await self._node_op("uncordon", request, context)

    async def Checkpoint(self, request: pb.CheckpointRequest,
                         context: grpc.aio.ServicerContext) -> pb.CheckpointResponse:
        if self.agent.view.plan is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no generation is running: nothing to checkpoint")
        request_id = f"checkpoint-{uuid.uuid4().hex[:12]}"
        await self.agent.etcd.put(self.agent.keys.control_request(request_id),
                                  dumps({"op": "checkpoint", "time": time.time()}))
        return pb.CheckpointResponse(request_id=request_id)

    async def WatchEvents(self, request: pb.WatchEventsRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Event]:
        async for ev in history(self.agent.etcd, self.agent.keys, request.follow):
            yield pb.Event(revision=ev.revision, kind=ev.kind, node=ev.node,
                           generation=ev.generation, message=ev.message)

    async def ReportProgress(self, request: pb.Progress,
                             context: grpc.aio.ServicerContext) -> pb.ProgressReply:
        if not self.agent.election.is_leader:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{self.agent.node_id} is not the leader")
        progress = {"generation": request.generation, "step": request.step,
                    "consumed_samples": request.consumed_samples, "loss": request.loss,
                    "finished": request.finished, "checkpoint_step": request.checkpoint_step,
                    "checkpoint_path": request.checkpoint_path, "time": time.time()}
        try:
            await asyncio.wait_for(self.agent.leader.record_progress(progress),
                                   self.agent.config.ttl)
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ETCD_ERRORS as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd: {exc}")
        return pb.ProgressReply()
