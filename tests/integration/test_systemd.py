"""ultrad under systemd: the unit file, the notify protocol, and SIGTERM.

- `systemd-analyze verify` on deploy/systemd/ultrad.service (a copy whose ExecStart names this
  checkout's `ultrad`, since the unit's /opt path does not exist here), and its least
  privilege: `systemd-analyze security` at most 4.5, an unprivileged user (from
  ultrascale.sysusers), no capabilities, GPU and RDMA devices only, a private snapshot dir;
- the example configurations: agent.toml (etcd over https with a client certificate) and
  etcd.conf.yml run by a real etcd (certificates required on both ports);
- a real `ultrad` against a real etcd, notifying through a real datagram socket (an abstract
  one, as systemd's own): READY only once it holds its lease, STATUS as its state changes,
  WATCHDOG while healthy, STOPPING on SIGTERM (tests/unit/test_sdnotify.py blocks the loop
  and kills a task);
- SIGTERM to every agent of a 32-agent control-plane cluster: each leaves cleanly (its lease
  revoked, not expired) and exits 0 within 2 × TTL, three rounds in a row.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from daemon.cli.ultrad import _parser as ultrad_parser
from daemon.cli.ultrad import build_config, resolve_options
from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.etcd_security import EtcdSecurity
from daemon.control.etcd_server import EtcdServer, etcd_binary
from daemon.control.keys import Keys
from daemon.procutil import die_with_parent_prefix, free_ports, parent_death_env, terminate
from tests.integration.conftest import (
    ROOT,
    TINY_JOB,
    AgentProc,
    Cluster,
    etcd_call,
    wait_until,
)
from tests.pki import make_ca, require_openssl

pytestmark = pytest.mark.integration

UNIT = ROOT / "deploy" / "systemd" / "ultrad.service"


def _analyze() -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return analyze


def _unit_copy(tmp_path: Path) -> Path:
    """The unit with its ExecStart naming this checkout's `ultrad` (the /opt path does not
    exist on a test machine, and systemd-analyze checks it)."""
    ultrad = Path(sys.executable).with_name("ultrad")
    assert ultrad.exists(), f"{ultrad} missing: run `make install`"
    text = UNIT.read_text()
    assert "ExecStart=/opt/ultrascale/.venv/bin/ultrad " in text
    unit = tmp_path / "ultrad.service"
    unit.write_text(text.replace("ExecStart=/opt/ultrascale/.venv/bin/ultrad ",
                                 f"ExecStart={ultrad} "))
    return unit


def _settings() -> dict[str, list[str]]:
    """The [Service] section as systemd reads it: a key may repeat, "" resets it."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out[key] = [] if value == "" else [*out.get(key, []), value]
    return out


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = _analyze()
    unit = _unit_copy(tmp_path)
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr
    text = UNIT.read_text()
    for line in ("Type=notify", "Restart=on-failure", "KillMode=mixed", "WatchdogSec=",
                 "TimeoutStopSec="):
        assert line in text, line


EXPOSURE_MAX = 4.5


def test_unit_exposure_is_at_most_4_5(tmp_path: Path) -> None:
    analyze = _analyze()
    unit = _unit_copy(tmp_path)
    result = subprocess.run([analyze, "security", "--offline=true", str(unit)],
                            capture_output=True, text=True, timeout=60)
    if "--offline" in result.stderr:
        pytest.skip(f"this systemd-analyze has no --offline (systemd >= 250): {result.stderr}")
    score = re.search(r"Overall exposure level for ultrad\.service: (\d+\.\d+)", result.stdout)
    assert score, result.stdout + result.stderr
    open_items = "\n".join(line for line in result.stdout.splitlines() if "\u2717" in line)
    assert float(score.group(1)) <= EXPOSURE_MAX, f"exposure {score.group(1)}:\n{open_items}"


def test_unit_runs_unprivileged_with_only_gpu_and_rdma_devices() -> None:
    s = _settings()
    assert s.get("User") == ["ultrascale"] and "DynamicUser" not in s
    assert s["CapabilityBoundingSet"] == [] and "AmbientCapabilities" not in s
    assert s["NoNewPrivileges"] == ["yes"]
    assert s["DevicePolicy"] == ["closed"]
    assert s["DeviceAllow"] == ["char-nvidia* rw", "char-infiniband_verbs rw"]
    assert "PrivateDevices" not in s  # it would hide the GPUs
    # Snapshots: a directory of this unit alone, owned by its user, 0700 (docs/systemd.md).
    assert s["RuntimeDirectory"] == ["ultrascale"] and s["RuntimeDirectoryMode"] == ["0700"]
    assert s["ExecStart"][0].endswith(" --snapshot-dir %t/ultrascale")
    assert s["StateDirectoryMode"] == ["0700"] and s["UMask"] == ["0077"]


