"""[eval] under the daemon: real etcd, two agents, one worker each. The held-out loss reaches
the step lines (steps.jsonl), both agents' `ultra_eval_loss` and `ultractl events` through
the workers' step reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from daemon.cli.local import LocalCluster, _call
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.integration.conftest import wait_for_members, wait_until
from tests.integration.test_crash_loop import ctl
from tests.integration.test_training_recovery import committed_steps, scrape
from tests.processes import running
from trainer.tokens import write_token_file

pytestmark = pytest.mark.integration
STEPS, EVERY = 4, 2


@pytest.fixture
def cluster(tmp_path: Path):
    with running(LocalCluster(tmp_path / "state", nodes=2, devices_per_node=1, ttl=2)) as c:
        yield c


def test_eval_loss_reaches_the_step_lines_and_the_agents_gauge(
        cluster: LocalCluster, token_file: Path, tmp_path: Path) -> None:
    held_out = tmp_path / "held_out.bin"
    rng = np.random.default_rng(1)
    write_token_file(held_out, (np.cumsum(rng.integers(-3, 4, 5000)) % 64 + 32).astype(np.uint16),
                     vocab_size=256, source="held-out walk", tokenizer="bytes")
    job_text = small_job_text(token_file, train={"steps": STEPS},
                              eval={"path": str(held_out), "every": EVERY, "samples": 5})
    output = tmp_path / "output"
    token = cluster.token_file.read_text().strip()
    wait_for_members(cluster, token, 2)
    _call(cluster, token, "SubmitJob",
          pb.SubmitJobRequest(spec_toml=job_text, overrides=[f'job.output_dir="{output}"']))

    def state() -> dict:
        result = ctl(cluster, "status", "-o", "json")
        return json.loads(result.stdout) if result.returncode == 0 else {}

    wait_until(lambda: (s := state()) and s["state"] == "finished", 240, "the job to finish")
    steps = committed_steps(output / "steps.jsonl")
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    for step, rec in steps.items():
        if step % EVERY:
            assert "eval_loss" not in rec, rec
        else:
            assert 0 < rec["eval_loss"] < math.log(256) + 1, rec
            assert rec["eval_ppl"] == pytest.approx(math.exp(rec["eval_loss"]), rel=1e-12)
    assert steps[2]["eval_loss"] != steps[4]["eval_loss"]  # the model trained in between
    events = ctl(cluster, "events").stdout
    for step in (2, 4):
        assert f"step {step}: eval_loss {steps[step]['eval_loss']:.6g}" in events, events
    for node in cluster.agents:
        samples = scrape(json.loads((cluster.state_dir / node / "agent.json").read_text())
                         ["metrics_url"])
        assert samples["ultra_eval_loss"] == pytest.approx(steps[STEPS]["eval_loss"], rel=1e-12)
