"""What per-step in-memory snapshots cost the training loop.

    python -m bench.overhead [--runs 3] [--steps 100] [--nodes 3] [--global-batch 10]
                             [--arms bare,ultrad,ultrad+snap]

The job of `bench.recovery` (a 2-layer GQA Llama, global batch 10, no durable checkpoints) on
`--nodes` CPU ranks, in three arms, interleaved run by run. `--global-batch` scales a step's
compute without changing the state a snapshot copies or the control messages of a step: what
ultrad adds per step is about constant, so its ratio to the bare loop shrinks as steps grow
(the tiny job's ~0.1 s steps are its worst case; a real job's steps take seconds).

  bare        torchrun --standalone --nproc-per-node=N -m trainer: the plain FSDP2 loop
  ultrad      `--nodes` agents on loopback, one worker each, snapshots off
              (`checkpoint.snapshot_every=0`)
  ultrad+snap the same with a snapshot every step (the default), replicated to a buddy node

Step time is the wall time between consecutive committed steps (steps.jsonl `time`), so it
includes everything between two steps (the step report and agreement, the snapshot), not only
the step itself. The table also shows the CPU time the control processes spend per committed
step, from /proc over the middle of the run: for the ultrad arms the agents (all of them
together) and etcd, for the bare loop torchrun's own elastic agent. On this machine they share
the cores with the workers, so their work shows up as step time, and CPU time is the steadier
measure of it. The workers' CPU per step (every process under torchrun or the agents, standby
workers included) shows what a snapshot costs on the training path itself. The last two
columns add both up and compare that with the bare loop's: where the workers alone keep the
cores busy (3 CPU ranks on 2 cores), the step time follows the CPU all processes spend per
step, so that ratio is about where the wall-time ratio can go.

Each run's median over the steps after the first 5 and, for ultrad, after every node's standby
worker has imported torch (it starts once the job trains and competes for the CPU until then:
a one-off start-up cost, not a per-step one); the table shows the median over runs and the
ratio to the bare loop; with several runs it also prints each run against the bare loop of the
same run (the machine's speed drifts from run to run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.recovery import GLOBAL_BATCH, _descendants, _env, _wait, write_job

ARMS = ("bare", "ultrad", "ultrad+snap")
WARMUP = 5


def step_gaps(steps_file: Path, after: float = 0.0) -> list[float]:
    """Gaps between consecutive committed steps past the warm-up that start after `after`."""
    last: dict[int, float] = {}
    for raw in steps_file.read_text().splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(raw)
            last[line["step"]] = line["time"]
    steps = sorted(last)
    return [last[b] - last[a] for a, b in zip(steps, steps[1:], strict=False)
            if b == a + 1 and a > WARMUP and last[a] > after]


def standbys_ready(state_dir: Path) -> float:
    """When the last node's standby worker had imported torch (its first log line saying so):
    the steps before compete with that import for the CPU, a one-off cost of a job's start."""
    ready = 0.0
    for log in state_dir.glob("*/logs/worker-standby.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "standby: torch imported" in line:
                stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
                ready = max(ready, stamp + int(line[20:23]) / 1000)
                break
    return ready


@dataclass
class CpuMeter:
    """CPU seconds per committed step of the control processes (agents, etcd) and of the
    workers, sampled from /proc while a run goes on."""

    steps_file: Path
    # (wall time, steps committed, CPU seconds so far) of the control processes, the workers
    control: list[tuple[float, int, float]] = field(default_factory=list)
    workers: list[tuple[float, int, float]] = field(default_factory=list)
    _worker_cpu: dict[int, float] = field(default_factory=dict)

    def sample(self, control: list[int], workers: set[int]) -> None:
        now, n = time.time(), committed(self.steps_file)
        self.control.append((now, n, sum(cpu_seconds(p) for p in control)))
        for pid in workers:  # a worker that exited keeps the CPU it was last seen with
            self._worker_cpu[pid] = max(self._worker_cpu.get(pid, 0.0), cpu_seconds(pid))
        self.workers.append((now, n, sum(self._worker_cpu.values())))

    def per_step(self, steps: int, after: float = 0.0) -> tuple[float, float]:
        """(control, workers) CPU seconds per step, from samples taken after `after` (the
        standby workers' torch import is a start-up cost, not a per-step one)."""
        return tuple(control_cpu_per_step([(n, c) for t, n, c in samples if t > after], steps)
                     for samples in (self.control, self.workers))  # type: ignore[return-value]


def run_bare(work: Path, job: Path, steps: int, ranks: int) -> tuple[list[float], float, float]:
    """Step gaps, and the CPU seconds per committed step of torchrun's own agent (the bare
    loop's control process) and of its workers."""
    output = work / "output"
    meter = CpuMeter(output / "steps.jsonl")
    with (work / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={ranks}", "-m", "trainer", "--config", str(job), "--steps",
             str(steps), "--set", "checkpoint.every=0", "--set", f'job.output_dir="{output}"'],
            cwd=work, env={**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 900
            while proc.poll() is None and time.monotonic() < deadline:
                meter.sample([proc.pid], set(_descendants(proc.pid)))
                time.sleep(0.5)
            if proc.poll() is None:
                raise TimeoutError("torchrun did not finish in 900 s")
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, "torchrun")
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    return step_gaps(output / "steps.jsonl"), *meter.per_step(steps)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def committed(steps_file: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return len(steps_file.read_text().splitlines())
    return 0


def control_cpu_per_step(samples: list[tuple[int, float]], steps: int) -> float:
    """CPU seconds per committed step between the first sample past a third of the run and the
    last before its final tenth; `samples` are (steps committed, CPU seconds so far)."""
    middle = [(n, c) for n, c in samples if steps // 3 <= n <= steps - steps // 10]
    if len(middle) < 2 or middle[-1][0] == middle[0][0]:
        return float("nan")
    return (middle[-1][1] - middle[0][1]) / (middle[-1][0] - middle[0][0])


def run_ultrad(work: Path, job: Path, steps: int, nodes: int, snapshots: bool
               ) -> tuple[list[float], float, float]:
    """Step gaps, and the CPU seconds per committed step of the agents and etcd together and
    of the workers."""
    from daemon.cli.local import LocalCluster, _call
    from proto.ultrascale.v1 import agent_pb2 as pb

    cluster = LocalCluster(work / "state", nodes, 1, ttl=2, allowed_paths=(work,))
    output = work / "output"
    pids: set[int] = set()
    meter = CpuMeter(output / "steps.jsonl")
    try:
        cluster.start(timeout=90)
        token = cluster.token_file.read_text().strip()
        overrides = [f'job.output_dir="{output}"', "checkpoint.every=0",
                     f"train.steps={steps}",
                     f"checkpoint.snapshot_every={1 if snapshots else 0}"]
        _call(cluster, token, "SubmitJob",
              pb.SubmitJobRequest(spec_toml=job.read_text(), overrides=overrides))

        def finished() -> bool:
            for proc in cluster.agents.values():
                pids.update(_descendants(proc.pid))
            assert cluster.etcd is not None and cluster.etcd.proc is not None
            control = [p.pid for p in cluster.agents.values()] + [cluster.etcd.proc.pid]
            meter.sample(control, pids)
            return _call(cluster, token, "GetStatus", pb.GetStatusRequest()).finished

        _wait(finished, 900, "the job to finish", 0.5)
    finally:
        cluster.stop()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)
    ready = standbys_ready(cluster.state_dir)
    return (step_gaps(output / "steps.jsonl", after=ready), *meter.per_step(steps, ready))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma-separated subset of " + ", ".join(ARMS) + " (ratios need bare)")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        p.error(f"--arms: a comma-separated subset of {', '.join(ARMS)} (got {args.arms!r})")
    if args.runs < 1 or args.steps <= WARMUP + 2 or args.nodes < 1 or args.global_batch < 1:
        p.error("--runs >= 1, --steps > 7, --nodes >= 1 and --global-batch >= 1")
    root = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    job = write_job(root, args.global_batch)
    medians: dict[str, list[float]] = {arm: [] for arm in arms}
    control: dict[str, list[float]] = {arm: [] for arm in arms}
    workers: dict[str, list[float]] = {arm: [] for arm in arms}
    for run in range(args.runs):
        for arm in arms:
            work = root / f"{arm}-{run}"
            work.mkdir()
            started = time.monotonic()
            if arm == "bare":
                gaps, cpu, worker_cpu = run_bare(work, job, args.steps, args.nodes)
            else:
                gaps, cpu, worker_cpu = run_ultrad(work, job, args.steps, args.nodes,
                                                   arm == "ultrad+snap")
            control[arm].append(cpu)
            workers[arm].append(worker_cpu)
            medians[arm].append(statistics.median(gaps))
            print(f"  {arm} run {run}: median step {medians[arm][-1] * 1e3:.1f} ms over "
                  f"{len(gaps)} steps ({time.monotonic() - started:.0f}s)", file=sys.stderr,
                  flush=True)
    base = statistics.median(medians["bare"]) if "bare" in medians else float("nan")
    print(f"\nwall time per step, {args.nodes} ranks, global batch {args.global_batch} "
          f"(median over {args.runs} runs of each run's median over steps "
          f"{WARMUP + 1}..{args.steps})")
    total = {arm: statistics.median([c + w for c, w in zip(control[arm], workers[arm],
                                                            strict=True)]) for arm in arms}
    base_cpu = total.get("bare", float("nan"))
    print(f"{'arm':<12} {'ms/step':>8} {'vs bare':>8} {'control CPU ms/step':>20} "
          f"{'workers CPU ms/step':>20} {'all CPU ms/step':>16} {'vs bare':>8}")
    for arm in arms:
        m = statistics.median(medians[arm])
        print(f"{arm:<12} {m * 1e3:>8.1f} {m / base:>7.2f}x "
              f"{statistics.median(control[arm]) * 1e3:>20.1f} "
              f"{statistics.median(workers[arm]) * 1e3:>20.1f} {total[arm] * 1e3:>16.1f} "
              f"{total[arm] / base_cpu:>7.2f}x")
    if "bare" in medians and args.runs > 1:
        # The machine's speed drifts between runs; an arm against the bare loop of its own run
        # cancels that drift.
        print("\neach run against its own bare loop:")
        for arm in arms:
            if arm != "bare":
                ratios = [a / b for a, b in zip(medians[arm], medians["bare"], strict=True)]
                print(f"{arm:<12} median {statistics.median(ratios):.2f}x  "
                      f"({', '.join(f'{r:.2f}' for r in ratios)})")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
