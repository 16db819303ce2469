"""The planner: deterministic node-major ranks, JSON round trip, subsets, clear errors."""

from __future__ import annotations

import json

import pytest

from parallel import job as jobmod
from parallel.planner import NodeInfo, Plan, PlanError, plan_generation

pytestmark = pytest.mark.unit

TINY = """
[job]
name = "tiny"
[data]
source = "synthetic"
[train]
global_batch = 8
"""


def _job(*overrides: str) -> jobmod.JobConfig:
    return jobmod.loads(TINY, overrides)


def test_ranks_are_node_major_and_sorted_by_node_id() -> None:
    nodes = [NodeInfo("b", 2), NodeInfo("a", 1), NodeInfo("c", 2)]
    plan = plan_generation(_job(), nodes, 3, ("10.0.0.1", 2345))
    assert [(r.node, r.local_rank, r.global_rank) for r in plan.ranks] == [
        ("a", 0, 0), ("b", 0, 1), ("b", 1, 2), ("c", 0, 3), ("c", 1, 4),
    ]
    assert plan.layout.dp == 5 and plan.world_size == 5
    assert plan.layout.grad_accum == 2  # ceil(8 / (5 x 1))
    assert plan.nodes == ("a", "b", "c")
    assert plan == plan_generation(_job(), list(reversed(nodes)), 3, ("10.0.0.1", 2345))


def test_only_ready_nodes_are_used() -> None:
    nodes = [NodeInfo("a", 1), NodeInfo("b", 1, "draining"), NodeInfo("c", 1, "cordoned"),
             NodeInfo("d", 0)]
    plan = plan_generation(_job(), nodes, 1, ("h", 1))
    assert plan.nodes == ("a",)


def test_json_round_trip_has_the_architecture_shape() -> None:
    restore = {"source": "checkpoint", "step": 40, "locations": ["/ckpt/step-40"]}
    plan = plan_generation(_job(), [NodeInfo("a", 2)], 7, ("127.0.0.1", 5000), restore)
    raw = json.loads(plan.to_json())
    assert set(raw) >= {"generation", "job", "layout", "ranks", "store", "restore", "predicted"}
    assert set(raw["layout"]) >= {"dp", "tp", "pp", "cp", "zero", "pp_schedule", "virtual_stages",
                                  "recompute", "micro_batch", "grad_accum"}
    assert raw["store"] == {"host": "127.0.0.1", "port": 5000, "prefix": ""}
    assert raw["restore"] == restore
    assert set(raw["predicted"]["memory_bytes"]) == {"params", "grads", "optimizer", "activations"}
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_too_many_devices_uses_the_largest_prefix_and_names_the_idle_nodes() -> None:
    # global_batch 2 -> at most dp 2 (pad_uneven needs a sample per rank).
    nodes = [NodeInfo(n, 1) for n in "abcd"]
    plan = plan_generation(_job("train.global_batch=2", "parallel.micro_batch=1"), nodes, 1,
                           ("h", 1))
    assert plan.nodes == ("a", "b") and plan.idle == ("c", "d")


def test_errors_are_clear() -> None:
    with pytest.raises(PlanError, match="no ready node"):
        plan_generation(_job(), [NodeInfo("a", 1, "cordoned")], 1, ("h", 1))
    with pytest.raises(PlanError, match="duplicate node id"):
        plan_generation(_job(), [NodeInfo("a", 1), NodeInfo("a", 2)], 1, ("h", 1))
    with pytest.raises(PlanError, match="generation must be >= 1"):
        plan_generation(_job(), [NodeInfo("a", 1)], 0, ("h", 1))
    with pytest.raises(PlanError, match=r"parallel\.dp"):
        plan_generation(_job("parallel.dp=3"), [NodeInfo("a", 2)], 1, ("h", 1))
    with pytest.raises(PlanError, match="restore.source"):
        plan_generation(_job(), [NodeInfo("a", 1)], 1, ("h", 1), {"source": "tape"})
    with pytest.raises(PlanError, match="malformed plan"):
        Plan.from_json('{"generation": 1}')


def test_tp_group_must_fit_in_a_node():
    job = jobmod.loads('[data]\nsource = "python-stdlib"\n[parallel]\ntp = 4\n')
    with pytest.raises(PlanError, match="devices per node"):
        plan_generation(job, [NodeInfo("a", 2), NodeInfo("b", 2)], 1, ("127.0.0.1", 1))
    plan = plan_generation(job, [NodeInfo("a", 4), NodeInfo("b", 4)], 1, ("127.0.0.1", 1))
    assert plan.layout.tp == 4 and plan.layout.dp == 2
