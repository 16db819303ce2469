"""Non-finite steps never commit (trainer/nonfinite.py), on real gloo ranks (tests/forkrun.py).

A NaN loss (or an infinite gradient) injected on ONE rank at one step must make every rank skip
that step's update; the run then stays exact (fp32) against the single-process reference that
skips the same step, whose samples are consumed all the same. The step lines carry the
telemetry: lr equal to the schedule's, grad_norm equal to the reference's, tokens_per_s, and a
null mfu on CPU. Five skipped steps in a row fail the run, naming the step.
"""

from __future__ import annotations

import pytest

from parallel.job import load
from tests.compare import assert_params_close
from tests.distributed.reference import reference_results
from tests.launch import final_model_state, run_trainer
from trainer.fault_injection import NonFiniteInjection
from trainer.loop import learning_rate

pytestmark = pytest.mark.distributed
STEPS = 6
SKIPPED = 3
RTOL = 1e-5
# As tests/distributed/test_tp_zero_recompute.py (which says why): Adam's eps 1e-6 keeps TP's
# reduction-order noise on near-zero gradient elements at float level.
SECTIONS = {"model": {"num_key_value_heads": 4}, "train": {"eps": 1e-6}}


@pytest.mark.parametrize(
    "layout, where, rank, reason, rank0_loss_finite",
    [
        # dp 2: rank 1's NaN loss (and NaN gradients) at step 3; the loss sum carries it.
        ({"dp": 2}, "loss", 1, "nonfinite_loss", False),
        # tp 2: only tp rank 1's loss is NaN: rank 0's loss (which it prints) is finite, yet
        # rank 0 skips too, for the reason only rank 1 saw.
        ({"dp": 1, "tp": 2}, "loss", 1, "nonfinite_loss", True),
        # pp 2: stage 0's gradient alone turns infinite; the loss (stage 1's) is finite.
        ({"dp": 1, "pp": 2}, "grad", 0, "nonfinite_grad", True),
    ],
    ids=["dp2-loss", "tp2-loss", "pp2-grad"],
)
def test_a_nonfinite_step_on_one_rank_is_skipped_on_every_rank(
    layout, where, rank, reason, rank0_loss_finite, small_job, tmp_path, monkeypatch
):
    job = small_job(**SECTIONS, parallel=layout)
    cfg = load(job)
    ref, ref_params = reference_results(
        job, STEPS, NonFiniteInjection(SKIPPED, SKIPPED, where, None))
    assert ref[SKIPPED].skipped == reason  # the reference skips the same step
    monkeypatch.setenv("ULTRA_FAULT_NAN_STEPS", str(SKIPPED))
    monkeypatch.setenv("ULTRA_FAULT_NAN_IN", where)
    monkeypatch.setenv("ULTRA_FAULT_NAN_RANKS", str(rank))
    ckpt = tmp_path / "ckpt"
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    result = run_trainer(job, world, "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
                         "--checkpoint-every", str(STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    for step, rec in result.steps.items():
        r = ref[step]
        assert rec["consumed_samples"] == step * cfg.train.global_batch  # skipped ones too
        assert rec["lr"] == pytest.approx(learning_rate(cfg.train, step - 1), rel=1e-12)
        assert rec["tokens_per_s"] > 0
        assert rec["mfu"] is None  # CPU: no peak in the table
        if step == SKIPPED:
            assert rec["skipped"] == reason, rec
            assert rec["grad_norm"] is None
            assert (rec["loss"] is not None) == rank0_loss_finite, rec
            continue
        assert "skipped" not in rec, rec
        assert rec["loss"] == pytest.approx(r.loss, rel=RTOL), f"step {step}"
        assert rec["grad_norm"] == pytest.approx(r.grad_norm, rel=RTOL), f"step {step}"
    assert_params_close(final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path), ref_params, RTOL)


def test_five_nonfinite_steps_in_a_row_fail_the_run_naming_the_step(
    small_job, tmp_path, monkeypatch
):
    job = small_job(parallel={"dp": 2})
    monkeypatch.setenv("ULTRA_FAULT_NAN_STEPS", "2-6")
    monkeypatch.setenv("ULTRA_FAULT_NAN_RANKS", "0")
    result = run_trainer(job, 2, "--steps", "8")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "step 6 skipped (nonfinite_loss): 5 non-finite steps in a row (steps 2-6) reached " \
           "train.max_skipped_steps=5" in result.stderr, result.stderr[-3000:]
    assert sorted(result.steps) == [1, 2, 3, 4, 5]
    assert all(result.steps[s]["skipped"] == "nonfinite_loss" for s in (2, 3, 4, 5))
