"""TrainState.load_state_dict: a model state dict DCP loaded in place is not copied again;
anything else is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import checkpoint.state as state_module
from checkpoint.state import Progress, TrainState

pytestmark = pytest.mark.unit


def _state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model.register_buffer("scale", torch.ones(2))
    return TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.1), Progress())


def _no_model_copy(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model state was copied again")
    monkeypatch.setattr(state_module, "set_model_state_dict", refuse)


def test_a_dict_loaded_in_place_is_not_copied_again(monkeypatch):
    state = _state()
    sd = state.state_dict()
    with torch.no_grad():  # what DCP's load does: it writes into the tensors handed out
        for i, tensor in enumerate(sd["model"].values()):
            tensor.fill_(float(i))
        sd["optim"]["state.0.weight.exp_avg"].fill_(7.0)
    sd["progress"] = {"step": 5, "consumed_samples": 50}
    _no_model_copy(monkeypatch)
    state.load_state_dict(sd)
    for i, (name, tensor) in enumerate(state.model.state_dict().items()):
        assert torch.equal(tensor, torch.full_like(tensor, float(i))), name
    weight = state.model[0].weight
    assert torch.equal(state.optimizer.state[weight]["exp_avg"], torch.full_like(weight, 7.0))
    assert (state.progress.step, state.progress.consumed_samples) == (5, 50)


def test_fresh_tensors_are_copied_onto_the_module():
    state = _state()
    sd = state.state_dict()
    sd["model"] = {k: torch.full_like(v, 3.0) for k, v in sd["model"].items()}
    state.load_state_dict(sd)
    for name, tensor in state.model.state_dict().items():
        assert torch.equal(tensor, torch.full_like(tensor, 3.0)), name


def test_the_modules_memory_under_other_names_is_copied(monkeypatch):
    state = _state()
    sd = state.state_dict()
    model_sd = dict(sd["model"])  # views of the module, but the two weights swapped
    model_sd["0.weight"], model_sd["1.weight"] = model_sd["1.weight"], model_sd["0.weight"]
    sd["model"] = model_sd
    copied = []
    monkeypatch.setattr(state_module, "set_model_state_dict",
                        lambda model, values, options: copied.append(values))
    state.load_state_dict(sd)
    assert copied == [model_sd]
