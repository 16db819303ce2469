"""Mutual TLS on the agents' gRPC listener: ultractl and peers need a certificate from the
agents' CA; no certificate, or one from another CA, is refused at the handshake."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.api.servers import AgentIO
from daemon.cli.ctlconfig import Context, save_context
from daemon.config import AgentConfig, TLSConfig
from daemon.control.etcd_server import EtcdServer
from daemon.metrics import Metrics
from tests.integration.conftest import ROOT, Cluster, _cluster
from tests.pki import Pair, make_ca

pytestmark = pytest.mark.integration


@dataclass
class MTLSCluster:
    cluster: Cluster
    ca: Path          # the agents' CA
    operator: Pair    # an operator's client certificate from that CA
    intruder: Pair    # a client certificate from another CA
    agents: dict[str, Pair]
    rogue_agent: Pair  # an agent certificate from another CA

    def ctl(self, *args: str, env: dict[str, str] | None = None,
            endpoint: bool = True, token: bool = True) -> subprocess.CompletedProcess[str]:
        c = self.cluster
        flags = ["--endpoint", c.agents["n1"].address] if endpoint else []
        flags += ["--token-file", str(c.token_file)] if token else []
        return subprocess.run(
            [sys.executable, "-m", "daemon.cli.ultractl", *flags, *args],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            # The caller's own ULTRA_* settings must not leak into what is tested.
            env={**{k: v for k, v in os.environ.items() if not k.startswith("ULTRA_")},
                 "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(c.root / "xdg"), **(env or {})})


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MTLSCluster]:
    root = tmp_path_factory.mktemp("mtls")
    good = make_ca(root / "good", "cluster")
    bad = make_ca(root / "bad", "elsewhere")
    agents = {n: good.issue(n) for n in ("n1", "n2")}
    server = EtcdServer(root / "etcd").start()
    c = _cluster(root, server)
    try:
        for node, pair in agents.items():
            c.start(node, 1, "--tls-cert", str(pair.cert), "--tls-key", str(pair.key),
                    "--tls-ca", str(good.cert))
        yield MTLSCluster(c, good.cert, good.issue("operator"), bad.issue("intruder"),
                          agents, bad.issue("rogue-agent"))
    finally:
        c.stop()
        server.stop()


def test_ultractl_without_a_client_certificate_is_refused(mtls: MTLSCluster) -> None:
    result = mtls.ctl("--tls-ca", str(mtls.ca), "-o", "json", "status")
    # Nothing was sent (exit 3), and the message carries gRPC's reason for the failed connection.
    assert result.returncode == 3 and "UNAVAILABLE" in result.stderr, result


def test_ultractl_with_a_certificate_from_another_ca_is_refused(mtls: MTLSCluster) -> None:
    result = mtls.ctl("--tls-ca", str(mtls.ca), "--tls-cert", str(mtls.intruder.cert),
                      "--tls-key", str(mtls.intruder.key), "status")
    assert result.returncode == 3 and "UNAVAILABLE" in result.stderr, result


def test_ultractl_with_the_right_certificate_works(mtls: MTLSCluster) -> None:
    op = mtls.operator
    by_flags = mtls.ctl("--tls-ca", str(mtls.ca), "--tls-cert", str(op.cert),
                        "--tls-key", str(op.key), "-o", "json", "nodes")
    assert by_flags.returncode == 0, by_flags
    assert {n["node"] for n in json.loads(by_flags.stdout)} == {"n1", "n2"}
    by_env = mtls.ctl("-o", "json", "status", env={
        "ULTRA_TLS_CA": str(mtls.ca), "ULTRA_TLS_CERT": str(op.cert),
        "ULTRA_TLS_KEY": str(op.key)})
    assert by_env.returncode == 0 and json.loads(by_env.stdout)["nodes"] == 2, by_env
    c = mtls.cluster
    save_context(c.root / "xdg" / "ultrascale" / "config", Context(
        "secure", c.agents["n2"].address, token_file=str(c.token_file), tls_ca=str(mtls.ca),
        tls_cert=str(op.cert), tls_key=str(op.key)))
    by_context = mtls.ctl("-o", "json", "status", endpoint=False, token=False)
    assert by_context.returncode == 0, by_context
    assert json.loads(by_context.stdout)["node"] == "n2"


def test_a_client_certificate_does_not_replace_the_token(mtls: MTLSCluster) -> None:
    op = mtls.operator
    no_context = str(mtls.cluster.root / "no-context")
    result = mtls.ctl("--tls-ca", str(mtls.ca), "--tls-cert", str(op.cert),
                      "--tls-key", str(op.key), "status", token=False,
                      env={"XDG_CONFIG_HOME": no_context})
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr, result


def test_ultractl_names_a_half_given_client_certificate(mtls: MTLSCluster) -> None:
    result = mtls.ctl("--tls-ca", str(mtls.ca), "--tls-cert", str(mtls.operator.cert),
                      "status")
    assert result.returncode == 2 and "--tls-cert and --tls-key" in result.stderr, result


def _probe_from(pair: Pair | None, ca: Path | None, address: str) -> tuple[bool, bool | None]:
    """What the peer-probe code of an agent holding `pair` sees of the agent at `address`."""
    tls = TLSConfig(pair.cert, pair.key, ca) if pair is not None else None
    io = AgentIO(AgentConfig(node_id="prober", devices=0, etcd="127.0.0.1:1", ttl=4, tls=tls),
                 Metrics())

    async def go() -> tuple[bool, bool | None]:
        try:
            return await io.probe(address), await io.etcd_health(address)
        finally:
            await io.stop()
    return asyncio.run(go())


def test_peers_probe_each_other_over_mtls(mtls: MTLSCluster) -> None:
    n2 = mtls.cluster.agents["n2"].address
    # n1's own certificate is its client certificate towards n2: alive, and reaches etcd.
    assert _probe_from(mtls.agents["n1"], mtls.ca, n2) == (True, True)
    # A peer whose certificate comes from another CA gets no answer, as does a plain channel.
    assert _probe_from(mtls.rogue_agent, mtls.ca, n2) == (False, None)
    assert _probe_from(None, None, n2) == (False, None)
