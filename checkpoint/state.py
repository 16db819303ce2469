"""The training state as one DCP `Stateful`.

Model and optimizer go through `torch.distributed.checkpoint.state_dict`, which presents
sharded (DTensor) state under the single-device names, so DCP can reshard it to any layout on
load. Progress (step, consumed samples: the data cursor) and the RNG state ride along as plain
values; they are identical on every rank, and DCP stores one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from checkpoint.optimizer_state import prime_optimizer_state


@dataclass
class Progress:
    step: int = 0  # number of completed steps
    consumed_samples: int = 0


# Flat optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): keyed per parameter,
# so a pipeline rank saves and loads exactly its own parameters' entries. The nested form keeps
# param_groups as one list per rank, which DCP deduplicates to a single rank's list.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LOAD_OPTIONS = StateDictOptions(strict=True, flatten_optimizer_state_dict=True)

# The flat form has one entry per parameter and hyper-parameter ("param_groups.<fqn>.lr"): 11
# for each AdamW parameter, 231 of the 318 items of a 2-layer model, each stored, planned,
# fetched, verified and unpickled on its own. Saved, a parameter's hyper-parameters are one
# item instead, still keyed by the parameter ("hyperparameters.<fqn>": its (name, value) pairs
# by name), so a pipeline rank still saves and loads exactly its own.
_FLAT = "param_groups."
_PACKED = "hyperparameters."
# How a checkpoint written in the flat form names those items (under `dcp.load({"state": ...})`).
_SAVED_FLAT = "state.optim." + _FLAT
# And the packed form (checkpoint/snapshot_fastpath.py serves those items by this name).
SAVED_HYPERPARAMETERS = "state.optim." + _PACKED


def pack_hyperparameters(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """`optim_sd` (flat) with each parameter's hyper-parameters in one entry."""
    out: dict[str, Any] = {}
    packed: dict[str, list[tuple[str, Any]]] = {}
    for key, value in optim_sd.items():
        if key.startswith(_FLAT):
            # No hyper-parameter name has a dot: the last component is it, the rest the fqn.
            fqn, _, name = key[len(_FLAT):].rpartition(".")
            packed.setdefault(fqn, []).append((name, value))
        else:
            out[key] = value
    for fqn, pairs in packed.items():
        out[_PACKED + fqn] = tuple(sorted(pairs, key=lambda pair: pair[0]))
    return out


def unpack_hyperparameters(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """The flat form `set_optimizer_state_dict` takes, from either form. ValueError naming the
    entry when a packed one is not (name, value) pairs (a damaged or forged checkpoint)."""
    out: dict[str, Any] = {}
    for key, value in optim_sd.items():
        if not key.startswith(_PACKED):
            out[key] = value
            continue
        fqn = key[len(_PACKED):]
        if not isinstance(value, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and pair[0] and "." not in pair[0] for pair in value):
            raise ValueError(f"optimizer entry {key!r} is not a tuple of (name, value) pairs "
                             f"(got {type(value).__name__})")
        out.update((f"{_FLAT}{fqn}.{name}", v) for name, v in value)
    return out


def present_as_saved(state_dict: dict[str, Any], saved: Any) -> None:
    """Before a load: when the checkpoint (its keys `saved`) holds the hyper-parameters in the
    flat form (written before they were packed), present `state_dict`'s ("state": a
    TrainState's) that way too, so that DCP finds every item; `load_state_dict` takes both."""
    if not any(str(key).startswith(_SAVED_FLAT) for key in saved):
        return
    state = state_dict.get("state")
    optim = state.get("optim") if isinstance(state, dict) else None
    if not isinstance(optim, dict):
        return
    flat = unpack_hyperparameters(optim)
    optim.clear()
    optim.update(flat)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _module_views(model: nn.Module, values: dict[str, Any]) -> dict[str, int] | None:
    """Where each tensor of a model state dict starts, when every one is a view of the module's
    own parameter or buffer memory (same start, same size); else None."""
    own = {_local(t).data_ptr(): _local(t).numel()
           for t in (*model.parameters(), *model.buffers())}
    starts = {}
    for key, value in values.items():
        if not isinstance(value, torch.Tensor) or own.get(_local(value).data_ptr()) != \
                _local(value).numel():
            return None
        starts[key] = _local(value).data_ptr()
    return starts


class TrainState(Stateful):
    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.progress = progress
        # Where each tensor of the model state dict last handed out starts, when all are views
        # of the module's memory (as FSDP2, DTensor and plain modules give them). DCP loads into
        # those tensors in place; copying them onto the parameters again would cost a restore
        # DTensor dispatch. Addresses only: no reference to a tensor (and its mesh) is kept.
        self._model_starts: dict[str, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        prime_optimizer_state(self.optimizer)  # else get_state_dict runs a step to create it
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        self._model_starts = _module_views(self.model, model_sd)
        return {
            "model": model_sd,
            "optim": pack_hyperparameters(optim_sd),
            "progress": {
                "step": self.progress.step,
                "consumed_samples": self.progress.consumed_samples,
            },
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model_sd, handed_out = state_dict["model"], self._model_starts
        if handed_out is None or _module_views(self.model, model_sd) != handed_out:
            # Not the module's own memory under the names it was handed out with: copy.
            set_model_state_dict(self.model, model_sd, options=_LOAD_OPTIONS)
        set_optimizer_state_dict(self.model, self.optimizer,
                                 unpack_hyperparameters(state_dict["optim"]),
                                 options=_LOAD_OPTIONS)
        self.progress.step = int(state_dict["progress"]["step"])
        self.progress.consumed_samples = int(state_dict["progress"]["consumed_samples"])
        torch.set_rng_state(state_dict["rng"])
