"""Recompute keeps names and numbers, and measures only the recomputation."""

from __future__ import annotations

import pytest
import torch

from models.llama.model import build_model, init_weights
from parallel.job import ModelConfig
from parallel.recompute import RecomputeMeter, apply_recompute

pytestmark = pytest.mark.unit

CFG = ModelConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=16,
)


def model(mode: str, meter: RecomputeMeter) -> torch.nn.Module:
    m = build_model(CFG)
    apply_recompute(m, mode, meter)
    m.to_empty(device="cpu")
    init_weights(m, seed=3)
    return m


def grads(m: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    m.zero_grad()
    m(tokens).float().logsumexp(-1).sum().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_names_same_gradients_and_measured(mode):
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = model("none", RecomputeMeter())
    meter = RecomputeMeter()
    ckpt = model(mode, meter)
    # Checkpoint keys (and the per-name init) must not change with the recompute mode.
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    with torch.no_grad():
        ckpt(tokens)
    assert meter.seconds == 0.0  # a forward alone recomputes nothing
    expected, got = grads(plain, tokens), grads(ckpt, tokens)
    assert meter.seconds > 0.0
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)
    meter.reset()
    assert meter.seconds == 0.0


def test_none_is_untouched():
    meter = RecomputeMeter()
    m = model("none", meter)
    assert "forward" not in vars(m.layers["0"])
    grads(m, torch.zeros(1, 4, dtype=torch.long))
    assert meter.seconds == 0.0
