"""Daemon pieces that need no etcd: auth, flags, config contexts, state machine, supervisor."""

from __future__ import annotations

import asyncio
import logging
import socket
import stat
from pathlib import Path

import pytest

from daemon.api.auth import AuthError, check_listen, load_or_create_token
from daemon.cli.ctlconfig import Context, ContextError, load_context, save_context
from daemon.cli.ultrad import UsageError, _parser, build_config, resolve_options
from daemon.control.etcd_server import EtcdServer
from daemon.control.keys import Keys
from daemon.control.records import NodeRecord
from daemon.node.supervisor import Supervisor, WorkerExit
from daemon.procutil import free_ports
from daemon.state import AgentState, StateMachine

pytestmark = pytest.mark.unit


def test_token_is_generated_once_with_0600(tmp_path: Path) -> None:
    token, path = load_or_create_token(None, tmp_path / "state")
    assert len(token) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_token(None, tmp_path / "state") == (token, path)
    given = tmp_path / "given"
    given.write_text("abc\n")
    given.chmod(0o600)
    assert load_or_create_token(given, tmp_path / "other")[0] == "abc"
    with pytest.raises(AuthError, match="--token-file"):
        load_or_create_token(tmp_path / "missing", tmp_path)


@pytest.mark.parametrize("address", ["127.0.0.1:1", "localhost:1", "[::1]:1", "unix:/tmp/s"])
def test_loopback_listen_needs_no_tls(address: str) -> None:
    check_listen(address, tls=False, insecure=False)


def test_non_loopback_listen_needs_tls_or_insecure() -> None:
    with pytest.raises(AuthError, match="--insecure"):
        check_listen("0.0.0.0:7400", tls=False, insecure=False)
    check_listen("0.0.0.0:7400", tls=True, insecure=False)
    check_listen("10.1.2.3:7400", tls=False, insecure=True)


def test_flags_fall_back_to_env_then_config_file(tmp_path: Path) -> None:
    config = tmp_path / "ultrad.toml"
    config.write_text('devices = 4\nnode_id = "from-file"\nttl = 7\n')
    args = _parser().parse_args(["--config", str(config), "--node-id", "from-flag"])
    opts = resolve_options(args, {"ULTRA_ETCD": "127.0.0.1:2379", "ULTRA_TTL": "3"})
    assert opts["node_id"] == "from-flag" and opts["devices"] == 4 and opts["ttl"] == 3
    cfg = build_config(opts)
    assert cfg.etcd == "127.0.0.1:2379" and cfg.workers is True
    with pytest.raises(UsageError, match="--devices is required"):
        resolve_options(_parser().parse_args(["--etcd", "h:1"]), {})
    with pytest.raises(UsageError, match="--devices must be int"):
        resolve_options(_parser().parse_args(["--etcd", "h:1", "--devices", "x"]), {})
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 1\n")
    with pytest.raises(UsageError, match="unknown key"):
        resolve_options(_parser().parse_args(["--config", str(bad)]), {})
    opts = resolve_options(_parser().parse_args(["--etcd", "nohost", "--devices", "1"]), {})
    with pytest.raises(UsageError, match="--etcd"):
        build_config(opts)
    assert cfg.device_memory == 0  # unknown unless told
    opts = resolve_options(_parser().parse_args(
        ["--etcd", "h:1", "--devices", "1", "--device-memory", "80000000000"]), {})
    assert build_config(opts).device_memory == 80_000_000_000
    opts = resolve_options(_parser().parse_args(
        ["--etcd", "h:1", "--devices", "1", "--device-memory", "-1"]), {})
    with pytest.raises(UsageError, match=r"--device-memory must be in \[0, 2\*\*50\]"):
        build_config(opts)


def test_contexts_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ultrascale" / "config"
    assert load_context(path) is None
    save_context(path, Context("local", "127.0.0.1:1", "/t"))
    save_context(path, Context("prod", "10.0.0.1:7400", "/p"), make_current=False)
    assert load_context(path) == Context("local", "127.0.0.1:1", "/t")
    assert load_context(path, "prod").endpoint == "10.0.0.1:7400"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ContextError, match="no context 'nope'"):
        load_context(path, "nope")


