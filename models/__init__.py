"""Model families by name (`[model] family`); see models/spec.py for what a family provides."""

from __future__ import annotations

from types import MappingProxyType

from models.llama import SPEC as LLAMA
from models.model_config import ConfigError
from models.moe import SPEC as MOE
from models.spec import HFAdapter, ModelSpec, ParamCounts, ParamShape

__all__ = ["SPECS", "HFAdapter", "ModelSpec", "ParamCounts", "ParamShape", "get_spec", "spec_of"]

SPECS = MappingProxyType({spec.name: spec for spec in (LLAMA, MOE)})


def get_spec(family: str) -> ModelSpec:
    try:
        return SPECS[family]
    except KeyError:
        raise ConfigError(
            f"model.family must be one of {', '.join(sorted(SPECS))} (got {family!r})"
        ) from None


def spec_of(model: object) -> ModelSpec:
    """The spec of a module a spec built (it carries its `cfg`)."""
    return get_spec(model.cfg.family)  # type: ignore[attr-defined]
