"""DeepSeek-V3's auxiliary-loss-free balancing (models/moe/bias_balance.py): the bias picks the
experts but never weighs them, moves toward balance by the rate's sign steps, is model state
(checkpointed, zero at start) and its field is checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import get_spec
from models.moe.bias_balance import update_expert_bias
from models.moe.model import MoE
from models.moe.router import route
from parallel.job import ConfigError, ModelConfig

pytestmark = pytest.mark.unit

CFG = ModelConfig(family="moe", hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                  max_position_embeddings=16, num_experts=4, num_experts_per_tok=2,
                  first_k_dense_replace=1, router_bias_update_rate=0.01)


def test_the_bias_chooses_the_experts_and_the_probabilities_weigh_them() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain = route(logits, 2, normalise=False)
    assert plain.experts.tolist() == [[0, 1]]
    biased = route(logits, 2, normalise=False, bias=torch.tensor([0.0, 0.0, 0.5, 0.0]))
    probs = torch.softmax(logits, dim=-1)
    assert biased.experts.tolist() == [[0, 2]]  # 0.09 + 0.5 beats 0.24
    assert torch.equal(biased.weights, probs[:, [0, 2]])  # the bias never enters the weights
    normalised = route(logits, 2, normalise=True, bias=torch.tensor([0.0, 0.0, 0.5, 0.0]))
    assert torch.allclose(normalised.weights.sum(-1), torch.ones(1))


def _model() -> torch.nn.Module:
    spec = get_spec("moe")
    model = spec.build(CFG)
    model.to_empty(device="cpu")
    spec.init_weights(model, 0)
    return model


def test_the_bias_is_zero_at_start_model_state_and_moves_toward_balance() -> None:
    model = _model()
    state = model.state_dict()
    assert {k for k in state if k.endswith("expert_bias")} == {
        "layers.1.mlp.expert_bias", "layers.2.mlp.expert_bias"}
    assert all(not state[k].any() for k in state if k.endswith("expert_bias"))
    # Layer 1: expert 0 overloaded, 3 starved, 1 and 2 at the mean (25); layer 2 balanced.
    update_expert_bias(model, {1: [40, 25, 25, 10], 2: [25, 25, 25, 25]}, 0.01)
    layers = model.layers
    assert layers["1"].mlp.expert_bias.tolist() == pytest.approx([-0.01, 0.0, 0.0, 0.01])
    assert not layers["2"].mlp.expert_bias.any()
    update_expert_bias(model, {1: [40, 25, 25, 10], 2: [0, 0, 0, 100]}, 0.01)
    assert layers["1"].mlp.expert_bias.tolist() == pytest.approx([-0.02, 0.0, 0.0, 0.02])
    assert layers["2"].mlp.expert_bias.tolist() == pytest.approx([0.01, 0.01, 0.01, -0.01])
    assert not any(n.endswith("expert_bias") for n, _ in model.named_parameters())


def test_without_a_rate_there_is_no_bias() -> None:
    cfg = dataclasses.replace(CFG, router_bias_update_rate=0.0)
    model = get_spec("moe").build(cfg)
    assert not any(k.endswith("expert_bias") for k in model.state_dict())
    assert all(m.expert_bias is None for m in model.modules() if isinstance(m, MoE))


@pytest.mark.parametrize(("change", "message"), [
    ({"router_bias_update_rate": -0.1}, "model.router_bias_update_rate must be >= 0"),
    ({"family": "llama", "num_experts": 0}, "router_bias_update_rate needs model.family"),
])
def test_the_rate_is_checked_naming_the_field(change, message) -> None:
    cfg = dataclasses.replace(CFG, **change)
    with pytest.raises(ConfigError, match=message):
        get_spec(cfg.family).validate(cfg)
