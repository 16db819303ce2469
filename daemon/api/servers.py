"""The agent's endpoints: the gRPC listener (admin API, health, reflection), the workers' unix
sockets (WorkerControl, and the step socket: daemon/node/step_socket.py), /metrics, and the
channels to peers (health probes).

grpc.health.v1 answers "" (the agent is up) and "etcd" (SERVING while its lease keepalives are
acknowledged). Both are open to unauthenticated callers, so peers on other hosts can probe each
other without sharing the admin token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from daemon.api import advertise
from daemon.api.admin_service import AdminContext, AdminService
from daemon.api.auth import BearerTokenInterceptor, load_or_create_token
from daemon.api.grpc_limits import MESSAGE_OPTIONS, SERVER_OPTIONS
from daemon.api.probes import Probe, start_probe_server
from daemon.api.replication_streams import ReplicationStreams
from daemon.api.snapshot_service import SnapshotPeerService
from daemon.config import AgentConfig
from daemon.control.etcd_client import parse_endpoints
from daemon.control.records import SnapshotHoldings
from daemon.metrics import Metrics
from daemon.node.snapshot_files import Incoming
from daemon.node.snapshot_keeper import SnapshotKeeper
from daemon.node.step_socket import serve_step_socket
from daemon.node.worker_service import WorkerControlService, WorkerHost
from daemon.tls_files import client_credentials
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ETCD_HEALTH = "etcd"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class AgentIO:
    def __init__(self, config: AgentConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.token = ""
        self.address = ""  # what peers, workers and ultractl dial: advertised host:bound port
        self.advertised_host = ""  # never a wildcard (advertise.py)
        self.metrics_url = ""
        self.health_address = ""
        self.socket_path = Path()
        self.step_socket_path = Path()
        self._step_server: asyncio.AbstractServer | None = None
        self.pid = os.getpid()
        self._servers: list[grpc.aio.Server] = []
        self._metrics_server: Any = None
        self._health: health.aio.HealthServicer | None = None
        self._etcd_serving: bool | None = None
        self._peers: dict[str, grpc.aio.Channel] = {}
        self._peer_secret: Any = lambda: ""
        self._replication = ReplicationStreams(self._peer, self._peer_metadata)

    async def start(self, admin: AdminContext, probes: dict[str, Probe], node: WorkerHost,
                    snapshots: SnapshotKeeper | None, peer_secret: Callable[[], str]) -> None:
        """Serve the admin service (`admin`), health `probes`, this node's workers (`node`)
        and, when this agent keeps snapshots, its peers' snapshot calls, authenticated with
        the job's `peer_secret`."""
        cfg = self.config
        self.token, _ = load_or_create_token(cfg.token_file, cfg.state_dir)
        self.advertised_host = await asyncio.to_thread(
            advertise.choose, cfg.listen.rpartition(":")[0], cfg.advertise_host,
            parse_endpoints(cfg.etcd))
        listen_host, _, port = cfg.metrics_listen.rpartition(":")
        # /metrics in a daemon thread of its own; `.shutdown()` stops it.
        self._metrics_server, _ = start_http_server(int(port), addr=listen_host,
                                                    registry=self.metrics.registry)
        metrics_host = self.advertised_host if advertise.is_wildcard(listen_host) \
            else listen_host.strip("[]")
        metrics_port = self._metrics_server.server_port
        self.metrics_url = f"http://{advertise.host_port(metrics_host, metrics_port)}/metrics"

        self._peer_secret = peer_secret
        server = grpc.aio.server(interceptors=[BearerTokenInterceptor(self.token,
                                                                      self._peer_secret)],
                                 options=SERVER_OPTIONS)
        pb_grpc.add_AgentServicer_to_server(AdminService(admin), server)
        if snapshots is not None:
            pb_grpc.add_SnapshotPeerServicer_to_server(SnapshotPeerService(snapshots), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Agent"].full_name, reflection.SERVICE_NAME,
             health.SERVICE_NAME), server)
        if cfg.tls is not None:
            bound = server.add_secure_port(cfg.listen, cfg.tls.server_credentials())
        else:
            bound = server.add_insecure_port(cfg.listen)
        self._servers.append(server)
        await server.start()
        self.address = advertise.host_port(self.advertised_host, bound)
        await self.set_etcd_health(False)

        self.socket_path = _socket_path(cfg.state_dir)
        self.socket_path.unlink(missing_ok=True)
        workers = grpc.aio.server(options=MESSAGE_OPTIONS)
        worker_control = WorkerControlService(node)
        pb_grpc.add_WorkerControlServicer_to_server(worker_control, workers)
        workers.add_insecure_port(f"unix:{self.socket_path}")
        self._servers.append(workers)
        await workers.start()
        os.chmod(self.socket_path, 0o600)  # only this user's processes may drive the agent
        self.step_socket_path = self.socket_path.with_name("steps.sock")
        self._step_server = await serve_step_socket(self.step_socket_path,
                                                    worker_control.step_reply)
        if cfg.health_listen:
            server, self.health_address = await start_probe_server(cfg.health_listen, probes)
            self._servers.append(server)

    def write_agent_file(self, node: str) -> None:
        """Where to reach this agent, for `ultrad local`, tests and operators."""
        info = {"node": node, "address": self.address, "metrics_url": self.metrics_url,
                "socket": str(self.socket_path), "pid": self.pid, "health": self.health_address}
        path = self.config.state_dir / "agent.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)

    def worker_env(self) -> dict[str, str]:
        """What the workers need besides ULTRA_AGENT_SOCKET (which their supervisor sets)."""
        return {"ULTRA_STEP_SOCKET": str(self.step_socket_path)}

    async def leaving(self) -> None:
        """From now on peers' probes (`probe`) find this agent gone: called just before it
        revokes its lease. A probe that reached it after the revoke and before its servers
        stopped answered "alive", and a leader takes a live member without a lease for one
        re-attaching after an etcd outage, waiting two TTLs for it."""
        if self._health is not None:
            await self._health.set("", _NOT_SERVING)

    async def stop(self) -> None:
        for server in self._servers:
            await server.stop(grace=0.5)
        self._servers.clear()
        if self._step_server is not None:
            self._step_server.close()
            self._step_server = None
            self.step_socket_path.unlink(missing_ok=True)
        self._replication.close()
        for channel in self._peers.values():
            await channel.close()
        self._peers.clear()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        if self.socket_path != Path():
            self.socket_path.unlink(missing_ok=True)

    async def set_etcd_health(self, connected: bool) -> None:
        if self._health is None or connected == self._etcd_serving:
            return
        self._etcd_serving = connected
        await self._health.set(ETCD_HEALTH, _SERVING if connected else _NOT_SERVING)

    # -- peers --------------------------------------------------------------------------------

    def _peer(self, address: str) -> grpc.aio.Channel:
        if address not in self._peers:
            tls = self.config.tls
            if tls is not None:
                # The agent's own certificate doubles as its client certificate: peers that
                # require mTLS accept it when both chain to the same --tls-ca.
                creds = client_credentials(tls.ca, tls.cert, tls.key)
                self._peers[address] = grpc.aio.secure_channel(address, creds, MESSAGE_OPTIONS)
            else:
                self._peers[address] = grpc.aio.insecure_channel(address, MESSAGE_OPTIONS)
        return self._peers[address]

    async def _check(self, address: str, service: str) -> int | None:
        try:
            reply = await health_pb2_grpc.HealthStub(self._peer(address)).Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=max(0.25, self.config.ttl / 4))
        except grpc.aio.AioRpcError:
            return None
        return int(reply.status)

    async def probe(self, address: str) -> bool:
        """Is the agent at `address` alive and staying? A short health check, for fast failure
        confirmation; an agent on its way out answers no (`leaving`)."""
        return await self._check(address, "") == _SERVING

    def _peer_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._peer_secret()}"),)

    async def put_snapshot_file(self, address: str, header: Incoming,
                                pieces: AsyncIterator[bytes]) -> None:
        """Send one snapshot file to the agent at `address` (SnapshotPeer.Replicate)."""
        await self._replication.send(address, header, pieces)

    async def read_snapshot(self, address: str, request: pb.SnapshotRanges
                            ) -> list[list[bytes]]:
        """The pieces of each range of `request`, read from the agent at `address` in one call
        (SnapshotPeer.ReadRanges). Raises grpc.aio.AioRpcError, and ValueError for a reply
        that does not answer every range."""
        stub = pb_grpc.SnapshotPeerStub(self._peer(address))
        pieces: list[list[bytes]] = [[] for _ in request.ranges]
        async for piece in stub.ReadRanges(request, metadata=self._peer_metadata(),
                                           timeout=max(10.0, self.config.ttl * 4)):
            if not 0 <= piece.range < len(pieces):
                raise ValueError(f"{address} answered range {piece.range} of "
                                 f"{len(pieces)}")
            pieces[piece.range].append(piece.data)
        if not all(pieces):
            raise ValueError(f"{address} left ranges unanswered")
        return pieces

    async def snapshot_holdings(self, address: str) -> SnapshotHoldings | None:
        """What the agent at `address` holds of snapshots now (SnapshotPeer.Holdings); None
        when it does not answer in time or keeps none."""
        stub = pb_grpc.SnapshotPeerStub(self._peer(address))
        try:
            reply = await stub.Holdings(pb.HoldingsRequest(), metadata=self._peer_metadata(),
                                        timeout=max(0.25, self.config.ttl / 4))
            return SnapshotHoldings.from_json(reply.holdings_json)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # an agent that runs no workers
                log.info("no snapshot holdings from %s: %s", address, exc.code().name)
            return None
        except (ValueError, TypeError) as exc:
            log.warning("unreadable snapshot holdings from %s: %s", address, str(exc)[:200])
            return None

    async def etcd_health(self, address: str) -> bool | None:
        """Does the agent at `address` reach etcd? None when it does not answer."""
        status = await self._check(address, ETCD_HEALTH)
        return None if status is None else status == _SERVING


def _socket_path(state_dir: Path) -> Path:
    path = state_dir / "agent.sock"
    # sun_path holds 107 bytes; deep state dirs (pytest's) fall back to a short private dir.
    if len(str(path)) < 100:
        return path
    return Path(tempfile.mkdtemp(prefix="ultrad-")) / "agent.sock"
