"""One node's agent: membership, election, the generation lifecycle, and its gRPC servers.

Everything runs on one asyncio loop; the parts are small modules (membership, election,
leader, view, supervisor, services) and this file only wires them and owns the agent's state
machine (state.py). The agent never runs collectives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from daemon import __version__
from daemon.auth import BearerTokenInterceptor, call_metadata, load_or_create_token
from daemon.config import AgentConfig
from daemon.election import Election
from daemon.etcd_client import ETCD_ERRORS, Etcd
from daemon.keys import Keys, NodeRecord, dumps
from daemon.leader import Leader
from daemon.membership import Membership
from daemon.metrics import Metrics, serve
from daemon.state import AgentState, StateMachine
from daemon.store_host import StoreHost
from daemon.supervisor import Supervisor, WorkerExit
from daemon.view import ClusterView
from daemon.worker_service import WorkerControlService
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Progress from rank 0 is forwarded to the leader at most this often (boundaries at once).
PROGRESS_INTERVAL_S = 0.5


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.keys = Keys(config.job)
        self.metrics = Metrics()
        self.etcd = Etcd(config.etcd, timeout=max(1.0, config.ttl / 2))
        self.view = ClusterView(self.etcd, self.keys)
        self.election = Election(self.etcd, self.keys, self.node_id)
        self.state = StateMachine()
        self.token = ""
        self.address = ""
        self.metrics_url = ""
        self.socket_path = Path()
        self.stopping = asyncio.Event()
        self.membership: Membership | None = None
        self.leader: Leader
        self.supervisor: Supervisor | None = None
        self._servers: list[grpc.aio.Server] = []
        self._metrics_server: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._seen_generation = 0
        self._failure_at: tuple[float, int] | None = None  # (monotonic, generation) of a failure
        self._progress: dict[str, Any] = {}
        self._progress_sent_at = 0.0
        self._progress_dirty = False
        self._progress_task: asyncio.Task[None] | None = None
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        # Per local rank: the generation a worker was last handed, and whether it is asking
        # for the next one right now (free, not stuck in an old generation's collectives).
        self._worker_generation: dict[int, int] = {}
        self._worker_asking: dict[int, bool] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.token, _ = load_or_create_token(cfg.token_file, cfg.state_dir)
        self._start_metrics()
        await self._start_servers()
        host = cfg.advertise_host or self.address.rpartition(":")[0]
        self.leader = Leader(self.etcd, self.keys, self.view, self.election, StoreHost(host),
                             cfg.ttl, cfg.debounce_s, self._probe)
        if cfg.workers:
            self.supervisor = Supervisor(self.node_id, self.socket_path, cfg.state_dir / "logs",
                                         self._on_worker_exit, cfg.worker_module)
        record = NodeRecord(self.node_id, self.address, self.metrics_url, cfg.devices,
                            pid=os.getpid(), version=__version__)
        self.membership = Membership(self.etcd, self.keys, record, cfg.ttl, self._on_fenced)
        self.view.subscribe(self._on_view)
        await self.etcd.connect()
        for name, coro in (("view", self.view.run()), ("membership", self.membership.run()),
                           ("leadership", self._leadership())):
            self._tasks.append(asyncio.create_task(coro, name=name))
        self._write_agent_file()
        log.info("agent %s up: grpc %s, metrics %s, %d device(s), etcd %s, job namespace %s",
                 self.node_id, self.address, self.metrics_url, cfg.devices, cfg.etcd, cfg.job)

    def _start_metrics(self) -> None:
        host, _, port = self.config.metrics_listen.rpartition(":")
        self._metrics_server = serve(self.metrics, host, int(port))
        self.metrics_url = f"http://{host}:{self._metrics_server.server_port}/metrics"

    async def _start_servers(self) -> None:
        cfg = self.config
        server = grpc.aio.server(interceptors=[BearerTokenInterceptor(self.token)])
        pb_grpc.add_AgentServicer_to_server(_admin(self), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Agent"].full_name, reflection.SERVICE_NAME,
             health.SERVICE_NAME), server)
        if cfg.tls is not None:
            port = server.add_secure_port(cfg.listen, cfg.tls.server_credentials())
        else:
            port = server.add_insecure_port(cfg.listen)
        await server.start()
        self.address = f"{cfg.listen.rpartition(':')[0]}:{port}"
        self._servers.append(server)

        self.socket_path = _socket_path(cfg.state_dir)
        self.socket_path.unlink(missing_ok=True)
        workers = grpc.aio.server()
        pb_grpc.add_WorkerControlServicer_to_server(WorkerControlService(self), workers)
        workers.add_insecure_port(f"unix:{self.socket_path}")
        await workers.start()
        os.chmod(self.socket_path, 0o600)  # only this user's processes may drive the agent
        self._servers.append(workers)

    def _write_agent_file(self) -> None:
        """Where to reach this agent, for `ultrad local`, tests and operators."""
        info = {"node": self.node_id, "address": self.address, "metrics_url": self.metrics_url,
                "socket": str(self.socket_path), "pid": os.getpid()}
        path = self.config.state_dir / "agent.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)

    async def serve_forever(self) -> None:
        await self.stopping.wait()

    async def stop(self) -> None:
        """Leave cleanly: workers first, then the lease (peers re-plan at once), then servers."""
        self.stopping.set()
        if self.supervisor is not None:
            await self.supervisor.stop(grace=self.config.ttl)
        if self.membership is not None:
            await self.membership.leave()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for server in self._servers:
            await server.stop(grace=0.5)
        for channel in self._peer_channels.values():
            await channel.close()
        self.leader.store.close()
        with contextlib.suppress(*ETCD_ERRORS):
            await self.etcd.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.socket_path.unlink(missing_ok=True)

    # -- leadership ------------------------------------------------------------------------------

    async def _leadership(self) -> None:
        assert self.membership is not None
        while True:
            await self.membership.joined.wait()
            await self.view.synced.wait()
            if self.view.leader is None or self.view.leader[0] == self.node_id:
                try:
                    won = await self.election.campaign(self.membership.lease_id)
                except ETCD_ERRORS:
                    await asyncio.sleep(0.2)
                    continue
                if won:
                    self.metrics.is_leader.set(1)
                    try:
                        await self.leader.lead()
                    finally:
                        self.election.drop("stopped leading")
                        self.metrics.is_leader.set(0)
                    continue
            await self.view.wait_for(lambda: self.view.leader is None, timeout=self.config.ttl)

    async def _on_fenced(self, reason: str) -> None:
        self.election.drop(f"fenced: {reason}")
        self.metrics.is_leader.set(0)
        self.state.to(AgentState.JOINING, f"fenced: {reason}")
        self._seen_generation = 0
        if self.supervisor is not None:
            await self.supervisor.kill_all()

    # -- generations ----------------------------------------------------------------------------

    def _on_view(self, kinds: set[str]) -> None:
        membership = self.membership
        if membership is None or not membership.joined.is_set():
            return
        plan = self.view.plan
        if "nodes" in kinds and plan is not None and self._failure_at is None \
                and any(n not in self.view.nodes for n in plan.nodes):
            self._failure_at = (time.monotonic(), plan.generation)
        if "control" in kinds:
            asyncio.get_running_loop().create_task(self._apply_node_requests())
        if kinds & {"generation", "nodes", "leader"} or self.state.state == AgentState.JOINING:
            asyncio.get_running_loop().create_task(self._follow_generation())

    async def _follow_generation(self) -> None:
        assert self.membership is not None
        plan, record = self.view.plan, self.membership.record
        in_plan = plan is not None and self.node_id in plan.nodes
        if plan is not None and plan.generation > self._seen_generation:
            self._seen_generation = plan.generation
            self.metrics.generation.set(plan.generation)
            self.metrics.world_size.set(plan.world_size)
            for dim in ("dp", "tp", "pp", "cp"):
                self.metrics.mesh_size.labels(dim=dim).set(getattr(plan.layout, dim))
            self.metrics.bubble.labels(source="predicted").set(plan.predicted.bubble_ratio)
            self.metrics.membership_changes.labels(reason=plan.reason or "start").inc()
            if in_plan:
                self.state.to(AgentState.RECONFIGURING, f"generation {plan.generation}")
                if self.supervisor is not None:
                    await self._ensure_workers(plan)
            if self.supervisor is not None:
                asyncio.get_running_loop().create_task(self._enforce_leave(plan.generation))
        if record.state == "draining":
            self.state.to(AgentState.DRAINING, "drain requested")
        elif in_plan:
            self.state.to(AgentState.RUNNING, f"in generation {self.view.generation}")
        else:
            self.state.to(AgentState.WAITING, "not in the current generation"
                          if plan is not None else "no generation yet")

    async def _apply_node_requests(self) -> None:
        """Apply drain/cordon/uncordon requests that name this node, then consume them."""
        assert self.membership is not None
        for request_id, request in list(self.view.control.items()):
            if request.get("node") != self.node_id or request.get("op") not in (
                    "drain", "cordon", "uncordon"):
                continue
            state = {"drain": "draining", "cordon": "cordoned", "uncordon": "ready"}[request["op"]]
            try:
                if self.membership.record.state != state:
                    await self.membership.set_state(state)
                    log.info("node state -> %s (%s)", state, request_id)
                await self.etcd.delete(self.keys.control_request(request_id))
            except ETCD_ERRORS as exc:
                log.warning("could not apply %s: %s", request_id, exc)
                return
        await self._follow_generation()

    def worker_asking(self, local_rank: int, asking: bool, handed: int | None = None) -> None:
        """Called by the worker service around each GetGeneration of a local worker."""
        self._worker_asking[local_rank] = asking
        if handed is not None:
            self._worker_generation[local_rank] = handed

    async def _enforce_leave(self, generation: int) -> None:
        """Replace workers that have not left an older generation 3 TTLs after `generation`.

        A worker learns of a new generation at its next step report, or when a collective of
        the old one fails; one blocked in an old generation's rendezvous or collective would
        otherwise sit out its process-group timeout while its peers wait for it in the new one,
        and a staggered group can fail generation after generation that way.
        """
        await asyncio.sleep(3 * self.config.ttl)
        plan, supervisor = self.view.plan, self.supervisor
        if supervisor is None or plan is None or plan.generation != generation:
            return
        stuck = [rank for rank in supervisor.alive()
                 if not self._worker_asking.get(rank, False)
                 and self._worker_generation.get(rank, 0) < generation]
        if not stuck:
            return
        log.warning("worker(s) %s did not leave their generation within %ds of generation %d: "
                    "replacing them", stuck, 3 * self.config.ttl, generation)
        await supervisor.stop(stuck, grace=0)
        await self._ensure_workers(plan)

    async def _ensure_workers(self, plan: Plan) -> None:
        assert self.supervisor is not None
        started = await self.supervisor.ensure(r.local_rank for r in plan.ranks_of(self.node_id))
        for rank in started:
            # A new process's first GetGeneration hands it this generation: not stuck in an old one.
            self._worker_generation[rank] = plan.generation
            self._worker_asking[rank] = False

    def worker_should_exit(self, local_rank: int) -> bool:
        if self.stopping.is_set() or local_rank >= self.config.devices:
            return True
        p, plan = self.view.progress, self.view.plan
        if plan is not None and p.get("finished") and p.get("generation") == plan.generation:
            return True
        membership = self.membership
        draining = membership is not None and membership.record.state == "draining"
        return draining and (plan is None or self.node_id not in plan.nodes)

    # -- worker reports ---------------------------------------------------------------------------

    def on_step(self, report: pb.StepReport) -> None:
        plan = self.view.plan
        mine = plan.ranks_of(self.node_id) if plan else ()
        first_local = min((r.local_rank for r in mine), default=0)
        if report.local_rank == first_local:
            m = self.metrics
            m.steps.inc()
            m.tokens.inc(max(0, report.tokens))
            m.loss.set(report.loss)
            m.step_duration.observe(max(0.0, report.step_seconds))
            for kind in ("params", "grads", "optimizer", "activations"):
                field = f"memory_{kind}_bytes"
                if report.HasField(field):
                    m.memory.labels(kind=kind, source="measured").set(getattr(report, field))
            if report.HasField("bubble_ratio"):
                m.bubble.labels(source="measured").set(report.bubble_ratio)
            if report.HasField("recompute_seconds"):
                m.recompute_seconds.inc(report.recompute_seconds)
            if report.HasField("recompute_ratio"):
                m.recompute_ratio.set(report.recompute_ratio)
            if self._failure_at is not None and report.generation > self._failure_at[1]:
                m.recovery.observe(time.monotonic() - self._failure_at[0])
                self._failure_at = None
        if report.global_rank == 0:
            directive = self.view.directive
            boundary = directive.get("generation") == report.generation and report.step in (
                directive.get("stop_after_step"), directive.get("checkpoint_at_step"))
            self.forward_progress({"generation": report.generation, "step": report.step,
                                   "consumed_samples": report.consumed_samples,
                                   "loss": report.loss}, urgent=boundary)

    async def on_worker_failure(self, local_rank: int, generation: int, message: str) -> None:
        if self._failure_at is None:
            self._failure_at = (time.monotonic(), generation)
        log.error("worker local_rank=%d failed in generation %d: %s", local_rank, generation,
                  message[:500])
        request_id = f"failure-{self.node_id}-{generation}-{local_rank}"
        with contextlib.suppress(*ETCD_ERRORS):
            await self.etcd.put(self.keys.control_request(request_id), dumps(
                {"op": "failure", "node": self.node_id, "generation": generation,
                 "message": message[:2000], "time": time.time()}))

    def _on_worker_exit(self, exit_: WorkerExit) -> None:
        if exit_.expected:
            return
        message = f"worker local_rank={exit_.local_rank} exited with {exit_.returncode}"
        asyncio.get_running_loop().create_task(self.on_worker_failure(
            exit_.local_rank, self.view.generation, f"{message}: {exit_.error}"))

    def forward_progress(self, update: dict[str, Any], urgent: bool = False) -> None:
        """Send rank 0's progress to the leader, which records it in etcd (fenced)."""
        if update.get("generation", 0) != self._progress.get("generation"):
            self._progress = {"checkpoint_step": -1, "checkpoint_path": "", "finished": False}
        self._progress.update(update)
        self._progress_dirty = True
        now = time.monotonic()
        if not urgent and now - self._progress_sent_at < PROGRESS_INTERVAL_S:
            return
        self._progress_sent_at = now
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.get_running_loop().create_task(self._send_progress())

    async def _send_progress(self) -> None:
        # An update that arrives while a send is in flight (the final "finished" one, say)
        # must not be lost: keep sending until nothing new is left.
        while self._progress_dirty:
            self._progress_dirty = False
            await self._send_progress_once(dict(self._progress))

    async def _send_progress_once(self, p: dict[str, Any]) -> None:
        message = pb.Progress(
            generation=int(p.get("generation", 0)), step=int(p.get("step", 0)),
            consumed_samples=int(p.get("consumed_samples", 0)), loss=float(p.get("loss", 0.0)),
            finished=bool(p.get("finished")), checkpoint_step=int(p.get("checkpoint_step", -1)),
            checkpoint_path=str(p.get("checkpoint_path", "")))
        leader = self.view.nodes.get(self.view.leader_node)
        if leader is None:
            return
        try:
            stub = pb_grpc.AgentStub(self._peer(leader.record.address))
            await stub.ReportProgress(message, timeout=self.config.ttl,
                                      metadata=call_metadata(self.token))
        except grpc.aio.AioRpcError as exc:
            log.warning("progress not recorded by leader %s: %s", leader.record.node,
                        exc.details())

    def _peer(self, address: str) -> grpc.aio.Channel:
        if address not in self._peer_channels:
            if self.config.tls is not None:
                ca = self.config.tls.ca.read_bytes() if self.config.tls.ca else None
                creds = grpc.ssl_channel_credentials(
                    ca, self.config.tls.key.read_bytes(), self.config.tls.cert.read_bytes())
                self._peer_channels[address] = grpc.aio.secure_channel(address, creds)
            else:
                self._peer_channels[address] = grpc.aio.insecure_channel(address)
        return self._peer_channels[address]

    async def _probe(self, address: str) -> bool:
        """Is the agent at `address` alive? A short health check, for fast failure confirmation."""
        try:
            reply = await health_pb2_grpc.HealthStub(self._peer(address)).Check(
                health_pb2.HealthCheckRequest(), timeout=max(0.25, self.config.ttl / 4))
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def _admin(agent: Agent) -> pb_grpc.AgentServicer:
    from daemon.admin_service import AdminService  # imports the job parser; keep start fast

    return AdminService(agent)


def _socket_path(state_dir: Path) -> Path:
    path = state_dir / "agent.sock"
    # sun_path holds 107 bytes; deep state dirs (pytest's) fall back to a short private dir.
    if len(str(path)) < 100:
        return path
    return Path(tempfile.mkdtemp(prefix="ultrad-")) / "agent.sock"
