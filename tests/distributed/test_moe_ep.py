"""Expert parallelism against one process (fp32): the tiny MoE job's losses over 6 steps at
ep 2, ep 4, ep 2 x dp 2 (edp 2) and with shared experts and a dense first layer, under each
ZeRO stage, and ep 2 with pp, tp or cp 2; final parameters (experts included) from the DCP
checkpoint where one is written."""

from __future__ import annotations

import re
import shutil

import pytest

from parallel.job import load
from parallel.layout import resolve
from parallel.memory_model import rank_memory
from tests.compare import assert_params_close
from tests.conftest import small_job_text
from tests.distributed.reference import reference_results
from tests.launch import final_model_state, run_trainer

pytestmark = pytest.mark.distributed
STEPS = 6
RTOL = 1e-5

# 4 experts of width 32, top-2, over the small job's 2 layers; a balancing-loss weight large
# enough that its gradient moves the router visibly within 6 steps.
MOE = {"family": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "router_aux_loss_coef": 0.05}
# 3 layers, the first dense, one shared expert next to the routed ones.
SHARED = MOE | {"num_hidden_layers": 3, "first_k_dense_replace": 1, "num_shared_experts": 1}


def _job(tmp_path_factory, token_file, model: dict, **sections: dict):
    path = tmp_path_factory.mktemp("moe") / "job.toml"
    path.write_text(small_job_text(token_file, model=model, **sections))
    return path


@pytest.fixture(scope="module")
def moe_job(tmp_path_factory, token_file):
    return _job(tmp_path_factory, token_file, MOE)


@pytest.fixture(scope="module")
def cp_job(tmp_path_factory, token_file):
    """Adam eps 1e-6, as in test_context_parallel.py: ring attention sums each softmax block by
    block, and with eps 1e-8 Adam turns that rounding on elements whose gradient is near zero
    into updates of up to lr (lm_head then drifts by 1.5e-5 relative in 6 steps)."""
    return _job(tmp_path_factory, token_file, MOE, train={"eps": 1e-6})


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory, token_file):
    """Adam eps 1e-6, as in test_tp_zero_recompute.py: under tp the dense first layer's MLP
    sums its matmuls in another order, and with eps 1e-8 Adam turns that rounding on elements
    whose gradient is near zero into updates of up to lr (its down_proj then drifts by 1.3e-5
    relative in 6 steps on a CPU whose kernels block the sums differently, AVX-512)."""
    return _job(tmp_path_factory, token_file, SHARED, train={"eps": 1e-6})


def _reference(job):
    results, params = reference_results(job, STEPS)
    return {step: r.loss for step, r in results.items()}, params, results


@pytest.fixture(scope="module")
def moe_reference(moe_job):
    return _reference(moe_job)


@pytest.fixture(scope="module")
def cp_reference(cp_job):
    return _reference(cp_job)


@pytest.fixture(scope="module")
def shared_reference(shared_job):
    return _reference(shared_job)


def _assert_steps(steps: dict[int, dict], reference, first: int = 1) -> None:
    """Every step's loss, balancing loss and expert load against the single process."""
    ref_losses, _, ref_results = reference
    assert sorted(steps) == list(range(first, STEPS + 1))
    for step, rec in steps.items():
        ref = ref_results[step]
        assert rec["loss"] == pytest.approx(ref_losses[step], rel=RTOL), f"step {step}"
        assert rec["aux_loss"] == pytest.approx(ref.aux_loss, rel=RTOL), f"step {step}"
        # 10 samples x 32 tokens x top-2 per MoE layer, padding slots not counted.
        assert [sum(row) for row in rec["expert_load"]] == [640] * len(ref.expert_load)
        # Identical weights at step 1: routing, a function of the token only, is identical.
        if step == 1:
            assert rec["expert_load"] == [list(row) for row in ref.expert_load]


def _check(job, world: int, ep: int, zero: int, reference, tmp_path) -> None:
    _, ref_params, _ = reference
    ckpt = tmp_path / "ckpt"
    result = run_trainer(
        job, world, "--steps", str(STEPS), "--set", f"parallel.ep={ep}",
        "--set", f"parallel.zero={zero}",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(STEPS),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(rf"'dp': {world}, .*'ep': {ep}, 'zero': {zero}", result.stderr)
    _assert_steps(result.steps, reference)
    state = final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path)
    assert any(".experts." in name for name in state)
    assert_params_close(state, ref_params, RTOL)


@pytest.mark.parametrize("zero", [1, 3])
def test_ep2_matches_single_process(zero, moe_job, moe_reference, tmp_path):
    _check(moe_job, 2, 2, zero, moe_reference, tmp_path)


def test_ep4_matches_single_process(moe_job, moe_reference, tmp_path):
    """4 ranks, one expert each; dp 4 x micro_batch 2 leaves 6 padding slots in a step of 10
    samples (their balancing loss must not count)."""
    _check(moe_job, 4, 4, 3, moe_reference, tmp_path)


def test_ep2_dp2_matches_single_process(moe_job, moe_reference, tmp_path):
    """dp 4 = edp 2 x ep 2: experts are sharded over ep and their gradients reduced (ZeRO-2)
    over the two edp ranks that hold the same experts."""
    _check(moe_job, 4, 2, 2, moe_reference, tmp_path)


def test_shared_experts_and_dense_first_layer_at_ep2(shared_job, shared_reference, tmp_path):
    _check(shared_job, 2, 2, 3, shared_reference, tmp_path)


