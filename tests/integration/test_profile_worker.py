"""`[profile]` under ultrad: an agent's persistent worker writes the window's trace too (the
torchrun entry is tests/distributed/test_profile.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.cli.local import LocalCluster
from tests.integration.conftest import wait_until
from tests.integration.test_hang_stacks import submit
from tests.integration.test_training_recovery import committed_steps
from tests.processes import running

pytestmark = pytest.mark.integration


def test_an_agents_worker_writes_the_profile_window(tmp_path: Path, token_file: Path) -> None:
    output = tmp_path / "output"
    trace = output / "profile" / "rank_0" / "steps_2-3.pt.trace.json"
    with running(LocalCluster(tmp_path / "state", nodes=1, devices_per_node=1, ttl=2)) as cluster:
        submit(cluster, token_file, output, profile={"steps": [2, 3]})
        wait_until(lambda: trace.exists() and len(committed_steps(output / "steps.jsonl")) >= 4,
                   120, "the trace of steps 2-3")
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted(e["name"] for e in events if e["name"].startswith("train_step#"))
    assert steps == ["train_step#2", "train_step#3"]
    assert any(e["name"] == "aten::mm" for e in events)
