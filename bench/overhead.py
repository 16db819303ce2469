"""What per-step in-memory snapshots cost the training loop.

    python -m bench.overhead [--runs 3] [--steps 100] [--nodes 3] [--global-batch 10]
                             [--arms bare,ultrad,ultrad+snap] [--pin [--pinned-steps 300]]

Last, it prints what one more collective per step would cost as the world grows (a tiny gloo
all-reduce at 2 to 32 ranks: `python -m bench.collective_scale`, which runs it alone).

The job of `bench.recovery` (a 2-layer GQA Llama, global batch 10, no durable checkpoints) on
`--nodes` CPU ranks, in three arms, interleaved run by run (each run in another order: the
first run bare, ultrad, ultrad+snap; the next ultrad, ultrad+snap, bare; and so on).
`--global-batch` scales a step's compute without changing the state a snapshot copies or the
control messages of a step: what ultrad adds per step is about constant, so its ratio to the
bare loop shrinks as steps grow (the tiny job's ~0.1 s steps are its worst case; a real job's
steps take seconds).

  bare        torchrun --standalone --nproc-per-node=N -m trainer: the plain FSDP2 loop
  ultrad      `--nodes` agents on loopback, one worker each, snapshots off
              (`checkpoint.snapshot_every=0`)
  ultrad+snap the same with a snapshot every step (the default), replicated to a buddy node
  bare-again  the bare loop once more: the same loop twice in one run differs only by the
              machine's drift, so its ratio to `bare` is the resolution of the other ratios
              (on this 2-core VM one run's bare loops differ by up to ~10%: a ratio within
              that spread of 1 is not resolved by a handful of runs)

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
worker has imported torch and warmed up (it starts once the job trains and competes for the CPU
until then: a one-off start-up cost, not a per-step one; a pinned run trains `--pinned-steps`
so that enough steps come after it); the table shows the median over runs and the
ratio to the bare loop; with several runs it also prints each run against the bare loop of the
same run (the machine's speed drifts from run to run).

Collectives per step and rank are counted, not assumed: every training process counts its
`torch.distributed` collective calls (bench/collectives/sitecustomize.py) and the table shows
their growth per committed step over the middle of the run, like the CPU columns.

`--pin` first runs the arms on one node with one rank, that rank's worker pinned to CPU 0 and
everything else (the agent, etcd, the standby worker, torchrun's own agent) pinned to CPU 1;
the bare loop's rank is pinned to CPU 0 the same way. The workers then never lose their core
to the control path, so the wall ratio measures what the step path itself adds, not CPU theft.
The worker's snapshot-writing thread (`snapshot-write`: the shard's write, checksums and
records, which the design keeps off the step) is pinned to CPU 1 too, as on a GPU node, where
it runs on a core the step does not use. That table also shows a snapshot's blocking time (the
worker's own figure, from the agent's `ultra_checkpoint_blocking_seconds{tier="memory"}`, over
the snapshots after the first 5 steps: the rewrites, not the generation's first snapshot, a
full collective save) against a plain copy of the same bytes on CPU 0, from memory (after
writing 256 MiB, more than the caches hold) and from the caches. Two figures that no drift
of the machine's speed moves: the CPU per step of the rank's main thread and of its other
threads on CPU 0 (gloo's, gRPC's, the heartbeat: what the step path adds there besides the
step itself), and a check of the pinning's premise, that work on CPU 1 leaves CPU 0 alone
(matrix multiplications on CPU 0 while CPU 1 is idle, runs a Python loop, copies memory).
The unpinned table of `--nodes` ranks follows, for comparison.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench import collective_scale
from bench.recovery import GLOBAL_BATCH, _descendants, _env, _wait, write_job
from trainer.thread_names import SNAPSHOT_WRITER

ARMS = ("bare", "ultrad", "ultrad+snap", "bare-again")
BARE_ARMS = ("bare", "bare-again")  # the plain torchrun loop
WARMUP = 5
COUNTER = Path(__file__).resolve().parent / "collectives"
TRAINING_CPU, OTHER_CPUS = {0}, {1}
EVICT_BYTES = 256 << 20  # more than any CPU cache here (32 MiB L3)


def counting_env(out: Path) -> dict[str, str]:
    """The environment under which training processes count their collectives into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rest = os.environ.get("PYTHONPATH", "")
    return {"ULTRA_COUNT_COLLECTIVES": str(out),
            "PYTHONPATH": os.pathsep.join(p for p in (str(COUNTER), rest) if p)}