def test_state_machine_logs_each_transition_once(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[AgentState, AgentState]] = []
    sm = StateMachine(lambda old, new, _reason: seen.append((old, new)))
    with caplog.at_level(logging.INFO, logger="daemon.state"):
        assert sm.to(AgentState.WAITING, "joined")
        assert not sm.to(AgentState.WAITING, "joined again")
        assert sm.to(AgentState.RUNNING, "generation 1")
    assert seen == [(AgentState.JOINING, AgentState.WAITING),
                    (AgentState.WAITING, AgentState.RUNNING)]
    assert len([r for r in caplog.records if "->" in r.getMessage()]) == 2


def test_keys_and_records() -> None:
    keys = Keys("job-1")
    assert keys.node("a") == b"/ultrascale/job-1/nodes/a"
    assert keys.relative(keys.generation) == "generation"
    with pytest.raises(ValueError, match="job"):
        Keys("../etc")
    record = NodeRecord("a", "h:1", "http://h:2/metrics", 2)
    assert NodeRecord.from_json(record.to_json()) == record
    with pytest.raises(ValueError, match="node state"):
        record.with_state("asleep")


def test_supervisor_spawns_reports_deaths_and_stops(tmp_path: Path) -> None:
    """A worker gets the documented env, dies with a reported exit, and stops on request."""
    worker = tmp_path / "envworker.py"
    worker.write_text(
        "import json, os, sys, time\n"
        "keys = ('ULTRA_AGENT_SOCKET', 'ULTRA_LOCAL_RANK', 'ULTRA_NODE_ID',\n"
        "        'TORCH_DISABLE_SHARE_RDZV_TCP_STORE', 'TORCHELASTIC_ERROR_FILE')\n"
        "out = os.path.join(os.path.dirname(__file__), f\"env-{os.environ['ULTRA_LOCAL_RANK']}\")\n"
        "json.dump({k: os.environ.get(k) for k in keys}, open(out, 'w'))\n"
        "sys.exit(3) if os.environ['ULTRA_LOCAL_RANK'] == '1' else time.sleep(60)\n"
    )
    exits: list[WorkerExit] = []

    async def scenario() -> None:
        sup = Supervisor("n1", tmp_path / "agent.sock", tmp_path / "logs", exits.append,
                         worker_module="envworker", extra_env={"PYTHONPATH": str(tmp_path)})
        assert await sup.ensure([0, 1]) == [0, 1]
        for _ in range(200):
            if exits and (tmp_path / "env-0").exists():
                break
            await asyncio.sleep(0.05)
        assert await sup.ensure([0]) == []  # alive: not respawned
        await sup.stop(grace=2)
        assert sup.alive() == {}

    asyncio.run(scenario())
    import json

    env = json.loads((tmp_path / "env-0").read_text())
    assert env["ULTRA_LOCAL_RANK"] == "0" and env["ULTRA_NODE_ID"] == "n1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["ULTRA_AGENT_SOCKET"] == str(tmp_path / "agent.sock")
    died = [e for e in exits if e.local_rank == 1]
    assert died and died[0].returncode == 3 and not died[0].expected
    stopped = [e for e in exits if e.local_rank == 0]
    assert stopped and stopped[0].expected


