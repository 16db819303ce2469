"""The mesh-dimension registry (parallel/mesh_dims.py) is what every reader of the dimensions
uses: the layout's fields and checks, the job's checks and re-plan dimensions, the step line,
the agent's `ultra_mesh_size{dim}` and `ultractl status`."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from prometheus_client import generate_latest

from daemon.metrics import Metrics
from parallel import mesh_dims
from parallel.job import REPLAN_DIMS, ConfigError, ParallelConfig
from parallel.layout import Layout
from proto.ultrascale.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit


def test_every_dimension_is_a_layout_field_a_parallel_field_a_proto_field_and_a_module() -> None:
    layout = {f.name for f in dataclasses.fields(Layout)}
    parallel = {f.name for f in dataclasses.fields(ParallelConfig)}
    for d in mesh_dims.DIMS:
        assert d.name in layout and d.name in parallel, d.name
        assert d.name in pb.Layout.DESCRIPTOR.fields_by_name, d.name
        assert importlib.util.find_spec(d.technique) is not None, d.technique
        assert not d.within or d.within in mesh_dims.NAMES
    assert mesh_dims.NAMES[0] == "dp" and "ep" in mesh_dims.NAMES


def test_the_world_is_the_product_of_the_device_dimensions_and_ep_splits_dp() -> None:
    layout = Layout(dp=4, tp=2, pp=2, cp=2, ep=4)
    assert layout.world_size == 32  # ep adds no devices: it splits dp
    assert mesh_dims.sizes(layout) == {"dp": 4, "tp": 2, "pp": 2, "cp": 2, "ep": 4}
    with pytest.raises(ConfigError, match=r"parallel\.ep must divide dp: expert parallelism "
                                          r"takes its ranks from data parallelism \(got ep 3"):
        Layout(dp=4, ep=3)
    for name in mesh_dims.NAMES:
        with pytest.raises(ConfigError, match=rf"layout\.{name} must be >= 1"):
            Layout(**{name: 0})


def test_the_searchable_dimensions_lead_the_re_plan_dimensions() -> None:
    searchable = mesh_dims.SEARCHABLE
    assert "dp" not in searchable  # dp follows the world
    assert REPLAN_DIMS[: len(searchable)] == searchable


def test_the_agent_exports_one_mesh_size_per_dimension() -> None:
    text = generate_latest(Metrics().registry).decode()
    for name in mesh_dims.NAMES:
        assert f'ultra_mesh_size{{dim="{name}"}} 0.0' in text
