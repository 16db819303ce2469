"""parallel.reproducible with the moe family: the same bits at dp 1 (ep 1), dp 2 and dp 4 at
ep 2, with each ZeRO stage, over 40 steps of the tiny MoE job (4 experts, top-2).

ep must divide dp (expert parallelism takes its ranks from data parallelism), so there is no
dp 1 at ep 2: the dp 1 run is at ep 1, where every expert is local. The runs are compared as
tests/distributed/test_reproducible.py compares them: the loss of every step as the exact
float of its JSON line (and here the balancing loss and the expert load too), and the final
parameters byte for byte from a DCP checkpoint. The global batch of 10 pads at dp 4 (6
padding slots per step). The mode also stays within 1e-5 of the fp32 run without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.compare import assert_params_close
from tests.conftest import small_job_text
from tests.distributed.reference import reference_run
from tests.distributed.test_reproducible import Run, assert_identical, fingerprint, run
from tests.launch import final_model_state

pytestmark = pytest.mark.distributed
STEPS = 40
EARLY = 8
MOE = {"family": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "router_aux_loss_coef": 0.05}


def _routing(result) -> dict[int, tuple]:
    return {s: (rec["aux_loss"], rec["expert_load"]) for s, rec in result.steps.items()}


@pytest.fixture(scope="module")
def baseline(token_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """dp 1 (ep 1) for 40 steps: (job, its run, routing statistics, the state at step 8)."""
    root = tmp_path_factory.mktemp("moe-reproducible-dp1")
    job = root / "job.toml"
    job.write_text(small_job_text(token_file, model=MOE, train={"steps": STEPS}))
    result, last = run(job, 1, root, STEPS, "--checkpoint-every", str(EARLY),
                       "--set", "checkpoint.keep=10")
    early = final_model_state(root / "ckpt" / f"step_{EARLY:08d}", root)
    return job, fingerprint(result, last, root), _routing(result), early


@pytest.mark.parametrize(("dp", "zero"), [(2, 1), (4, 3), (4, 2)])
def test_dp_at_ep2_gives_the_same_bits(dp, zero, baseline, tmp_path):
    job, expected, routing, _ = baseline
    result, last = run(job, dp, tmp_path, STEPS, "--set", "parallel.ep=2",
                       "--set", f"parallel.zero={zero}")
    assert {(rec["dp"]) for rec in result.steps.values()} == {dp}
    assert "'ep': 2" in result.stderr
    assert_identical(fingerprint(result, last, tmp_path), expected, f"dp{dp} ep2 zero{zero}")
    assert _routing(result) == routing


def test_close_to_the_fp32_run(baseline):
    """The exact sums change rounding, not results: within fp32 noise of the mode off."""
    job, expected, _, early = baseline
    ref_losses, ref_params = reference_run(job, EARLY)
    for step, loss in ref_losses.items():
        assert expected.losses[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    assert_params_close({n: t.to(torch.float32) for n, t in early.items()}, ref_params, 1e-5)


def test_the_baseline_is_not_trivial(baseline):
    """The balancing loss is in the objective and routing changes over the run."""
    _, expected, routing, _ = baseline
    assert isinstance(expected, Run) and len(expected.losses) == STEPS
    assert all(aux > 0 for aux, _ in routing.values())
    assert routing[1][1] != routing[STEPS][1]


def test_the_expert_bias_keeps_the_bits(token_file: Path, tmp_path: Path) -> None:
    """Auxiliary-loss-free balancing under the mode: the bias moves from the exact global load,
    so dp 1 (ep 1) and dp 2 at ep 2 still give the same bits (12 steps)."""
    steps = 12
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file, model=MOE | {"router_bias_update_rate": 0.05},
                                  train={"steps": steps}))
    one, last_one = run(job, 1, tmp_path / "dp1", steps)
    two, last_two = run(job, 2, tmp_path / "dp2", steps, "--set", "parallel.ep=2")
    assert_identical(fingerprint(two, last_two, tmp_path / "dp2"),
                     fingerprint(one, last_one, tmp_path / "dp1"), "dp2 ep2 with the bias")
    assert _routing(one) == _routing(two)
    state = final_model_state(last_one, tmp_path / "dp1")
    bias = [t for n, t in state.items() if n.endswith("expert_bias")]
    assert bias and any(t.abs().max() > 0 for t in bias)  # the bias moved and was compared