def collectives(out: Path) -> int:
    """Collective calls counted so far by every training process of a run (not a standby's
    warm-up: bench/collectives/sitecustomize.py)."""
    return sum(_counted(path) for path in out.glob("*.json")
               if not path.name.endswith(".standby.json"))


def _counted(path: Path) -> int:
    """One process's count. The counter renames each new count over the last, so a read
    finds a whole one."""
    try:
        return sum(json.loads(path.read_text()).values())
    except FileNotFoundError:
        return 0


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def _is_store_process(pid: int) -> bool:
    """An agent's store process (daemon/control/store_process.py): part of the control path."""
    return "daemon.control.store_process" in _cmdline(pid)


def _is_standby(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return b"ULTRA_LOCAL_RANK=standby\0" in Path(f"/proc/{pid}/environ").read_bytes()
    return False


def _training_threads(pids: list[int]) -> Iterator[tuple[int, Path, bool]]:
    """(pid, /proc task dir, on the step's core) of every thread of the training ranks among
    `pids`; the thread that writes snapshots (trainer.snapshots names it) is off the step's
    core: that is work the design keeps off the step."""
    for pid in pids:
        if not _is_training(pid):
            continue
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    yield pid, task, (task / "comm").read_text().strip() != SNAPSHOT_WRITER


def _is_training(pid: int) -> bool:
    """A training rank: `python -m trainer...`, not torchrun's agent, not a standby."""
    argv = _cmdline(pid)
    if "-m" not in argv or "torch.distributed.run" in argv or _is_standby(pid):
        return False
    return any(a == "trainer" or a.startswith("trainer.") for a in argv)


def training_threads_cpu(pids: list[int]) -> tuple[float, float]:
    """(main thread, other threads on TRAINING_CPU) CPU seconds so far of the training ranks
    among `pids`: what runs on the step's core."""
    main = others = 0.0
    for pid, task, on_step in _training_threads(pids):
        with contextlib.suppress(OSError):
            if on_step and int(task.name) == pid:
                main += _stat_cpu(task / "stat")
            elif on_step:
                others += _stat_cpu(task / "stat")
    return main, others


def pin_training(pids: list[int]) -> None:
    """Move every thread of the training ranks among `pids` to TRAINING_CPU (threads they start
    later inherit it; called again at each sample for threads started from elsewhere), except
    the thread that writes snapshots off the step: it goes to OTHER_CPUS with the rest of the
    control path, as on a GPU node, where it runs on a core the step does not use."""
    for _, task, on_step in _training_threads(pids):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), TRAINING_CPU if on_step else OTHER_CPUS)


def copy_seconds(nbytes: int, runs: int = 20, cold: bool = False) -> float:
    """Median time of a plain copy of `nbytes` into a buffer allocated once, on TRAINING_CPU.
    `cold`: each copy after writing a buffer larger than the CPU caches, so its source and
    destination come from memory (a snapshot's copy follows a step that used the caches for
    activations and gradients); else the same bytes copied again and again, from the caches."""
    import torch

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, TRAINING_CPU)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        evict = torch.zeros(EVICT_BYTES, dtype=torch.uint8) if cold else None
        times = []
        for _ in range(runs):
            if evict is not None:
                evict.add_(1)
            started = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        os.sched_setaffinity(0, before)


NEIGHBOURS = {  # what runs on OTHER_CPUS while TRAINING_CPU multiplies matrices
    "idle": None,
    "a Python loop": "print(flush=True)\nwhile True:\n    d = {i: str(i) for i in range(1000)}",
    "a memory copy": "import torch\nx = torch.empty(16 << 20, dtype=torch.uint8)\n"
                     "y = torch.empty_like(x)\nprint(flush=True)\nwhile True:\n    y.copy_(x)",
}


