"""What every multi-rank benchmark needs: a gloo rank on a local port, a timer."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def init_gloo_rank(rank: int, world: int, port: int, timeout: timedelta | None = None) -> None:
    """Join a local gloo group of `world` ranks at `port`, one intra-op thread per rank."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group("gloo", rank=rank, world_size=world, **kwargs)


def timed_across_ranks(fn: Callable[[], object]) -> float:
    """Wall time of `fn` across all ranks: from everyone starting to the last one finishing."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start
