"""etcd over TLS with client certificates and etcd's user/password auth, against a real etcd;
and `https://` endpoints that are never dialled in plain text."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.control.etcd_client import ETCD_ERRORS, Etcd, KeepAlive
from daemon.control.etcd_security import EtcdSecurity
from daemon.control.etcd_server import EtcdServer
from daemon.procutil import free_port, parent_death_env, terminate
from tests.integration.conftest import ROOT, TINY_JOB, _cluster, wait_until
from tests.integration.secure_etcd import SecureEtcd, void_auth_tokens
from tests.pki import make_ca

pytestmark = pytest.mark.integration


async def _first_event(watch: object) -> object:
    async for resp in watch:  # type: ignore[attr-defined]
        if resp.events:
            return resp.events[0]
    raise AssertionError("watch ended without an event")


def test_client_over_tls_with_user_password(secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    endpoint = secure_etcd.server.endpoint
    assert endpoint.startswith("https://")

    async def go() -> None:
        etcd = Etcd(endpoint, timeout=5, security=secure_etcd.security())
        try:
            assert etcd.tls
            await etcd.put(b"/ultrascale/t/a", b"1")
            assert (await etcd.get(b"/ultrascale/t/a")).value == b"1"  # type: ignore[union-attr]
            ok, _ = await etcd.txn([etcd.tx.value(b"/ultrascale/t/a") == b"1"],
                                   [etcd.tx.put(b"/ultrascale/t/b", b"2")])
            assert ok
            kvs, _ = await etcd.get_prefix(b"/ultrascale/t/")
            assert [kv.key for kv in kvs] == [b"/ultrascale/t/a", b"/ultrascale/t/b"]
            # The role of this user covers /ultrascale/ only: etcd checks the token's user.
            with pytest.raises(ETCD_ERRORS, match="permission denied"):
                await etcd.put(b"/elsewhere", b"x")

            lease = await etcd.grant(2)
            keepalive = KeepAlive(etcd, lease, 2)
            first_deadline = keepalive.deadline
            task = asyncio.create_task(keepalive.run())
            watch = asyncio.create_task(_first_event(
                etcd.watch(b"/ultrascale/w/", prefix=True)))
            await asyncio.sleep(0.5)  # let the watch be created before the put
            await etcd.put(b"/ultrascale/w/k", b"v", lease=lease)
            event = await asyncio.wait_for(watch, 20)
            assert event.kv.key == b"/ultrascale/w/k"  # type: ignore[attr-defined]
            # Keepalives are acknowledged over TLS: the deadline moves past the first TTL.
            await asyncio.sleep(2.5)
            assert keepalive.deadline > first_deadline and not keepalive.expired.is_set()
            assert (await etcd.get(b"/ultrascale/w/k")) is not None  # the lease is alive
            task.cancel()
            await etcd.revoke(lease)
            assert (await etcd.get(b"/ultrascale/w/k")) is None
        finally:
            await etcd.close()

    asyncio.run(go())


def _refused(endpoint: str, security: EtcdSecurity) -> BaseException:
    async def go() -> BaseException:
        etcd = Etcd(endpoint, timeout=2, security=security)
        try:
            await etcd.get(b"/ultrascale/t/a")
        except ETCD_ERRORS as exc:
            return exc
        finally:
            await etcd.close()
        raise AssertionError(f"etcd answered a client with {security}")
    return asyncio.run(go())


def test_etcd_refuses_bad_credentials(secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    endpoint = secure_etcd.server.endpoint
    good = secure_etcd.security()
    wrong = tmp_path / "wrong-password"
    wrong.write_text("nope\n")
    wrong.chmod(0o600)
    exc = _refused(endpoint, EtcdSecurity(good.ca, good.cert, good.key, good.user, wrong))
    assert "authentication failed" in str(exc)
    # No client certificate: etcd's --client-cert-auth ends the handshake.
    _refused(endpoint, EtcdSecurity(ca=good.ca, user=good.user,
                                    password_file=good.password_file))
    # A client certificate from another CA, and a server verified against another CA.
    other = make_ca(tmp_path / "other", "other").issue("intruder")
    _refused(endpoint, EtcdSecurity(good.ca, other.cert, other.key, good.user,
                                    good.password_file))
    other_ca = tmp_path / "other" / "other-ca.pem"
    _refused(endpoint, EtcdSecurity(other_ca, good.cert, good.key, good.user,
                                    good.password_file))


def test_tls_channel_fails_over_to_the_next_endpoint(secure_etcd: SecureEtcd) -> None:
    server = secure_etcd.server
    dead = f"https://127.0.0.1:{free_port('127.0.0.1')}"

    async def go() -> bytes:
        etcd = Etcd(f"{dead},{server.endpoint}", timeout=5, security=secure_etcd.security())
        try:
            await etcd.put(b"/ultrascale/f", b"over")
            got = await etcd.get(b"/ultrascale/f")
            return got.value if got else b""
        finally:
            await etcd.close()

    assert asyncio.run(go()) == b"over"


def test_agent_on_tls_etcd_survives_restarts_and_reauthenticates(
        secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    (tmp_path / "agents").mkdir()
    cluster = _cluster(tmp_path / "agents", secure_etcd.server)
    try:
        cluster.start("n1", 1, *secure_etcd.flags())
        wait_until(lambda: cluster.status().nodes == 1, 20, "n1 registered through TLS etcd")
        secure_etcd.server.kill()
        secure_etcd.server.start()
        # Whether a restart voids the agent's token depends on etcd's log replay: void it
        # for sure, so that the job below is submitted on a token etcd refuses.
        void_auth_tokens(secure_etcd)

        def submitted() -> bool:
            cluster.submit(TINY_JOB)
            return True
        wait_until(submitted, 30, "the job submitted through n1 after etcd restarted")
        wait_until(lambda: cluster.status().generation >= 1, 30, "a generation after restart")
        assert "re-authenticated as ultrad" in cluster.agents["n1"].log
    finally:
        cluster.stop()


class FirstBytes:
    """A TCP listener that records the first bytes each connection sends, then hangs up."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    self.received.append(conn.recv(16))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def first_bytes() -> Iterator[FirstBytes]:
    listener = FirstBytes()
    try:
        yield listener
    finally:
        listener.close()


