"""The worker-facing gRPC service (unix socket `$ULTRA_AGENT_SOCKET`).

A worker's whole contract with its agent (see `proto/ultrascale/v1/agent.proto`):

1. `GetGeneration(after_generation=g, local_rank=$ULTRA_LOCAL_RANK)` long-polls for a plan it
   has not run yet: the plan JSON, this rank's global rank (-1: no place in it, ask again), and
   the c10d store (host, port, prefix) the plan names. `exit` means leave the loop.
2. Join the process group through that store, restore `plan.restore`, train; `Heartbeat` about
   once a second from a thread, whatever the main thread is doing.
3. After each step: a step report on the step socket (`$ULTRA_STEP_SOCKET`,
   daemon/node/step_socket.py; `ReportStep` takes the same report over gRPC), without waiting
   for the reply; all ranks agree on it inside the next step (an all-reduce MAX the step
   performs anyway) and act at that step: `stop_now` (leave at once), `stop` (planned change:
   checkpoint the step, `ReportDone` with `stopped`, leave), `checkpoint_seq` (checkpoint the
   step when it grew).
4. A failure: `ReportFailure` (kind peer|local), leave the process group, go to 1.
5. After the last step: `ReportDone`, then go to 1 (the agent answers `exit`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from daemon.config import AgentConfig
from daemon.control.records import FailureKind
from daemon.control.view import ClusterView
from daemon.node.snapshot_keeper import SnapshotKeeper
from daemon.node.snapshot_relay import RelayError, fetch_ranges
from parallel.job import ConfigError
from parallel.job_paths import check_paths
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc


class WorkerHost(Protocol):
    """What the service needs from this node's workers (daemon/node/workers.py implements it)."""

    node_id: str
    devices: int
    config: AgentConfig
    view: ClusterView
    broken_generation: int  # a local worker failed in it: hand it to nobody any more
    snapshots: SnapshotKeeper | None  # None: this agent keeps no snapshots

    def worker_should_exit(self, local_rank: int) -> bool: ...
    def on_step(self, report: pb.StepReport) -> None: ...
    def on_heartbeat(self, beat: pb.HeartbeatRequest) -> None: ...
    def on_worker_failure(self, local_rank: int, generation: int, kind: FailureKind, step: int,
                          message: str, detect_s: float = 0.0) -> None: ...
    def on_done(self, report: pb.DoneReport) -> None: ...
    def on_checkpoint(self, report: pb.CheckpointReport) -> None: ...
    def handed(self, local_rank: int, generation: int) -> None: ...
    def on_restore(self, report: pb.RestoreReport) -> None: ...
    async def read_peer_snapshot(self, address: str, request: pb.SnapshotRanges
                                 ) -> list[list[bytes]]: ...