def test_the_sysusers_file_creates_the_units_user(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    subprocess.run([sysusers, f"--root={tmp_path}", str(UNIT.with_name("ultrascale.sysusers"))],
                   check=True, capture_output=True, timeout=60)
    users = {line.split(":")[0]: line.split(":") for line in
             (tmp_path / "etc" / "passwd").read_text().splitlines()}
    (user,) = _settings()["User"]
    name, _, uid, gid, _, home, shell = users[user]
    assert 0 < int(uid) < 1000 and home == "/var/lib/ultrad" and shell.endswith("nologin")
    groups = {line.split(":")[0]: line.split(":")[2]
              for line in (tmp_path / "etc" / "group").read_text().splitlines()}
    assert groups[_settings()["Group"][0]] == gid


def test_example_agent_config_is_valid(tmp_path: Path) -> None:
    # The example as shipped, with its /etc/ultrad paths pointing at real test PEM files:
    # ultrad reads each one at start and names the flag of any it cannot use.
    ca = make_ca(tmp_path / "pki", "example")
    agent_pair = ca.issue("agent")
    etcd_ca = make_ca(tmp_path / "etcd-pki", "etcd")
    etcd_client = etcd_ca.issue("ultrascale-agent")
    paths = {"/etc/ultrad/tls/agent.crt": agent_pair.cert, "/etc/ultrad/tls/agent.key":
             agent_pair.key, "/etc/ultrad/tls/ca.crt": ca.cert,
             "/etc/ultrad/etcd/ca.crt": etcd_ca.cert, "/etc/ultrad/etcd/tls.crt":
             etcd_client.cert, "/etc/ultrad/etcd/tls.key": etcd_client.key}
    text = UNIT.with_name("agent.toml").read_text()
    for shipped, real in paths.items():
        assert f'"{shipped}"' in text, shipped
        text = text.replace(f'"{shipped}"', f'"{real}"')
    config = tmp_path / "agent.toml"
    config.write_text(text)
    opts = resolve_options(ultrad_parser().parse_args(["--config", str(config)]), {})
    agent = build_config(opts)
    assert agent.devices == 8 and agent.tls is not None and agent.ttl == 5
    # etcd: https only, verified against etcd's CA, with the agents' client certificate.
    assert all(e.startswith("https://") for e in opts["etcd"].split(","))
    assert (opts["etcd_ca"], opts["etcd_cert"], opts["etcd_key"]) == (
        str(etcd_ca.cert), str(etcd_client.cert), str(etcd_client.key))


def _locked_out(endpoint: str, security: EtcdSecurity) -> None:
    async def go() -> None:
        client = Etcd(endpoint, timeout=3, security=security)
        try:
            await client.put(b"/ultrascale/t/spec", b"x")
        except ETCD_ERRORS:
            return
        finally:
            await client.close()
        raise AssertionError(f"etcd at {endpoint} served a client with {security}")
    asyncio.run(go())


def test_example_etcd_config_requires_certificates(tmp_path: Path) -> None:
    """deploy/systemd/etcd.conf.yml run by a real etcd (hosts mapped to loopback, files to
    make-certs.sh's output): no client or peer without a certificate of its own CA."""
    require_openssl()
    certs = tmp_path / "certs"
    subprocess.run(["sh", str(ROOT / "deploy" / "etcd" / "make-certs.sh"), str(certs)],
                   check=True, capture_output=True, timeout=120,
                   env={**os.environ, "EXTRA_SANS": "IP:127.0.0.1", "MEMBER_NAMES":
                        " ".join(f"etcd-{i}.example.internal" for i in range(3))})
    config = yaml.safe_load(UNIT.with_name("etcd.conf.yml").read_text())
    ports = dict(zip((2379, 2380, 2381), free_ports(3), strict=True))
    files = {"/etc/etcd/tls/server": certs / "etcd-server-tls",
             "/etc/etcd/tls/peer": certs / "etcd-peer-tls"}

    def local(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        if not isinstance(value, str):
            return value
        if str(Path(value).parent) in files:
            return str(files[str(Path(value).parent)] / Path(value).name)
        return re.sub(r"(https?)://[^:/,]+:(\d+)",
                      lambda m: f"{m.group(1)}://127.0.0.1:{ports[int(m.group(2))]}", value)

    for side in ("client-transport-security", "peer-transport-security"):
        assert config[side]["client-cert-auth"] is True, side
    assert config["enable-grpc-gateway"] is False
    config = {k: local(v) for k, v in config.items()}
    config["data-dir"] = str(tmp_path / "data")
    config["initial-cluster"] = config["initial-cluster"].split(",")[0]
    config["unsafe-no-fsync"] = True  # test speed only
    (tmp_path / "etcd.conf.yml").write_text(yaml.safe_dump(config))
    with (tmp_path / "etcd.log").open("ab") as log:
        proc = subprocess.Popen([*die_with_parent_prefix(), str(etcd_binary()), "--config-file",
                                 str(tmp_path / "etcd.conf.yml")], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[2381]}/health",
                                            timeout=1) as resp:
                    return bool(json.loads(resp.read()).get("health") == "true")
            except (urllib.error.URLError, OSError, ValueError):
                return False
        wait_until(healthy, 30, "the example etcd to be healthy")
        endpoint = config["advertise-client-urls"]
        assert endpoint.startswith("https://")
        client_ca = certs / "ca" / "ca.crt"
        _locked_out(endpoint, EtcdSecurity(ca=client_ca))
        peer = certs / "etcd-peer-tls"
        _locked_out(endpoint, EtcdSecurity(ca=client_ca, cert=peer / "tls.crt",
                                           key=peer / "tls.key"))
        # agent.toml's three files are make-certs.sh's ultrad-etcd-client/.
        agent = certs / "ultrad-etcd-client"
        security = EtcdSecurity(ca=agent / "ca.crt", cert=agent / "tls.crt",
                                key=agent / "tls.key")

        async def put_get() -> bytes:
            client = Etcd(endpoint, timeout=5, security=security)
            try:
                await client.put(b"/ultrascale/t/spec", b"ok")
                got = await client.get(b"/ultrascale/t/spec")
                return got.value if got else b""
            finally:
                await client.close()
        assert asyncio.run(put_get()) == b"ok"
        # The peer port: the agents' certificate is of the client CA, not the peer CA.
        context = ssl.create_default_context(cafile=str(certs / "peer-ca" / "ca.crt"))
        context.load_cert_chain(str(agent / "tls.crt"), str(agent / "tls.key"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(f"https://127.0.0.1:{ports[2380]}/version", timeout=5,
                                   context=context).close()
    finally:
        terminate(proc)


# -- the notify protocol ----------------------------------------------------------------------


class Listener:
    """An abstract AF_UNIX datagram socket, as systemd's NOTIFY_SOCKET."""

    def __init__(self) -> None:
        self.name = f"@ultrad-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.messages: list[list[str]] = []

    def poll(self, timeout: float = 0.1) -> list[str]:
        self.sock.settimeout(timeout)
        try:
            message = self.sock.recv(4096).decode().split("\n")
        except TimeoutError:
            return []
        self.messages.append(message)
        return message

    def wait(self, what: str, timeout: float = 60) -> list[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            message = self.poll()
            if any(field.startswith(what) for field in message):
                return message
        raise AssertionError(f"no {what!r} within {timeout}s; got {self.messages}")

    def seen(self, what: str) -> bool:
        return any(f.startswith(what) for m in self.messages for f in m)


def test_notify_protocol_through_a_real_socket(cluster: Cluster) -> None:
    listener = Listener()
    try:
        # etcd frozen: the agent starts and listens but cannot get a lease, so no READY yet.
        assert cluster.etcd.proc is not None
        cluster.etcd.proc.send_signal(signal.SIGSTOP)
        try:
            agent = cluster.start("n1", env={"NOTIFY_SOCKET": listener.name,
                                             "WATCHDOG_USEC": "1000000"})
            end = time.monotonic() + 3 * 2  # a few lease TTLs (2 s) of trying
            while time.monotonic() < end:
                listener.poll()
            assert not listener.seen("READY=1"), listener.messages
        finally:
            cluster.etcd.proc.send_signal(signal.SIGCONT)
        ready = listener.wait("READY=1")
        status = next(f for f in ready if f.startswith("STATUS="))
        lease = int(status.rsplit(" ", 1)[1], 16)
        key = Keys(cluster.job_ns).node("n1")
        held = etcd_call(cluster.etcd.endpoint, lambda c: c.get(key))
        assert held is not None and held.lease == lease, (held, status)

        cluster.submit(TINY_JOB)
        listener.wait("STATUS=running")
        before = sum(m == ["WATCHDOG=1"] for m in listener.messages)
        end = time.monotonic() + 60
        while sum(m == ["WATCHDOG=1"] for m in listener.messages) < before + 3:
            assert time.monotonic() < end, "no WATCHDOG=1 while healthy"
            listener.poll()

        # Control plane only, so not in a running job: SIGTERM stops at once, exit 0.
        agent.proc.send_signal(signal.SIGTERM)
        listener.wait("STOPPING=1")
        end = time.monotonic() + 60
        while agent.proc.poll() is None and time.monotonic() < end:
            listener.poll()
        assert agent.proc.poll() == 0, agent.log
        order = [f for m in listener.messages for f in m if f in ("READY=1", "STOPPING=1")]
        assert order[0] == "READY=1" and order.count("READY=1") == 1, order
    finally:
        listener.sock.close()


# -- SIGTERM to a whole control-plane cluster ------------------------------------------------

AGENTS = 32
ROUNDS = 3
TTL = 5  # generous on a loaded 2-core machine; the property checked is "within 2 × TTL"


def _start_agents(root: Path, etcd: EtcdServer, token: Path, round_: int
                  ) -> dict[str, subprocess.Popen[bytes]]:
    procs = {}
    for i in range(AGENTS):
        node = f"r{round_}n{i:02d}"
        state = root / node
        state.mkdir(parents=True)
        with (state / "ultrad.log").open("ab") as log:
            procs[node] = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli.ultrad", "--etcd", etcd.endpoint,
                 "--node-id", node, "--devices", "1", "--listen", "127.0.0.1:0",
                 "--metrics-listen", "127.0.0.1:0", "--state-dir", str(state),
                 "--token-file", str(token), "--ttl", str(TTL), "--job", f"round{round_}",
                 "--no-workers"],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), **parent_death_env()})
    return procs


