"""Agents against a real etcd: admin API, auth, metrics, events, bad input."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from parallel.cli_common import version
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.integration.conftest import TTL, Cluster, etcd_call, wait_until

pytestmark = pytest.mark.integration


def test_status_nodes_and_plan(shared_cluster: Cluster) -> None:
    c = shared_cluster
    status = json.loads(c.ctl("-o", "json", "status").stdout)
    assert {"job", "state", "generation", "step", "world_size", "layout"} <= set(status)
    assert status["job"] == "tiny" and status["generation"] >= 1 and status["world_size"] == 3
    assert status["layout"] == {"dp": 3, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    nodes = json.loads(c.ctl("-o", "json", "nodes").stdout)
    assert [n["node"] for n in nodes] == ["n1", "n2", "n3"]
    for n in nodes:
        assert {"node", "address", "metrics_url", "devices", "state", "pid", "leader"} <= set(n)
        assert n["state"] == "ready" and n["devices"] == 1 and n["pid"] > 0
    assert sum(n["leader"] for n in nodes) == 1
    plan = json.loads(c.ctl("-o", "json", "plan").stdout)
    assert [r["node"] for r in plan["ranks"]] == ["n1", "n2", "n3"]
    leader = next(n for n in nodes if n["leader"])
    assert plan["store"]["host"] == leader["address"].rpartition(":")[0]
    assert plan["store"]["port"] > 0
    # The planner's model for the live layout, and a what-if search on another world.
    assert plan["model_prediction"]["memory_bytes"]["params"] > 0
    whatif = json.loads(c.ctl("-o", "json", "plan", "--world", "2x1", "--memory", "1G").stdout)
    assert whatif["search"]["world"] == "2x1" and whatif["search"]["best"] is not None
    assert "dp 3" in c.ctl("plan", "--explain").stdout
    assert c.ctl("-o", "yaml", "status").stdout.startswith("agent_state:")
    assert status["state"] == "running" and status["reason"] == ""
    # kubectl habit: the output flag after the command works too.
    assert json.loads(c.ctl("nodes", "-o", "json").stdout) == nodes


def test_ultractl_version_asks_the_agents(shared_cluster: Cluster) -> None:
    versions = json.loads(shared_cluster.ctl("-o", "json", "version").stdout)
    assert versions == {"client": version(), "agents": dict.fromkeys(("n1", "n2", "n3"), version())}


def test_wrong_or_missing_token_is_unauthenticated(shared_cluster: Cluster, tmp_path) -> None:
    c = shared_cluster
    channel = grpc.insecure_channel(c.agents["n1"].address)
    stub = pb_grpc.AgentStub(channel)
    for md in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(grpc.RpcError) as err:
            stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(stub.WatchEvents(pb.WatchEventsRequest(), timeout=5,
                              metadata=(("authorization", "Bearer nope"),)))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Probes need no secret.
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    wrong.chmod(0o600)
    result = c.ctl("status", token_file=wrong)
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr


def test_bad_job_spec_is_rejected_naming_the_field(shared_cluster: Cluster, tmp_path) -> None:
    c = shared_cluster
    before = etcd_call(c.etcd.endpoint, lambda e: e.get(f"/ultrascale/{c.job_ns}/spec".encode()))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nglobal_batch = 0\n[data]\nsource = 'synthetic'\n")
    result = c.ctl("job", "submit", str(bad), "--replace")
    assert result.returncode == 1, result
    assert "train.global_batch" in result.stderr
    result = c.ctl("job", "submit", str(bad), "--set", "parallel.tp=3", "--set",
                   "train.global_batch=8", "--replace")
    assert result.returncode == 1 and "parallel.tp" in result.stderr
    after = etcd_call(c.etcd.endpoint, lambda e: e.get(f"/ultrascale/{c.job_ns}/spec".encode()))
    assert after == before
    assert c.status().job == "tiny"
    usage = c.ctl("job", "submit")
    assert usage.returncode == 2


def test_unknown_node_in_drain_is_a_clear_error(shared_cluster: Cluster) -> None:
    result = shared_cluster.ctl("drain", "no-such-node")
    assert result.returncode == 1
    assert "unknown node 'no-such-node'" in result.stderr and "n1" in result.stderr


def _samples(agent: Any) -> dict[str, float]:
    text = urllib.request.urlopen(agent.info["metrics_url"], timeout=5).read().decode()
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_parse_and_agree_with_the_plan(shared_cluster: Cluster) -> None:
    c = shared_cluster
    generation = c.status().generation
    for agent in c.agents.values():
        samples = _samples(agent)
        names = {k.split("{")[0] for k in samples}
        for metric in ("ultra_train_steps_total", "ultra_train_tokens_total", "ultra_train_loss",
                       "ultra_train_step_duration_seconds_count", "ultra_world_size",
                       "ultra_generation", "ultra_membership_changes_total",
                       "ultra_recovery_duration_seconds_count", "ultra_agent_is_leader",
                       "ultra_build_info", "ultra_recompute_seconds_total",
                       "ultra_recompute_ratio"):
            assert metric in names, metric
        assert samples["ultra_generation{}"] == generation
        assert samples["ultra_world_size{}"] == 3
        assert samples['ultra_mesh_size{"dim": "dp"}'] == 3
        changes = sum(v for k, v in samples.items()
                      if k.startswith("ultra_membership_changes_total"))
        assert changes >= 1

    # The agents are read one after another: a leadership change between two reads (a 2 s
    # lease lapsing on a loaded machine) shows 0 or 2 leaders for a moment. What must hold is
    # that the agents settle on exactly one.
    def one_leader() -> bool:
        return sum(_samples(a)["ultra_agent_is_leader{}"] for a in c.agents.values()) == 1

    wait_until(one_leader, 3 * TTL, "exactly one agent reporting ultra_agent_is_leader 1")


def test_events_tell_the_story(shared_cluster: Cluster) -> None:
    result = shared_cluster.ctl("-o", "json", "events")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("node-joined") >= 3 and "leader" in kinds
    assert "job-submitted" in kinds and "generation" in kinds
    revisions = [e["revision"] for e in events]
    assert revisions == sorted(revisions)
