"""One training run inside a launched process: join the world, build, restore, train."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.job import JobConfig, process_group_timeout
from parallel.layout import resolve
from parallel.mesh import build_mesh
from trainer.driver import GenerationDriver, output_dir, select_device
from trainer.fault_injection import NonFiniteInjection
from trainer.teardown import leave_world


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def init_distributed(timeout: timedelta) -> tuple[torch.device, str]:
    """Join torchrun's world, or form a world of one when not launched by torchrun."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # Ranks share the cores this process may run on (its CPU affinity: taskset, a cgroup
    # cpuset); oversubscribing threads makes every rank slower.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    device, backend, device_type = select_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return device, device_type


def run(cfg: JobConfig, *, stop_at: int, resume: bool, printer) -> int:
    timeout = timedelta(seconds=process_group_timeout(cfg.fault))
    device, device_type = init_distributed(timeout)
    try:
        return _train(cfg, device, device_type, timeout, stop_at=stop_at, resume=resume,
                      printer=printer)
    except BaseException as exc:
        # The traceback's frames hold the model and the mesh: drop their locals (it still
        # names every line) so that the world can be freed below.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        # Free the world now, while the interpreter is alive: its groups are pinned by the
        # mesh and torch.distributed's caches, and left to interpreter shutdown a gloo group's
        # threads can abort the process after a run that trained to the end.
        leave_world()


def _train(cfg: JobConfig, device: torch.device, device_type: str, timeout: timedelta, *,
           stop_at: int, resume: bool, printer) -> int:
    rank = dist.get_rank()
    layout = resolve(cfg, dist.get_world_size())
    driver = GenerationDriver(
        cfg,
        layout,
        build_mesh(layout, device_type, timeout),
        device,
        timeout=timeout,
        last_step=stop_at,
        step_log=output_dir(cfg),
        inject=NonFiniteInjection.from_env(os.environ),
    )
    restored = driver.restore_start(resume)
    if rank == 0 and restored.source == "checkpoint":
        _log(f"resume: loaded {driver.ckpt.root / restored.name} (step {driver.step}, "
             f"consumed_samples {driver.consumed_samples}) on dp={layout.dp}")
    elif rank == 0 and (resume or restored.source == "pretrained"):
        _log(f"restored {restored.describe()}")
    if rank == 0:
        _log(f"layout: {layout.to_dict()}")
    while driver.step < stop_at:
        result = driver.train_step()
        driver.commit(result)
        if rank == 0:
            printer.step(result, layout.dp)
        if driver.checkpoint_due(result.step):
            driver.save()
    driver.wait()
    return 0
