"""What one extra collective per step would cost as the world grows: a tiny all-reduce on gloo.

    python -m bench.collective_scale [--worlds 2,4,8,16,32] [--calls 200] [--runs 3]

The worker's agreement on the agent's requests (three integers: planned change, checkpoint
request, stop) rides on an all-reduce the step performs anyway (trainer/agreement.py); as an
all-reduce of its own it would be one more collective on every step, over the whole world. This
table shows what such a collective costs at each world size: `world` gloo ranks on loopback
(forked from a server that imported torch once), each timing `--calls` all-reduces of a 3-element
int64 tensor after 20 untimed, from a barrier to the last rank done; the median over `--runs` of
the time per call on rank 0, and its ratio to the smallest world's.

On this 2-core machine the ranks past two take turns on the cores, so the larger worlds measure
the scheduler's hand-offs as much as gloo's algorithm; on a cluster each step of the algorithm
is a network hop instead. Either way the cost grows with the world and is paid in full by every
step, since no rank can go on before the all-reduce has heard from all of them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.ranks import init_gloo_rank, timed_across_ranks

WORLDS = (2, 4, 8, 16, 32)
WARMUP = 20
CALLS = 200  # timed all-reduces per run
RUNS = 3
TIMEOUT = timedelta(seconds=120)


def _rank(rank: int, world: int, port: int, calls: int, runs: int, out: str) -> None:
    init_gloo_rank(rank, world, port, TIMEOUT)
    flags = torch.zeros(3, dtype=torch.int64)

    def all_reduces(n: int) -> None:
        for _ in range(n):
            dist.all_reduce(flags)

    all_reduces(WARMUP)
    per_call = [timed_across_ranks(lambda: all_reduces(calls)) / calls for _ in range(runs)]
    if rank == 0:
        Path(out).write_text(json.dumps(per_call))
    dist.destroy_process_group()


PRELOAD = ["torch.distributed", "bench.ranks"]


def seconds_per_call(world: int, calls: int, runs: int,
                     preload: list[str] | None = None) -> list[float]:
    """Each run's seconds per all-reduce on rank 0 of a fresh gloo world of `world` ranks,
    forked from the process's forkserver, which imports `preload` (default `PRELOAD`) when it
    starts: the first use in the process decides, so a caller with a forkserver of its own
    passes that server's list."""
    from bench.collective_scale import _rank  # by its module's name, also under `-m`
    from daemon.procutil import free_port

    context = multiprocessing.get_context("forkserver")
    # torch imported once, in the server. Not this module: a child imports it by name after
    # running the main module, and runpy warns when it finds it imported already.
    context.set_forkserver_preload(PRELOAD if preload is None else preload)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "per_call.json")
        port = free_port()
        ranks = [context.Process(target=_rank, args=(r, world, port, calls, runs, out),
                                 name=f"allreduce-{r}") for r in range(world)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(TIMEOUT.total_seconds())
        failed = [p.name for p in ranks if p.exitcode != 0]
        for p in ranks:
            if p.is_alive():
                p.kill()
        if failed:
            raise RuntimeError(f"all-reduce world of {world}: rank(s) {', '.join(failed)} failed")
        return json.loads(Path(out).read_text())


@dataclass(frozen=True)
class Row:
    world: int
    per_call_s: float  # median over runs


def measure(worlds: tuple[int, ...] = WORLDS, calls: int = CALLS, runs: int = RUNS) -> list[Row]:
    return [Row(w, statistics.median(seconds_per_call(w, calls, runs))) for w in worlds]


def table(rows: list[Row], calls: int, runs: int) -> str:
    base = rows[0].per_call_s
    lines = [f"one all-reduce of 3 int64s on gloo, loopback, {calls} calls (median of {runs} "
             "runs, rank 0)",
             f"{'ranks':>5}  {'us per call':>11}  {'vs ' + str(rows[0].world) + ' ranks':>10}",
             f"{'-' * 5}  {'-' * 11}  {'-' * 10}"]
    lines += [f"{r.world:>5}  {r.per_call_s * 1e6:>11.1f}  {r.per_call_s / base:>9.1f}x"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.collective_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    p.add_argument("--calls", type=int, default=CALLS)
    p.add_argument("--runs", type=int, default=RUNS)
    args = p.parse_args(argv)
    try:
        worlds = tuple(int(w) for w in args.worlds.split(","))
    except ValueError:
        p.error(f"--worlds: comma-separated rank counts (got {args.worlds!r})")
    if not worlds or min(worlds) < 2 or args.calls < 1 or args.runs < 1:
        p.error("--worlds of 2 ranks or more, --calls >= 1 and --runs >= 1")
    print(table(measure(worlds, args.calls, args.runs), args.calls, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
