"""parallel.reproducible through the daemon: kill -9 of one of three agents mid-run, and the
committed losses and the final weights equal a dp=1 run of the same job bit for bit.

The same cluster as test_training_recovery.py (real etcd, agents and persistent workers): dp 3
until the kill, then the survivors restore at dp 2 (the newest in-memory snapshot they can
assemble, the dead node's shard from its buddy, else the last checkpoint) and finish. Without the
mode the two runs agree within 1e-4; with it, exactly.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from daemon.cli.local import LocalCluster, _call
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.integration.conftest import wait_until
from tests.integration.test_training_recovery import committed_steps
from tests.launch import final_model_state, run_trainer
from tests.processes import running

pytestmark = pytest.mark.integration
STEPS, KILL_AT = 20, 10


def weights(ckpt: Path, tmp: Path) -> dict[str, bytes]:
    tmp.mkdir(parents=True, exist_ok=True)
    return {n: t.contiguous().numpy().tobytes() for n, t in final_model_state(ckpt, tmp).items()}


def test_kill_one_agent_equals_the_dp1_run(token_file: Path, tmp_path: Path):
    job_text = small_job_text(
        token_file,
        train={"steps": STEPS},
        parallel={"reproducible": True},
        checkpoint={"dir": "ckpt", "every": 4},
    )
    job = tmp_path / "job.toml"
    job.write_text(job_text)
    output = tmp_path / "output"
    steps_file = output / "steps.jsonl"
    with running(LocalCluster(tmp_path / "state", nodes=3, devices_per_node=1, ttl=2)) as cluster:
        token = cluster.token_file.read_text().strip()
        _call(
            cluster,
            token,
            "SubmitJob",
            pb.SubmitJobRequest(spec_toml=job_text, overrides=[f'job.output_dir="{output}"']),
        )
        wait_until(
            lambda: max(committed_steps(steps_file), default=0) >= KILL_AT,
            180,
            f"step {KILL_AT}",
            0.1,
        )
        cluster.agents["node-2"].send_signal(signal.SIGKILL)
        wait_until(
            lambda: _call(cluster, token, "GetStatus", pb.GetStatusRequest()).finished,
            240,
            "the job to finish",
            0.25,
        )
    committed = committed_steps(steps_file)
    assert sorted(committed) == list(range(1, STEPS + 1))
    assert {r["world_size"] for r in committed.values()} == {3, 2}

    reference = run_trainer(
        job, None, "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "dp1")
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert {s: r["loss"] for s, r in committed.items()} == {
        s: r["loss"] for s, r in reference.steps.items()
    }
    last = f"step_{STEPS:08d}"
    daemon_run = weights(output / "ckpt" / last, tmp_path / "daemon")
    assert daemon_run == weights(tmp_path / "dp1" / last, tmp_path / "reference")
