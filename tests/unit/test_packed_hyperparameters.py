"""A TrainState saves each parameter's optimizer hyper-parameters as one item, loads them back
exactly, and still loads a checkpoint that stored one item per hyper-parameter (the form before
they were packed)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from checkpoint.safe_unpickle import SafeLoadPlanner
from checkpoint.state import Progress, TrainState, unpack_hyperparameters

pytestmark = pytest.mark.unit


def _state(lr: float, seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    groups = [{"params": [model[0].weight], "weight_decay": 0.1},
              {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0}]
    state = TrainState(model, torch.optim.AdamW(groups, lr=lr, betas=(0.8, 0.9)), Progress())
    model(torch.randn(2, 3)).sum().backward()
    state.optimizer.step()
    return state


def _save(tree: dict, path: Path) -> None:
    with warnings.catch_warnings():  # one process, no process group: meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tree, storage_writer=FileSystemWriter(path), no_dist=True)


def _load(state: TrainState, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"state": state}, storage_reader=FileSystemReader(path),
                 planner=SafeLoadPlanner(), no_dist=True)


def _optimizer(state: TrainState) -> dict:
    return get_state_dict(state.model, state.optimizer,
                          options=StateDictOptions(flatten_optimizer_state_dict=True))[1]


def _assert_same_optimizer(a: TrainState, b: TrainState) -> None:
    x, y = _optimizer(a), _optimizer(b)
    assert x.keys() == y.keys()
    for key, value in x.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, y[key]), key
        else:
            assert value == y[key], key


def test_one_item_per_parameter_round_trips(tmp_path: Path) -> None:
    saved = _state(lr=0.05, seed=0)
    optim = saved.state_dict()["optim"]
    assert not [k for k in optim if k.startswith("param_groups.")]
    packed = {k: v for k, v in optim.items() if k.startswith("hyperparameters.")}
    assert sorted(packed) == sorted(f"hyperparameters.{n}" for n, _ in
                                    saved.model.named_parameters())
    assert dict(packed["hyperparameters.0.weight"])["weight_decay"] == 0.1
    assert dict(packed["hyperparameters.1.bias"])["betas"] == (0.8, 0.9)
    _save({"state": saved}, tmp_path)
    items = FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    assert len([k for k in items if ".hyperparameters." in k]) == 4  # one per parameter
    loaded = _state(lr=0.5, seed=1)
    _load(loaded, tmp_path)
    _assert_same_optimizer(loaded, saved)
    assert loaded.optimizer.param_groups[0]["lr"] == 0.05


def test_a_checkpoint_with_one_item_per_hyperparameter_still_loads(tmp_path: Path) -> None:
    saved = _state(lr=0.05, seed=0)
    tree = saved.state_dict()
    tree["optim"] = unpack_hyperparameters(tree["optim"])  # the form saved before packing
    _save({"state": tree}, tmp_path)
    items = FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    assert "state.optim.param_groups.0.weight.lr" in items
    loaded = _state(lr=0.5, seed=1)
    _load(loaded, tmp_path)
    _assert_same_optimizer(loaded, saved)
    assert [g["lr"] for g in loaded.optimizer.param_groups] == [0.05, 0.05]


@pytest.mark.parametrize("forged", [0.1, ("lr", 0.1), (("lr", 0.1, 3),), ((1, 0.1),),
                                    (("a.b", 0.1),)])
def test_a_packed_entry_that_is_not_name_value_pairs_is_refused_by_name(forged) -> None:
    optim = {"hyperparameters.0.weight": forged}
    with pytest.raises(ValueError, match=r"'hyperparameters\.0\.weight'"):
        unpack_hyperparameters(optim)
