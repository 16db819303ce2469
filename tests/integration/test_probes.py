"""Kubernetes probes on `--health-listen`: a real agent, a real etcd, a real grpc health client.

readiness follows the lease and the generation; liveness never follows etcd.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemon.api.probes import LIVENESS, READINESS
from daemon.control.etcd_server import EtcdServer
from tests.integration.conftest import TINY_JOB, TTL, Cluster, wait_until

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


@contextmanager
def stopped(etcd: EtcdServer) -> Iterator[None]:
    """etcd frozen (SIGSTOP): connections stay open but nothing answers, as in a partition."""
    assert etcd.proc is not None
    etcd.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        etcd.proc.send_signal(signal.SIGCONT)


def test_readiness_follows_lease_and_generation_liveness_ignores_etcd(cluster: Cluster) -> None:
    # A short outage allowance: alone, the agent holds on that long, then fences (drops its
    # lease) while etcd is still frozen.
    agent = cluster.start("n1", 1, "--health-listen", "127.0.0.1:0", "--etcd-outage", "1")
    health = agent.info["health"]
    assert health.startswith("127.0.0.1:") and not health.endswith(":0")

    # A member (its lease is in the view) but no job, so no generation: alive, not ready.
    wait_until(lambda: cluster.status().nodes == 1, 20, "n1 to hold its lease")
    assert cluster.status().generation == 0
    assert check(health, READINESS) == NOT_SERVING
    assert check(health, LIVENESS) == SERVING
    assert check(health, "") == SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        check(health, "etcd")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "readiness" in (unknown.value.details() or "")

    cluster.submit(TINY_JOB)
    wait_until(lambda: check(health, READINESS) == SERVING, 20, "readiness with a generation")
    assert cluster.status().generation >= 1

    with stopped(cluster.etcd):
        def unready_while_alive() -> bool:
            # Every look at readiness is paired with one at liveness: never NOT_SERVING.
            assert check(health, LIVENESS) == SERVING
            return check(health, READINESS) == NOT_SERVING

        # Keepalives stop being acknowledged; after a TTL and the 1 s outage allowance the
        # agent fences itself and has no lease.
        wait_until(unready_while_alive, 30 + 4 * TTL, "readiness to drop without a lease",
                   interval=0.2)
        assert "fencing myself" in agent.log
        # Still alive for another lease TTL of a frozen etcd (the agent keeps trying to join).
        for _ in range(int(TTL / 0.2)):
            assert check(health, LIVENESS) == SERVING
            assert check(health, "") == SERVING
            time.sleep(0.2)
        assert agent.proc.poll() is None

    # etcd back: the agent joins again and is (again) in a generation.
    wait_until(lambda: check(health, READINESS) == SERVING, 30, "readiness after etcd is back")
    assert check(health, LIVENESS) == SERVING

