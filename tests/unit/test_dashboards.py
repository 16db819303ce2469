"""deploy/grafana: valid dashboards with stable uids, every query through the `$datasource`
variable, and only metrics the agent exports or the rules record (names parsed from the files)."""

from __future__ import annotations

import json

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.metrics import Metrics
from parallel.job import loads
from parallel.planner import NodeInfo, plan_generation
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.deploy_files import (
    DASHBOARDS,
    REPO,
    dashboard_exprs,
    load_dashboard,
    metric_names,
    names_used,
    panels,
    recorded_names,
)
from tests.unit.test_metrics import JOB

pytestmark = pytest.mark.unit

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Stable: Grafana links, bookmarks and provisioning updates follow the uid.
UIDS = {"ultrascale-overview", "ultrascale-efficiency", "ultrascale-reliability"}


def test_dashboards_are_json_with_the_stable_unique_uids() -> None:
    assert DASHBOARDS, "no dashboards under deploy/grafana/dashboards"
    uids = []
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        uids.append(d["uid"])
        assert path.stem == d["uid"], f"{path.name}: file name and uid differ ({d['uid']})"
        ids = [p["id"] for p in panels(d)]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
    assert sorted(uids) == sorted(UIDS)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_and_query_uses_the_datasource_variable(path) -> None:
    d = load_dashboard(path)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DATASOURCE, f"variable {var['name']}"
    queried = [p for p in panels(d) if p["type"] != "row"]
    assert queried
    for panel in queried:
        assert panel["datasource"] == DATASOURCE, f"panel {panel['title']!r}"
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, f"panel {panel['title']!r}"
            assert metric_names(target["expr"]), f"panel {panel['title']!r}: {target['expr']}"


def test_the_dashboards_show_what_each_promises() -> None:
    used = {uid: set().union(*(metric_names(e) for e in exprs))
            for uid, exprs in dashboard_exprs().items()}
    assert {"ultra_world_size", "ultra_generation", "ultra_train_steps_total",
            "ultra_train_tokens_total", "ultra_train_loss", "ultra_train_learning_rate",
            "ultra_train_grad_norm", "ultra_train_mfu_ratio",
            "ultra_train_skipped_steps_total", "ultra_moe_expert_imbalance",
            "ultra_moe_expert_tokens", "ultra_moe_aux_loss",
            "ultra_moe_dropped_tokens_total"} <= used["ultrascale-overview"]
    assert {"ultra_recompute_ratio", "ultra_pipeline_bubble_ratio",
            "ultra_memory_bytes"} <= used["ultrascale-efficiency"]
    assert {"ultra_membership_changes_total", "ultra_recovery_duration_seconds_bucket",
            "ultra_lost_steps_total", "ultra:checkpoint_age_seconds",
            "ultra_checkpoint_duration_seconds_bucket", "ultra_recovery_duration_seconds_sum",
            "ultra_checkpoint_blocking_seconds_bucket"} <= used["ultrascale-reliability"]


def test_every_metric_used_is_exported_by_the_agent_or_recorded_by_a_rule() -> None:
    # Labelled gauges have samples once the agent saw a plan and a step.
    metrics = Metrics()
    metrics.observe_plan(plan_generation(loads(JOB), [NodeInfo("a", 1)], 1, ("h", 1)))
    metrics.observe_step(pb.StepReport(generation=1, step=1, bubble_ratio=0.1,
                                       memory_params_bytes=1, aux_loss=0.1,
                                       expert_load=[pb.ExpertLoad(layer=0, tokens=[1, 2])]))
    text = generate_latest(metrics.registry).decode()
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    # Prometheus writes `up` for every target it scrapes (1 scraped, 0 failed): no exporter
    # has it, and the rules for a down agent can only use it.
    synthetic = {"up"}
    unknown = {name: sorted(users) for name, users in names_used().items()
               if name not in exported | recorded_names() | synthetic}
    assert not unknown, f"metrics that nothing exports: {unknown}"


def test_metric_names_are_parsed_from_promql() -> None:
    expr = ('histogram_quantile(0.9, max by (le) (rate(a_seconds_bucket{job=~"$job", '
            'le!="x"}[$__rate_interval]))) / on (instance) group_left b:c:d > 1e-9 '
            'and ignoring (state) e offset 5m unless sum without (kind) (f)')
    assert metric_names(expr) == {"a_seconds_bucket", "b:c:d", "e", "f"}


def test_provisioning_points_grafana_at_the_dashboards_and_prometheus() -> None:
    root = REPO / "deploy" / "grafana" / "provisioning"
    providers = yaml.safe_load((root / "dashboards" / "ultrascale.yml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    sources = yaml.safe_load((root / "datasources" / "ultrascale.yml").read_text())
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]
