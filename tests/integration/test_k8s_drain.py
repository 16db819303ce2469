"""A node drain that drains: the node-watch container of deploy/k8s's DaemonSet, run exactly as
`kubectl kustomize deploy/k8s` renders it (its command, args and env, the downward-API values
substituted), against real etcd, real agents and real workers training the small job, with a
stand-in for the API server's Node endpoint (tests/kube_api.py). A cordon of the victim's node
(the first step of `kubectl drain`) makes its agent leave at a step boundary with a durable
checkpoint: no step is re-run, every step's loss matches the reference run, and the job
finishes without it; an uncordon brings the agent back; SIGTERM (the kubelet's) stops the
watcher with exit 0.

How real: the agents, etcd, workers, the RPCs and the watcher's process and HTTP client are the
real ones. Not exercised: the kubelet, the container runtime, the DaemonSet controller and the
API server itself (the stand-in answers GET /api/v1/nodes/NAME only), TLS between watcher and
agent (the local cluster runs without it) and the service account's RBAC (checked statically
by tests/unit/test_k8s_manifests.py). Two deviations from the rendered container, both below:
the agent's address and token file are the local cluster's, and the poll interval is 1 s
instead of 5 s so the drain lands in the middle of a 20-step job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from checkpoint.manifest import checkpoint_dir, committed_steps
from tests.integration.conftest import ROOT, wait_until
from tests.integration.test_training_elastic import (  # noqa: F401 - fixtures
    STEPS,
    TRIGGER_STEP,
    Elastic,
    check_committed,
    check_no_step_rerun,
    elastic,
    generations,
    reference,
)
from tests.kube_api import FakeNodeApi, serving

pytestmark = pytest.mark.integration

API_TOKEN = "service-account-token-of-the-test"


def nodewatch_container() -> dict[str, Any]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (CI installs it: .ci/run)")
    built = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "k8s")],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    (ds,) = [d for d in yaml.safe_load_all(built)
             if d and d["kind"] == "DaemonSet" and d["metadata"]["name"] == "ultrad"]
    (container,) = [c for c in ds["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "nodewatch"]
    return container


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def rendered_command(node: str, e: Elastic, api: FakeNodeApi, token: Path
                     ) -> tuple[list[str], dict[str, str]]:
    """The container's command line and environment as the kubelet would start it on `node`,
    pointed at this test's local cluster and API stand-in."""
    container = nodewatch_container()
    downward = {"spec.nodeName": node, "status.podIP": "127.0.0.1"}
    env: dict[str, str] = {}
    for var in container["env"]:  # in order: later values may refer to earlier ones
        if "valueFrom" in var:
            env[var["name"]] = downward[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = expand(var["value"], env)
    # The manifest dials the agent on the node's own address at the agent's gRPC port; the
    # local cluster's agents listen on loopback at ports of their own, without TLS.
    assert env["ULTRA_ENDPOINT"] == "127.0.0.1:7400"
    address = json.loads((e.cluster.state_dir / node / "agent.json").read_text())["address"]
    env["ULTRA_ENDPOINT"] = address
    env["ULTRA_TOKEN_FILE"] = str(e.cluster.token_file)
    for name in ("ULTRA_TLS_CA", "ULTRA_TLS_CERT", "ULTRA_TLS_KEY"):
        assert env.pop(name).startswith("/etc/ultrad/tls/")
    command = container["command"]
    assert command[0] == "python"
    argv = [sys.executable, *command[1:], *(expand(a, env) for a in container["args"]),
            f"--api-url={api.url}", f"--token-file={token}", "--interval=0.2"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ULTRA_")}
    return argv, {**clean, **env, "PYTHONPATH": str(ROOT),
                  "XDG_CONFIG_HOME": str(e.root / "watcher-config")}


def test_a_cordon_drains_the_agent_at_a_step_boundary_and_an_uncordon_brings_it_back(
        elastic, reference, tmp_path: Path) -> None:  # noqa: F811
    # keep: every checkpoint stays, so the one written at the leave step can be checked.
    e = elastic(3, keep=STEPS)
    api = FakeNodeApi(API_TOKEN, {node: False for node in e.cluster.agents})
    token = tmp_path / "sa-token"
    token.write_text(API_TOKEN + "\n")
    leader = wait_until(lambda: e.status().leader, 30, "a leader")
    victim = next(n for n in ("node-2", "node-1", "node-0") if n != leader)
    log_path = tmp_path / "nodewatch.log"
    with serving(api), log_path.open("wb") as log:
        argv, env = rendered_command(victim, e, api, token)
        watcher = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        try:
            # The watcher polls before the job starts: its start-up (seconds on a loaded
            # machine) then cannot eat the steps left between the cordon and the job's end.
            wait_until(lambda: api.requests, 60, "the watcher's first poll", interval=0.1)
            e.submit()
            e.wait_step(TRIGGER_STEP)
            assert e.status().leader == leader, "the leader changed: the victim may now lead"
            assert e.step() < STEPS, "the job finished before the cordon: nothing to drain"
            api.set_cordoned(victim, True)  # kubectl cordon / the start of kubectl drain
            wait_until(lambda: "draining its agent" in log_path.read_text(), 30,
                       "the watcher to ask for the drain", interval=0.1)
            e.wait_finished()
            assert e.cluster.agents[victim].poll() is None, "a drained agent stays up"
            nodes = {n["node"]: n["state"] for n in json.loads(e.ctl("-o", "json", "nodes").stdout)}
            assert nodes[victim] == "draining", nodes

            api.set_cordoned(victim, False)  # kubectl uncordon

            def back() -> bool:
                result = e.ctl("-o", "json", "nodes")
                return {n["node"]: n["state"] for n in json.loads(result.stdout)}[victim] \
                    == "ready"
            wait_until(back, 30, f"{victim} to be ready again", interval=0.25)
        finally:
            watcher.send_signal(signal.SIGTERM)  # as the kubelet stops the container
            code = watcher.wait(30)
    text = log_path.read_text()
    assert code == 0, text
    assert "Traceback" not in text, text
    assert all(status == 200 for _, status in api.requests), api.requests
    assert {path for path, _ in api.requests} == {f"/api/v1/nodes/{victim}"}

    # The generation with the victim stopped at a boundary; the next one, without it, began at
    # the following step from the durable checkpoint written there.
    lines = e.lines()
    gens = generations(lines)
    assert list(gens.values())[-2:] == [3, 2], gens
    first, second = list(gens)[-2:]
    leave_step = max(line["step"] for line in lines if line["generation"] == first)
    assert min(line["step"] for line in lines if line["generation"] == second) == leave_step + 1
    assert TRIGGER_STEP <= leave_step < STEPS
    checkpoints = e.output / "checkpoints"
    assert leave_step in committed_steps(checkpoints), (leave_step, committed_steps(checkpoints))
    assert checkpoint_dir(checkpoints, leave_step).is_dir()
    check_no_step_rerun(e)
    check_committed(e, reference)
    events = e.events()
    messages = "\n".join(ev["message"] for ev in events)
    assert any(ev["kind"] == "control" and ev["node"] == victim and "drain" in ev["message"]
               for ev in events), messages
    assert any(ev["kind"] == "generation" and "(drain)" in ev["message"] for ev in events), \
        messages
