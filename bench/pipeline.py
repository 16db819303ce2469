"""Pipeline bubble: measured idle fraction against the playbook's prediction, per schedule.

    python -m bench.pipeline [--steps 8] [--pp 2 4]

For p in {2, 4}, p gloo ranks are spawned once and run every (schedule, v, m) with v in {1, 2}
and m in {4, 8} micro-batches per step through the real trainer (`trainer.loop.Trainer`, dp 1,
ZeRO-2) on an 8-layer Llama. Combinations a schedule cannot run are listed with the reason
`parallel.layout` gives. Per step, each pp rank measures `1 - busy / step_time` (busy: its
forward, loss, backward and gradient-reduction actions; parallel.pipeline); the table shows the
median over steps (the first, which also infers stage shapes, is dropped) of the mean over
ranks, with the per-rank medians beside it.

Predicted is the playbook's bubble r = (p - 1) / (v m) ("Pipeline parallelism", interleaving
stages) as a fraction of the step, r / (1 + r). Zero-bubble schedules aim below it (their weight
gradients fill the bubble). On a CPU box with fewer cores than ranks (p = 4 on 2 cores), ranks
that compute at the same time share a core, so busy time stretches and the measured bubble
reads low; compare schedules within a row group, not with a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.ranks import init_gloo_rank
from daemon.procutil import free_port
from parallel.job import (
    ConfigError,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    process_group_timeout,
)
from parallel.layout import Layout, predicted_bubble, resolve
from parallel.mesh import build_mesh
from trainer.data import SampleStream

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble (v=1) / ScheduleZBVZeroBubble (v=2)",
}
VIRTUAL = (1, 2)
MICRO_BATCHES = (4, 8)
MICRO_BATCH = 2
SEQ = 64


def job(p: int, schedule: str, v: int, m: int) -> JobConfig:
    return JobConfig(
        model=ModelConfig(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=SEQ,
        ),
        train=TrainConfig(steps=1000, global_batch=m * MICRO_BATCH, seq_len=SEQ, warmup_steps=1),
        parallel=ParallelConfig(
            pp=p, pp_schedule=schedule, virtual_stages=v, micro_batch=MICRO_BATCH, zero=2
        ),
    )


def configs(p: int) -> tuple[list[tuple[str, int, int]], list[str]]:
    runnable, skipped = [], []
    for schedule in SCHEDULES:
        for v in VIRTUAL:
            for m in MICRO_BATCHES:
                try:
                    resolve(job(p, schedule, v, m), p)
                except ConfigError as exc:
                    skipped.append(f"p={p} {schedule} v={v} m={m}: {exc}")
                    continue
                runnable.append((schedule, v, m))
    return runnable, skipped


def _rank_main(rank: int, p: int, port: int, steps: int, out: mp.Queue) -> None:
    init_gloo_rank(rank, p, port)
    from trainer.loop import Trainer

    tokens = np.random.default_rng(0).integers(0, 256, size=200_000).astype(np.uint16)
    stream = SampleStream(tokens, SEQ, seed=0)
    try:
        for schedule, v, m in configs(p)[0]:
            cfg = job(p, schedule, v, m)
            layout = resolve(cfg, p)
            mesh = build_mesh(layout, "cpu", timedelta(seconds=process_group_timeout(cfg.fault)))
            trainer = Trainer(cfg, layout, mesh, torch.device("cpu"), stream)
            results = [trainer.train_step() for _ in range(steps + 1)][1:]
            if rank == 0:
                out.put((schedule, v, m, layout, results))
            del trainer
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _row(p: int, schedule: str, v: int, m: int, layout: Layout, results: list) -> str:
    per_rank = [statistics.median(r.bubble_ratio_pp_ranks[i] for r in results) for i in range(p)]
    mean = statistics.median(statistics.fmean(r.bubble_ratio_pp_ranks) for r in results)
    step_ms = statistics.median(r.step_seconds for r in results) * 1e3
    ranks = " ".join(f"{x:.2f}" for x in per_rank)
    pred = predicted_bubble(layout)
    return (
        f"{schedule:<17} {p:>2} {v:>2} {m:>2} {pred:>9.3f} {mean:>9.3f} {mean / pred:>6.2f}"
        f"  {step_ms:>8.1f}  {ranks}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per config (after one)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], choices=(2, 4))
    args = ap.parse_args(argv)
    started = time.perf_counter()
    header = (
        f"{'schedule':<17} {'p':>2} {'v':>2} {'m':>2} {'predicted':>9} {'measured':>9} "
        f"{'ratio':>6}  {'step ms':>8}  per-rank measured"
    )
    rows, skipped = [], []
    ctx = mp.get_context("spawn")
    for p in args.pp:
        runnable, skip = configs(p)
        skipped += skip
        queue = ctx.Queue()
        procs = mp.start_processes(
            _rank_main,
            args=(p, free_port(), args.steps, queue),
            nprocs=p,
            join=False,
            start_method="spawn",
        )
        for _ in runnable:
            rows.append(_row(p, *queue.get(timeout=600)))
            print(f"  done: {rows[-1].split()[0]} p={p} ({len(rows)})", file=sys.stderr, flush=True)
        procs.join()
    print(f"Pipeline bubble, median of {args.steps} steps (1 warm-up dropped); "
          f"{os.cpu_count()} CPU cores, gloo, dp 1, ZeRO-2")  # fmt: skip
    print("predicted = r/(1+r), r = (p-1)/(v*m) [Ultra-Scale Playbook, pipeline parallelism]")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(row)
    print("\nschedules:")
    for name, cls in SCHEDULES.items():
        print(f"  {name:<17} {cls}")
    print("skipped (not supported by the schedule):")
    for line in skipped:
        print(f"  {line}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
