"""Layouts the workers cannot apply are refused up front, naming the constraint."""

from __future__ import annotations

import pytest

from parallel.job import ConfigError, loads
from parallel.layout import Layout, resolve

pytestmark = pytest.mark.unit

BASE = '[data]\nsource = "python-stdlib"\n'


def job(parallel: dict, model: dict | None = None):
    text = BASE + "[parallel]\n" + "".join(f"{k} = {v}\n" for k, v in parallel.items())
    if model:
        text += "[model]\n" + "".join(f"{k} = {v}\n" for k, v in model.items())
    return loads(text)


@pytest.mark.parametrize(
    ("world", "parallel", "model", "devices_per_node", "message"),
    [
        # Default model: 8 heads, 4 KV heads, 8 layers.
        (
            16,
            {"tp": 8},
            None,
            None,
            "parallel.tp must divide model.num_attention_heads and model.num_key_value_heads",
        ),
        (
            6,
            {"tp": 3},
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96},
            None,
            None,
        ),
        (
            4,
            {"tp": 4},
            {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64},
            None,
            "parallel.tp must divide model.num_attention_heads and model.num_key_value_heads",
        ),
        (8, {"tp": 4}, None, 2, "parallel.tp must divide the devices per node"),
        (8, {"tp": 4}, None, 6, "parallel.tp must divide the devices per node"),
        (
            4,
            {"pp": 4, "virtual_stages": 4, "pp_schedule": '"interleaved_1f1b"'},
            None,
            None,
            "parallel.pp x parallel.virtual_stages must divide model.num_hidden_layers",
        ),
        (
            2,
            {"tp": 2},
            {"tie_word_embeddings": "true"},
            None,
            "model.tie_word_embeddings needs parallel.tp = 1",
        ),
        (6, {"tp": 4}, None, None, "parallel.tp x pp x cp = 4 must divide the number of devices"),
        (3, {"cp": 3}, None, None, "train.seq_len must be a multiple of 2 x parallel.cp"),
        (4, {"cp": 4}, None, None, None),
    ],
)
def test_impossible_layout_names_the_constraint(world, parallel, model, devices_per_node, message):
    cfg = job(parallel, model)
    if message is None:  # the control: the same shape of layout, possible
        resolve(cfg, world, devices_per_node)
        return
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world, devices_per_node)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("world", "parallel", "devices_per_node"),
    [
        (4, {"tp": 2, "sequence_parallel": "true", "zero": 1}, 4),
        (8, {"tp": 4, "recompute": '"selective"'}, 8),
        (8, {"tp": 2, "pp": 2, "zero": 2, "mixed_precision": '"bf16"'}, 2),
        (2, {"recompute": '"full"', "zero": 1, "mixed_precision": '"bf16"'}, None),
        (8, {"cp": 2, "tp": 2, "sequence_parallel": "true"}, 4),
        (16, {"cp": 2, "tp": 2, "pp": 2, "zero": 1}, 2),
    ],
)
def test_supported_layouts_resolve(world, parallel, devices_per_node):
    layout = resolve(job(parallel), world, devices_per_node)
    assert layout.world_size == world
    for key, value in parallel.items():
        assert str(getattr(layout, key)).lower() == str(value).strip('"').lower()


def test_layout_fields_are_validated():
    with pytest.raises(ConfigError, match="layout.recompute"):
        Layout(recompute="some")
    with pytest.raises(ConfigError, match="layout.zero"):
        Layout(zero=4)
