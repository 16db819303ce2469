"""ultractl against real agents: an `ultrad local` cluster's context outlives its first agent
(stopped or killed),
a context learns every member through one agent, flags go after the command, and each field
comes from the flag, else the environment, else the context."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.cli.ctlconfig import config_path, load_context, save_context
from daemon.cli.local import LocalCluster
from daemon.procutil import free_port
from tests.integration.conftest import ROOT, TTL, Cluster, wait_until

pytestmark = pytest.mark.integration


def ultractl(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real CLI, with its config file at `config` and no ULTRA_* from the caller."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ULTRA")}
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.ultractl", *args], capture_output=True, text=True,
        timeout=60, cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), "ULTRACTL_CONFIG": str(config), **env})


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalCluster]:
    """What `ultrad local` starts (etcd and three agents), control plane only."""
    cluster = LocalCluster(tmp_path / "local", nodes=3, devices_per_node=1, ttl=TTL,
                           extra_agent_args=["--no-workers"])
    try:
        # Three agents import grpc and etcd's client at once: allow for a loaded machine.
        cluster.start(timeout=120)
        yield cluster
    finally:
        cluster.stop()


def kill(cluster: LocalCluster, node: str) -> None:
    cluster.agents[node].kill()
    cluster.agents[node].wait()


def test_local_context_answers_after_its_first_agent_is_killed(local: LocalCluster,
                                                               tmp_path: Path) -> None:
    config = tmp_path / "config"
    # The context `ultrad local` writes: every agent's endpoint, node-0's first.
    save_context(config, local.context())
    assert config_path({"ULTRACTL_CONFIG": str(config)}) == config
    first = json.loads((local.state_dir / "node-0" / "agent.json").read_text())["address"]
    assert load_context(config, "local").endpoints()[0] == first
    before = ultractl(config, "--context", "local", "status", "-o", "json")
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout)["node"] == "node-0"
    # Stopped, node-0 still accepts TCP but never answers: the next agent is tried alongside.
    local.agents["node-0"].send_signal(signal.SIGSTOP)
    stopped = ultractl(config, "--context", "local", "status", "-o", "json")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["node"] in ("node-1", "node-2")
    kill(local, "node-0")
    after = ultractl(config, "--context", "local", "status", "-o", "json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["node"] in ("node-1", "node-2")


def test_context_learns_every_member_through_one_agent(local: LocalCluster,
                                                       tmp_path: Path) -> None:
    config = tmp_path / "config"
    token = str(local.token_file)
    seed = json.loads((local.state_dir / "node-0" / "agent.json").read_text())["address"]
    made = ultractl(config, "config", "set-context", "seed", "--endpoint", seed,
                    "--token-file", token)
    assert made.returncode == 0, made.stderr
    assert ultractl(config, "config", "use-context", "seed").returncode == 0

    def members() -> list[str]:
        # Agents see each other through etcd's watch: wait until node-0 lists all three.
        result = ultractl(config, "nodes", "-o", "json")
        assert result.returncode == 0, result.stderr
        return sorted(n["address"] for n in json.loads(result.stdout))
    everyone = wait_until(lambda: len(members()) == 3 and members(), 20, "3 members")
    listed = json.loads(ultractl(config, "config", "get-contexts", "-o", "json").stdout)
    assert listed == [{"name": "seed", "current": True, "endpoint": seed,
                       "token-file": token, "discovered": everyone}]
    assert ultractl(config, "config", "get-contexts").stdout.splitlines()[1].split()[:4] == \
        ["*", "seed", seed, "3"]
    # The seed dies: the context still reaches the cluster through a discovered member.
    kill(local, "node-0")
    status = ultractl(config, "status", "-o", "json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["node"] in ("node-1", "node-2")
    # Every agent gone: exit 3, nothing sent, and a message that says so.
    kill(local, "node-1")
    kill(local, "node-2")
    for command in (["status"], ["drain", "node-1"]):
        gone = ultractl(config, *command)
        assert gone.returncode == 3, gone
        assert "cannot reach any agent" in gone.stderr and seed in gone.stderr


def test_flags_after_the_command_and_flag_over_env_over_context(shared_cluster: Cluster,
                                                                tmp_path: Path) -> None:
    c = shared_cluster
    config = tmp_path / "config"
    live, token = c.agents["n2"].address, str(c.token_file)
    dead = f"127.0.0.1:{free_port()}"
    # Every global flag after the command, against a real agent.
    result = ultractl(config, "status", "--endpoint", live, "--token-file", token,
                      "--timeout", "20", "-o", "json", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["node"] == "n2"
    # The environment alone.
    result = ultractl(config, "nodes", "-o", "json", ULTRA_ENDPOINT=live,
                      ULTRA_TOKEN_FILE=token, ULTRA_OUTPUT="yaml")
    assert result.returncode == 0 and len(json.loads(result.stdout)) == 3, result.stderr
    # A context pointing nowhere loses to the environment, the environment to the flag.
    assert ultractl(config, "config", "set-context", "stale", "--endpoint", dead,
                    "--token-file", token).returncode == 0
    assert ultractl(config, "config", "use-context", "stale").returncode == 0
    assert ultractl(config, "status").returncode == 3
    assert ultractl(config, "status", ULTRA_ENDPOINT=live).returncode == 0
    assert ultractl(config, "status", "--endpoint", live, ULTRA_ENDPOINT=dead).returncode == 0
    assert ultractl(config, "status", "--endpoint", dead, ULTRA_ENDPOINT=live).returncode == 3
    # The token: a wrong one from the environment is refused (exit 1), the flag's is used.
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    wrong.chmod(0o600)
    refused = ultractl(config, "status", ULTRA_ENDPOINT=live, ULTRA_TOKEN_FILE=str(wrong))
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert ultractl(config, "status", "--token-file", token, ULTRA_ENDPOINT=live,
                    ULTRA_TOKEN_FILE=str(wrong)).returncode == 0
    # Endpoints from the environment are not the context's: nothing discovered into it.
    assert "discovered" not in context_row(config, "stale")


def context_row(config: Path, name: str) -> dict[str, object]:
    rows = json.loads(ultractl(config, "config", "get-contexts", "-o", "json").stdout)
    return next(r for r in rows if r["name"] == name)
