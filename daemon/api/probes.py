"""Kubernetes probes: grpc.health.v1 on a plaintext port of its own (`ultrad --health-listen`).

- `readiness`: SERVING while the agent holds its lease and is in the current generation (and is
  not shutting down). A pod that waits outside the plan, or has lost its lease, is not Ready.
- `liveness` (also `""`): SERVING unless a supervised task of the agent died. The servicer runs
  on the agent's own event loop, so an answer at all proves the loop is not wedged; a wedged
  loop makes the probe time out, which the kubelet counts as a failure.

Neither depends on etcd: restarting the agent cannot repair etcd, and during an outage the
workers keep training on purpose (docs/architecture.md, "etcd outages"), so "etcd is down" must
never kill the pod. Losing the lease only makes the pod unready.

The port is plaintext because the kubelet's gRPC probe neither presents nor verifies
certificates; it reveals nothing but these two states, so it may listen on any address
while the admin listener stays TLS.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemon.api.auth import split_host_port
from daemon.api.grpc_limits import MESSAGE_OPTIONS
from daemon.control.view import ClusterView
from daemon.tasks import TaskSupervisor

log = logging.getLogger(__name__)

READINESS = "readiness"
LIVENESS = "liveness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# A probe: None while serving, else why not (logged when the answer changes).
Probe = Callable[[], "str | None"]


def agent_probes(node: str, view: ClusterView, tasks: TaskSupervisor, stopping: asyncio.Event,
                 joined: Callable[[], bool]) -> dict[str, Probe]:
    """Readiness and liveness of the agent of `node`; `joined`: whether it holds a lease."""
    def ready() -> str | None:
        if stopping.is_set():
            return "shutting down"
        # `joined` stays true while an etcd outage is ridden out, and turns false when the
        # agent fences itself or etcd says the lease expired.
        if not joined():
            return "no lease"
        plan = view.plan
        if plan is None:
            return "no generation yet"
        if node not in plan.nodes:
            return f"not in generation {plan.generation}"
        return None

    def live() -> str | None:
        if tasks.failed.is_set():
            return tasks.failure or "a supervised task failed"
        return None

    return {READINESS: ready, LIVENESS: live, "": live}


class ProbeService(health_pb2_grpc.HealthServicer):
    """Answers Check from the probes at call time (no cached state that could go stale).
    Watch stays unimplemented: the kubelet only calls Check."""

    def __init__(self, probes: Mapping[str, Probe]) -> None:
        self._probes = dict(probes)
        self._last: dict[str, str | None] = {}

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        probe = self._probes.get(request.service)
        if probe is None:
            known = ", ".join(repr(s) for s in sorted(self._probes))
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"service: unknown health service {request.service!r} "
                                f"(known: {known})")
        reason = probe()
        name = request.service or LIVENESS
        if name not in self._last or self._last[name] != reason:
            if name in self._last or reason is not None:
                log.info("%s probe: %s", name,
                         "SERVING" if reason is None else f"NOT_SERVING ({reason})")
            self._last[name] = reason
        return health_pb2.HealthCheckResponse(
            status=_SERVING if reason is None else _NOT_SERVING)


def check_health_listen(address: str) -> None:
    """Raise ValueError naming the flag when --health-listen is not host:port."""
    try:
        split_host_port(address)
    except ValueError as exc:
        raise ValueError(f"--health-listen: {exc}") from None


async def start_probe_server(listen: str, probes: Mapping[str, Probe]
                             ) -> tuple[grpc.aio.Server, str]:
    """A plaintext gRPC server with only grpc.health.v1; returns it and its bound address."""
    server = grpc.aio.server(options=MESSAGE_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(ProbeService(probes), server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:  # grpc raises instead of returning 0 on a failed bind
        raise OSError(f"--health-listen {listen}: cannot bind ({exc})") from None
    if port == 0:
        raise OSError(f"--health-listen {listen}: cannot bind")
    await server.start()
    return server, f"{listen.rpartition(':')[0]}:{port}"
