"""Where ultractl sends the admin token: only to agents whose TLS identity it verified, or to
loopback; never in clear to another host unless the operator said `--insecure`, and never to
an address it only learned from a node record (which anyone who can write etcd can forge).

The agents here are fake: gRPC servers that answer GetStatus and ListNodes and record the
`authorization` metadata of every call, so a test sees exactly what reached them. ultractl is
the real command, run as a process. The "other host" is this machine's own non-loopback
address: reaching it does not need the network, but it is not loopback to ultractl.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration

TOKEN = "reach-test-token"


def non_loopback_address() -> str:
    """A global IPv4 address of this machine, or skip."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    pytest.skip("this machine has no non-loopback IPv4 address")


@dataclass
class FakeAgent(pb_grpc.AgentServicer):
    """Answers like an agent; `nodes` are the members it reports."""

    name: str
    nodes: list[str] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (method, authorization)

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        self.seen.append((method, dict(context.invocation_metadata()).get("authorization", "")))

    def GetStatus(self, request: Any, context: grpc.ServicerContext) -> pb.Status:
        self._record("GetStatus", context)
        return pb.Status(node=self.name, state="none", layout=pb.Layout(dp=1))

    def ListNodes(self, request: Any, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        self._record("ListNodes", context)
        return pb.ListNodesResponse(nodes=[pb.Node(node=f"n{i}", address=a, state="ready")
                                           for i, a in enumerate(self.nodes)])

    @property
    def tokens(self) -> list[str]:
        return [auth for _, auth in self.seen if auth]


@dataclass
class Served:
    agent: FakeAgent
    server: grpc.Server
    port: int


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[Served] = []

    def start(agent: FakeAgent, host: str) -> Served:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_AgentServicer_to_server(agent, server)
        port = server.add_insecure_port(f"{host}:0")
        server.start()
        started.append(Served(agent, server, port))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            s.server.stop(grace=None)


def ultractl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    token = tmp_path / "token"
    if not token.exists():
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULTRA")}
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.ultractl", "--token-file", str(token),
         "--timeout", "3", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "ULTRACTL_CONFIG": str(tmp_path / "config")})


def test_a_node_record_on_another_host_never_receives_the_token(serve: Any,
                                                                tmp_path: Path) -> None:
    # A fake node record names an address on another host, in plain text; the genuine agent
    # (loopback) reports it among the members.
    other = non_loopback_address()
    rogue = serve(FakeAgent("rogue"), other)
    seed = serve(FakeAgent("seed", nodes=[f"{other}:{rogue.port}"]), "127.0.0.1")
    config = tmp_path / "config"
    config.write_text(yaml.safe_dump({
        "current-context": "c",
        "contexts": {"c": {"endpoint": f"127.0.0.1:{seed.port}",
                           "token-file": str(tmp_path / "token")}}}))
    done = ultractl(tmp_path, "status")
    assert done.returncode == 0, done.stderr
    assert seed.agent.tokens == [f"Bearer {TOKEN}"] * 2  # GetStatus, then ListNodes
    # The seed goes away: the only member left is the one a node record named.
    seed.server.stop(grace=None)
    done = ultractl(tmp_path, "status")
    assert rogue.agent.tokens == [], f"the token reached {other}:{rogue.port}: {done}"
    assert done.returncode == 3, done
    # And under --insecure too: that flag covers the endpoints the operator named, not the
    # addresses node records name.
    done = ultractl(tmp_path, "status", "--insecure")
    assert rogue.agent.tokens == [], f"the token reached {other}:{rogue.port}: {done}"


def test_another_host_without_tls_needs_insecure(serve: Any, tmp_path: Path) -> None:
    other = non_loopback_address()
    agent = serve(FakeAgent("plain"), other)
    endpoint = f"{other}:{agent.port}"
    done = ultractl(tmp_path, "--endpoint", endpoint, "status")
    assert done.returncode == 2, done
    assert endpoint in done.stderr and "--insecure" in done.stderr, done.stderr
    assert agent.agent.seen == [], "nothing is sent to a refused endpoint"
    # The operator accepts clear text for the endpoint they named.
    done = ultractl(tmp_path, "--endpoint", endpoint, "--insecure", "status")
    assert done.returncode == 0, done.stderr
    assert agent.agent.tokens == [f"Bearer {TOKEN}"]
