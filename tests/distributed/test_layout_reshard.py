"""Reshard-resume across layouts: a dp2 x tp2 checkpoint continues the curve at dp4, tp4, pp2 x dp2.

DCP reshards model and optimizer state by global offsets, so it does not matter whether the
state was a 2-D FSDP2 + TP DTensor (ZeRO-3), a ZeRO-1 dp-sharded moment or a pipeline stage's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import small_job_text
from tests.launch import RunResult, run_trainer

pytestmark = pytest.mark.distributed
RTOL = 1e-5
STEPS = 12
# As in test_tp_zero_recompute: tp = 4 needs 4 KV heads; eps 1e-6 keeps Adam from amplifying
# reduction-order noise on noise-level gradient elements.
SECTIONS = {"model": {"num_key_value_heads": 4}, "train": {"eps": 1e-6}}
SOURCE = {"tp": 2, "sequence_parallel": True, "zero": 3}


def write_job(root: Path, token_file: Path, parallel: dict) -> Path:
    job = root / "job.toml"
    job.write_text(small_job_text(token_file, **SECTIONS, parallel=parallel))
    return job


@pytest.fixture(scope="module")
def uninterrupted(token_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """12 steps at dp2 x tp2 (SP, ZeRO-3: 2-D FSDP2 + TP) with checkpoints at steps 6 and 12."""
    root = tmp_path_factory.mktemp("dp2tp2")
    job = write_job(root, token_file, SOURCE)
    ckpt = root / "ckpt"
    result = run_trainer(
        job, 4, "--steps", str(STEPS), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "6"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    return ckpt, result


def assert_continues(resumed: RunResult, full: RunResult, first: int, last: int, dp: int) -> None:
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(resumed.steps) == list(range(first, last + 1))
    for step, rec in resumed.steps.items():
        assert rec["dp"] == dp
        assert rec["consumed_samples"] == full.steps[step]["consumed_samples"] == step * 10
        assert rec["loss"] == pytest.approx(full.steps[step]["loss"], rel=RTOL), f"step {step}"


def resume(job: Path, nproc: int, ckpt: Path, stop_at: int, every: int) -> RunResult:
    return run_trainer(
        job,
        nproc,
        "--steps",
        str(stop_at),
        "--resume",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(every),
    )


@pytest.mark.parametrize(
    ("parallel", "dp"),
    [
        pytest.param({"zero": 3}, 4, id="dp4"),
        pytest.param({"tp": 4, "sequence_parallel": True}, 1, id="tp4"),
        pytest.param({"pp": 2}, 2, id="pp2-dp2"),
    ],
)
def test_resume_at_another_layout(parallel, dp, uninterrupted, token_file, tmp_path):
    ckpt, full = uninterrupted
    shutil.copytree(ckpt / "step_00000006", tmp_path / "ckpt" / "step_00000006")
    job = write_job(tmp_path, token_file, parallel)
    resumed = resume(job, 4, tmp_path / "ckpt", STEPS, 6)
    assert_continues(resumed, full, first=7, last=STEPS, dp=dp)
    assert "loaded" in resumed.stderr and "step_00000006" in resumed.stderr


def test_zero1_state_round_trips(uninterrupted, token_file, tmp_path):
    """2-D FSDP2 state -> ZeRO-1 at dp4 (steps 7-9) -> its ZeRO-1 state -> dp2 x tp2 (10-12)."""
    ckpt, full = uninterrupted
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt / "step_00000006", dst / "step_00000006")
    zero1 = resume(write_job(tmp_path, token_file, {"zero": 1}), 4, dst, 9, 3)
    assert_continues(zero1, full, first=7, last=9, dp=4)
    back = tmp_path / "back"
    back.mkdir()
    resumed = resume(write_job(back, token_file, SOURCE), 4, dst, STEPS, 6)
    assert_continues(resumed, full, first=10, last=STEPS, dp=2)
    assert "step_00000009" in resumed.stderr
