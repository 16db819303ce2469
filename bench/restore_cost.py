"""What one rank's start of a restored generation costs in CPU, without the recovery around it.

    python -m bench.restore_cost [--runs 30] [--workdir DIR]

`bench.recovery` times a whole recovery on three nodes that share this machine's two cores, so
a few milliseconds of one rank's work are inside its run-to-run spread. This measures that work
alone: one process, a gloo world of one, the recovery benchmark's job (its 2-layer Llama with
ZeRO-3 and AdamW), and medians over `--runs` after 3 untimed rounds of

- build: the generation's `Trainer` with its weights undrawn (as a restoring worker builds it),
  after dropping torch.distributed's DTensor caches as a surviving worker's teardown does, so
  every sharding propagation is paid again as in a new world;
- restore: `load_snapshot` of a snapshot of that state from this node's shared memory (the
  index read and checked, the plan, every chunk fetched and verified, the state written).

Each restore is checked to bring back the saved step and parameters.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.recovery import write_job
from checkpoint.snapshot_reader import load_snapshot, local_fetch
from checkpoint.snapshot_writer import save_snapshot
from daemon.procutil import free_port
from parallel.job import load
from parallel.layout import resolve
from parallel.mesh import build_mesh
from trainer.loop import Trainer
from trainer.teardown import clear_dtensor_caches, leave_world

STEP = 5


def measure(work: Path, runs: int) -> dict[str, list[float]]:
    """Seconds of each round's build and restore (the untimed rounds left out)."""
    job = load(write_job(work))
    layout = resolve(job, 1)  # as the torchrun entry resolves a world of one
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = build_mesh(layout, "cpu", timedelta(seconds=60))
        saved = Trainer(job, layout, mesh, torch.device("cpu"))
        saved.train_step()
        saved.progress.step = STEP
        root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        try:
            save_snapshot(saved.state, root, layout=layout.to_dict())
            expected = [p.full_tensor().clone() for p in saved.model.parameters()]
            times: dict[str, list[float]] = {"build": [], "restore": []}
            for i in range(runs + 3):
                clear_dtensor_caches()
                started = time.perf_counter()
                trainer = Trainer(job, layout, mesh, torch.device("cpu"), initial_weights=False)
                built = time.perf_counter()
                load_snapshot(trainer.state, STEP, local_fetch(root, STEP))
                restored = time.perf_counter()
                if trainer.progress.step != STEP or not all(
                        torch.equal(p.full_tensor(), q) for p, q
                        in zip(trainer.model.parameters(), expected, strict=True)):
                    raise AssertionError("the restore did not bring back the saved state")
                if i >= 3:
                    times["build"].append(built - started)
                    times["restore"].append(restored - built)
                del trainer
            return times
        finally:
            shutil.rmtree(root, ignore_errors=True)
    finally:
        leave_world()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.restore_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be >= 1")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-restore-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    times = measure(work, args.runs)
    print(f"\none rank's generation start, recovery benchmark's job, world of 1 (median of "
          f"{args.runs}, ms)")
    print(f"{'build':>8}  {'restore':>8}  {'total':>8}")
    build, restore = (statistics.median(times[k]) * 1e3 for k in ("build", "restore"))
    print(f"{build:8.2f}  {restore:8.2f}  {build + restore:8.2f}")


if __name__ == "__main__":
    main()
