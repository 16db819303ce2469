"""The compute/communication model: FLOPs, bubble, recompute and per-dimension volumes."""

from __future__ import annotations

import math

import pytest

from parallel.cost_model import (
    Hardware,
    bubble_ratio,
    cp_comm_bytes,
    dp_comm_bytes,
    flops_per_token,
    pp_comm_bytes,
    recompute_flops_per_token,
    step_cost,
    tp_comm_bytes,
    training_flops,
)
from parallel.job import ModelConfig
from parallel.layout import Layout, predicted_bubble
from parallel.memory_model import param_counts

pytestmark = pytest.mark.unit

# Links so fast that communication costs nothing: the step is compute, padding and bubble.
IDEAL_LINKS = Hardware(intra_node_bytes_per_s=math.inf, inter_node_bytes_per_s=math.inf)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 4), (4, 8), (8, 8), (8, 64)])
def test_bubble_is_the_playbooks(p: int, m: int) -> None:
    assert bubble_ratio(p, m) == (p - 1) / m
    for v in (2, 4):
        assert bubble_ratio(p, m, v) == (p - 1) / (v * m)
    with pytest.raises(ValueError):
        bubble_ratio(0, m)


def test_flops_per_token_agrees_with_the_mfu_benchmark() -> None:
    mfu = pytest.importorskip("bench.mfu")
    h, i, layers, heads, kv, seq = 2048, 5632, 22, 32, 4, 2048
    model = ModelConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv,
                        vocab_size=mfu.VOCAB, max_position_embeddings=seq)
    assert flops_per_token(model, seq) == pytest.approx(
        mfu.model_flops_per_token(h, i, layers, heads, kv, seq), rel=1e-12)
    assert training_flops(model, seq, 1000) == pytest.approx(1000 * flops_per_token(model, seq))


def test_training_flops_are_six_n_tokens_plus_attention() -> None:
    model = ModelConfig()
    counts = param_counts(model)
    # Matmul weights: everything but the norms and the embedding (a lookup).
    n = counts.total - counts.embedding - counts.per_layer_norms * counts.num_layers
    n -= counts.final_norm
    attention = 12 * model.num_hidden_layers * model.hidden_size * 128
    assert training_flops(model, 128, 4096) == (6 * n + attention) * 4096


def test_recompute_costs_one_forward_of_the_layers_or_the_attention_core() -> None:
    model = ModelConfig()
    seq = 256
    head_fwd = 2 * model.vocab_size * model.hidden_size
    forward = (flops_per_token(model, seq) - 3 * head_fwd) / 3  # backward = 2 x forward
    assert recompute_flops_per_token(model, seq, "full") == pytest.approx(forward)
    selective = recompute_flops_per_token(model, seq, "selective")
    assert 0 < selective < recompute_flops_per_token(model, seq, "full")
    assert recompute_flops_per_token(model, seq, "none") == 0


def test_dp_volumes_follow_zero_stages() -> None:
    psi, n = 1_000_000, 8
    ring = (n - 1) / n
    all_reduce = dp_comm_bytes(psi, n, zero=0, grad_bytes=2, param_bytes=2, micro_batches=1)
    assert all_reduce == pytest.approx(2 * ring * psi * 2)
    # ZeRO-1: reduce-scatter + all-gather, the same bytes as an all-reduce.
    assert dp_comm_bytes(psi, n, 1, 2, 2, 1) == pytest.approx(all_reduce)
    # ZeRO-3 gathers parameters twice: 3Ψ instead of 2Ψ, for every micro-batch.
    assert dp_comm_bytes(psi, n, 3, 2, 2, 1) == pytest.approx(1.5 * all_reduce)
    assert dp_comm_bytes(psi, n, 3, 2, 2, 4) == pytest.approx(4 * 1.5 * all_reduce)
    assert dp_comm_bytes(psi, 1, 3, 2, 2, 4) == 0
    with pytest.raises(ValueError):
        dp_comm_bytes(psi, n, 5, 2, 2, 1)


def test_model_parallel_volumes() -> None:
    tokens, hidden = 4096, 1024
    # Four all-reduces of tokens x hidden per layer and micro-batch (two forward, two backward).
    assert tp_comm_bytes(tokens, hidden, 4, 2, 3, 2) == pytest.approx(
        4 * 2 * (3 / 4) * tokens * hidden * 2 * 2 * 3)
    assert tp_comm_bytes(tokens, hidden, 1, 2, 3, 2) == 0
    assert tp_comm_bytes(tokens, hidden, 4, 1, 1, 2, full_recompute=True) == pytest.approx(
        1.5 * tp_comm_bytes(tokens, hidden, 4, 1, 1, 2))
    assert pp_comm_bytes(tokens, hidden, 1, 8, 1, 2) == 0
    assert pp_comm_bytes(tokens, hidden, 4, 8, 2, 2) == 2 * 2 * 8 * tokens * hidden * 2
    assert cp_comm_bytes(tokens, 256, 1, 4, 4, 2) == 0
    assert cp_comm_bytes(tokens, 256, 4, 1, 1, 2) == 6 * 3 * tokens * 256 * 2


def test_one_device_step_is_all_useful_work() -> None:
    model = ModelConfig()
    cost = step_cost(model, Layout(micro_batch=2, grad_accum=4), 128, 8, 1)
    assert cost.efficiency == pytest.approx(1.0)
    assert cost.bubble_ratio == 0 and cost.recompute_ratio == 0 and cost.comm.total == 0


def test_padding_and_recompute_lower_the_score() -> None:
    model = ModelConfig()
    # Global batch 10 on dp 4 with micro-batch 1: 3 micro-batches, 12 slots for 10 samples.
    padded = step_cost(model, Layout(dp=4, grad_accum=3), 128, 10, 4, IDEAL_LINKS)
    assert padded.efficiency == pytest.approx(10 / 12)
    full = step_cost(model, Layout(recompute="full"), 128, 1, 1, IDEAL_LINKS)
    extra = recompute_flops_per_token(model, 128, "full")
    base = flops_per_token(model, 128)
    assert full.recompute_ratio == pytest.approx(extra / (base + extra))
    assert full.efficiency == pytest.approx(base / (base + extra))


def test_pipeline_bubble_in_the_step() -> None:
    model = ModelConfig()
    layout = Layout(pp=4, grad_accum=8, pp_schedule="1f1b")
    cost = step_cost(model, layout, 128, 8, 4, IDEAL_LINKS)
    r = 3 / 8
    assert cost.bubble_ratio == predicted_bubble(layout) == pytest.approx(r / (1 + r))
    assert cost.efficiency == pytest.approx(1 / (1 + r))


def test_slower_links_never_raise_the_score() -> None:
    model = ModelConfig()
    layout = Layout(dp=4, tp=2, zero=3, grad_accum=2, micro_batch=2)
    fast = step_cost(model, layout, 128, 16, 8, IDEAL_LINKS)
    slow = step_cost(model, layout, 128, 16, 2, Hardware(inter_node_bytes_per_s=1e6))
    assert slow.efficiency < fast.efficiency <= 1.0
    assert slow.comm == fast.comm  # volumes do not depend on where the ranks are
