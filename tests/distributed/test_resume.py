"""Durable checkpoints: reshard on resume (dp 4 -> 3, 2) and fall back past corrupt ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import small_job_text
from tests.launch import RunResult, run_trainer

pytestmark = pytest.mark.distributed
RTOL = 1e-5


@pytest.fixture(scope="module")
def uninterrupted(
    token_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, RunResult]:
    """12 steps at dp=4 with checkpoints at steps 6 and 12."""
    root = tmp_path_factory.mktemp("dp4")
    job = root / "job.toml"
    job.write_text(small_job_text(token_file))
    result = run_trainer(
        job, 4, "--steps", "12", "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "6"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.steps) == list(range(1, 13))
    return job, root / "ckpt", result


def assert_continues(resumed: RunResult, full: RunResult, first: int, dp: int) -> None:
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(resumed.steps) == list(range(first, 13))
    for step, rec in resumed.steps.items():
        assert rec["dp"] == dp
        assert rec["consumed_samples"] == full.steps[step]["consumed_samples"] == step * 10
        assert rec["loss"] == pytest.approx(full.steps[step]["loss"], rel=RTOL), f"step {step}"


@pytest.mark.parametrize("dp", [3, 2])
def test_resume_on_fewer_ranks_continues_the_curve(dp, uninterrupted, tmp_path):
    job, ckpt, full = uninterrupted
    shutil.copytree(ckpt / "step_00000006", tmp_path / "ckpt" / "step_00000006")
    resumed = run_trainer(
        job,
        dp,
        "--steps",
        "12",
        "--resume",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "6",
    )
    assert_continues(resumed, full, first=7, dp=dp)
    assert "loaded" in resumed.stderr and "step_00000006" in resumed.stderr


def _corrupt_copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def test_truncated_shard_falls_back_to_previous(uninterrupted, tmp_path):
    job, ckpt, full = uninterrupted
    dst = _corrupt_copy(ckpt, tmp_path)
    shard = dst / "step_00000012" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run_trainer(job, None, "--steps", "12", "--resume", "--checkpoint-dir", str(dst))
    assert "step_00000012/__1_0.distcp" in resumed.stderr
    assert "step_00000006" in resumed.stderr
    assert_continues(resumed, full, first=7, dp=1)


def test_missing_manifest_means_no_checkpoint(uninterrupted, tmp_path):
    job, ckpt, full = uninterrupted
    dst = _corrupt_copy(ckpt, tmp_path)
    (dst / "step_00000012" / "manifest.json").unlink()
    resumed = run_trainer(job, None, "--steps", "12", "--resume", "--checkpoint-dir", str(dst))
    assert "step_00000012" in resumed.stderr and "manifest" in resumed.stderr
    assert_continues(resumed, full, first=7, dp=1)


def test_checksum_mismatch_names_the_file(uninterrupted, tmp_path):
    job, ckpt, full = uninterrupted
    dst = _corrupt_copy(ckpt, tmp_path)
    shard = dst / "step_00000012" / "__2_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    resumed = run_trainer(job, None, "--steps", "12", "--resume", "--checkpoint-dir", str(dst))
    assert "checksum mismatch in step_00000012/__2_0.distcp" in resumed.stderr
    assert_continues(resumed, full, first=7, dp=1)
