"""The chaos scenario runner: a real LocalCluster (etcd + agents + persistent workers), one
small job, faults injected at chosen moments, and the checks every scenario shares.

A scenario is: `ChaosRun.start()`, `submit()`, `wait_step(trigger)`, one or more faults inside
`with run.fault("name"):` (which timestamps them and notes the generation they hit), then
`run.finish_and_check()`, which

- waits for the job to be `finished` (GetStatus, asked of any agent that is not stopped);
- checks the committed record in steps.jsonl: every step 1..N committed, consumed_samples ==
  step x global_batch on every line, generations never interleave (no line of an older
  generation after a line of a newer one: two generations committing at once is split brain),
  and each generation's lines are consecutive steps;
- checks the etcd history of the generation key: no generation number written twice;
- replays the layout history with the torchrun entry (`tests/chaos/replay.py`) and compares
  the committed losses step by step (relative difference <= 1e-6);
- measures, per fault, the stall (fault -> first committed step of a newer generation, or of
  any step when the fault made no new generation) and the steps re-run;
- appends one row per fault to the report (JSON lines) and only then asserts, so a failing
  scenario still leaves its row.

Every process it starts is cleaned up by `stop()` (stopped processes get SIGCONT first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from daemon.api.auth import call_metadata
from daemon.cli.local import LocalCluster
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.conftest import small_job_text
from tests.netns import Hosts
from tests.processes import Held, descendants, worker_pids

GLOBAL_BATCH = 10  # small_job_text's
RTOL = 1e-6
JOB_DEADLINE_S = float(os.environ.get("ULTRA_CHAOS_JOB_DEADLINE", "420"))


class ChaosError(AssertionError):
    pass


# -- processes ---------------------------------------------------------------------------------


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


# -- steps.jsonl -------------------------------------------------------------------------------


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for raw in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(raw))
    return out


def committed(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last line written for each step is the committed one."""
    out: dict[int, dict[str, Any]] = {}
    for line in lines:
        out[line["step"]] = line
    return out


def consistency_problems(lines: list[dict[str, Any]], steps: int) -> list[str]:
    """What is wrong with the committed record (empty: nothing)."""
    problems: list[str] = []
    last = committed(lines)
    missing = sorted(set(range(1, steps + 1)) - set(last))
    if missing:
        problems.append(f"steps never committed: {missing}")
    for line in lines:
        if line["consumed_samples"] != line["step"] * GLOBAL_BATCH:
            problems.append(f"consumed_samples {line['consumed_samples']} at step {line['step']} "
                            f"(generation {line['generation']}), expected "
                            f"{line['step'] * GLOBAL_BATCH}")
    newest = 0
    prev: dict[int, int] = {}
    for i, line in enumerate(lines):
        g, s = line["generation"], line["step"]
        if g < newest:
            problems.append(f"line {i + 1}: generation {g} committed step {s} after generation "
                            f"{newest} had committed (two generations committing: split brain)")
        newest = max(newest, g)
        if g in prev and s != prev[g] + 1:
            problems.append(f"line {i + 1}: generation {g} committed step {s} after {prev[g]}")
        prev[g] = s
    return problems


def steps_rerun(lines: list[dict[str, Any]]) -> int:
    return len(lines) - len({line["step"] for line in lines})


# -- the etcd history of the generation key -----------------------------------------------------


def generation_history(endpoint: str, namespace: str) -> list[int]:
    """Every value ever written to the generation key (etcd's revision history)."""
    from daemon.control.etcd_client import Etcd

    key = f"/ultrascale/{namespace}/generation".encode()

    async def go() -> list[int]:
        client = Etcd(endpoint, timeout=5)
        try:
            _, until = await client.get_prefix(key)
            numbers: list[int] = []
            async for resp in client.watch(key, start_revision=1, progress_every=0.1):
                numbers += [json.loads(ev.kv.value)["generation"] for ev in resp.events
                            if ev.kv.value]
                if not resp.events and not resp.created and resp.header.revision >= until:
                    return numbers
            return numbers
        finally:
            await client.close()

    return asyncio.run(asyncio.wait_for(go(), 30))


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Fault:
    name: str
    time: float  # time.time() when injected (the same clock as steps.jsonl's `time`)
    generation: int  # the newest generation known when it was injected
    step: int  # the newest committed step when it was injected
    step_seconds: float  # median step time before it
    expect_new_generation: bool = True


