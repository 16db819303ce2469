"""Context parallelism against one process: same losses, same weights.

cp 2 and 4 alone, then with TP, DP and PP around it, up to every dimension at 2 (16 ranks,
opt-in with ULTRA_SLOW=1: about 1.5 minutes on a 2-core machine by itself). The model has 4
query heads and 2 KV heads, so attention is grouped-query on every rank, also at tp 2 (2 and
1). Then bf16 under cp, and a cp checkpoint resumed on a layout without cp.
"""

from __future__ import annotations

import shutil

import pytest

from tests.compare import assert_params_close
from tests.conftest import slow
from tests.distributed.reference import reference_run
from tests.launch import final_model_state, run_trainer

pytestmark = pytest.mark.distributed
STEPS = 4
RTOL = 1e-5
# seq_len 32 = 8 chunks of 4 at cp 4. Adam eps 1e-6 as in test_tp_zero_recompute.py: with
# eps 1e-8 reduction-order noise on an element whose gradient is at noise level moves it by
# up to lr/eps times that noise (its tensor's relative difference then exceeds 1e-5).
SECTIONS = {"train": {"eps": 1e-6}}
# Final parameters under cp: each row's softmax is summed block by block in ring order, and
# Adam's first steps turn order noise on elements whose gradient is near zero into updates of up
# to lr. The reference itself drifts by the same order when only its micro-batch order changes
# (docs/context_parallel.md, "Tolerances"), so weights are held to 2e-5; losses stay at 1e-5.
PARAM_RTOL = 2e-5

SLOW = slow("16 ranks")


@pytest.fixture(scope="module")
def reference(token_file, tmp_path_factory):
    from tests.conftest import small_job_text

    path = tmp_path_factory.mktemp("ref") / "job.toml"
    path.write_text(small_job_text(token_file, **SECTIONS))
    return reference_run(path, STEPS)


@pytest.mark.parametrize(
    ("nproc", "parallel"),
    [
        pytest.param(2, {"cp": 2}, id="cp2"),
        pytest.param(4, {"cp": 4}, id="cp4"),
        # Selective recompute caches the blocks' matmul outputs: the ring must not write to them.
        pytest.param(2, {"cp": 2, "recompute": "selective"}, id="cp2-recompute-selective"),
        pytest.param(4, {"cp": 2, "tp": 2}, id="cp2-tp2",
                     marks=slow("cp2-tp2-sp-zero1-recompute-full covers it")),
        pytest.param(
            4,
            {"cp": 2, "tp": 2, "sequence_parallel": True, "zero": 1, "recompute": "full"},
            id="cp2-tp2-sp-zero1-recompute-full",
        ),
        pytest.param(8, {"dp": 2, "cp": 2, "tp": 2}, id="dp2-cp2-tp2"),
        pytest.param(8, {"pp": 2, "cp": 2, "tp": 2}, id="pp2-cp2-tp2"),
        pytest.param(
            16,
            {"dp": 2, "pp": 2, "cp": 2, "tp": 2},
            id="dp2-pp2-cp2-tp2",
            marks=[pytest.mark.slow, SLOW],
        ),
    ],
)
def test_context_parallel_matches_single_process(nproc, parallel, small_job, tmp_path, reference):
    ref_losses, ref_params = reference
    job = small_job(**SECTIONS, parallel=parallel)
    ckpt = tmp_path / "ckpt"
    result = run_trainer(
        job,
        nproc,
        "--steps", str(STEPS),
        "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", str(STEPS),
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    for step, rec in result.steps.items():
        assert rec["dp"] == parallel.get("dp", 1)
        assert rec["consumed_samples"] == step * 10
        assert rec["loss"] == pytest.approx(ref_losses[step], rel=RTOL), f"step {step}"
    assert_params_close(final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path), ref_params,
                        PARAM_RTOL)


@pytest.mark.parametrize("zero", [3, 1])
def test_bf16_context_parallel_follows_fp32(zero, small_job, reference):
    """FSDP2's bf16 policy (ZeRO-3) and autocast (ZeRO-1): the ring's blocks run in bf16."""
    job = small_job(**SECTIONS, parallel={"cp": 2, "zero": zero, "mixed_precision": "bf16"})
    result = run_trainer(job, 2, "--steps", str(STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    drift = [abs(result.steps[s]["loss"] / reference[0][s] - 1) for s in range(1, STEPS + 1)]
    assert 1e-5 < max(drift) <= 2e-2, drift  # bf16 really ran, and stayed on the fp32 curve


def test_context_parallel_checkpoint_resumes_without_cp(small_job, tmp_path, reference):
    """cp2 x tp2 -> dp2: DCP reshards the (dp x cp, tp) state onto dp alone, same curve."""
    job = small_job(**SECTIONS, parallel={"cp": 2, "tp": 2})
    half = STEPS // 2
    first = run_trainer(
        job, 4, "--steps", str(half), "--checkpoint-dir", str(tmp_path / "cp"),
        "--checkpoint-every", str(half),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    resumed_dir = tmp_path / "dp"
    shutil.copytree(tmp_path / "cp" / f"step_{half:08d}", resumed_dir / f"step_{half:08d}")
    second = run_trainer(
        job, 2, "--steps", str(STEPS), "--resume", "--set", "parallel.cp=1",
        "--set", "parallel.tp=1", "--checkpoint-dir", str(resumed_dir),
        "--checkpoint-every", str(STEPS),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"step_{half:08d}" in second.stderr
    assert sorted(second.steps) == list(range(half + 1, STEPS + 1))
    ref_losses, ref_params = reference
    for step, rec in second.steps.items():
        assert rec["dp"] == 2
        assert rec["loss"] == pytest.approx(ref_losses[step], rel=RTOL), f"step {step}"
    final = final_model_state(resumed_dir / f"step_{STEPS:08d}", tmp_path)
    assert_params_close(final, ref_params, PARAM_RTOL)
