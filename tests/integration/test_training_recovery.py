"""kill -9 of one of three agents mid-run: the survivors re-form and finish exactly.

Real etcd, real agents, real persistent workers (gloo). The committed losses in steps.jsonl
must equal an uninterrupted single-process run within 1e-4 relative (fp32; the summation order
differs between world sizes) and consumed_samples must be exact at every committed step; each
survivor's /metrics shows the new world, exactly one recovery split into phases that add up to
its total, and the time its snapshots and checkpoints blocked the step loop.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.cli.local import LocalCluster, _call
from daemon.recovery_phases import PHASES
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.distributed.reference import reference_run
from tests.integration.conftest import wait_until
from tests.processes import Held, descendants, running, worker_pids

pytestmark = pytest.mark.integration
STEPS, BATCH, KILL_AT = 16, 10, 8


def committed_steps(path: Path) -> dict[int, dict]:
    """The last line written for each step is the committed one."""
    out: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out


def scrape(url: str) -> dict[str, float]:
    """Samples of an agent's /metrics, parsed with prometheus_client's parser, keyed by name,
    or `name{label="value",...}` (labels sorted) for labelled ones."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        sample.name
        + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}"
           if sample.labels else ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def cluster(tmp_path: Path):
    with running(LocalCluster(tmp_path / "state", nodes=3, devices_per_node=1, ttl=2)) as c:
        yield c


def test_kill_one_agent_mid_run(cluster: LocalCluster, token_file: Path, tmp_path: Path):
    job_text = small_job_text(
        token_file, train={"steps": STEPS}, checkpoint={"dir": "ckpt", "every": 4}
    )
    (tmp_path / "job.toml").write_text(job_text)
    output = tmp_path / "output"
    token = cluster.token_file.read_text().strip()
    _call(
        cluster,
        token,
        "SubmitJob",
        pb.SubmitJobRequest(spec_toml=job_text, overrides=[f'job.output_dir="{output}"']),
    )
    steps_file = output / "steps.jsonl"
    wait_until(
        lambda: max(committed_steps(steps_file), default=0) >= KILL_AT, 120, f"step {KILL_AT}", 0.1
    )

    victim = cluster.agents["node-2"]
    assert worker_pids(victim.pid), "node-2 runs a worker"
    orphans = Held(descendants(victim.pid))  # its worker, standby and store process
    victim.send_signal(signal.SIGKILL)
    # The kernel kills them with their agent (PR_SET_PDEATHSIG). What is checked is that none
    # outlives the agent, not how fast a killed process finishes exiting: in one CI run on a
    # loaded machine the worker was still there after 1 s, a former bound.
    wait_until(
        lambda: not orphans.running(), 10.0, "the victim's processes to die with it", 0.02
    )
    orphans.close()

    def finished() -> bool:
        status = _call(cluster, token, "GetStatus", pb.GetStatusRequest())
        return status.finished

    wait_until(finished, 180, "the job to finish", 0.25)
    committed = committed_steps(steps_file)
    assert sorted(committed) == list(range(1, STEPS + 1))
    generations = [json.loads(line) for line in steps_file.read_text().splitlines()]
    before = {r["generation"] for r in generations if r["world_size"] == 3}
    after = {r["generation"] for r in generations if r["world_size"] == 2}
    assert before and after and min(after) > max(before), (
        "a world-2 generation follows the world-3 one"
    )
    assert committed[STEPS]["world_size"] == 2

    for node in ("node-0", "node-1"):
        metrics = scrape(json.loads((cluster.state_dir / node / "agent.json").read_text())["metrics_url"])
        assert metrics["ultra_world_size"] == 2
        assert metrics["ultra_generation"] >= 2
        recovery = {phase: (metrics[f'ultra_recovery_duration_seconds_count{{phase="{phase}"}}'],
                            metrics[f'ultra_recovery_duration_seconds_sum{{phase="{phase}"}}'])
                    for phase in (*PHASES, "total")}
        assert recovery["total"][0] == 1, f"{node}: one failure, one recovery"
        assert 0 < recovery["total"][1] < 60
        for phase, (count, seconds) in recovery.items():
            assert count == 1 and seconds >= 0, f"{node}: {phase} {recovery}"
        assert sum(recovery[p][1] for p in PHASES) == pytest.approx(recovery["total"][1],
                                                                    abs=1e-3), recovery
        # Snapshots every step, a durable checkpoint every 4: each reported with the next step.
        for tier in ("memory", "durable"):
            assert metrics[f'ultra_checkpoint_blocking_seconds_count{{tier="{tier}"}}'] > 0, tier
            assert metrics[f'ultra_checkpoint_blocking_seconds_sum{{tier="{tier}"}}'] > 0, tier
        assert metrics["ultra_train_steps_total"] >= STEPS

    ref_losses, _ = reference_run(tmp_path / "job.toml", STEPS)
    for step, rec in committed.items():
        assert rec["consumed_samples"] == step * BATCH, f"step {step}"
        assert rec["loss"] == pytest.approx(ref_losses[step], rel=1e-4), f"step {step}"