def test_balancing_loss_moves_the_losses(tmp_path_factory, token_file, moe_reference):
    """The parity above is not vacuous: the balancing loss is part of the reported objective
    and of the gradient (a different weight changes step 1's loss and later ones)."""
    other = _job(tmp_path_factory, token_file, MOE | {"router_aux_loss_coef": 0.0})
    results, _ = reference_results(other, 2)
    assert results[1].aux_loss == 0
    losses = {step: r.loss for step, r in results.items()}
    ref_losses, _, ref_results = moe_reference
    # Step 1 starts from the same weights: the losses differ by the balancing loss alone.
    assert ref_losses[1] - losses[1] == pytest.approx(ref_results[1].aux_loss, rel=1e-4)
    # 2 MoE layers x 0.05 x a per-layer loss of about 1 (1 when balanced).
    assert 0.05 < ref_losses[1] - losses[1] < 0.5


@pytest.fixture(scope="module")
def ep2_first_half(moe_job, tmp_path_factory):
    """Steps 1-3 at ep 2 (ZeRO-3), checkpointed at step 3."""
    ckpt = tmp_path_factory.mktemp("ep2ckpt") / "ckpt"
    result = run_trainer(moe_job, 2, "--steps", "3", "--set", "parallel.ep=2",
                         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    return ckpt


@pytest.mark.parametrize(("world", "ep", "zero"), [(4, 4, 1), (2, 1, 2)],
                         ids=["ep4-zero1", "ep1-dp2-zero2"])
def test_resume_across_a_change_of_ep(world, ep, zero, moe_job, moe_reference, ep2_first_half,
                                      tmp_path):
    """DCP reshards the (E, ., .) expert tensors and their Adam moments from ep 2 to another
    ep (and ZeRO stage); steps 4-6 continue the single-process curve."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ep2_first_half / "step_00000003", ckpt / "step_00000003")
    result = run_trainer(moe_job, world, "--steps", str(STEPS), "--resume",
                         "--set", f"parallel.ep={ep}", "--set", f"parallel.zero={zero}",
                         "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_steps(result.steps, moe_reference, first=4)


@pytest.mark.parametrize("zero", [1, 3])
def test_measured_state_memory_matches_the_model(zero, moe_job):
    """Rank 0's parameters, gradients and optimizer state at ep 2 equal the memory model's
    (experts 1/ep, then ZeRO over edp); activations of MoE layers are not modelled yet."""
    result = run_trainer(moe_job, 2, "--steps", "2", "--set", "parallel.ep=2",
                         "--set", f"parallel.zero={zero}")
    assert result.returncode == 0, result.stderr[-3000:]
    measured = result.steps[2]["memory_bytes"]
    cfg = load(moe_job, ["parallel.ep=2", f"parallel.zero={zero}"])
    predicted = rank_memory(cfg.model, resolve(cfg, 2), cfg.train.seq_len, pp_rank=0)
    for kind in ("params", "grads", "optimizer"):
        assert measured[kind] == getattr(predicted, kind), (kind, measured, predicted)


def test_ep2_pp2_matches_single_process(moe_job, moe_reference, tmp_path):
    """pp 2 x dp 2 (= ep 2), 1F1B over 3 micro-batches: one MoE layer per stage, each stage's
    balancing loss entering through its own backward."""
    _, ref_params, _ = moe_reference
    ckpt = tmp_path / "ckpt"
    result = run_trainer(
        moe_job, 4, "--steps", str(STEPS), "--set", "parallel.ep=2", "--set", "parallel.pp=2",
        "--set", "parallel.zero=2",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(STEPS),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"'dp': 2, 'tp': 1, 'pp': 2, 'cp': 1, 'ep': 2", result.stderr)
    _assert_steps(result.steps, moe_reference)
    assert_params_close(final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path), ref_params, RTOL)


@pytest.mark.parametrize("zero", [1, 3])
def test_ep2_tp2_matches_single_process(zero, shared_job, shared_reference, tmp_path):
    """tp 2 x dp 2 (= ep 2) with a shared expert and a dense first layer: attention and the
    dense MLP split over tp, MoE layers (router and shared expert as replicated DTensors)
    run whole on each tp rank."""
    _, ref_params, _ = shared_reference
    ckpt = tmp_path / "ckpt"
    result = run_trainer(
        shared_job, 4, "--steps", str(STEPS), "--set", "parallel.ep=2", "--set", "parallel.tp=2",
        "--set", f"parallel.zero={zero}",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(STEPS),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"'dp': 2, 'tp': 2, 'pp': 1, 'cp': 1, 'ep': 2", result.stderr)
    _assert_steps(result.steps, shared_reference)
    assert_params_close(final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path), ref_params, RTOL)


@pytest.mark.parametrize(("world", "zero"), [
    pytest.param(4, 1, id="dp2-zero1"),
    pytest.param(4, 3, id="dp2-zero3"),
    # edp 2: the experts' group is then edp x cp, 4 ranks of 8 (about 25 s on 2 cores).
    pytest.param(8, 2, id="dp4-zero2"),
])
def test_ep2_cp2_matches_single_process(world, zero, cp_job, cp_reference, tmp_path):
    """cp 2 x dp (ep 2): each rank holds half of every sequence (zig-zag); the balancing loss
    sums its per-sequence expert counts over cp, and the experts' gradients reduce over the
    ranks holding the same experts, edp x cp (at dp 2 the cp pair)."""
    _, ref_params, _ = cp_reference
    ckpt = tmp_path / "ckpt"
    result = run_trainer(
        cp_job, world, "--steps", str(STEPS), "--set", "parallel.ep=2", "--set", "parallel.cp=2",
        "--set", f"parallel.zero={zero}",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(STEPS), timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(rf"'dp': {world // 2}, 'tp': 1, 'pp': 1, 'cp': 2, 'ep': 2, 'zero': {zero}",
                     result.stderr)
    _assert_steps(result.steps, cp_reference)
    assert_params_close(final_model_state(ckpt / f"step_{STEPS:08d}", tmp_path), ref_params, RTOL)
