"""Recovery after `kill -9` of one of 3 nodes: ultrad against torchrun's elastic c10d rendezvous.

    python -m bench.recovery [--runs 3]
        [--arms ultrad,ultrad-disk,ultrad-kill-leader,ultrad-kill-worker,torchrun-default,
                torchrun-tuned]
                             [--kill-step 8] [--global-batch 10] [--workdir DIR] [--keep]

Every arm trains the same small job (a 2-layer GQA Llama on a synthetic token file, global batch
10, durable DCP checkpoints every 4 steps) on 3 "nodes" on loopback with one CPU worker each,
kills one node at about step `--kill-step` (SIGKILL to the node's agent and its worker), and times
from the kill to:

  detect     the failure is known to the control plane. ultrad: the first survivor agent's
             log line "worker ... failed in generation g" (its worker's collective failed and
             it reported that). torchrun: the first survivor agent logging that its worker
             group failed.
  rdzv       the new world is agreed. ultrad: the leader's log line "generation g+1"; torchrun:
             the first "Rendezvous complete" logged by a survivor after the kill.
  restore    the state is restored: the start of the first step after recovery (its completion
             time minus its own duration: the step starts right after the restore).
  first step the first step of the new world completed (ultrad: steps.jsonl `time` of the first
             line of the new generation; torchrun: when the first JSON step line printed after
             the restarted workers' "resume:" line reaches the bench).

Two more columns, ultrad arms only, say what no recovery here can go below:

  victim exit      kill → the victim's worker has exited (a zombie or gone, polled in /proc).
                   A killed process's sockets close only after the kernel has freed its memory,
                   so no survivor can see the death sooner (a torch process takes tens of ms).
  one step         the new world's first step alone (its `step_seconds`): a recovery ends with
                   one whole step of the new world.
  ÷ floor          kill → first step over (victim exit + one step), per run, then the median.
And one that says whether the machine could have gone faster:
  cores busy       the mean number of this machine's CPUs busy (user, system, interrupts) from
                   the kill to the first step, from /proc/stat (bench/cpu_busy.py); each run's
                   line adds the cores the hypervisor stole. Near the machine's CPU count, the
                   recovery was CPU-bound: its wall time is the work of every process of the
                   three nodes over the cores here, not what one node with cores of its own
                   would take.

ultrad arms: `ultrad` restores from the in-memory snapshots (every step, replicated to a buddy
node; docs/snapshots.md), `ultrad-disk` turns them off (`checkpoint.snapshot_every=0`) and
restores from the durable checkpoint, and both kill a node that is not the leader's;
`ultrad-kill-leader` kills the leader's node (it hosts the generation's TCPStore): a survivor
revokes its lease and a new leader is elected at once; `ultrad-kill-worker` kills only the
worker of a node that is not the leader's: its agent lives on, and its standby worker (torch
already imported) takes the dead worker's local rank in the next generation. "steps re-run" counts committed steps
trained again (the step in flight when the node died is not counted). torchrun's victim is never
its rendezvous host (the first agent, which binds the --rdzv-endpoint port).

torchrun arms (`python -m torch.distributed.run --nnodes=2:3 --nproc-per-node=1 --max-restarts=3
--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT -m trainer --config JOB --resume
--checkpoint-dir DIR --checkpoint-every 4 --log-format json`): `torchrun-default` with torchrun's
defaults; `torchrun-tuned` with `--rdzv-conf last_call_timeout=1,join_timeout=60,
keep_alive_interval=1,keep_alive_max_attempt=2`; `torchrun-lastcall` (not run by default) with
only `last_call_timeout=1,join_timeout=60`.

Prints a table of medians over `--runs` runs, and each arm's ratio to ultrad's.
Each ultrad run's line also carries the survivors' own measurement, the mean of
`ultra_recovery_duration_seconds`: `agent_recovery_s` (phase="total") and
`agent_recovery_phases_s` (detect, rendezvous, restore, first_step; docs/observability.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cpu_busy import CpuBusy

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 10
STEPS = 400  # never reached: a run ends once the recovered world has trained a step
TTL = 2
TUNED = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"
ARMS = {
    "ultrad": None,
    "ultrad-disk": None,
    "ultrad-kill-leader": None,
    "ultrad-kill-worker": None,
    "torchrun-default": "",
    "torchrun-lastcall": "last_call_timeout=1,join_timeout=60",
    "torchrun-tuned": TUNED,
}
# torchrun's workers create their own c10d store (hosted by global rank 0), as ultrad's workers
# never share one either. With torch 2.13's default (workers share the agent's rendezvous store)
# the restarted 2-rank world hung here: gloo's connectFullMesh read a bogus peer address
# ("[127.0.0.1]:1932$1") and rank 0 never came up; --torchrun-share-store brings it back.
TORCHRUN_ENV: dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
METRICS = ("detect", "rdzv", "restore", "first_step", "rerun", "victim_exit", "step", "busy")
# ultrad arms: (restore from in-memory snapshots, what is killed: a non-leader node, the
# leader's node, or the worker alone of a non-leader node, its agent and standby worker alive)
ULTRAD_ARMS = {"ultrad": (True, "node"), "ultrad-disk": (False, "node"),
               "ultrad-kill-leader": (True, "leader"), "ultrad-kill-worker": (True, "worker")}


@dataclass
class Result:
    arm: str
    run: int
    detect: float | None = None
    rdzv: float | None = None
    restore: float | None = None
    first_step: float | None = None
    rerun: float | None = None  # committed steps trained again (the step in flight is not one)
    victim_exit: float | None = None  # kill → the victim worker gone (its sockets closed)
    step: float | None = None  # the new world's first step alone (its step_seconds)
    busy: float | None = None  # ultrad: the machine's mean busy cores, kill → first step
    extra: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def over_floor(self) -> float | None:
        """kill → first step over the floor no recovery goes below (victim exit + one step)."""
        if self.first_step is None or self.victim_exit is None or self.step is None:
            return None
        return self.first_step / (self.victim_exit + self.step)


# -- shared ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def write_job(work: Path, global_batch: int = GLOBAL_BATCH) -> Path:
    """The benchmark job (`global_batch` scales a step's compute, not its state)."""
    import numpy as np

    from trainer.tokens import write_token_file

    rng = np.random.default_rng(0)
    tokens = (np.cumsum(rng.integers(-2, 3, size=200_000)) % 64 + 32).astype(np.uint16)
    data = work / "walk.bin"
    write_token_file(data, tokens, vocab_size=256, source="synthetic random walk",
                     tokenizer="bytes")
    job = work / "job.toml"
    job.write_text(textwrap.dedent(f"""\
        [job]
        name = "bench-recovery"
        [model]
        hidden_size = 64
        intermediate_size = 128
        num_hidden_layers = 2
        num_attention_heads = 4
        num_key_value_heads = 2
        vocab_size = 256
        max_position_embeddings = 64
        [data]
        path = "{data}"
        [train]
        steps = {STEPS}
        global_batch = {global_batch}
        seq_len = 32
        seed = 7
        lr = 1e-2
        min_lr = 1e-3
        warmup_steps = 2
        [parallel]
        micro_batch = 2
        [checkpoint]
        dir = "checkpoints"
        every = 4
        keep = 2
        """))
    return job


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    for c in (task / "children").read_text().split():
                        if int(c) not in out:
                            out.append(int(c))
                            todo.append(int(c))
    return out


def _named(agent_pid: int, comm: str) -> int | None:
    """The agent's process named `comm` (workers name themselves ultra-w<rank>, ultra-standby)."""
    for pid in _descendants(agent_pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                return pid
    return None


def kill_node(pid: int) -> float:
    """SIGKILL a node: its agent and everything under it. Returns the kill's wall time."""
    victims = _descendants(pid)
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    for v in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(v, signal.SIGKILL)
    return t


def exit_seconds(pid: int, t_kill: float, timeout: float = 10.0) -> float | None:
    """Seconds from `t_kill` until every thread of process `pid` has exited (at most its
    zombie leader is left). The last thread out frees the memory and then closes the files, so
    the sockets close only then and no survivor can see the death sooner. (The leader alone
    turns zombie first: its state says nothing about the others.) None if it outlived
    `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return time.time() - t_kill
        if len(tasks) <= 1 and state in ("Z", "X"):
            return time.time() - t_kill
        time.sleep(0.002)
    return None


def _log_time(line: str) -> float | None:
    """Wall time of a `logging` line starting 'YYYY-MM-DD HH:MM:SS,mmm'."""
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() \
        + int(m.group(2)) / 1000


def _wait(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# -- ultrad -----------------------------------------------------------------------------------


def run_ultrad(work: Path, job: Path, kill_step: int, run: int, arm: str = "ultrad") -> Result:
    import grpc

    from daemon.cli.local import LocalCluster, _call
    from proto.ultrascale.v1 import agent_pb2 as pb

    snapshots, target = ULTRAD_ARMS[arm]
    kill_leader = target == "leader"
    res = Result(arm, run)
    os.environ.update({"OMP_NUM_THREADS": "1"})
    cluster = LocalCluster(work / "state", 3, 1, ttl=TTL, allowed_paths=(work, job.parent))
    output = work / "output"
    steps_path = output / "steps.jsonl"
    workers: set[int] = set()
    load = CpuBusy()

    def lines() -> list[dict[str, Any]]:
        if not steps_path.exists():
            return []
        out = []
        for raw in steps_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    try:
        cluster.start(timeout=90)
        token = cluster.token_file.read_text().strip()

        def call(method: str, request: object) -> Any:
            return _call(cluster, token, method, request)

        overrides = [f'job.output_dir="{output}"']
        if not snapshots:
            overrides.append("checkpoint.snapshot_every=0")
        call("SubmitJob", pb.SubmitJobRequest(spec_toml=job.read_text(), overrides=overrides))

        def at_kill_step() -> bool:
            for proc in cluster.agents.values():
                workers.update(_descendants(proc.pid))
            return any(x["step"] >= kill_step for x in lines())

        _wait(at_kill_step, 180, f"step {kill_step}")
        # Steady state: every node's standby worker (started once the job trains) is ready,
        # not importing torch while the recovery measured here runs.
        for node, proc in cluster.agents.items():
            _wait(lambda p=proc: _named(p.pid, "ultra-standby"), 60, f"{node}'s standby worker")
            _wait(lambda n=node: "standby: torch imported" in (
                cluster.state_dir / n / "logs" / "worker-standby.log").read_text(errors="replace"),
                60, f"{node}'s standby worker ready")
        status = call("GetStatus", pb.GetStatusRequest())
        leader, generation = status.leader, status.generation
        victim = leader if kill_leader else next(
            n for n in ("node-2", "node-1", "node-0") if n != leader)
        pid = _named(cluster.agents[victim].pid, "ultra-w0")
        if pid is None:
            raise RuntimeError(f"no worker process of {victim}")
        load.start()
        if target == "worker":
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
        else:
            t_kill = kill_node(cluster.agents[victim].pid)
        res.victim_exit = exit_seconds(pid, t_kill)
        res.extra.update(victim=victim, leader=leader)

        def recovered() -> dict[str, Any] | None:
            return next((x for x in lines() if x["generation"] > generation), None)

        first = _wait(recovered, 240, "the first step of the next generation")
        load.stop()
        res.first_step = first["time"] - t_kill
        busy = load.between(t_kill, first["time"])
        if busy is not None:
            res.busy = busy[0]
            res.extra["stolen_cores"] = round(busy[1], 3)
        before = [x["step"] for x in lines() if x["generation"] <= generation]
        res.rerun = max(0, max(before, default=0) - (first["step"] - 1))
        res.restore = first["time"] - first["step_seconds"] - t_kill
        res.step = first["step_seconds"]
        res.extra.update(generation=first["generation"], world=first["world_size"],
                         resumed_at_step=first["step"])
        # The (new) leader's log: failure confirmed, then the next generation written.
        if kill_leader:
            leader = call("GetStatus", pb.GetStatusRequest()).leader
            res.extra["new_leader"] = leader
        leader_log = (cluster.state_dir / leader / "ultrad.log").read_text(errors="replace")
        for line in leader_log.splitlines():
            t = _log_time(line)
            if t is None or t < t_kill - 0.01:
                continue
            if res.rdzv is None and re.search(r"control\.leader: generation \d+ \(", line):
                res.rdzv = t - t_kill
        # Detected: the first survivor agent told of the failure (its worker's report).
        for node in cluster.agents:
            if node == victim:
                continue
            log_text = (cluster.state_dir / node / "ultrad.log").read_text(errors="replace")
            for line in log_text.splitlines():
                t = _log_time(line)
                if t is not None and t >= t_kill - 0.01 and \
                        f"failed in generation {generation}" in line:
                    found = t - t_kill
                    res.detect = found if res.detect is None else min(res.detect, found)
                    break
        if res.detect is None:  # no worker report reached it: the lease ran out instead
            res.extra["detect_via"] = "lease expiry"
            res.detect = res.rdzv
        # The agents' own view: ultra_recovery_duration_seconds{phase} (failure → first step).
        time.sleep(0.5)
        for node, proc in cluster.agents.items():
            if node == victim or proc.poll() is not None:
                continue
            info = json.loads((cluster.state_dir / node / "agent.json").read_text())
            with contextlib.suppress(OSError):
                text = urllib.request.urlopen(info["metrics_url"], timeout=5).read().decode()
                phases = agent_recovery_means(text)
                if "total" in phases:
                    res.extra.setdefault("agent_recovery_s", {})[node] = phases.pop("total")
                    res.extra.setdefault("agent_recovery_phases_s", {})[node] = phases
    except (TimeoutError, OSError, RuntimeError, grpc.RpcError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        load.stop()
        for proc in cluster.agents.values():
            workers.update(_descendants(proc.pid))
        cluster.stop()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return res



def agent_recovery_means(text: str) -> dict[str, float]:
    """Mean seconds per phase of `ultra_recovery_duration_seconds{phase}` in an agent's
    /metrics text ("total" among them), for the phases that counted a recovery."""
    found: dict[str, dict[str, float]] = {}
    for kind, phase, value in re.findall(
            r'^ultra_recovery_duration_seconds_(sum|count)\{[^}]*phase="(\w+)"[^}]*\} (\S+)',
            text, re.M):
        found.setdefault(phase, {})[kind] = float(value)
    return {phase: round(v["sum"] / v["count"], 3) for phase, v in found.items()
            if v.get("count", 0) > 0 and "sum" in v}

# -- torchrun -------------------------------------------------------------------------------


class Reader:
    """Timestamped lines of one process's merged stdout/stderr, read on a thread."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.log = log.open("w")
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t = time.time()
            with self.lock:
                self.lines.append((t, line.rstrip("\n")))
            self.log.write(f"{t:.3f} {line}")
            self.log.flush()

    def snapshot(self) -> list[tuple[float, str]]:
        with self.lock:
            return list(self.lines)


def _step(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    with contextlib.suppress(ValueError):
        d = json.loads(line)
        if isinstance(d, dict) and "step" in d and "loss" in d:
            return d
    return None


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_torchrun(arm: str, conf: str, work: Path, job: Path, kill_step: int,
                 run: int) -> Result:
    from daemon.procutil import free_port

    res = Result(arm, run)
    port = free_port()
    ckpt = work / "checkpoints"
    procs: list[subprocess.Popen[str]] = []
    readers: list[Reader] = []
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
            "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=bench-{run}"]
    if conf:
        args.append(f"--rdzv-conf={conf}")
    args += ["-m", "trainer", "--config", str(job), "--resume", "--checkpoint-dir", str(ckpt),
             "--checkpoint-every", "4", "--log-format", "json"]
    env = {**_env(), "LOGLEVEL": "INFO", **TORCHRUN_ENV}
    try:
        for i in range(3):
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=work, env=env, start_new_session=True)
            procs.append(proc)
            readers.append(Reader(proc, work / f"torchrun-{i}.log"))
            if i == 0:  # the first agent binds the endpoint: it hosts the rendezvous store
                _wait(lambda p=proc: _port_open(port) or p.poll() is not None, 60,
                      "the rendezvous host to listen")
        # Every step line comes from global rank 0, on whichever agent hosts it.

        def all_steps() -> list[tuple[float, int, dict[str, Any]]]:
            out = []
            for i, r in enumerate(readers):
                for t, line in r.snapshot():
                    d = _step(line)
                    if d is not None:
                        out.append((t, i, d))
            return sorted(out, key=lambda x: x[0])

        def failed() -> str:
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            return f"torchrun agent(s) {dead} exited" if dead else ""

        def at_kill_step() -> bool:
            if failed():
                raise RuntimeError(failed())
            return any(d["step"] >= kill_step for _, _, d in all_steps())

        _wait(at_kill_step, 240, f"step {kill_step}")
        victim = 2  # never the rendezvous host (0)
        t_kill = kill_node(procs[victim].pid)
        res.extra["victim"] = f"torchrun agent {victim}"

        def recovered() -> tuple[float, int, dict[str, Any]] | None:
            survivors = [i for i in range(3) if i != victim]
            if all(procs[i].poll() is not None for i in survivors):
                raise RuntimeError("every surviving torchrun agent exited")
            for i in survivors:
                resumed = None
                for t, line in readers[i].snapshot():
                    if t < t_kill:
                        continue
                    if line.startswith("resume:"):
                        resumed = t
                    elif resumed is not None and (d := _step(line)) is not None:
                        return t, i, d
            return None

        t_first, host, first = _wait(recovered, 300, "the first step after the restart")
        res.first_step = t_first - t_kill
        res.restore = t_first - first["step_seconds"] - t_kill
        res.extra.update(resumed_at_step=first["step"], dp=first["dp"], rank0_on=host)
        for i in range(3):
            if i == victim:
                continue
            for t, line in readers[i].snapshot():
                if t < t_kill:
                    continue
                if ("Worker group FAILED" in line or "exitcode" in line) \
                        and (res.detect is None or t - t_kill < res.detect):
                    res.detect = t - t_kill
                    break
            for t, line in readers[i].snapshot():
                if t >= t_kill and "Rendezvous complete" in line \
                        and (res.rdzv is None or t - t_kill < res.rdzv):
                    res.rdzv = t - t_kill
                    break
    except (TimeoutError, OSError, RuntimeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Workers of a SIGKILLed agent are in its session too.
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for r in readers:
            r.thread.join(5)
            r.log.close()
    return res


# -- report ---------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: list[Result], arms: list[str]) -> str:
    med: dict[str, dict[str, float | None]] = {}
    rows = [["arm", "runs ok", "detect s", "re-rdzv s", "restore s", "kill→first step s",
             "steps re-run", "victim exit s", "one step s", "cores busy", "÷ floor",
             "first step / ultrad"]]
    for arm in arms:
        ok = [r for r in results if r.arm == arm and not r.error]
        med[arm] = {}
        for m in METRICS:
            values = [getattr(r, m) for r in ok if getattr(r, m) is not None]
            med[arm][m] = statistics.median(values) if values else None
    base = med.get("ultrad", {}).get("first_step")
    for arm in arms:
        n = sum(1 for r in results if r.arm == arm)
        ok = sum(1 for r in results if r.arm == arm and not r.error)
        fs = med[arm]["first_step"]
        ratio = f"{fs / base:.1f}x" if fs is not None and base else "-"
        floors = [r.over_floor for r in results
                  if r.arm == arm and not r.error and r.over_floor is not None]
        floor = f"{statistics.median(floors):.2f}x" if floors else "-"
        rows.append([arm, f"{ok}/{n}", *(_fmt(med[arm][m]) for m in METRICS), floor, ratio])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--arms", default="ultrad,ultrad-disk,ultrad-kill-leader,ultrad-kill-worker,"
                                     "torchrun-default,torchrun-tuned",
                   help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument("--kill-step", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH,
                   help="samples per step: scales a step's compute (the floor's one step), "
                        "not the state a recovery restores")
    p.add_argument("--workdir", default="", help="default: a temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--torchrun-share-store", action="store_true",
                   help="let torchrun's workers share the agent's rendezvous store (torch default)")
    p.add_argument("--json", default="", help="also write every run's result to this file")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.torchrun_share_store:
        TORCHRUN_ENV.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or args.runs < 1:
        p.error(f"unknown arm(s) {unknown}" if unknown else "--runs must be >= 1")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-recovery-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if args.global_batch < 1:
        p.error("--global-batch must be >= 1")
    job = write_job(root, args.global_batch)
    print(f"bench.recovery: work in {root}; {args.runs} run(s) of {', '.join(arms)}; "
          f"kill -9 of one of 3 nodes at about step {args.kill_step}; ultrad lease TTL {TTL}s; "
          f"{os.cpu_count()} CPUs",
          file=sys.stderr, flush=True)
    results: list[Result] = []
    for run in range(args.runs):
        for arm in arms:  # interleaved, so a slow spell on the machine hits every arm
            work = root / f"{arm}-{run}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            started = time.monotonic()
            if arm in ULTRAD_ARMS:
                res = run_ultrad(work, job, args.kill_step, run, arm)
            else:
                res = run_torchrun(arm, ARMS[arm] or "", work, job, args.kill_step, run)
            results.append(res)
            print(f"  {arm} run {run}: detect {_fmt(res.detect)}  rdzv {_fmt(res.rdzv)}  "
                  f"restore {_fmt(res.restore)}  first step {_fmt(res.first_step)}  "
                  f"re-run {_fmt(res.rerun)}  victim exit {_fmt(res.victim_exit)}  "
                  f"one step {_fmt(res.step)}  cores busy {_fmt(res.busy)}  "
                  f"{json.dumps(res.extra)}  ({time.monotonic() - started:.0f}s)"
                  + (f"  FAILED: {res.error}" if res.error else ""), file=sys.stderr, flush=True)
    print()
    print("seconds from the kill -9 (medians of successful runs)")
    print(table(results, arms))
    failed = [r for r in results if r.error]
    for r in failed:
        print(f"note: {r.arm} run {r.run} failed: {r.error}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    if not args.keep and not failed:
        shutil.rmtree(root, ignore_errors=True)
    elif failed or args.keep:
        print(f"logs kept in {root}")
    return 1 if len(failed) == len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
