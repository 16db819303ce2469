"""Before the watchdog kills a hung worker it asks for its Python stacks; they go to the agent log
and into the failure event. A stopped worker cannot answer: it is killed without waiting, and the
event says there are no stacks.

Real etcd, a real agent and a real worker. The Python hang is trainer/fault_injection.py's
`injected_hang` (a sleep loop after a step): its heartbeat thread keeps beating, so the
progress deadline finds it. The stopped worker is SIGSTOPped: its heartbeat goes silent.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest

from daemon.cli.local import LocalCluster, _call
from daemon.node.stacks import STACKS_WAIT_S
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.integration.conftest import wait_for_members, wait_until
from tests.integration.test_crash_loop import ctl
from tests.integration.test_training_recovery import committed_steps
from tests.processes import Held, running, worker_pids

pytestmark = pytest.mark.integration
HANG_AT, HEARTBEAT_TIMEOUT_S = 3, 3.0


def submit(cluster: LocalCluster, token_file: Path, output: Path, **sections: dict) -> None:
    token = cluster.token_file.read_text().strip()
    wait_for_members(cluster, token, 1)
    job_text = small_job_text(token_file, train={"steps": 400}, **sections)
    _call(cluster, token, "SubmitJob",
          pb.SubmitJobRequest(spec_toml=job_text, overrides=[f'job.output_dir="{output}"']))


def failure_event(cluster: LocalCluster) -> str:
    """`ultractl events` once it shows a hang failure (its line and the indented stack after)."""
    def hang_failure() -> str:
        out = ctl(cluster, "events").stdout
        return out if "hang failure" in out else ""
    return wait_until(hang_failure, 120, "a hang failure event")


def test_a_worker_hung_in_python_is_killed_with_its_stacks(
        tmp_path: Path, token_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ULTRA_FAULT_HANG_AT_STEP", str(HANG_AT))  # agents pass it to workers
    state = tmp_path / "state"
    with running(LocalCluster(state, nodes=1, devices_per_node=1, ttl=2)) as cluster:
        submit(cluster, token_file, tmp_path / "output",
               fault={"hang_floor_s": 2, "hang_step_factor": 1})
        events = failure_event(cluster)
        agent_log = (state / "node-0" / "ultrad.log").read_text()
    # The stack names the function the worker hangs in, and the step loop that called it.
    assert "in injected_hang" in events and "in _train" in events, events
    assert "no progress" in events, events
    logged = agent_log[agent_log.index("stacks:"):]
    assert "in injected_hang" in logged and "in _train" in logged, agent_log[-3000:]
    stacks_file = state / "node-0" / "logs" / "worker-0.stacks"
    assert stat.S_IMODE(stacks_file.stat().st_mode) == 0o600


def test_a_stopped_worker_is_killed_in_time_without_stacks(tmp_path: Path,
                                                          token_file: Path) -> None:
    state, output = tmp_path / "state", tmp_path / "output"
    with running(LocalCluster(state, nodes=1, devices_per_node=1, ttl=2)) as cluster:
        submit(cluster, token_file, output, fault={"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S})
        wait_until(lambda: len(committed_steps(output / "steps.jsonl")) >= 2, 120,
                   "two committed steps")
        agent = cluster.agents["node-0"].pid
        [pid] = wait_until(lambda: worker_pids(agent) or None, 10, "the worker")
        stopped_at = time.monotonic()
        worker = Held([pid])
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: not worker.running(), 60, "the stopped worker to be killed")
        worker.close()
        took = time.monotonic() - stopped_at
        events = failure_event(cluster)
        agent_log = (state / "node-0" / "ultrad.log").read_text()
    # Detected within heartbeat_timeout_s of the stop (the last beat came before it), checked
    # four times a second; a stopped worker's stacks are not waited for, and no wait exceeds
    # STACKS_WAIT_S. The last second is slack for a loaded machine.
    assert took < HEARTBEAT_TIMEOUT_S + STACKS_WAIT_S + 1.0, took
    assert "no stacks: the worker is stopped" in events, events
    assert "no stacks: the worker is stopped" in agent_log
