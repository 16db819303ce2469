"""prime_optimizer_state creates exactly the state DCP's zero-gradient step would."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state

from checkpoint.optimizer_state import prime_optimizer_state
from trainer.shard_local_adamw import ShardLocalAdamW

pytestmark = pytest.mark.unit


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2, bias=False))
    model[1].weight.requires_grad_(False)  # frozen parameters get no state
    return model


def _described(optimizer: torch.optim.Optimizer) -> list[tuple[str, str, tuple[int, ...], float]]:
    """Each state entry's name, dtype, shape and, for the moments, their sum (a load overwrites
    every value; DCP's step leaves `step` at 1, priming at 0)."""
    out = []
    for i, state in enumerate(optimizer.state.values()):
        for key, value in sorted(state.items()):
            total = 0.0 if key == "step" else float(value.abs().sum())
            out.append((f"{i}.{key}", str(value.dtype), tuple(value.shape), total))
    return out


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, {"weight_decay": 0.1}),
                                        (torch.optim.AdamW, {"amsgrad": True}),
                                        (torch.optim.Adam, {}),
                                        (ShardLocalAdamW, {"weight_decay": 0.1})])
def test_primed_state_equals_dcps_zero_step(cls, kwargs):
    by_dcp, primed = _model(), _model()
    opt_dcp = cls(by_dcp.parameters(), lr=0.1, **kwargs)
    opt_primed = cls(primed.parameters(), lr=0.1, **kwargs)
    _init_optim_state(opt_dcp)
    prime_optimizer_state(opt_primed)
    assert _described(opt_primed) == _described(opt_dcp)
    assert len(opt_primed.state) == 4  # of 5 parameters: the frozen LayerNorm weight has none
    # Neither touched the parameters, and both leave no gradient behind.
    for a, b in zip(by_dcp.parameters(), primed.parameters(), strict=True):
        assert torch.equal(a, b) and a.grad is None and b.grad is None


def test_existing_state_and_unknown_optimizers_are_left_alone():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prime_optimizer_state(sgd)
    assert not sgd.state  # DCP's own step handles it
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    adamw.step()
    before = {k: v.clone() for k, v in adamw.state[model[0].weight].items()}
    prime_optimizer_state(adamw)
    after = adamw.state[model[0].weight]
    assert all(torch.equal(before[k], after[k]) for k in before)
