"""`[profile] steps = [2, 3]`: with 2 ranks (tests/forkrun.py) each rank writes a Chrome trace
holding exactly those steps' work; work between the window's steps is not recorded; a window
a failure interrupts is closed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.job import ProfileConfig
from tests.conftest import small_job_text
from tests.launch import run_trainer
from trainer.profiling import StepProfiler, trace_path

pytestmark = pytest.mark.distributed


def test_profile_window_records_only_its_steps(token_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file, job={"output_dir": str(out)},
                                  train={"steps": 4}, profile={"steps": [2, 3], "ranks": "all"}))
    result = run_trainer(job, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.steps) == [1, 2, 3, 4]
    for rank in (0, 1):
        trace = out / "profile" / f"rank_{rank}" / "steps_2-3.pt.trace.json"
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
                 if e["name"].startswith("train_step#")}
        assert sorted(steps) == ["train_step#2", "train_step#3"], sorted(steps)
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        assert any(e["name"] == "aten::mm" for e in ops)
        outside = [e["name"] for e in ops
                   if not any(lo - 1 <= e["ts"] and e["ts"] + e["dur"] <= hi + 1
                              for lo, hi in steps.values())]
        assert not outside, f"rank {rank}: ops recorded outside steps 2-3: {outside[:10]}"
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["rank_0", "rank_1"]
    assert [p.name for p in (out / "profile" / "rank_0").iterdir()] == ["steps_2-3.pt.trace.json"]


def _trace_ops(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e["name"] for e in events if e.get("ph") == "X"]


def test_work_between_the_window_steps_is_not_recorded(tmp_path: Path) -> None:
    """Steps multiply; between steps (agreement, snapshots in a worker) the loop adds."""
    profiler = StepProfiler(ProfileConfig(steps=(2, 3)), 0, tmp_path, torch.device("cpu"))
    a = torch.ones(8, 8)
    for step in range(1, 5):
        with profiler.step(step):
            a @ a
        torch.add(a, a)
    names = _trace_ops(trace_path(tmp_path, 0, 2, 3))
    assert [n for n in names if n.startswith("train_step#")] == ["train_step#2", "train_step#3"]
    assert names.count("aten::mm") == 2 and "aten::add" not in names


def test_a_step_failing_inside_the_window_closes_it(tmp_path: Path) -> None:
    profiler = StepProfiler(ProfileConfig(steps=(1, 2)), 0, tmp_path, torch.device("cpu"))
    with pytest.raises(RuntimeError), profiler.step(1):
        raise RuntimeError("a peer died")
    assert not torch.autograd.profiler._is_profiler_enabled  # a next generation can profile
    assert not trace_path(tmp_path, 0, 1, 2).exists()