class WorkerControlService(pb_grpc.WorkerControlServicer):
    def __init__(self, host: WorkerHost) -> None:
        self.host = host
        # Per local rank: the store prefix of the plan last handed out. A plan whose number is
        # not newer but whose prefix differs (etcd restored from a backup) is still news.
        self._handed: dict[int, str] = {}

    def _local_rank(self, request: pb.GenerationRequest) -> int:
        if request.WhichOneof("rank") == "global_rank":
            plan = self.host.view.plan
            for r in plan.ranks if plan else ():
                if r.global_rank == request.global_rank and r.node == self.host.node_id:
                    return r.local_rank
            return -1
        return int(request.local_rank)

    def _news(self, local: int, after: int) -> bool:
        plan = self.host.view.plan
        if plan is None or plan.generation <= self.host.broken_generation:
            return False
        if plan.generation > after:
            return True
        handed = self._handed.get(local)
        return handed is not None and handed != plan.store.prefix

    def _paths_allowed(self, local: int, plan: Plan) -> bool:
        """Whether the job's paths lie under this node's allowed roots. SubmitJob checked them
        on the agent that took the job, but a spec written into etcd directly was checked by
        nobody: a refused generation reaches no worker and fails the job (no retry helps)."""
        try:
            check_paths(plan.job, self.host.config.job_roots)
        except ConfigError as exc:
            self.host.on_worker_failure(local, plan.generation, FailureKind.STORAGE, -1,
                                        f"{self.host.node_id} refuses the job's paths: {exc}")
            return False
        return True

    async def GetGeneration(self, request: pb.GenerationRequest,
                            context: grpc.aio.ServicerContext) -> pb.GenerationPlan:
        host, view, after = self.host, self.host.view, request.after_generation
        local = self._local_rank(request)
        if local < 0 or local >= host.devices:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rank: no local rank {local} on node {host.node_id}")
        wait = request.wait_seconds if request.wait_seconds > 0 else None
        host.handed(local, 0)  # asking: not stuck in a generation
        await view.wait_for(lambda: self._news(local, after) or host.worker_should_exit(local),
                            wait)
        plan = view.plan
        exit_ = host.worker_should_exit(local)
        if plan is None or not self._news(local, after) or exit_ \
                or not self._paths_allowed(local, plan):
            return pb.GenerationPlan(generation=view.generation, changed=False, global_rank=-1,
                                     local_rank=local, exit=exit_)
        mine = [r for r in plan.ranks_of(host.node_id) if r.local_rank == local]
        self._handed[local] = plan.store.prefix
        host.handed(local, plan.generation)
        return pb.GenerationPlan(
            generation=plan.generation, plan_json=plan.to_json(), changed=True,
            global_rank=mine[0].global_rank if mine else -1, local_rank=local,
            world_size=plan.world_size, store_host=plan.store.host, store_port=plan.store.port,
            store_prefix=plan.store.prefix, exit=False,
        )

    def step_reply(self, request: pb.StepReport) -> pb.StepReply:
        """Take a step report, and answer it: what the step socket (daemon/node/step_socket.py)
        and `ReportStep` answer."""
        host, view = self.host, self.host.view
        host.on_step(request)
        d = view.directive
        mine = d.generation == request.generation
        return pb.StepReply(stop=mine and d.stop, checkpoint_seq=d.checkpoint_seq if mine else 0,
                            stop_now=view.generation > request.generation
                            or host.worker_should_exit(request.local_rank))

    async def ReportStep(self, request: pb.StepReport,
                         context: grpc.aio.ServicerContext) -> pb.StepReply:
        return self.step_reply(request)

    async def Heartbeat(self, request: pb.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        self.host.on_heartbeat(request)
        return pb.HeartbeatReply()

    async def ReportFailure(self, request: pb.FailureReport,
                            context: grpc.aio.ServicerContext) -> pb.FailureReply:
        try:
            kind = FailureKind(request.kind or "peer")
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kind: expected peer, local, storage, disk or diverged "
                                f"(got {request.kind!r})")
        # Worker and agent share the host's clock: the report's age is how late the agent knew.
        detect_s = max(0.0, time.time() - request.failed_at) \
            if request.HasField("failed_at") else 0.0
        self.host.on_worker_failure(request.local_rank, request.generation, kind, request.step,
                                    request.message, detect_s)
        return pb.FailureReply()

    async def ReportDone(self, request: pb.DoneReport,
                         context: grpc.aio.ServicerContext) -> pb.DoneReply:
        self.host.on_done(request)
        return pb.DoneReply()

    async def ReportCheckpoint(self, request: pb.CheckpointReport,
                               context: grpc.aio.ServicerContext) -> pb.CheckpointReportReply:
        self.host.on_checkpoint(request)
        return pb.CheckpointReportReply()

    async def FetchSnapshot(self, request: pb.SnapshotRanges, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.SnapshotPiece]:
        keeper = self.host.snapshots
        if keeper is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this agent keeps no snapshots")
        try:
            async for piece in fetch_ranges(keeper, self.host.read_peer_snapshot, request):
                yield piece
        except RelayError as exc:
            await context.abort(exc.code, exc.details)

    async def ReportRestore(self, request: pb.RestoreReport,
                            context: grpc.aio.ServicerContext) -> pb.RestoreReply:
        self.host.on_restore(request)
        return pb.RestoreReply()
