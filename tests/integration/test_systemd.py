"""ultrad under systemd: the unit file, the notify protocol, and SIGTERM.

- `systemd-analyze verify` on deploy/systemd/ultrad.service (a copy whose ExecStart names this
  checkout's `ultrad`, since the unit's /opt path does not exist here);
- a real `ultrad` against a real etcd, notifying through a real datagram socket (an abstract
  one, as systemd's own): READY only once it holds its lease, STATUS as its state changes,
  WATCHDOG while healthy, STOPPING on SIGTERM (tests/unit/test_sdnotify.py blocks the loop
  and kills a task);
- SIGTERM to every agent of a 32-agent control-plane cluster: each leaves cleanly (its lease
  revoked, not expired) and exits 0 within 2 × TTL, three rounds in a row.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from daemon.cli.ultrad import _parser as ultrad_parser
from daemon.cli.ultrad import build_config, resolve_options
from daemon.control.etcd_server import EtcdServer
from daemon.control.keys import Keys
from daemon.procutil import parent_death_env, terminate
from tests.integration.conftest import (
    ROOT,
    TINY_JOB,
    AgentProc,
    Cluster,
    etcd_call,
    wait_until,
)
from tests.pki import make_ca

pytestmark = pytest.mark.integration

UNIT = ROOT / "deploy" / "systemd" / "ultrad.service"


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    ultrad = Path(sys.executable).with_name("ultrad")
    assert ultrad.exists(), f"{ultrad} missing: run `make install`"
    text = UNIT.read_text()
    assert "ExecStart=/opt/ultrascale/.venv/bin/ultrad " in text
    unit = tmp_path / "ultrad.service"
    unit.write_text(text.replace("ExecStart=/opt/ultrascale/.venv/bin/ultrad ",
                                 f"ExecStart={ultrad} "))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr
    for line in ("Type=notify", "Restart=on-failure", "KillMode=mixed", "WatchdogSec=",
                 "TimeoutStopSec="):
        assert line in text, line


def test_example_agent_config_is_valid(tmp_path: Path) -> None:
    # The example as shipped, with its /etc/ultrad/tls paths pointing at real test PEM files:
    # ultrad reads each one at start and names the flag of any it cannot use.
    ca = make_ca(tmp_path / "pki", "example")
    agent_pair = ca.issue("agent")
    paths = {"/etc/ultrad/tls/agent.crt": agent_pair.cert, "/etc/ultrad/tls/agent.key":
             agent_pair.key, "/etc/ultrad/tls/ca.crt": ca.cert}
    text = UNIT.with_name("agent.toml").read_text()
    for shipped, real in paths.items():
        assert f'"{shipped}"' in text, shipped
        text = text.replace(f'"{shipped}"', f'"{real}"')
    config = tmp_path / "agent.toml"
    config.write_text(text)
    opts = resolve_options(ultrad_parser().parse_args(["--config", str(config)]), {})
    agent = build_config(opts)
    assert agent.devices == 8 and agent.tls is not None and agent.ttl == 5


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
