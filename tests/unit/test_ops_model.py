"""Kernels against their math references; the model's init depends on (seed, name) only."""

from __future__ import annotations

import math

import pytest
import torch

from models.llama.model import build_model, init_weights
from ops.attention import attention, attention_math, attention_sdpa
from ops.loss import IGNORE_INDEX, count_tokens, cross_entropy_sum
from ops.norm import rms_norm
from ops.rotary import apply_rotary, rotary_tables
from parallel.job import ModelConfig, TrainConfig
from trainer.loop import learning_rate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_sdpa_matches_math_with_gqa(kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g)
    k, v = torch.randn(2, kv_heads, 9, 8, generator=g), torch.randn(2, kv_heads, 9, 8, generator=g)
    torch.testing.assert_close(
        attention_sdpa(q, k, v), attention_math(q, k, v), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(attention(q, k, v), attention_math(q, k, v), rtol=1e-5, atol=1e-6)
    # causal: the first query sees only the first key
    torch.testing.assert_close(
        attention_math(q, k, v)[:, :, 0], v.repeat_interleave(4 // kv_heads, 1)[:, :, 0]
    )


def test_rms_norm_formula():
    x, w = torch.randn(3, 16), torch.randn(16)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expected)


def test_rotary_scores_depend_on_relative_position_only():
    cos, sin = rotary_tables(32, 8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> float:
        qi = apply_rotary(q, cos, sin, torch.tensor([i]))
        kj = apply_rotary(k, cos, sin, torch.tensor([j]))
        return float((qi * kj).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert float(apply_rotary(q, cos, sin, torch.tensor([7])).norm()) == pytest.approx(
        float(q.norm()), rel=1e-5
    )


def test_cross_entropy_is_a_sum_that_skips_ignored_tokens():
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    targets[1, 2:] = IGNORE_INDEX
    mean = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )
    assert int(count_tokens(targets)) == 7
    torch.testing.assert_close(cross_entropy_sum(logits, targets), mean * 7)


def _init(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    model = build_model(cfg)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_init_depends_on_seed_and_name_only():
    cfg = ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
    )
    a, b, c = _init(cfg, 1), _init(cfg, 1), _init(cfg, 2)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"], c["layers.0.mlp.up_proj.weight"])
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"], a["layers.1.mlp.up_proj.weight"])
    assert torch.equal(a["norm.weight"], torch.ones(32))
    assert float(a["embed_tokens.weight"].std()) == pytest.approx(0.02, rel=0.1)
    # A deeper model keeps the same tensors for the layers both have.
    deeper = _init(ModelConfig(**{**cfg.__dict__, "num_hidden_layers": 3}), 1)
    assert torch.equal(
        deeper["layers.1.self_attn.q_proj.weight"], a["layers.1.self_attn.q_proj.weight"]
    )


def test_tied_embeddings_share_one_tensor():
    cfg = ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    )
    model = build_model(cfg)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model(torch.randint(0, 64, (1, 8))).shape == (1, 8, 64)


def test_learning_rate_schedule():
    t = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert learning_rate(t, 0) == pytest.approx(0.1)
    assert learning_rate(t, 9) == pytest.approx(1.0)
    assert learning_rate(t, 60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(t, 110) == pytest.approx(0.1)