def test_https_endpoint_is_dialled_with_tls_only(first_bytes: FirstBytes,
                                                 etcd: EtcdServer) -> None:
    # Without any TLS file, https:// still means TLS (verified against the system's roots).
    _refused(f"https://127.0.0.1:{first_bytes.port}", EtcdSecurity())
    wait_until(lambda: first_bytes.received, 10, "a connection to the listener")
    # A TLS record (0x16 handshake, 0x03 version major): a ClientHello, never an HTTP/2 preface.
    assert all(b[:2] == b"\x16\x03" for b in first_bytes.received), first_bytes.received
    # A plain-text etcd behind an https:// URL fails the handshake; it never serves the call.
    plain = etcd.endpoint.replace("http://", "https://")
    assert plain.startswith("https://")
    _refused(plain, EtcdSecurity())


def test_ultrad_dials_an_https_endpoint_with_tls(first_bytes: FirstBytes,
                                                 tmp_path: Path) -> None:
    args = [sys.executable, "-m", "daemon.cli.ultrad", "--etcd",
            f"https://127.0.0.1:{first_bytes.port}", "--node-id", "n1", "--devices", "1",
            "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path / "n1"), "--no-workers", "--ttl", "2"]
    log = (tmp_path / "ultrad.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **parent_death_env()})
    try:
        wait_until(lambda: first_bytes.received or proc.poll() is not None, 30,
                   "ultrad to dial etcd")
        assert first_bytes.received, (tmp_path / "ultrad.log").read_text()
        assert first_bytes.received[0][:2] == b"\x16\x03", first_bytes.received
    finally:
        terminate(proc, timeout=5)
        log.close()

