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


def _replan_job(*overrides: str) -> jobmod.JobConfig:
    return _job('parallel.replan=["pp"]', *overrides)


def test_without_replan_a_layout_that_cannot_run_leaves_the_job_pending() -> None:
    with pytest.raises(PlanError, match=r"parallel\.tp x pp x cp = 2"):
        plan_generation(_job("parallel.pp=2"), [NodeInfo("a", 1)], 2, ("h", 1))


def test_the_jobs_own_layout_is_kept_while_a_prefix_hosts_it() -> None:
    # pp 2 on three 1-device nodes: two of them run it, the third idles; nothing re-planned.
    plan = plan_generation(_replan_job("parallel.pp=2"), [NodeInfo(n, 1) for n in "abc"], 1,
                           ("h", 1))
    assert (plan.layout.pp, plan.layout.dp, plan.idle) == (2, 1, ("c",))
    assert plan.layout_reason.startswith("the job's tp1 pp2 ")
    assert plan.layout_reason.endswith(" kept: valid on 2 of 3 ready node(s)")


def test_a_lost_pp_is_re_planned_and_the_reason_names_the_jobs_layout() -> None:
    job = _replan_job("parallel.pp=2")
    plan = plan_generation(job, [NodeInfo("a", 1)], 2, ("h", 1))
    assert (plan.layout.pp, plan.layout.dp, plan.layout.grad_accum) == (1, 1, 8)
    assert plan.layout_reason.startswith("re-planned to tp1 pp1 ")
    assert "the job's tp1 pp2 " in plan.layout_reason
    assert "parallel.tp x pp x cp = 2 must divide the number of devices (1)" in plan.layout_reason
    assert Plan.from_json(plan.to_json()) == plan
    # The job's layout comes back as soon as it fits again.
    back = plan_generation(job, [NodeInfo("a", 1), NodeInfo("b", 1)], 3, ("h", 1),
                           current=plan.layout)
    assert back.layout.pp == 2 and back.layout_reason.startswith("the job's tp1 pp2 ")


def test_a_re_planned_layout_that_still_fits_is_kept_rather_than_searched_again() -> None:
    job = _replan_job("parallel.pp=4")
    three = plan_generation(job, [NodeInfo(n, 1) for n in "abc"], 2, ("h", 1))
    assert (three.layout.pp, three.layout.dp) == (1, 3)  # 8 layers: no pp divides 3 devices
    two = plan_generation(job, [NodeInfo(n, 1) for n in "ab"], 3, ("h", 1), current=three.layout)
    assert (two.layout.pp, two.layout.dp) == (1, 2)
    assert two.layout_reason.startswith("kept tp1 pp1 ")
    # With nothing running, the search decides (here pp 2 on two devices).
    fresh = plan_generation(job, [NodeInfo(n, 1) for n in "ab"], 1, ("h", 1))
    assert fresh.layout.pp * fresh.layout.dp == 2 and fresh.layout_reason.startswith("re-planned")


def test_tp_fixed_by_the_job_is_kept_and_only_dp_shrinks() -> None:
    job = _job('parallel.replan=["pp", "zero"]', "parallel.tp=2")
    nodes = [NodeInfo(n, 2) for n in "abc"]
    assert plan_generation(job, nodes, 1, ("h", 1)).layout.dp == 3
    after = plan_generation(job, nodes[:2], 2, ("h", 1))
    assert (after.layout.tp, after.layout.dp) == (2, 2)
    assert after.layout_reason.startswith("the job's tp2 pp1 ")
    assert after.layout_reason.endswith("kept: valid on 2 of 2 ready node(s)")
    # Without parallel.replan nothing is said: the layout is simply the job's.
    assert plan_generation(_job("parallel.tp=2"), nodes[:2], 2, ("h", 1)).layout_reason == ""


def test_memory_that_no_longer_fits_re_plans_the_zero_stage() -> None:
    job = _job('parallel.replan=["zero"]', "parallel.zero=1")
    nodes = [NodeInfo("a", 1), NodeInfo("b", 1)]
    # At dp 2 the model predicts 31.9 MB per device with ZeRO-1 and 25.3 MB with ZeRO-2.
    plan = plan_generation(job, nodes, 1, ("h", 1), memory_per_device=28_000_000)
    assert (plan.layout.zero, plan.layout.dp) == (2, 2)
    assert "predicted memory 0.0319 GB per device > 0.028 GB on 2 node(s)" in plan.layout_reason
    # The budget is only a bound for jobs that let the planner choose.
    fixed = plan_generation(_job("parallel.zero=1"), nodes, 1, ("h", 1),
                            memory_per_device=28_000_000)
    assert fixed.layout.zero == 1
    with pytest.raises(PlanError, match="no layout over zero is valid either: predicted memory exceeds the device"):
        plan_generation(job, nodes, 1, ("h", 1), memory_per_device=1_000_000)


def test_replan_names_only_known_dimensions() -> None:
    with pytest.raises(jobmod.ConfigError, match="parallel.replan must list distinct"):
        _job('parallel.replan=["dp"]')
    with pytest.raises(jobmod.ConfigError, match="parallel.replan must be a list"):
        _job('parallel.replan="pp"')


def test_snapshot_host_memory_is_predicted_per_node() -> None:
    """Own shards and the buddy's, for three steps, on the node with the most ranks; nothing
    when snapshots are off; carried through the plan's JSON."""
    nodes = [NodeInfo("a", 1), NodeInfo("b", 2)]
    plan = plan_generation(_job(), nodes, 1, ("h", 1))
    m = plan.predicted.memory_bytes
    assert m.params > 0 and m.optimizer > 0
    assert plan.predicted.snapshot_host_bytes == 3 * 2 * 2 * (m.params + m.optimizer)
    assert Plan.from_json(plan.to_json()).predicted == plan.predicted
    off = plan_generation(_job("checkpoint.snapshot_every=0"), nodes, 1, ("h", 1))
    assert off.predicted.snapshot_host_bytes == 0
