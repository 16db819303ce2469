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
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from checkpoint.optimizer_state import prime_optimizer_state


@dataclass
class Progress:
    step: int = 0  # number of completed steps
    consumed_samples: int = 0


# Flat optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): keyed per parameter,
# so a pipeline rank saves and loads exactly its own parameters' entries. The nested form keeps
# param_groups as one list per rank, which DCP deduplicates to a single rank's list.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState(Stateful):
    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.progress = progress

    def state_dict(self) -> dict[str, Any]:
        prime_optimizer_state(self.optimizer)  # else get_state_dict runs a step to create it
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "progress": {
                "step": self.progress.step,
                "consumed_samples": self.progress.consumed_samples,
            },
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=StateDictOptions(strict=True, flatten_optimizer_state_dict=True),
        )
        self.progress.step = int(state_dict["progress"]["step"])
        self.progress.consumed_samples = int(state_dict["progress"]["consumed_samples"])
        torch.set_rng_state(state_dict["rng"])
