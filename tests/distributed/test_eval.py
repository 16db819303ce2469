"""[eval]: the held-out loss is the same at dp 1, dp 2 x tp 2 and pp 2, equals the model's loss on
the held-out samples computed here, and evaluating changes nothing about training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models import get_spec
from ops.loss import cross_entropy_sum
from parallel.job import load
from tests.compare import assert_params_close
from tests.conftest import slow, small_job_text
from tests.distributed.reference import reference_results
from tests.launch import final_model_state, run_trainer
from trainer.evaluation import open_eval_stream
from trainer.tokens import write_token_file

pytestmark = pytest.mark.distributed
STEPS = 4
RTOL = 1e-5
# 7 held-out samples: padded to 10 slots at dp 1 (micro-batches of 2) and to 12 at dp 2.
EVAL = {"every": 2, "samples": 7}
# Adam eps 1e-6 as in test_tp_zero_recompute.py: TP's reduction order moves a noise-level
# gradient element by up to lr/eps times the noise.
TRAIN = {"eps": 1e-6}
LAYOUTS = {
    "dp1": (None, []),
    "dp2_tp2": (4, ["--set", "parallel.dp=2", "--set", "parallel.tp=2"]),
    "pp2": (2, ["--set", "parallel.pp=2", "--set", "parallel.dp=1"]),
    # Other forward paths, covered by the same code as the three above.
    "cp2": (2, ["--set", "parallel.cp=2", "--set", "parallel.dp=1"]),
    "pp2_zero_bubble": (2, ["--set", "parallel.pp=2", "--set", "parallel.dp=1",
                            "--set", 'parallel.pp_schedule="zero_bubble"', "--set",
                            "parallel.zero=2", "--set", "parallel.micro_batch=1"]),
    "dp2_reproducible": (2, ["--set", "parallel.dp=2", "--set", "parallel.reproducible=true"]),
}
EXTRA = {"cp2", "pp2_zero_bubble", "dp2_reproducible"}


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A token file the training data does not contain: another seeded random walk."""
    rng = np.random.default_rng(1)
    tokens = (np.cumsum(rng.integers(-3, 4, size=20_000)) % 64 + 32).astype(np.uint16)
    path = tmp_path_factory.mktemp("held_out") / "held_out.bin"
    write_token_file(path, tokens, vocab_size=256, source="held-out walk", tokenizer="bytes")
    return path


@pytest.fixture(scope="module")
def jobs(token_file: Path, held_out: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("eval_jobs")
    with_eval, without = root / "eval.toml", root / "plain.toml"
    with_eval.write_text(
        small_job_text(token_file, train=TRAIN, eval={"path": str(held_out), **EVAL})
    )
    without.write_text(small_job_text(token_file, train=TRAIN))
    return with_eval, without


@pytest.fixture(scope="module")
def reference(jobs):
    """Single-process runs with and without [eval]: their results and final parameters."""
    with_eval, without = jobs
    return reference_results(with_eval, STEPS), reference_results(without, STEPS)


def held_out_loss(job: Path, params: dict[str, torch.Tensor]) -> float:
    """The model with `params` on held-out samples 0..samples-1, in one plain forward."""
    cfg = load(job)
    spec = get_spec(cfg.model.family)
    model = spec.build(cfg.model)
    model.to_empty(device=torch.device("cpu"))
    model.init_buffers(torch.device("cpu"))
    assert params.keys() == dict(model.named_parameters()).keys()
    model.load_state_dict(params, strict=False)  # the parameters; buffers are derived
    stream = open_eval_stream(cfg)
    assert stream is not None
    rows = torch.from_numpy(np.stack([stream.sample(i) for i in range(cfg.eval.samples)]))
    with torch.no_grad():
        loss = cross_entropy_sum(model(rows[:, :-1]), rows[:, 1:])
    return float(loss) / rows[:, 1:].numel()


def test_evaluation_leaves_training_unchanged(reference) -> None:
    (evaluated, params), (plain, plain_params) = reference
    assert [r.loss for r in evaluated.values()] == [r.loss for r in plain.values()]
    assert evaluated.keys() == plain.keys()
    for name, value in plain_params.items():
        assert torch.equal(params[name], value), name
    assert [s for s, r in evaluated.items() if r.eval_loss is not None] == [2, 4]
    assert all(r.eval_loss is None for r in plain.values())


def test_reference_eval_loss_is_the_models_loss_on_the_held_out_samples(jobs, reference):
    (evaluated, params), _ = reference
    assert evaluated[STEPS].eval_loss == pytest.approx(held_out_loss(jobs[0], params), rel=RTOL)


@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=slow("dp 1, dp 2 x tp 2 and pp 2 cover the evaluation"))
    if name in EXTRA else name for name in LAYOUTS
])
def test_eval_loss_is_the_same_in_every_layout(layout, jobs, reference, tmp_path) -> None:
    nproc, args = LAYOUTS[layout]
    (evaluated, _), (plain, plain_params) = reference
    ckpt = tmp_path / "ckpt"
    result = run_trainer(
        jobs[0], nproc, "--steps", str(STEPS), *args,
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(STEPS),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    for step, rec in result.steps.items():
        # Training follows the run without [eval].
        assert rec["loss"] == pytest.approx(plain[step].loss, rel=RTOL), f"step {step}"
        if step % EVAL["every"]:
            assert "eval_loss" not in rec, f"step {step}"
            continue
        want = evaluated[step].eval_loss
        assert rec["eval_loss"] == pytest.approx(want, rel=RTOL), f"step {step}"
        assert rec["eval_ppl"] == pytest.approx(np.exp(want), rel=2 * RTOL), f"step {step}"
    assert_params_close(final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path), plain_params,
                        RTOL)
