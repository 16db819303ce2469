"""Failures that repeat end: a job whose workers fail at the same step every time is `failed`
with the cause after `fault.max_failures` attempts, visible in `ultractl status -o json` and
`ultractl events`; no fault makes the job re-form the same world forever.

Real etcd, agents and workers; the failure is a real exception raised by every worker after
step 5 (trainer/fault_injection.py), so each new generation restores the step-4 checkpoint and
fails again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.cli.local import LocalCluster, _call
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.integration.conftest import ROOT, wait_for_members, wait_until
from tests.integration.test_training_recovery import committed_steps
from tests.processes import running, worker_pids

pytestmark = pytest.mark.integration
FAIL_AT, MAX_FAILURES = 5, 3


@pytest.fixture
def failing_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Agents pass their environment to the workers they start.
    monkeypatch.setenv("ULTRA_FAULT_FAIL_AT_STEP", str(FAIL_AT))
    with running(LocalCluster(tmp_path / "state", nodes=2, devices_per_node=1, ttl=2)) as c:
        yield c


def ctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    endpoint = ",".join(cluster.endpoints())
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.ultractl", "--endpoint", endpoint, "--token-file",
         str(cluster.token_file), *args],
        capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_same_step_failure_ends_the_job_failed(failing_cluster: LocalCluster, token_file: Path,
                                               tmp_path: Path) -> None:
    cluster = failing_cluster
    job_text = small_job_text(
        token_file, train={"steps": 12}, checkpoint={"dir": "ckpt", "every": 2},
        fault={"max_failures": MAX_FAILURES, "backoff_s": 0.5})
    output = tmp_path / "output"
    token = cluster.token_file.read_text().strip()
    wait_for_members(cluster, token, 2)  # so that generation 1 is the first attempt
    _call(cluster, token, "SubmitJob",
          pb.SubmitJobRequest(spec_toml=job_text, overrides=[f'job.output_dir="{output}"']))

    def state() -> dict:
        result = ctl(cluster, "status", "-o", "json")
        return json.loads(result.stdout) if result.returncode == 0 else {}

    final = wait_until(lambda: (s := state()) and s["state"] == "failed" and s, 180,
                       "the job to fail")
    assert f"at step {FAIL_AT}" in final["reason"], final
    assert f"injected fault at step {FAIL_AT}" in final["reason"], final
    # Exactly `max_failures` worlds tried: the first, then one retry per failure but the last.
    plan = json.loads(ctl(cluster, "plan", "-o", "json").stdout)
    events = ctl(cluster, "events").stdout
    assert plan["generation"] == MAX_FAILURES, events
    assert plan["state"] == "failed"
    # Steps after the failing one were never committed; the ones before were, once each.
    assert max(committed_steps(output / "steps.jsonl")) == FAIL_AT - 1
    assert "job failed" in events and f"injected fault at step {FAIL_AT}" in events, events
    # It stays failed: no new generation is written, and the workers have exited.
    wait_until(lambda: not any(worker_pids(p.pid) for p in cluster.agents.values()), 20,
               "the workers to exit")
    assert state()["generation"] == MAX_FAILURES
