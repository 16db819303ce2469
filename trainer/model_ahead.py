"""A model built on the meta device while the agent plans the next generation.

Between a generation's failure (or planned end) and the next plan, a surviving worker waits on
its agent for tens of milliseconds; building the next generation's module then (its Python
objects on the meta device: no memory, no weights) takes that work off the path from the plan
to the first step. The next generation takes the module only for the same model config; its
layout (mesh, sharding, materialisation) is applied as to a module built there.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from models import get_spec
from models.model_config import ModelConfig


@dataclass
class ModelAhead:
    """At most one module, built for `cfg`, waiting for the generation that takes it."""

    cfg: ModelConfig | None = None
    model: nn.Module | None = None

    def build(self, cfg: ModelConfig) -> None:
        self.cfg, self.model = None, None  # a build that fails leaves nothing to take
        model = get_spec(cfg.family).build(cfg)
        if any(t.device.type != "meta" for t in (*model.parameters(), *model.buffers())):
            return  # a family that allocates as it builds: not while the old world is held
        self.cfg, self.model = cfg, model

    def take(self, cfg: ModelConfig) -> nn.Module | None:
        """The module built ahead if it was built for `cfg` (else None); either way it is
        gone from here: a module is taken by one generation at most."""
        model, built_for = self.model, self.cfg
        self.cfg, self.model = None, None
        return model if model is not None and built_for == cfg else None
