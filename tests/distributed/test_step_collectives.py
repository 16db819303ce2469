"""A step run by the worker issues exactly the collectives of the bare training loop.

The agent's requests ride on the step's own agreement (trainer.agreement), so the worker adds
no collective per step. Counted, not assumed: every `torch.distributed` collective call of each
rank is counted (bench/collectives/sitecustomize.py) in runs of 3 and 6 steps of each arm; the
difference over the 3 extra steps is the steady per-step count (start-up, restore and the
final checkpoint cancel out).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.job import load
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import REPO, small_job_text, worker_env
from tests.distributed.fake_agent import FakeAgent, run_workers, tail

pytestmark = pytest.mark.distributed
WORLD = 2
COUNTER = REPO / "bench" / "collectives"


def _counting(out: Path) -> dict[str, str]:
    out.mkdir(parents=True)
    return {"ULTRA_COUNT_COLLECTIVES": str(out), "PYTHONPATH": f"{COUNTER}:{REPO}"}


def _per_rank(out: Path) -> list[dict[str, int]]:
    """The counts of the processes that made collectives (the ranks), in no particular order."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _total(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for rank in counts:
        for name, n in rank.items():
            total[name] = total.get(name, 0) + n
    return total


def _job(tmp_path: Path, token_file: Path, steps: int) -> Path:
    path = tmp_path / f"job{steps}.toml"
    path.write_text(small_job_text(token_file, train={"steps": steps},
                                   job={"output_dir": str(tmp_path / f"out{steps}")}))
    return path


def _bare(tmp_path: Path, token_file: Path, steps: int) -> dict[str, int]:
    out = tmp_path / f"bare{steps}"
    env = worker_env() | _counting(out)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={WORLD}", "-m", "trainer", "--config",
         str(_job(tmp_path / "bare", token_file, steps)), "--log-format", "json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = _per_rank(out)
    assert len(counts) == WORLD, counts
    return _total(counts)


def _worker(tmp_path: Path, token_file: Path, steps: int) -> dict[str, int]:
    out = tmp_path / f"worker{steps}"
    logs = tmp_path / f"logs{steps}"
    logs.mkdir(parents=True)
    job = load(_job(tmp_path / "worker", token_file, steps))
    env = {rank: _counting(out / str(rank)) for rank in range(WORLD)}
    with FakeAgent(job, WORLD, generations=1, on_step=lambda g, r: pb.StepReply()) as agent:
        codes = run_workers(agent, logs, env)
    assert codes == [0] * WORLD, tail(logs)
    assert len(agent.requests("ReportStep")) == WORLD * steps
    counts = [c for rank in range(WORLD) for c in _per_rank(out / str(rank))]
    assert len(counts) == WORLD, counts
    return _total(counts)


def _per_step(more: dict[str, int], fewer: dict[str, int], steps: int) -> dict[str, float]:
    names = set(more) | set(fewer)
    diff = {n: (more.get(n, 0) - fewer.get(n, 0)) / steps / WORLD for n in sorted(names)}
    return {n: d for n, d in diff.items() if d}


def test_a_worker_step_issues_the_collectives_of_the_bare_loop(tmp_path, token_file):
    (tmp_path / "bare").mkdir()
    (tmp_path / "worker").mkdir()
    bare = _per_step(_bare(tmp_path, token_file, 6), _bare(tmp_path, token_file, 3), 3)
    worker = _per_step(_worker(tmp_path, token_file, 6), _worker(tmp_path, token_file, 3), 3)
    assert bare.get("all_reduce", 0) >= 1, bare  # the counter sees the step's collectives
    assert worker == bare, f"per step and rank: worker {worker}, bare loop {bare}"