def _members(etcd: EtcdServer, keys: Keys) -> int:
    kvs, _ = etcd_call(etcd.endpoint, lambda c: c.get_prefix(keys.nodes))
    return len(kvs)


def _sigterm_round(root: Path, etcd: EtcdServer, token: Path, round_: int) -> None:
    procs = _start_agents(root, etcd, token, round_)
    keys = Keys(f"round{round_}")
    try:
        wait_until(lambda: all(p.poll() is None for p in procs.values())
                   and _members(etcd, keys) == AGENTS, 240, f"{AGENTS} agents joined",
                   interval=0.5)
        # A job, so the leader hosts a c10d store (and imports torch for it) as for real.
        first = next(iter(procs))
        cluster = Cluster(etcd, root, token, job_ns=f"round{round_}")
        cluster.agents[first] = AgentProc(first, procs[first], root / first,
                                          json.loads((root / first / "agent.json").read_text()))
        cluster.submit(TINY_JOB)
        sent = time.monotonic()
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        exits: dict[str, tuple[int, float]] = {}
        # Polling every 50 ms costs nothing next to the bound; 4 × TTL only ends a hung test.
        while len(exits) < AGENTS and time.monotonic() - sent < 4 * TTL:
            for node, p in procs.items():
                if node not in exits and p.poll() is not None:
                    exits[node] = (p.returncode, time.monotonic() - sent)
            time.sleep(0.05)
        late = {n: round(t, 1) for n, (_, t) in exits.items() if t > 2 * TTL}
        stuck = sorted(set(procs) - set(exits))
        assert not stuck and not late, \
            f"round {round_}: still running {stuck}, exited after 2×TTL {late}\n" + \
            "".join((root / n / "ultrad.log").read_text()[-2000:] for n in stuck[:2])
        codes = {n: c for n, (c, _) in exits.items() if c != 0}
        assert not codes, f"round {round_}: non-zero exits {codes}"
        # They left (leases revoked), rather than being forgotten after a TTL.
        assert _members(etcd, keys) == 0
    finally:
        for p in procs.values():
            terminate(p, timeout=1)


def test_sigterm_to_every_agent_of_32_exits_within_two_ttl(tmp_path: Path,
                                                           etcd: EtcdServer) -> None:
    token = tmp_path / "token"
    token.write_text("test-token\n")
    token.chmod(0o600)
    for round_ in range(ROUNDS):
        _sigterm_round(tmp_path / f"round{round_}", etcd, token, round_)
