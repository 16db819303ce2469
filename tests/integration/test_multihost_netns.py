"""Three hosts that are not loopback: one network namespace per host on a bridge (tests/netns.py),
etcd on the bridge, and on each host an agent started as in production: `--listen
0.0.0.0:7400` with no `--advertise-host`, its own state directory (so its own admin token),
mutual TLS with a certificate carrying its address (one CA, made here with `openssl`). Workers
run in their agent's namespace; the checkpoint directory is one directory of the root
filesystem, shared by every host as a cluster filesystem would be.

node-2 starts first and leads; ranks are assigned in node order, so rank 0 is on node-0, a
host that is not the leader's. Mid-run every process of node-0's host is SIGKILLed. The job
must finish (reported by the new rank 0's agent, node-1, while node-2 still leads: progress
needs no leader's credentials), with every step committed, consumed_samples exact, and the
committed losses equal within 1e-6 relative to torchrun replaying the same layout history
(tests/chaos/replay.py). Along the way: the published addresses are the hosts' own, never the
wildcard, and each worker's gloo is bound to its host's interface.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from daemon.control.etcd_server import EtcdServer, EtcdServerTLS
from daemon.procutil import parent_death_env, terminate
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests import netns
from tests.chaos.replay import compare, replay, segments
from tests.chaos.runner import committed, consistency_problems, generation_history, read_lines
from tests.conftest import REPO, small_job_text
from tests.integration.conftest import wait_until
from tests.pki import make_ca
from tests.processes import worker_pids

pytestmark = pytest.mark.integration

NODES = ("node-0", "node-1", "node-2")
FIRST = "node-2"  # started alone first, so it leads
VICTIM = "node-0"  # rank 0's host in the first generation
PORT = 7400  # every host listens on the same production port: each has its own network
STEPS, EVERY, KILL_AFTER = 12, 3, 4
TTL = 5  # ultrad's default: like the production command line, the test passes no --ttl
DEADLINE_S = 300.0  # a bound for a hung run, not a performance expectation


# -- certificates ------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def make_certs(root: Path, names: dict[str, str]) -> Path:
    """One CA and, per name, `<name>.pem`/`<name>.key` signed by it, with subjectAltName
    IP:<address> when an address is given (a client-only certificate has none)."""
    root.mkdir(parents=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=ultrascale test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=root)
    for name, address in names.items():
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=root)
        ext = root / f"{name}.ext"
        ext.write_text("extendedKeyUsage=serverAuth,clientAuth\n"
                       + (f"subjectAltName=IP:{address}\n" if address else ""))
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name,
                 cwd=root)
    return root


# -- the cluster -------------------------------------------------------------------------------


@dataclass
class HostAgent:
    node: str
    host: netns.Host
    state_dir: Path
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"{self.host.address}:{PORT}"

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text().strip()

    @property
    def log(self) -> str:
        return (self.state_dir / "ultrad.log").read_text(errors="replace")


@dataclass
class NetnsCluster:
    root: Path
    hosts: netns.Hosts
    etcd: EtcdServer
    certs: Path
    agents: dict[str, HostAgent]
    etcd_args: list[str] = field(default_factory=list)  # default: --etcd <etcd.endpoint>

    def start(self, node: str, *extra: str) -> HostAgent:
        host = self.hosts[node]
        state = self.root / node
        state.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **parent_death_env())
        # The production command line, less nothing: no --insecure, no --advertise-host, no
        # shared --token-file.
        args = ["ip", "netns", "exec", host.netns, sys.executable, "-m", "daemon.cli.ultrad",
                *(self.etcd_args or ["--etcd", self.etcd.endpoint]), "--node-id", node,
                "--devices", "1",
                "--listen", f"0.0.0.0:{PORT}", "--metrics-listen", "127.0.0.1:9400",
                "--state-dir", str(state), "--tls-cert", str(self.certs / f"{node}.pem"),
                "--tls-key", str(self.certs / f"{node}.key"),
                "--tls-ca", str(self.certs / "ca.pem"), "--job", "netns", *extra]
        with (state / "ultrad.log").open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=REPO, env=env)
        agent = HostAgent(node, host, state, proc)
        self.agents[node] = agent
        wait_until(lambda: (state / "agent.json").exists() or proc.poll() is not None, 90,
                   f"agent {node} to start")
        assert proc.poll() is None, f"agent {node} exited:\n{agent.log[-3000:]}"
        return agent

    def call(self, node: str, method: str, request: Any, timeout: float = 10.0) -> Any:
        """An admin RPC to `node`'s agent: its address, its own token, the operator's
        client certificate."""
        agent = self.agents[node]
        creds = grpc.ssl_channel_credentials((self.certs / "ca.pem").read_bytes(),
                                             (self.certs / "operator.key").read_bytes(),
                                             (self.certs / "operator.pem").read_bytes())
        with grpc.secure_channel(agent.address, creds) as channel:
            return getattr(pb_grpc.AgentStub(channel), method)(
                request, timeout=timeout, metadata=(("authorization", f"Bearer {agent.token}"),))

    def live(self) -> list[str]:
        return [n for n, a in self.agents.items() if a.proc.poll() is None]

    def status(self) -> pb.Status | None:
        for node in self.live():
            try:
                return self.call(node, "GetStatus", pb.GetStatusRequest())
            except grpc.RpcError:
                continue
        return None

    def kill_host(self, node: str) -> list[int]:
        """SIGKILL every process in the host's network namespace: a machine dying."""
        listed = subprocess.run(["ip", "netns", "pids", self.hosts[node].netns],
                                capture_output=True, text=True, check=True).stdout.split()
        pids = [int(p) for p in listed]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        self.agents[node].proc.wait()
        return pids

    def stop(self) -> None:
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
        for agent in self.agents.values():
            terminate(agent.proc, timeout=3 * TTL)
        # Anything left in a namespace (a worker that outlived its agent) dies before the
        # namespaces are deleted.
        for host in self.hosts.hosts.values():
            listed = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True,
                                    text=True).stdout.split()
            for pid in listed:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    continue
        self.etcd.stop()

    def logs(self, tail: int = 2500) -> str:
        out = []
        for node, agent in self.agents.items():
            out.append(f"--- {node}/ultrad.log\n{agent.log[-tail:]}")
            for path in sorted((agent.state_dir / "logs").glob("worker-*.log")):
                out.append(f"--- {node}/{path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)


@pytest.fixture
def netns_cluster(tmp_path: Path) -> Iterator[NetnsCluster]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    if shutil.which("openssl") is None:
        pytest.skip("the `openssl` command is not installed (certificates for mTLS)")
    with netns.Hosts(list(NODES)) as hosts:
        certs = make_certs(tmp_path / "certs", {**{n: hosts[n].address for n in NODES},
                                                "operator": ""})
        etcd = EtcdServer(tmp_path / "etcd", host=hosts.bridge_address).start()
        cluster = NetnsCluster(tmp_path, hosts, etcd, certs, {})
        try:
            yield cluster
        finally:
            cluster.stop()


def worker_env(agent: HostAgent) -> dict[str, str]:
    pid = worker_pids(agent.proc.pid)[0]
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_three_hosts_mtls_own_tokens_kill_rank0_host(netns_cluster: NetnsCluster,
                                                     token_file: Path, tmp_path: Path) -> None:
    c = netns_cluster
    c.start(FIRST)
    wait_until(lambda: c.call(FIRST, "GetStatus", pb.GetStatusRequest()).leader == FIRST, 60,
               f"{FIRST} to lead")
    for node in NODES:
        if node != FIRST:
            c.start(node)
    assert len({a.token for a in c.agents.values()}) == len(NODES), "tokens are per agent"
    # Submit only once every node is registered, so the first plan has all three.
    wait_until(lambda: len(c.call(FIRST, "ListNodes", pb.ListNodesRequest()).nodes) == 3, 60,
               "three registered nodes")

    # Published addresses: each host's own, on the port it listens on; never 0.0.0.0.
    nodes = {n.node: n for n in c.call(FIRST, "ListNodes", pb.ListNodesRequest()).nodes}
    assert {n: nodes[n].address for n in NODES} == {n: c.agents[n].address for n in NODES}

    output = tmp_path / "output"
    # Hang detection stays on but is slack: on a loaded 2-core machine six torch processes
    # starve a restoring worker's heartbeat thread for seconds, and a false "hang" would only
    # add generations; the fault under test is a death, seen at once through gloo.
    job = small_job_text(token_file, job={"name": "netns"}, train={"steps": STEPS},
                         checkpoint={"dir": "checkpoints", "every": EVERY, "keep": 2},
                         fault={"heartbeat_timeout_s": 30, "hang_floor_s": 30})
    c.call(FIRST, "SubmitJob", pb.SubmitJobRequest(
        spec_toml=job, overrides=[f'job.output_dir="{output}"']))
    steps_file = output / "steps.jsonl"
    try:
        wait_until(lambda: any(x["step"] >= KILL_AFTER and x["world_size"] == 3
                               for x in read_lines(steps_file)), DEADLINE_S,
                   f"step {KILL_AFTER} committed by three ranks")
        first_plan = json.loads(c.call(FIRST, "GetPlan", pb.GetPlanRequest()).plan_json)
        assert first_plan["store"]["host"] == c.hosts[FIRST].address
        assert first_plan["ranks"][0]["node"] == VICTIM
        gloo = {n: worker_env(c.agents[n]).get("GLOO_SOCKET_IFNAME") for n in NODES}
        assert gloo == dict.fromkeys(NODES, "eth0")

        killed = c.kill_host(VICTIM)
        assert c.agents[VICTIM].proc.pid in killed

        def finished() -> pb.Status | None:
            status = c.status()
            if status is not None and status.state == "failed":
                raise AssertionError(f"the job failed: {status.reason}")
            return status if status is not None and status.state == "finished" else None
        status = wait_until(finished, DEADLINE_S, "the job to finish", interval=0.25)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.logs()}") from None

    assert status.step == STEPS
    last_plan = json.loads(c.call(FIRST, "GetPlan", pb.GetPlanRequest()).plan_json)
    # `finished` came from rank 0's agent on node-1, not from the leader.
    assert status.leader == FIRST and last_plan["ranks"][0]["node"] == "node-1"
    assert VICTIM not in {r["node"] for r in last_plan["ranks"]}

    lines = read_lines(steps_file)
    assert consistency_problems(lines, STEPS) == []  # every step, consumed_samples exact
    assert any(x["world_size"] == 2 for x in lines), "no step after the kill on the survivors"
    history = generation_history(c.etcd.endpoint, "netns")
    assert history == sorted(set(history)), f"a generation number written twice: {history}"

    result = replay(job, segments(lines), tmp_path / "replay")
    diff = compare(committed(lines), result, rtol=1e-6)
    assert diff.mismatches == [], diff.mismatches