def test_a_worker_that_crashes_leaves_its_python_stacks(tmp_path: Path) -> None:
    """A worker that dies of SIGSEGV (a crash in C code: here a read of address 0) has written
    its Python stacks to the agent's file first; the supervisor reports them with the exit. A
    worker killed by SIGKILL writes nothing, and an earlier SIGUSR1 answer is not a crash's."""
    worker = tmp_path / "crashworker.py"
    worker.write_text(
        "import ctypes, os, signal, time\n"
        "import trainer.stack_dump  # armed from ULTRA_STACKS_FD, as trainer.worker imports it\n"
        "def inside_a_collective():\n"
        "    ctypes.string_at(0)\n"
        "if os.environ['ULTRA_LOCAL_RANK'] == '0':\n"
        "    inside_a_collective()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.3)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root = Path(__file__).resolve().parents[2]
    exits: list[WorkerExit] = []

    async def scenario() -> None:
        sup = Supervisor("n1", tmp_path / "agent.sock", tmp_path / "logs", exits.append,
                         worker_module="crashworker",
                         extra_env={"PYTHONPATH": f"{tmp_path}:{root}"})
        assert await sup.ensure([0, 1]) == [0, 1]
        for _ in range(400):
            if len(exits) == 2:
                break
            await asyncio.sleep(0.025)
        await sup.stop(grace=0)

    asyncio.run(scenario())
    by_rank = {e.local_rank: e for e in exits}
    crashed, killed = by_rank[0], by_rank[1]
    assert crashed.returncode == -11 and not crashed.expected, crashed
    assert crashed.stacks.startswith("Fatal Python error: Segmentation fault"), crashed.stacks
    assert "in inside_a_collective" in crashed.stacks and "crashworker.py" in crashed.stacks
    assert killed.returncode == -9 and killed.stacks == "", killed
    # The SIGUSR1 answer is in rank 1's file all the same: it was written, not reported.
    assert "crashworker.py" in (tmp_path / "logs" / "worker-1.stacks").read_text()


def test_standby_worker_takes_a_dead_workers_rank(tmp_path: Path) -> None:
    """The standby (trainer.standby's protocol) takes a local rank that lost its worker: the
    rank's log, error file and environment; it is no rank's failure if it dies unadopted; and
    stop() ends it too."""
    worker = tmp_path / "standbyworker.py"
    worker.write_text(
        "import os, sys, time\n"
        "from trainer.standby import await_role, is_standby\n"
        "if is_standby(os.environ):\n"
        "    print('waiting', flush=True)\n"
        "    if await_role(sys.stdin.buffer) is None:\n"
        "        sys.exit(0)\n"
        "print('rank', os.environ['ULTRA_LOCAL_RANK'], os.environ['TORCHELASTIC_ERROR_FILE'],\n"
        "      flush=True)\n"
        "sys.exit(5) if os.environ['ULTRA_LOCAL_RANK'] == '0' and os.environ.get('DIE') else 0\n"
        "time.sleep(60)\n"
    )
    root = Path(__file__).resolve().parents[2]
    exits: list[WorkerExit] = []
    logs = tmp_path / "logs"

    async def until(predicate, what: str) -> None:
        for _ in range(400):
            if predicate():
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"timed out waiting for {what}")

    async def scenario() -> None:
        sup = Supervisor("n1", tmp_path / "agent.sock", logs, exits.append,
                         worker_module="standbyworker", standby=True,
                         extra_env={"PYTHONPATH": f"{tmp_path}:{root}", "DIE": "1"})
        await sup.keep_standby()
        standby = sup.standby_pid()
        assert standby is not None and sup.alive() == {}
        await until(lambda: "waiting" in (logs / "worker-standby.log").read_text(), "standby")
        await sup.keep_standby()
        assert sup.standby_pid() == standby  # one at a time
        assert await sup.ensure([0], adopt=0) == [0]
        assert sup.alive() == {0: standby} and sup.standby_pid() is None
        # It runs as rank 0 (which this script makes exit 5): a failure of rank 0.
        await until(lambda: exits, "rank 0's exit")
        assert exits[0].local_rank == 0 and exits[0].returncode == 5 and not exits[0].expected
        text = (logs / "worker-0.log").read_text()
        assert f"rank 0 {logs / 'worker-0.error.json'}" in text
        # No standby now: a new process for rank 0; then a new standby, which stop() ends.
        sup.extra_env.pop("DIE")
        assert await sup.ensure([0], adopt=0) == [0] and sup.alive()[0] != standby
        await sup.keep_standby()
        second = sup.standby_pid()
        assert second not in (None, standby)
        await sup.drop_standby()  # the job is over: it exits at the end of its input
        await until(lambda: sup.standby_pid() is None, "the standby to exit")
        await sup.keep_standby()
        assert sup.standby_pid() not in (None, second)
        await sup.stop(grace=2)
        assert sup.alive() == {} and sup.standby_pid() is None
        assert [e.local_rank for e in exits] == [0, 0]  # the standby's end is no rank's exit

    asyncio.run(scenario())


def test_free_ports_are_distinct() -> None:
    # Closed one by one, the kernel can hand the same port out twice in a row (it did: etcd's
    # client and peer port once came out equal and etcd could not start).
    for _ in range(50):
        ports = free_ports(3)
        assert len(set(ports)) == 3 and all(ports)


def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    # Outgoing connections take their source ports from that range: a port picked there, then
    # released until etcd restarts on it, was once taken in between (EADDRINUSE on restart).
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(50):
        for port in free_ports(3):
            assert 1024 <= port < first_ephemeral
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # and free: the check bound it


def test_etcd_ports_differ_and_keep_what_is_set(tmp_path: Path) -> None:
    for _ in range(50):
        server = EtcdServer(tmp_path)
        server.choose_ports()
        assert server.client_port and server.peer_port and server.client_port != server.peer_port
    preset = free_ports(1)[0]
    for _ in range(20):
        server = EtcdServer(tmp_path, client_port=preset)
        server.choose_ports()
        assert server.client_port == preset and server.peer_port not in (0, preset)
