"""Non-finite steps under the daemon: real etcd, two agents, one worker each.

Global rank 1's loss is NaN at steps 3-7 (trainer/fault_injection.py). Every rank skips those
steps; each skip is counted on both agents' /metrics (`ultra_train_skipped_steps_total`) and is an
event, the step lines and /metrics carry lr and grad_norm (mfu unknown on CPU), and the fifth
skip in a row fails the job at once (no retry: a restore would replay the same steps), its
reason naming the step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from daemon.cli.local import LocalCluster, _call
from parallel.job import loads
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.integration.conftest import wait_for_members, wait_until
from tests.integration.test_crash_loop import ctl
from tests.integration.test_training_recovery import committed_steps, scrape
from tests.processes import running
from trainer.loop import learning_rate

pytestmark = pytest.mark.integration
FIRST, LAST = 3, 7  # five in a row: train.max_skipped_steps' default


@pytest.fixture
def nan_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Agents pass their environment to the workers they start.
    monkeypatch.setenv("ULTRA_FAULT_NAN_STEPS", f"{FIRST}-{LAST}")
    monkeypatch.setenv("ULTRA_FAULT_NAN_RANKS", "1")
    with running(LocalCluster(tmp_path / "state", nodes=2, devices_per_node=1, ttl=2)) as c:
        yield c


def test_skipped_steps_are_counted_evented_and_five_in_a_row_fail_the_job(
        nan_cluster: LocalCluster, token_file: Path, tmp_path: Path) -> None:
    cluster = nan_cluster
    job_text = small_job_text(token_file, train={"steps": 10})
    output = tmp_path / "output"
    token = cluster.token_file.read_text().strip()
    wait_for_members(cluster, token, 2)
    _call(cluster, token, "SubmitJob",
          pb.SubmitJobRequest(spec_toml=job_text, overrides=[f'job.output_dir="{output}"']))

    def state() -> dict:
        result = ctl(cluster, "status", "-o", "json")
        return json.loads(result.stdout) if result.returncode == 0 else {}

    final = wait_until(lambda: (s := state()) and s["state"] == "failed" and s, 240,
                       "the job to fail")
    events = ctl(cluster, "events").stdout
    assert f"step {LAST} skipped (nonfinite_loss)" in final["reason"], final
    assert "train.max_skipped_steps=5" in final["reason"], final
    assert final["generation"] == 1, events  # failed at once: no retry
    assert "skipped on every rank (nonfinite_loss)" in events, events

    train = loads(job_text).train
    steps = committed_steps(output / "steps.jsonl")
    assert sorted(steps) == list(range(1, LAST)), steps
    for step, rec in steps.items():
        assert rec["lr"] == pytest.approx(learning_rate(train, step - 1), rel=1e-12)
        assert rec["mfu"] is None and rec["tokens_per_s"] > 0
        assert (rec.get("skipped") == "nonfinite_loss") == (step >= FIRST), rec
        assert (rec["grad_norm"] is None) == (step >= FIRST), rec
    for node in cluster.agents:
        samples = scrape(json.loads((cluster.state_dir / node / "agent.json").read_text())
                         ["metrics_url"])
        assert samples['ultra_train_skipped_steps_total{reason="nonfinite_loss"}'] == LAST - FIRST
        assert samples['ultra_train_skipped_steps_total{reason="nonfinite_grad"}'] == 0
        assert samples["ultra_train_learning_rate"] == pytest.approx(
            learning_rate(train, LAST - 2), rel=1e-12)  # the last reported step's
        assert samples["ultra_train_grad_norm"] == pytest.approx(steps[FIRST - 1]["grad_norm"],
                                                                 rel=1e-6)
        assert math.isnan(samples["ultra_train_mfu_ratio"])  # CPU: no peak in the table
