"""ZeRO-2/3 data parallelism against one process: same losses, same final parameters (fp32)."""

from __future__ import annotations

import pytest

from tests.compare import assert_params_close
from tests.conftest import slow
from tests.distributed.reference import reference_run
from tests.launch import final_model_state, run_trainer

pytestmark = pytest.mark.distributed
STEPS = 10
RTOL = 1e-5
TORCHRUN_CASE = (2, 3)  # (dp, zero)


@pytest.fixture(scope="module")
def reference(token_file, tmp_path_factory):
    from tests.conftest import small_job_text

    path = tmp_path_factory.mktemp("ref") / "job.toml"
    path.write_text(small_job_text(token_file))
    return reference_run(path, STEPS)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("dp", [1, 2, 3, pytest.param(4, marks=slow("dp 2 and 3 cover it"))])
def test_dp_matches_single_process(dp, zero, small_job, tmp_path, reference):
    ref_losses, ref_params = reference
    job = small_job()
    ckpt = tmp_path / "ckpt"
    result = run_trainer(
        job,
        dp,
        "--steps",
        str(STEPS),
        "--set",
        f"parallel.zero={zero}",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(STEPS),
        # One case through the entry as users launch it (torchrun: its launcher and one torch
        # import per rank); the others fork, which gives each rank the same environment.
        launcher="torchrun" if (dp, zero) == TORCHRUN_CASE else "fork",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    for step, rec in result.steps.items():
        assert rec["dp"] == dp
        assert rec["consumed_samples"] == step * 10
        assert rec["loss"] == pytest.approx(ref_losses[step], rel=RTOL), f"step {step}"
    assert_params_close(final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path), ref_params, RTOL)
