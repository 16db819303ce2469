"""deploy/prometheus and deploy/grafana against real tools: promtool checks the rules, the
example config and the agents' /metrics, and a real Prometheus (Debian's `prometheus` package)
scrapes the agents of a running local job with the rules loaded.

The metric names checked are parsed from the dashboards and rule files (tests/deploy_files.py),
so the check follows the files.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from daemon.cli.local import LocalCluster, _call
from daemon.procutil import free_port, terminate
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.deploy_files import PROMETHEUS, RULE_FILES, names_used, recorded_names
from tests.integration.conftest import wait_until
from tests.processes import running

pytestmark = pytest.mark.integration

STEPS = 6
# 4 experts of width 32, top-2, in both layers of the small job.
MOE = {"family": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
HERE = Path(__file__).resolve().parent
# Worker start (a torch import per worker) and six steps on a loaded 2-core machine.
JOB_DEADLINE_S = 240.0


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install prometheus)")
    return path


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool("promtool"), *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_promtool_checks_the_rules_and_the_example_config() -> None:
    result = _promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_fire_on_their_series_and_not_on_near_misses() -> None:
    result = _promtool("test", "rules", str(HERE / "promtool" / "alerts_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    # Every alert of the files has a case in which it fires and one in which it stays quiet.
    tests = yaml.safe_load((HERE / "promtool" / "alerts_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", ())]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    alerts = {r["alert"] for path in RULE_FILES
              for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]
              if "alert" in r}
    assert alerts and alerts - fires == set(), f"no case where these fire: {alerts - fires}"
    assert alerts - quiet == set(), f"no case where these stay quiet: {alerts - quiet}"
    assert (fires | quiet) - alerts == set(), "cases for alerts the rule files lack"


# -- a running job, scraped -----------------------------------------------------------------


@dataclass
class Job:
    cluster: LocalCluster
    token: str

    def status(self) -> pb.Status:
        return _call(self.cluster, self.token, "GetStatus", pb.GetStatusRequest())  # type: ignore[return-value]

    def history(self) -> str:
        """The generations the agents saw and what each worker restored, for failure messages."""
        lines = []
        for log in sorted(self.cluster.state_dir.glob("node-*/**/*.log")):
            lines += [f"{log.name}: {line}" for line in log.read_text(errors="replace").splitlines()
                      if "generation" in line]
        return "\n".join(lines[-60:])

    def metrics_urls(self) -> list[str]:
        return [json.loads((self.cluster.state_dir / node / "agent.json").read_text())
                ["metrics_url"] for node in self.cluster.agents]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[Job]:
    """Two agents with one worker each, training a small mixture-of-experts job at ep 2 (so
    the expert series exist too) that checkpoints every 2 steps."""
    _tool("promtool")
    root = tmp_path_factory.mktemp("prometheus-job")
    cluster = LocalCluster(root / "state", 2, 1, ttl=2)
    with running(cluster):
        job = Job(cluster, cluster.token_file.read_text().strip())
        spec = small_job_text(token_file, job={"name": "scraped"}, train={"steps": STEPS},
                              checkpoint={"dir": "checkpoints", "every": 2}, model=MOE,
                              parallel={"ep": 2})
        _call(cluster, job.token, "SubmitJob", pb.SubmitJobRequest(
            spec_toml=spec, overrides=[f'job.output_dir="{root / "output"}"']))
        yield job


class Prometheus:
    def __init__(self, root: Path, targets: list[str]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in RULE_FILES],
            "scrape_configs": [{"job_name": "ultrad", "static_configs": [{"targets": targets}]}],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = root / "prometheus.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [_tool("prometheus"), f"--config.file={root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def value(self, expr: str) -> float | None:
        result = self.api("query", query=expr)["result"]
        return float(result[0]["value"][1]) if result else None

    def missing(self, names: set[str]) -> set[str]:
        return {n for n in names if not self.api("series", **{"match[]": n})}


@pytest.fixture
def prometheus(tmp_path: Path, job: Job) -> Iterator[Prometheus]:
    targets = [urllib.parse.urlsplit(u).netloc for u in job.metrics_urls()]
    server = Prometheus(tmp_path / "prometheus", targets)
    try:
        wait_until(server.ready, 60, "prometheus to be ready", interval=0.2)
        yield server
    finally:
        terminate(server.proc, timeout=10)


def test_promtool_accepts_the_agents_metrics(job: Job) -> None:
    wait_until(lambda: job.status().step >= 1, JOB_DEADLINE_S, "the first step")
    for url in job.metrics_urls():
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        assert "ultra_train_steps_total" in text
        # Step telemetry: the schedule's lr and the gradient norm; MFU unknown on CPU (NaN).
        for line in ("ultra_train_learning_rate ", "ultra_train_grad_norm ",
                     "ultra_train_mfu_ratio NaN",
                     'ultra_train_skipped_steps_total{reason="nonfinite_loss"} 0.0',
                     'ultra_mesh_size{dim="ep"} 2.0', "ultra_moe_dropped_tokens_total 0.0",
                     'ultra_moe_expert_tokens{expert="3",layer="1"} ',
                     'ultra_moe_expert_imbalance{layer="0"} ', "ultra_moe_aux_loss "):
            assert line in text, line
        result = _promtool("check", "metrics", stdin=text)
        assert result.returncode == 0, f"{url}:\n{result.stdout}{result.stderr}"


def test_prometheus_finds_every_metric_the_dashboards_and_rules_use(
        job: Job, prometheus: Prometheus) -> None:
    wait_until(lambda: job.status().finished, JOB_DEADLINE_S, "the job to finish", interval=0.5)
    targets = lambda: prometheus.api("targets")["activeTargets"]  # noqa: E731
    wait_until(lambda: len(targets()) == 2 and all(t["health"] == "up" for t in targets()),
               60, "both agents scraped")
    # The job's end, scraped: every step counted, a checkpoint committed and timed.
    try:
        wait_until(lambda: prometheus.value("max(ultra_train_steps_total)") == STEPS, 60,
                   f"ultra_train_steps_total = {STEPS} in Prometheus")
    except AssertionError as exc:
        per_agent = prometheus.api("query", query="ultra_train_steps_total")["result"]
        raise AssertionError(f"{exc}: {per_agent}\n{job.history()}") from None
    assert prometheus.value("max(ultra_checkpoint_last_step)") == STEPS
    assert prometheus.value('max(ultra_job_state{state="finished"})') == 1
    assert prometheus.value("sum(ultra_checkpoint_duration_seconds_count)") >= 1
    assert prometheus.value("max(ultra_lost_steps_total)") == 0  # no failure, nothing re-run
    assert prometheus.value("sum(ultra_agent_is_leader)") == 1

    used = names_used()
    # Recorded series appear once the rules ran on two scrapes or more.
    wanted = set(used) | recorded_names()
    missing: set[str] = set()

    def everything_there() -> bool:
        missing.clear()
        missing.update(prometheus.missing(wanted))
        return not missing

    with contextlib.suppress(AssertionError):
        wait_until(everything_there, 60, "every metric in Prometheus", interval=0.5)
    assert not missing, {name: sorted(used.get(name, {"its recording rule"})) for name in missing}

    # No rule fails to evaluate (a many-to-many match, a bad label) on real series.
    groups = prometheus.api("rules")["groups"]
    assert {g["file"] for g in groups} == {str(p) for p in RULE_FILES}
    bad = {r["name"]: r.get("lastError") for g in groups for r in g["rules"]
           if r["health"] != "ok"}
    assert not bad, bad