def neighbour_interference(rounds: int = 5, seconds: float = 0.4) -> dict[str, float]:
    """Matrix multiplications per second on TRAINING_CPU while OTHER_CPUS is idle, runs a
    Python loop, or copies memory (rounds interleaved; the median of each), relative to
    idle. Two vCPUs of a virtual machine may share one physical core or its caches: then
    what the control path does on "its own" core slows the step's."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    before = os.sched_getaffinity(0)
    rates: dict[str, list[float]] = {name: [] for name in NEIGHBOURS}
    try:
        for _ in range(rounds):
            for name, code in NEIGHBOURS.items():
                neighbour = None if code is None else subprocess.Popen(
                    [sys.executable, "-c", code], stdout=subprocess.PIPE,
                    preexec_fn=lambda: os.sched_setaffinity(0, OTHER_CPUS))
                try:
                    if neighbour is not None:
                        neighbour.stdout.readline()  # it is in its loop
                    os.sched_setaffinity(0, TRAINING_CPU)
                    done, started = 0, time.perf_counter()
                    while time.perf_counter() - started < seconds:
                        for _ in range(20):
                            torch.mm(a, b)
                        done += 20
                    rates[name].append(done / (time.perf_counter() - started))
                finally:
                    os.sched_setaffinity(0, before)
                    if neighbour is not None:
                        neighbour.kill()
                        neighbour.wait()
    finally:
        os.sched_setaffinity(0, before)
    idle = statistics.median(rates["idle"])
    return {name: statistics.median(r) / idle for name, r in rates.items()}


def snapshot_step_bytes(snapshot_dir: Path) -> int:
    """The bytes of the newest snapshot step held under `snapshot_dir` (0: none)."""
    steps = sorted(snapshot_dir.rglob("step_*"), key=lambda p: p.name)
    if not steps:
        return 0
    return sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file())


def memory_blocking(metrics_url: str) -> tuple[float, float]:
    """(seconds, snapshots) the snapshots so far held the step, as the worker reported them to
    its agent."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name == "ultra_checkpoint_blocking_seconds":
            for sample in family.samples:
                if sample.labels.get("tier") == "memory":
                    found[sample.name.rsplit("_", 1)[-1]] = sample.value
    return found.get("sum", 0.0), found.get("count", 0.0)


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
    counts: Path  # where the training processes count their collectives
    pin: bool = False
    # (wall time, steps committed, CPU seconds so far) of the control processes, the workers;
    # and (wall time, steps committed, collectives so far) of the training processes
    control: list[tuple[float, int, float]] = field(default_factory=list)
    workers: list[tuple[float, int, float]] = field(default_factory=list)
    calls: list[tuple[float, int, float]] = field(default_factory=list)
    # pinned runs: the training rank's main thread and its other threads on the step's core
    main_thread: list[tuple[float, int, float]] = field(default_factory=list)
    other_threads: list[tuple[float, int, float]] = field(default_factory=list)
    _worker_cpu: dict[int, float] = field(default_factory=dict)

    def sample(self, control: list[int], workers: set[int]) -> None:
        if self.pin:
            pin_training(sorted(workers))
            main, others = training_threads_cpu(sorted(workers))
            n = committed(self.steps_file)
            self.main_thread.append((time.time(), n, main))
            self.other_threads.append((time.time(), n, others))
        now, n = time.time(), committed(self.steps_file)
        self.control.append((now, n, sum(cpu_seconds(p) for p in control)))
        for pid in workers:  # a worker that exited keeps the CPU it was last seen with
            self._worker_cpu[pid] = max(self._worker_cpu.get(pid, 0.0), cpu_seconds(pid))
        self.workers.append((now, n, sum(self._worker_cpu.values())))
        self.calls.append((now, n, float(collectives(self.counts))))

    def per_step(self, steps: int, after: float = 0.0
                 ) -> tuple[float, float, float, float, float]:
        """(control, workers) CPU seconds per step, collectives per step (all ranks), and (the
        training rank's main thread, its other threads on the step's core) CPU seconds per step
        (pinned runs; NaN otherwise), from samples taken after `after` (the standby workers'
        torch import is a start-up cost, not a per-step one)."""
        return tuple(control_cpu_per_step([(n, c) for t, n, c in samples if t > after], steps)
                     for samples in (self.control, self.workers, self.calls, self.main_thread,
                                     self.other_threads))  # type: ignore


@dataclass
class ArmRun:
    gaps: list[float]  # seconds between consecutive committed steps
    control_cpu: float  # CPU seconds per step of the control processes
    worker_cpu: float  # and of the training processes
    collectives: float  # collective calls per step and rank
    main_thread_cpu: float = float("nan")  # pinned: the rank's main thread, CPU s per step
    other_threads_cpu: float = float("nan")  # pinned: its other threads on the step's core
    # Mean seconds a snapshot held the step (ultrad+snap), over the snapshots after the first
    # WARMUP steps: the rewrites, not the generation's first snapshot (a full, collective save).
    blocking: float = float("nan")
    snapshot_bytes: int = 0  # the bytes of one snapshot step