@dataclass
class Outcome:
    finished: bool = False
    problems: list[str] = field(default_factory=list)
    exact: bool | None = None
    max_rel_diff: float | None = None
    bit_identical: bool | None = None
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    stalls: list[float | None] = field(default_factory=list)
    reruns: list[int | None] = field(default_factory=list)
    error: str = ""


class ChaosRun:
    def __init__(self, root: Path, token_file: Path, scenario: str, *, report: Path,
                 replay_cache: Path, nodes: int = 3, devices: int = 1, ttl: int = 2,
                 steps: int = 30, every: int = 4, keep: int = 2, tp: int = 1,
                 checkpoint_dir: str = "checkpoints", fault: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, hosts: Hosts | None = None,
                 parallel: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
                 snapshot_every: int | None = None) -> None:
        self.root, self.scenario, self.report = root, scenario, report
        self.replay_cache = replay_cache
        self.steps, self.every, self.ttl = steps, every, ttl
        self.cluster = LocalCluster(root / "state", nodes, devices, ttl=ttl)
        if hosts is not None:  # node-i runs on its own host (network namespace), etcd on the bridge
            self.cluster.etcd_host = hosts.bridge_address
            self.cluster.node_hosts = {n: h.address for n, h in hosts.hosts.items()}
            self.cluster.launch_prefix = {n: h.prefix() for n, h in hosts.hosts.items()}
            self.cluster.extra_agent_args.append("--insecure")
        self.output = root / "output"
        parallel = {**({"tp": tp} if tp > 1 else {}), **(parallel or {})}
        sections: dict[str, dict[str, Any]] = {
            "job": {"name": "chaos"}, "train": {"steps": steps},
            "checkpoint": {"dir": checkpoint_dir, "every": every, "keep": keep,
                           **({} if snapshot_every is None
                              else {"snapshot_every": snapshot_every})},
        }
        if parallel:
            sections["parallel"] = parallel
        if model:
            sections["model"] = model
        if fault:
            sections["fault"] = fault
        self.job_text = small_job_text(token_file, **sections)
        self.env = env or {}
        self.faults: list[Fault] = []
        self.stopped: set[int] = set()  # pids we SIGSTOPped and have not SIGCONTed
        self.unreachable: set[str] = set()  # nodes whose network we cut: not asked over RPC
        self.workers = Held()  # every worker seen, killed at the end
        self.recorded = False
        self.outcome = Outcome()
        self.started_at = time.time()
        self._saved_env: dict[str, str | None] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ChaosRun:
        # Agents pass their environment on to their workers.
        for k, v in {"OMP_NUM_THREADS": "1", **self.env}.items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        self.cluster.start(timeout=90)
        return self

    def stop(self) -> None:
        for pid in list(self.stopped):
            signal_pid(pid, signal.SIGCONT)
        self.stopped.clear()
        with contextlib.suppress(Exception):
            self.note_workers()
        try:
            if self.cluster.etcd is not None and self.cluster.etcd.proc is not None:
                signal_pid(self.cluster.etcd.proc.pid, signal.SIGCONT)
            self.cluster.stop()
        finally:
            self.workers.kill(signal.SIGCONT)
            self.workers.kill(signal.SIGKILL)
            self.workers.close()
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # -- agent RPCs --------------------------------------------------------------------------

    @property
    def token(self) -> str:
        return self.cluster.token_file.read_text().strip()

    def _address(self, node: str) -> str | None:
        proc = self.cluster.agents.get(node)
        path = self.cluster.state_dir / node / "agent.json"
        if proc is None or proc.poll() is not None or proc.pid in self.stopped \
                or node in self.unreachable or not path.exists():
            return None
        with contextlib.suppress(ValueError, OSError):
            return str(json.loads(path.read_text())["address"])
        return None

    def call(self, method: str, request: object, node: str | None = None,
             timeout: float = 5.0) -> Any:
        """Ask `node`, or any agent that is neither dead nor stopped."""
        nodes = [node] if node else list(self.cluster.agents)
        last: Exception | None = None
        for n in nodes:
            address = self._address(n)
            if address is None:
                continue
            with grpc.insecure_channel(address) as channel:
                try:
                    return getattr(pb_grpc.AgentStub(channel), method)(
                        request, timeout=timeout, metadata=call_metadata(self.token))
                except grpc.RpcError as exc:
                    last = exc
        raise ChaosError(f"no agent answered {method}: {last}")

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`ultractl ARGS` against the live agents."""
        return subprocess.run(
            [sys.executable, "-m", "daemon.cli.ultractl", "--endpoint",
             ",".join(self.cluster.endpoints()), "--token-file", str(self.cluster.token_file),
             *args], capture_output=True, text=True, timeout=60)

    def status(self, node: str | None = None) -> pb.Status:
        return self.call("GetStatus", pb.GetStatusRequest(), node=node)

    def submit(self) -> None:
        self.call("SubmitJob", pb.SubmitJobRequest(
            spec_toml=self.job_text, overrides=[f'job.output_dir="{self.output}"']))

    def leader(self) -> str:
        def get() -> str:
            with contextlib.suppress(ChaosError):
                return self.status().leader
            return ""
        return wait(get, 30, "a leader")

    def non_leaders(self) -> list[str]:
        leader = self.leader()
        return [n for n in self.live_nodes() if n != leader]

    def live_nodes(self) -> list[str]:
        return [n for n, p in self.cluster.agents.items() if p.poll() is None]

    # -- progress ----------------------------------------------------------------------------

    def lines(self) -> list[dict[str, Any]]:
        return read_lines(self.output / "steps.jsonl")

    def step(self) -> int:
        return max((line["step"] for line in self.lines()), default=0)

    def generation(self) -> int:
        lines = self.lines()
        known = max((line["generation"] for line in lines), default=0)
        with contextlib.suppress(ChaosError):
            known = max(known, self.status().generation)
        return known

    def note_workers(self) -> None:
        for proc in self.cluster.agents.values():
            if proc.poll() is None:
                self.workers.add(descendants(proc.pid))

    def worker_pids(self, node: str) -> list[int]:
        proc = self.cluster.agents[node]
        if proc.poll() is not None:
            return []
        return worker_pids(proc.pid)

    def all_worker_pids(self) -> dict[str, list[int]]:
        return {n: self.worker_pids(n) for n in self.live_nodes()}

    def wait_standby(self, node: str, timeout: float = 90) -> int:
        """Until the node's standby worker has imported torch (it names itself then)."""

        def ready() -> int | None:
            proc = self.cluster.agents[node]
            return next((p for p in descendants(proc.pid) if comm(p) == "ultra-standby"), None)
        return wait(ready, timeout, f"{node}'s standby worker")

    def wait_workers(self, timeout: float = 60) -> dict[str, list[int]]:
        """Until every live agent runs its workers."""
        devices = self.cluster.devices_per_node

        def ready() -> dict[str, list[int]] | None:
            pids = self.all_worker_pids()
            return pids if all(len(v) == devices for v in pids.values()) else None
        return wait(ready, timeout, "every agent's workers")

    def wait_step(self, step: int, timeout: float = 180, after: float | None = None,
                  generation_above: int | None = None) -> dict[str, Any]:
        """The first committed line at or past `step` (optionally: written after time `after`,
        by a generation newer than `generation_above`)."""
        checked = [time.monotonic()]

        def reached() -> dict[str, Any] | None:
            self.note_workers()
            for line in self.lines():
                if line["step"] >= step and (after is None or line["time"] >= after) \
                        and (generation_above is None or line["generation"] > generation_above):
                    return line
            if time.monotonic() - checked[0] > 1.0:
                checked[0] = time.monotonic()
                if self.finished_now():
                    raise ChaosError(f"the job finished before step {step} was reached")
            return None
        return wait(reached, timeout, f"step {step} committed", interval=0.05)

    def finished_now(self) -> bool:
        with contextlib.suppress(ChaosError):
            status = self.status()
            return status.state == "finished"
        return False

    def median_step_seconds(self) -> float:
        values = [line["step_seconds"] for line in self.lines()]
        return statistics.median(values) if values else 0.0

    # -- faults ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def fault(self, name: str, expect_new_generation: bool = True,
              generation: int | None = None) -> Iterator[Fault]:
        """Timestamp the fault injected in the body; `generation`, when the caller knows it,
        saves a status call (for faults that must follow a trigger at once)."""
        lines = self.lines()
        if generation is None:
            generation = max((line["generation"] for line in lines), default=0)
            with contextlib.suppress(ChaosError):
                generation = max(generation, self.status().generation)
        f = Fault(name, time.time(), generation,
                  max((line["step"] for line in lines), default=0),
                  self.median_step_seconds(), expect_new_generation)
        f.time = time.time()
        self.faults.append(f)
        yield f

    def kill_agent(self, node: str) -> list[int]:
        """SIGKILL a node's agent; its workers die with it (PR_SET_PDEATHSIG)."""
        workers = self.worker_pids(node)
        self.cluster.agents[node].send_signal(signal.SIGKILL)
        self.cluster.agents[node].wait()
        return workers

    def kill_node(self, node: str) -> None:
        """SIGKILL a node's agent and its workers at once (a machine dying)."""
        victims = self.worker_pids(node)
        self.cluster.agents[node].send_signal(signal.SIGKILL)
        for pid in victims:
            signal_pid(pid, signal.SIGKILL)
        self.cluster.agents[node].wait()

    def restart_agent(self, node: str, timeout: float = 60) -> None:
        self.cluster.start_agent(node)
        self.cluster.wait_agent(node, time.monotonic() + timeout)

    def stop_pid(self, pid: int) -> None:
        self.stopped.add(pid)
        os.kill(pid, signal.SIGSTOP)

    def cont_pid(self, pid: int) -> None:
        signal_pid(pid, signal.SIGCONT)
        self.stopped.discard(pid)

    def etcd_pid(self) -> int:
        assert self.cluster.etcd is not None and self.cluster.etcd.proc is not None
        return self.cluster.etcd.proc.pid

    # -- logs --------------------------------------------------------------------------------

    def log(self, node: str, tail: int = 4000) -> str:
        parts = []
        node_dir = self.cluster.state_dir / node
        for path in [node_dir / "ultrad.log", *sorted((node_dir / "logs").glob("worker-*.log"))]:
            with contextlib.suppress(OSError):
                parts.append(f"--- {node}/{path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(self.log(n, tail) for n in self.cluster.agents)

    def grep_logs(self, needle: str) -> list[str]:
        out = []
        for node in self.cluster.agents:
            node_dir = self.cluster.state_dir / node
            for path in [node_dir / "ultrad.log", *sorted((node_dir / "logs").glob("*.log"))]:
                with contextlib.suppress(OSError):
                    out += [f"{node}/{path.name}: {line}"
                            for line in path.read_text(errors="replace").splitlines()
                            if needle in line]
        return out

    # -- the end -----------------------------------------------------------------------------

    def wait_finished(self, timeout: float = JOB_DEADLINE_S) -> pb.Status:
        def finished() -> pb.Status | None:
            self.note_workers()
            if not any(p.poll() is None for p in self.cluster.agents.values()):
                raise ChaosError("every agent has exited")
            try:
                status = self.status()
            except ChaosError:
                return None  # no agent answered this time
            if status.state == "failed":
                raise ChaosError(f"the job failed: {status.reason}")
            if status.state == "finished" and status.step == self.steps:
                return status
            return None
        return wait(finished, timeout, "the job to finish", interval=0.25)

    def measure(self) -> None:
        lines = self.lines()
        o = self.outcome
        o.stalls, o.reruns = [], []
        for f in self.faults:
            stall, rerun = fault_effect(lines, f)
            o.stalls.append(stall)
            o.reruns.append(rerun)

    def analyse(self, check_history: bool = True) -> Outcome:
        from tests.chaos.replay import compare, replay, segments

        o = self.outcome
        lines = self.lines()
        self.measure()
        o.problems += consistency_problems(lines, self.steps)
        if check_history:
            try:
                assert self.cluster.etcd is not None
                o.generations = generation_history(self.cluster.etcd.endpoint,
                                                   self.cluster.namespace)
                if o.generations != sorted(set(o.generations)):
                    o.problems.append(f"a generation number was written twice (or went back): "
                                      f"etcd history {o.generations}")
            except Exception as exc:  # noqa: BLE001 - recorded as a problem, asserted later
                o.problems.append(f"could not read the generation history: {exc!r}")
        if not any("never committed" in p for p in o.problems):
            segs = segments(lines)
            o.segments = [(s.world_size, s.dp, s.first, s.last) for s in segs]
            result = replay(self.job_text, segs, self.replay_cache)
            diffs = compare(committed(lines), result)
            o.max_rel_diff = diffs.max_rel
            o.bit_identical = diffs.max_rel == 0.0
            o.exact = not diffs.mismatches and not any("consumed_samples" in p
                                                       for p in o.problems)
            o.problems += diffs.mismatches[:10]
        return o

    def record(self, extra: dict[str, Any] | None = None) -> None:
        if self.recorded:
            return
        self.recorded = True
        o = self.outcome
        lines = self.lines()
        rows = []
        faults = self.faults or [Fault("(none)", self.started_at, 0, 0, 0.0)]
        for i, f in enumerate(faults):
            stall = o.stalls[i] if i < len(o.stalls) else None
            rerun = o.reruns[i] if i < len(o.reruns) else None
            rows.append({
                "scenario": self.scenario if len(faults) == 1 else f"{self.scenario}#{i + 1}",
                "fault": f.name,
                "stall_s": None if stall is None else round(stall, 2),
                "steps_rerun": rerun,
                "steps_rerun_total": steps_rerun(lines),
                "exact": o.exact,
                "max_rel_diff": o.max_rel_diff,
                "finished": o.finished,
                "ok": o.finished and not o.problems and not o.error,
                "step_s": round(f.step_seconds, 3),
                "at_step": f.step,
                "at_time": round(f.time, 3),
                "segments": o.segments,
                "error": (o.error or "; ".join(o.problems))[:500],
                **(extra or {}),
            })
        self.report.parent.mkdir(parents=True, exist_ok=True)
        with self.report.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    def finish_and_check(self, *, extra_checks: Callable[[ChaosRun], list[str]] | None = None,
                         check_history: bool = True,
                         extra: dict[str, Any] | None = None) -> Outcome:
        """Wait for the end, analyse, record the row(s), then assert."""
        o = self.outcome
        try:
            self.wait_finished()
            o.finished = True
            self.analyse(check_history=check_history)
            if extra_checks is not None:
                o.problems += extra_checks(self)
        except Exception as exc:
            o.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                self.measure()
            self.record(extra)
            raise
        self.record(extra)
        if o.problems:
            raise ChaosError(f"{self.scenario}: " + "\n".join(o.problems)
                             + "\n" + self.logs(1500))
        return o


def fault_effect(lines: list[dict[str, Any]], f: Fault) -> tuple[float | None, int | None]:
    """(stall seconds, steps re-run) of one fault.

    Stall: fault -> the first committed step of a generation newer than the one the fault hit
    (when there is one written after the fault, and the fault is one that should make one),
    else -> the first step committed after it.
    Steps re-run: the newest step committed before that first new line, minus the step it
    restored (its step - 1); 0 when training simply continued.
    """
    after = [line for line in lines if line["time"] >= f.time]
    newer = [line for line in after if line["generation"] > f.generation]
    if not f.expect_new_generation:
        newer = []  # a later fault's generation is not this fault's stall
    first = newer[0] if newer else (after[0] if after else None)
    if first is None:
        return None, None
    before = [line["step"] for line in lines if line["time"] < first["time"]]
    rerun = max(0, max(before, default=0) - (first["step"] - 1))
    return first["time"] - f.time, rerun


def wait(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ChaosError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def flip_bytes(path: Path, count: int = 16) -> None:
    """Corrupt a file in place without changing its size."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(min(count, len(data))):
        data[(mid + i) % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def run_quiet(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)
