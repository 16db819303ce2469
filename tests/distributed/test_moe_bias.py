"""Auxiliary-loss-free balancing (model.router_bias_update_rate) against one process (fp32):
the per-expert routing bias moves the same way at ep 2 (each rank routing its own samples to
both ranks' experts, the load summed over them) as in one process, is
checkpointed with the model, and a resume at another ep continues the single-process curve."""

from __future__ import annotations

import shutil

import pytest

from tests.compare import assert_params_close
from tests.distributed.reference import reference_results
from tests.distributed.test_moe_ep import MOE, STEPS, _assert_steps, _job
from tests.launch import final_model_state, run_trainer

pytestmark = pytest.mark.distributed

# A rate large enough to change which experts the tiny router picks within a few steps.
BIASED = MOE | {"router_bias_update_rate": 0.05}


@pytest.fixture(scope="module")
def biased_job(tmp_path_factory, token_file):
    return _job(tmp_path_factory, token_file, BIASED)


@pytest.fixture(scope="module")
def biased_reference(biased_job):
    results, params = reference_results(biased_job, STEPS)
    return {step: r.loss for step, r in results.items()}, params, results


def test_the_bias_changes_the_routing(tmp_path_factory, token_file, biased_reference) -> None:
    """Not vacuous: the same job without the bias routes differently after a few steps (step 1
    starts from a zero bias: identical)."""
    plain, _ = reference_results(_job(tmp_path_factory, token_file, MOE), STEPS)
    _, params, biased = biased_reference
    assert plain[1].expert_load == biased[1].expert_load
    assert any(plain[s].expert_load != biased[s].expert_load for s in range(2, STEPS + 1))
    assert any(params[k].abs().max() > 0 for k in params if k.endswith("expert_bias"))


def test_ep2_moves_the_bias_as_one_process(biased_job, biased_reference, tmp_path) -> None:
    _, ref_params, _ = biased_reference
    ckpt = tmp_path / "ckpt"
    result = run_trainer(biased_job, 2, "--steps", str(STEPS), "--set", "parallel.ep=2",
                         "--set", "parallel.zero=2", "--checkpoint-dir", str(ckpt),
                         "--checkpoint-every", str(STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_steps(result.steps, biased_reference)
    state = final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path)
    assert {k for k in state if k.endswith("expert_bias")} == {
        "layers.0.mlp.expert_bias", "layers.1.mlp.expert_bias"}
    assert_params_close(state, ref_params, 1e-5)


def test_a_resume_at_another_ep_restores_the_bias(biased_job, biased_reference, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    first = run_trainer(biased_job, 2, "--steps", "3", "--set", "parallel.ep=2",
                        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpt / "step_00000003", resumed / "step_00000003")
    result = run_trainer(biased_job, 4, "--steps", str(STEPS), "--resume", "--set",
                         "parallel.ep=4", "--checkpoint-dir", str(resumed))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_steps(result.steps, biased_reference, first=4)
