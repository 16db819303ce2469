"""Cost of `parallel.reproducible`: step time and peak memory with the mode off and on.

    python -m bench.reproducible [--steps 10] [--dp 1 2 4] [--zero 1 2 3] [--job examples/tiny.toml]

For each dp and ZeRO stage, through the real trainer (`trainer.loop.Trainer`), one intra-op
thread per rank (so that no OpenMP team waits on a core that other work holds):

- Time: one set of dp gloo ranks builds the job twice, mode off and mode on, and alternates
  their steps (off, on, off, on, ...; torch's deterministic setting switched with them), so
  both see the same machine at nearly the same moment; a loaded machine moves both alike.
  Shown: the median over the measured pairs (2 warm-up pairs dropped) of the slowest rank's
  wall time per step, of the ranks' summed CPU time per step, and of the per-pair ratios.
- Memory: fresh ranks per mode (peak RSS is per process) run WARMUP + 2 steps. Shown: the
  largest peak RSS of any rank (ru_maxrss), and that peak above the rank's RSS once torch and
  the process group were up (the training part of it).

`retries`: steps that ran again because a gradient left the fixed-point range agreed from
micro-batch 0. The int64 accumulator the mode adds is 8 bytes per parameter per rank
(docs/reproducible.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.ranks import init_gloo_rank
from daemon.procutil import free_port
from parallel.job import load
from parallel.layout import resolve
from parallel.mesh import build_mesh
from trainer.loop import Trainer

WARMUP = 2
JOB = Path(__file__).resolve().parent.parent / "examples" / "tiny.toml"


@dataclass(frozen=True)
class Timed:
    wall_ms: tuple[float, float]  # median over pairs of the slowest rank's step: off, on
    cpu_ms: tuple[float, float]  # median over pairs of the ranks' summed CPU time: off, on
    wall_ratio: float  # median over pairs of on / off
    cpu_ratio: float
    retries: int
    params: int


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _join(rank: int, dp: int, port: int) -> timedelta:
    timeout = timedelta(seconds=120)
    init_gloo_rank(rank, dp, port, timeout)
    return timeout


def _trainer(job: str, dp: int, zero: int, reproducible: bool, timeout: timedelta) -> Trainer:
    overrides = [f"parallel.zero={zero}", f"parallel.reproducible={str(reproducible).lower()}"]
    cfg = load(job, overrides)
    layout = resolve(cfg, dp)
    return Trainer(cfg, layout, build_mesh(layout, "cpu", timeout), torch.device("cpu"))


def _gather(row: list[float], dp: int) -> torch.Tensor:
    mine = torch.tensor(row, dtype=torch.float64)
    rows = [torch.zeros_like(mine) for _ in range(dp)]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


def _time_main(
    rank: int, dp: int, port: int, job: str, zero: int, steps: int, out: mp.Queue
) -> None:
    timeout = _join(rank, dp, port)
    try:
        pair = [_trainer(job, dp, zero, on, timeout) for on in (False, True)]
        wall: list[list[float]] = [[], []]
        cpu: list[list[float]] = [[], []]
        for _ in range(WARMUP + steps):
            for i, trainer in enumerate(pair):
                torch.use_deterministic_algorithms(bool(i))
                before = time.process_time()
                wall[i].append(trainer.train_step().step_seconds)
                cpu[i].append(time.process_time() - before)
        table = _gather([*wall[0], *wall[1], *cpu[0], *cpu[1]], dp).view(dp, 4, -1)[..., WARMUP:]
        if rank == 0:
            slowest, summed = table[:, :2].amax(dim=0), table[:, 2:].sum(dim=0)
            on = pair[1]
            out.put(
                Timed(
                    (statistics.median(slowest[0].tolist()) * 1e3,
                     statistics.median(slowest[1].tolist()) * 1e3),
                    (statistics.median(summed[0].tolist()) * 1e3,
                     statistics.median(summed[1].tolist()) * 1e3),
                    statistics.median((slowest[1] / slowest[0]).tolist()),
                    statistics.median((summed[1] / summed[0]).tolist()),
                    on.exact.retries if on.exact is not None else 0,
                    sum(p.numel() for p in on.model.parameters()),
                )
            )  # fmt: skip
    finally:
        dist.destroy_process_group()


def _memory_main(
    rank: int, dp: int, port: int, job: str, zero: int, on: bool, out: mp.Queue
) -> None:
    timeout = _join(rank, dp, port)
    try:
        start = _peak_rss()
        trainer = _trainer(job, dp, zero, on, timeout)
        for _ in range(WARMUP + 2):
            trainer.train_step()
        table = _gather([_peak_rss(), _peak_rss() - start], dp)
        if rank == 0:
            out.put((int(table[:, 0].max()), int(table[:, 1].max())))
    finally:
        dist.destroy_process_group()


def _spawn(fn: Callable[..., None], dp: int, *args: Any) -> Any:
    queue = mp.get_context("spawn").Queue()
    procs = mp.start_processes(
        fn, args=(dp, free_port(), *args, queue), nprocs=dp, join=False, start_method="spawn"
    )
    result = queue.get(timeout=1800)
    procs.join()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.reproducible", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--steps", type=int, default=10, help=f"measured steps (after {WARMUP})")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3], choices=(1, 2, 3))
    ap.add_argument("--job", default=str(JOB))
    args = ap.parse_args(argv)
    started = time.perf_counter()
    mib = 2.0**20
    header = (
        f"{'dp':>2} {'zero':>4} | {'step ms off':>11} {'on':>7} {'ratio':>6} | "
        f"{'CPU ms off':>10} {'on':>7} {'ratio':>6} | "
        f"{'peak MiB off':>12} {'on':>5} {'ratio':>6} | {'above start off':>15} {'on':>5} "
        f"{'ratio':>6} | {'retries':>7}"
    )
    rows, params = [], 0
    for dp in args.dp:
        for zero in args.zero:
            timed: Timed = _spawn(_time_main, dp, args.job, zero, args.steps)
            (rss_off, above_off), (rss_on, above_on) = (
                _spawn(_memory_main, dp, args.job, zero, on) for on in (False, True)
            )
            params = timed.params
            rows.append(
                f"{dp:>2} {zero:>4} | {timed.wall_ms[0]:>11.1f} {timed.wall_ms[1]:>7.1f} "
                f"{timed.wall_ratio:>6.2f} | {timed.cpu_ms[0]:>10.1f} {timed.cpu_ms[1]:>7.1f} "
                f"{timed.cpu_ratio:>6.2f} | {rss_off / mib:>12.0f} {rss_on / mib:>5.0f} "
                f"{rss_on / rss_off:>6.2f} | {above_off / mib:>15.0f} {above_on / mib:>5.0f} "
                f"{above_on / max(1, above_off):>6.2f} | {timed.retries:>7}"
            )
            print(f"  done: dp={dp} zero={zero}", file=sys.stderr, flush=True)
    print(
        f"parallel.reproducible off vs on: {Path(args.job).name}, {params:,} parameters, "
        f"median of {args.steps} alternating off/on steps ({WARMUP} warm-up dropped), "
        f"{os.cpu_count()} CPU cores, gloo, 1 thread per rank"
    )
    print(f"int64 accumulator of the mode: {8 * params / mib:.1f} MiB per rank")
    print(header)
    print("-" * len(header))
    print("\n".join(rows))
    print(f"\ntotal {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