def run_bare(work: Path, job: Path, steps: int, ranks: int, pin: bool = False) -> ArmRun:
    """Step gaps, and the CPU seconds per committed step of torchrun's own agent (the bare
    loop's control process) and of its workers."""
    output = work / "output"
    meter = CpuMeter(output / "steps.jsonl", work / "collectives", pin)
    with (work / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={ranks}", "-m", "trainer", "--config", str(job), "--steps",
             str(steps), "--set", f"train.steps={steps}", "--set", "checkpoint.every=0",
             "--set", f'job.output_dir="{output}"'],  # the same job the ultrad arms submit
            cwd=work, env={**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                           **counting_env(work / "collectives")},
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 900
            while proc.poll() is None and time.monotonic() < deadline:
                meter.sample([proc.pid], set(_descendants(proc.pid)))
                time.sleep(0.2 if pin else 0.5)
            if proc.poll() is None:
                raise TimeoutError("torchrun did not finish in 900 s")
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, "torchrun")
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    control, workers, calls, main, others = meter.per_step(steps)
    return ArmRun(step_gaps(output / "steps.jsonl"), control, workers, calls / ranks, main,
                  others)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 once it is gone)."""
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0


def _stat_cpu(stat: Path) -> float:
    """User + system CPU seconds in a /proc stat file (a process's or a thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def committed(steps_file: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return len(steps_file.read_text().splitlines())
    return 0


def control_cpu_per_step(samples: list[tuple[int, float]], steps: int) -> float:
    """Growth per committed step of a count (CPU seconds, collective calls) over the samples
    from a third of the run to its final tenth: the least-squares slope of the count against
    the steps committed, `samples` being (steps committed, count so far).

    A sample reads the steps committed, then the count, and the next step's work goes on in
    between: a count sampled a few calls into step n + 1 is booked to step n. Two samples'
    difference carries that phase whole (3.01 collectives per step for 3.00 over a hundred
    steps); the slope through every sample of the window averages it out."""
    middle = [(n, c) for n, c in samples if steps // 3 <= n <= steps - steps // 10]
    if len({n for n, _ in middle}) < 2:
        return float("nan")
    mean_n = sum(n for n, _ in middle) / len(middle)
    mean_c = sum(c for _, c in middle) / len(middle)
    spread = sum((n - mean_n) ** 2 for n, _ in middle)
    return sum((n - mean_n) * (c - mean_c) for n, c in middle) / spread


def run_ultrad(work: Path, job: Path, steps: int, nodes: int, snapshots: bool,
               pin: bool = False) -> ArmRun:
    """Step gaps, and the CPU seconds per committed step of the agents and etcd together and
    of the workers."""
    from daemon.cli.local import LocalCluster, _call
    from proto.ultrascale.v1 import agent_pb2 as pb

    cluster = LocalCluster(work / "state", nodes, 1, ttl=2, allowed_paths=(work, job.parent))
    output = work / "output"
    pids: set[int] = set()  # the workers (and standbys)
    stores: set[int] = set()  # the agents' store processes: control, like the agents
    meter = CpuMeter(output / "steps.jsonl", work / "collectives", pin)
    blocking, snapshot_bytes = float("nan"), 0
    warm: tuple[float, float] | None = None  # memory_blocking once WARMUP steps are in
    saved_env = dict(os.environ)
    os.environ.update(counting_env(work / "collectives"))  # the agents pass it to workers
    try:
        cluster.start(timeout=90)
        token = cluster.token_file.read_text().strip()
        overrides = [f'job.output_dir="{output}"', "checkpoint.every=0",
                     f"train.steps={steps}",
                     f"checkpoint.snapshot_every={1 if snapshots else 0}"]
        _call(cluster, token, "SubmitJob",
              pb.SubmitJobRequest(spec_toml=job.read_text(), overrides=overrides))
        metrics_url = json.loads((cluster.state_dir / "node-0" / "agent.json").read_text())[
            "metrics_url"]

        def finished() -> bool:
            nonlocal warm
            for proc in cluster.agents.values():
                for pid in _descendants(proc.pid):
                    (stores if _is_store_process(pid) else pids).add(pid)
            assert cluster.etcd is not None and cluster.etcd.proc is not None
            control = [p.pid for p in cluster.agents.values()] + [cluster.etcd.proc.pid]
            meter.sample(control + sorted(stores), pids)
            if snapshots and warm is None and meter.workers[-1][1] > WARMUP:
                warm = memory_blocking(metrics_url)
            return _call(cluster, token, "GetStatus", pb.GetStatusRequest()).finished

        _wait(finished, 900, "the job to finish", 0.2 if pin else 0.5)
        if snapshots and warm is not None:
            held, taken = memory_blocking(metrics_url)
            if taken > warm[1]:
                blocking = (held - warm[0]) / (taken - warm[1])
            assert cluster.snapshot_dir is not None
            snapshot_bytes = snapshot_step_bytes(cluster.snapshot_dir)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        cluster.stop()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)
    ready = standbys_ready(cluster.state_dir)
    control, workers, calls, main, others = meter.per_step(steps, ready)
    return ArmRun(step_gaps(output / "steps.jsonl", after=ready), control, workers,
                  calls / nodes, main, others, blocking, snapshot_bytes)


def run_order(arms: list[str], run: int) -> list[str]:
    """The arms in the order run `run` runs them: rotated by one each run, so that over as
    many runs as there are arms each arm runs first, second and third once. A fixed order
    puts any drift within a run (the machine's speed, what the runs before left behind) on
    the later arms' ratios to the bare loop, always in the same direction."""
    k = run % len(arms)
    return arms[k:] + arms[:k]


def table(root: Path, job: Path, arms: list[str], runs: int, steps: int, ranks: int,
          global_batch: int, pin: bool) -> None:
    """Run every arm `runs` times, interleaved, and print the table."""
    results: dict[str, list[ArmRun]] = {arm: [] for arm in arms}
    for run in range(runs):
        for arm in run_order(arms, run):
            work = root / f"{'pinned' if pin else 'free'}-{arm}-{run}"
            work.mkdir()
            started = time.monotonic()
            if arm in BARE_ARMS:
                r = run_bare(work, job, steps, ranks, pin)
            else:
                r = run_ultrad(work, job, steps, ranks, arm == "ultrad+snap", pin)
            results[arm].append(r)
            print(f"  {arm} run {run}: median step {statistics.median(r.gaps) * 1e3:.1f} ms "
                  f"over {len(r.gaps)} steps ({time.monotonic() - started:.0f}s)",
                  file=sys.stderr, flush=True)

    def med(arm: str, value) -> float:
        return statistics.median(value(r) for r in results[arm])

    medians = {arm: [statistics.median(r.gaps) for r in results[arm]] for arm in arms}
    base = statistics.median(medians["bare"]) if "bare" in medians else float("nan")
    where = (f"1 rank pinned to CPU {min(TRAINING_CPU)}, everything else on CPU "
             f"{min(OTHER_CPUS)}" if pin else f"{ranks} ranks, unpinned")
    print(f"\nwall time per step, {where}, global batch {global_batch} (median over {runs} "
          f"runs of each run's median over steps {WARMUP + 1}..{steps})")
    total = {arm: med(arm, lambda r: r.control_cpu + r.worker_cpu) for arm in arms}
    base_cpu = total.get("bare", float("nan"))
    print(f"{'arm':<12} {'ms/step':>8} {'vs bare':>8} {'control CPU ms/step':>20} "
          f"{'workers CPU ms/step':>20} {'all CPU ms/step':>16} {'vs bare':>8} "
          f"{'collectives/step/rank':>22}")
    for arm in arms:
        m = statistics.median(medians[arm])
        print(f"{arm:<12} {m * 1e3:>8.1f} {m / base:>7.3f}x "
              f"{med(arm, lambda r: r.control_cpu) * 1e3:>20.1f} "
              f"{med(arm, lambda r: r.worker_cpu) * 1e3:>20.1f} {total[arm] * 1e3:>16.1f} "
              f"{total[arm] / base_cpu:>7.2f}x {med(arm, lambda r: r.collectives):>22.2f}")
    if "bare" in medians and runs > 1:
        # The machine's speed drifts between runs; an arm against the bare loop of its own run
        # cancels that drift.
        print("\neach run against its own bare loop:")
        for arm in arms:
            if arm != "bare":
                ratios = [a / b for a, b in zip(medians[arm], medians["bare"], strict=True)]
                print(f"{arm:<12} median {statistics.median(ratios):.3f}x  "
                      f"({', '.join(f'{r:.3f}' for r in ratios)})")
        if "bare-again" in medians:
            same = [a / b for a, b in zip(medians["bare-again"], medians["bare"], strict=True)]
            print(f"resolution: the same bare loop twice in a run, {min(same):.3f}x to "
                  f"{max(same):.3f}x (median |ratio - 1| "
                  f"{statistics.median(abs(r - 1) for r in same):.3f}): an arm's ratio closer "
                  f"to 1 than that is within the machine's drift, not measured")
    if pin:
        print(f"\nCPU per step on the step's core (CPU {min(TRAINING_CPU)}), from /proc: the "
              f"rank's main thread, and its other threads (gloo's, gRPC's, the heartbeat; "
              f"not the snapshot writer, moved off it)")
        for arm in arms:
            print(f"{arm:<12} main thread {med(arm, lambda r: r.main_thread_cpu) * 1e3:6.2f} ms"
                  f"   other threads {med(arm, lambda r: r.other_threads_cpu) * 1e3:5.2f} ms")
    if pin and "ultrad+snap" in results:
        snaps = results["ultrad+snap"]
        nbytes = int(statistics.median(r.snapshot_bytes for r in snaps))
        blocking = statistics.median(r.blocking for r in snaps)
        hot = copy_seconds(nbytes) if nbytes else float("nan")
        cold = copy_seconds(nbytes, cold=True) if nbytes else float("nan")
        print(f"\na snapshot of {nbytes / 1e6:.2f} MB held the step {blocking * 1e3:.3f} ms "
              f"(worker's report, mean over the snapshots after step {WARMUP}, median over runs); "
              f"a plain copy of the same bytes on CPU {min(TRAINING_CPU)}: {cold * 1e3:.3f} ms "
              f"from memory ({blocking / cold:.1f}x), {hot * 1e3:.3f} ms from the caches "
              f"({blocking / hot:.1f}x)")
    if pin:
        slowed = neighbour_interference()
        print(f"\nthe step's core next to busy ones: matrix multiplications on CPU "
              f"{min(TRAINING_CPU)} while CPU {min(OTHER_CPUS)} "
              + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in slowed.items()
                          if name != "idle") + " (of idle)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma-separated subset of " + ", ".join(ARMS) + " (ratios need bare)")
    p.add_argument("--pin", action="store_true",
                   help="first a table of 1 rank pinned to CPU 0, the rest on CPU 1")
    p.add_argument("--pinned-steps", type=int, default=300,
                   help="steps of each pinned run (its rank steps twice as fast as one of 3 "
                        "unpinned ranks, and only the steps after the standby is ready count)")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        p.error(f"--arms: a comma-separated subset of {', '.join(ARMS)} (got {args.arms!r})")
    if args.runs < 1 or min(args.steps, args.pinned_steps) <= WARMUP + 2 or args.nodes < 1 \
            or args.global_batch < 1:
        p.error("--runs >= 1, --steps and --pinned-steps > 7, --nodes >= 1 and "
                "--global-batch >= 1")
    allowed = os.sched_getaffinity(0)
    if args.pin and not allowed >= (TRAINING_CPU | OTHER_CPUS):
        p.error(f"--pin needs CPUs {sorted(TRAINING_CPU | OTHER_CPUS)} (this process may use "
                f"{sorted(allowed)})")
    root = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    job = write_job(root, args.global_batch)
    try:
        if args.pin:
            os.sched_setaffinity(0, OTHER_CPUS)  # every process started from here inherits it
            try:
                table(root, job, arms, args.runs, args.pinned_steps, 1, args.global_batch,
                      pin=True)
            finally:
                os.sched_setaffinity(0, allowed)
        table(root, job, arms, args.runs, args.steps, args.nodes, args.global_batch, pin=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # What the step would pay for an agreement of its own: bench/collective_scale.py.
    print("\nwhat one more collective per step would cost as the world grows")
    print(collective_scale.table(collective_scale.measure(), collective_scale.CALLS,
                                 collective_scale.RUNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