# -- etcd by the DaemonSet's names -------------------------------------------------------------

K8S_NAMESPACE = "ultrascale"
ETCD_NAMES = [f"etcd-{i}.etcd.{K8S_NAMESPACE}.svc" for i in range(3)]


@pytest.fixture
def named_etcd_cluster(tmp_path: Path) -> Iterator[NetnsCluster]:
    """Two hosts that reach etcd as the DaemonSet does: `https://etcd-N.etcd.<ns>.svc`, names
    that resolve in each host's namespace (its own /etc/hosts). etcd-0 is a member that is
    down (its name resolves to the host itself, where nothing listens on etcd's port); the
    other two names lead to the running etcd, whose certificate carries all three names."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    if shutil.which("openssl") is None:
        pytest.skip("the `openssl` command is not installed (certificates for TLS)")
    nodes = ["node-0", "node-1"]
    with netns.Hosts(nodes) as hosts:
        certs = make_certs(tmp_path / "certs", {**{n: hosts[n].address for n in nodes},
                                                "operator": ""})
        ca = make_ca(tmp_path / "etcd-ca", "etcd")
        # The bridge address too: the test's own health check dials it.
        server = ca.issue("etcd-server", san=",".join(
            [*(f"DNS:{n}" for n in ETCD_NAMES), f"IP:{hosts.bridge_address}"]))
        client = ca.issue("etcd-client")
        etcd = EtcdServer(tmp_path / "etcd", host=hosts.bridge_address,
                          tls=EtcdServerTLS(server.cert, server.key, ca.cert)).start()
        for node in nodes:
            hosts.resolve(node, {ETCD_NAMES[0]: hosts[node].address,
                                 **dict.fromkeys(ETCD_NAMES[1:], hosts.bridge_address)})
        endpoints = ",".join(f"https://{n}:{etcd.client_port}" for n in ETCD_NAMES)
        etcd_args = ["--etcd", endpoints, "--etcd-ca", str(ca.cert), "--etcd-cert",
                     str(client.cert), "--etcd-key", str(client.key)]
        cluster = NetnsCluster(tmp_path, hosts, etcd, certs, {}, etcd_args)
        try:
            yield cluster
        finally:
            cluster.stop()


def test_agents_join_through_the_daemonsets_etcd_names(
        named_etcd_cluster: NetnsCluster) -> None:
    c = named_etcd_cluster
    for node in ("node-0", "node-1"):
        c.start(node, "--no-workers")
    expected = {n: c.agents[n].address for n in ("node-0", "node-1")}

    def members(node: str) -> dict[str, str]:
        return {n.node: n.address for n in c.call(node, "ListNodes", pb.ListNodesRequest()).nodes}
    try:
        for node in expected:
            wait_until(lambda: members(node) == expected, 60,  # noqa: B023 - called at once
                       f"{node} to see both agents, registered through etcd's DNS names")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.logs()}") from None
    # The member that is down was tried, and said so with its name and gRPC's reason.
    dead = f"https://{ETCD_NAMES[0]}:{c.etcd.client_port}"
    for agent in c.agents.values():
        warned = [line for line in agent.log.splitlines() if " WARNING " in line and dead in line]
        assert warned and "refused" in warned[0].lower(), agent.log[-3000:]
