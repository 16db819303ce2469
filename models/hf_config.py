"""`[init] hf`: the job's `[model]` fields come from the Hugging Face directory's config.json.

A `[model]` key the job sets must agree with config.json; one that contradicts it is an error
naming both, so a job never silently trains a different shape than the weights it starts from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.model_config import ConfigError


def hf_dir(path: str) -> Path:
    return Path(path).expanduser()


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"init.hf: {path} does not exist (a Hugging Face model directory "
                          "has config.json and *.safetensors)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"init.hf: cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"init.hf: {path} must hold a JSON object")
    return raw


def model_fields(directory: Path, family: str | None) -> dict[str, Any]:
    """The `[model]` table of the model in `directory`; `family` None: the family that reads
    its model_type (Llama's, which names the key it cannot take, when none does)."""
    from models import SPECS, get_spec

    path = directory / "config.json"
    raw = read_hf_config(directory)
    if family is None:
        family = next((spec.name for spec in SPECS.values()
                       if raw.get("model_type") in spec.hf.model_types), "llama")
    return get_spec(family).hf.config_from_hf(raw, str(path))


def with_pretrained_model(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` (a job as TOML tables) with `[model]` filled in from `[init] hf`'s config.json."""
    model = raw.get("model", {})
    if not isinstance(model, Mapping):
        raise ConfigError(f"model must be a table (got {type(model).__name__})")
    directory = hf_dir(str(raw["init"]["hf"]))
    path = directory / "config.json"
    family = model.get("family")
    fields = model_fields(directory, None if family is None else str(family))
    for key, value in model.items():
        if key not in fields:
            continue
        theirs = fields[key]
        if isinstance(value, Mapping) and isinstance(theirs, Mapping):
            diff = {k: v for k, v in value.items() if theirs.get(k) != v}
            if diff:
                raise ConfigError(f"model.{key} = {dict(value)} contradicts {path} "
                                  f"({key}: {dict(theirs)})")
        elif value != theirs:
            raise ConfigError(f"model.{key} = {value!r} contradicts {path} ({key}: {theirs!r})")
    # Absolute, so every process that re-reads the job (workers under ultrad, in their own
    # working directories) opens the directory the job was checked against.
    return {**raw, "model": {**model, **fields},
            "init": {**raw["init"], "hf": str(directory.absolute())}}
