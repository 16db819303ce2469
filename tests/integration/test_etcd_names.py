"""etcd endpoints given as host names, several of them, as the DaemonSet and the systemd example
write them: they connect, TLS checks each member for the name it was dialled by, and an
endpoint that cannot be reached is logged at WARNING with gRPC's reason."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.etcd_security import EtcdSecurity
from daemon.control.etcd_server import EtcdServer, EtcdServerTLS
from daemon.procutil import free_port
from tests.integration.conftest import Cluster, wait_until
from tests.integration.secure_etcd import SecureEtcd
from tests.pki import make_ca

pytestmark = pytest.mark.integration


def test_agent_joins_through_several_named_endpoints(cluster: Cluster) -> None:
    port = cluster.etcd.client_port
    cluster.start("n1", 1, "--etcd", f"http://localhost:{port},http://localhost:{port}")
    wait_until(lambda: cluster.status().nodes == 1, 30, "n1 registered through localhost names")


def test_an_unreachable_endpoint_is_logged_at_warning(cluster: Cluster) -> None:
    dead = f"http://localhost:{free_port('127.0.0.1')}"
    live = f"http://localhost:{cluster.etcd.client_port}"
    agent = cluster.start("n1", 1, "--etcd", f"{dead},{live}")
    wait_until(lambda: cluster.status().nodes == 1, 30, "n1 registered past a dead member")
    warnings = [line for line in agent.log.splitlines() if " WARNING " in line and dead in line]
    assert warnings, agent.log
    # gRPC's own account of the failure, not just "unavailable".
    assert "refused" in warnings[0].lower(), warnings[0]


@pytest.fixture
def ip_only_etcd(tmp_path: Path) -> Iterator[tuple[EtcdServer, EtcdSecurity]]:
    """An https etcd whose certificate names 127.0.0.1 only (not `localhost`), and a client's
    security settings for it."""
    ca = make_ca(tmp_path / "ca", "names")
    pair = ca.issue("etcd-ip-only", san="IP:127.0.0.1")
    client = ca.issue("client")
    server = EtcdServer(tmp_path / "etcd", tls=EtcdServerTLS(pair.cert, pair.key,
                                                             ca.cert)).start()
    try:
        yield server, EtcdSecurity(ca=ca.cert, cert=client.cert, key=client.key)
    finally:
        server.stop()


def test_each_member_is_verified_for_the_name_it_was_dialled_by(
        ip_only_etcd: tuple[EtcdServer, EtcdSecurity],
        caplog: pytest.LogCaptureFixture) -> None:
    server, security = ip_only_etcd
    by_name = f"https://localhost:{server.client_port}"
    by_address = f"https://127.0.0.1:{server.client_port}"

    async def put_get(endpoints: str) -> bytes:
        etcd = Etcd(endpoints, timeout=3, security=security)
        try:
            await etcd.put(b"/ultrascale/names", b"ok")
            got = await etcd.get(b"/ultrascale/names")
            return got.value if got else b""
        finally:
            await etcd.close()

    # The member dialled as `localhost` shows a certificate without that name: refused, and
    # said so; the same member dialled by its address (which the certificate names) serves.
    with caplog.at_level(logging.WARNING, logger="daemon.control.etcd_members"):
        assert asyncio.run(put_get(f"{by_name},{by_address}")) == b"ok"
    named = [r for r in caplog.records if r.levelno == logging.WARNING and by_name in r.message]
    assert named, [r.message for r in caplog.records]
    with pytest.raises(ETCD_ERRORS):
        asyncio.run(put_get(by_name))


def test_named_https_members_with_client_certificates_and_auth(secure_etcd: SecureEtcd) -> None:
    port = secure_etcd.server.client_port
    endpoints = f"https://localhost:{port},https://localhost:{port}"

    async def go() -> bytes:
        etcd = Etcd(endpoints, timeout=5, security=secure_etcd.security())
        try:
            await etcd.put(b"/ultrascale/n", b"named")
            got = await etcd.get(b"/ultrascale/n")
            return got.value if got else b""
        finally:
            await etcd.close()

    assert asyncio.run(go()) == b"named"
