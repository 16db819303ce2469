"""One training run inside a launched process: join the world, build, restore, train."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.durable import CheckpointManager
from parallel.job import JobConfig
from parallel.layout import resolve
from parallel.mesh import build_mesh
from trainer.loop import Trainer


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def select_device(local_rank: int) -> tuple[torch.device, str, str]:
    """(device, process-group backend, mesh device type) for this local rank."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo for the CPU side too: async checkpoint uploads collect on CPU.
        return device, "cpu:gloo,cuda:nccl", "cuda"
    return torch.device("cpu"), "gloo", "cpu"


def init_distributed(timeout: timedelta) -> tuple[torch.device, str]:
    """Join torchrun's world, or form a world of one when not launched by torchrun."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # Ranks share the host's cores; oversubscribing threads makes every rank slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    device, backend, device_type = select_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return device, device_type


def run(cfg: JobConfig, *, stop_at: int, resume: bool, printer, pg_timeout: timedelta) -> int:
    device, device_type = init_distributed(pg_timeout)
    try:
        rank = dist.get_rank()
        layout = resolve(cfg, dist.get_world_size())
        mesh = build_mesh(layout, device_type)
        trainer = Trainer(cfg, layout, mesh, device)
        ckpt = None
        if cfg.checkpoint.dir:
            ckpt = CheckpointManager(
                Path(cfg.checkpoint.dir).expanduser(), cfg.checkpoint.keep, layout=layout.to_dict()
            )
        if resume:
            loaded = ckpt.load_latest(trainer.state) if ckpt else None
            if rank == 0:
                if loaded is None:
                    _log("resume: no valid checkpoint found; starting from step 0")
                else:
                    _log(
                        f"resume: loaded {loaded} (step {trainer.progress.step}, "
                        f"consumed_samples {trainer.progress.consumed_samples}) on dp={layout.dp}"
                    )
        if rank == 0:
            _log(f"layout: {layout.to_dict()}")
        while trainer.progress.step < stop_at:
            result = trainer.train_step()
            if rank == 0:
                printer.step(result, layout.dp)
            if ckpt and cfg.checkpoint.every and result.step % cfg.checkpoint.every == 0:
                ckpt.save_async(trainer.state)
        if ckpt:
            ckpt.wait()
        return 0
    finally:
        dist.destroy_process_group()
