"""What every multi-rank benchmark needs: a free local port and a gloo rank on it."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo_rank(rank: int, world: int, port: int, timeout: timedelta | None = None) -> None:
    """Join a local gloo group of `world` ranks at `port`, one intra-op thread per rank."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group("gloo", rank=rank, world_size=world, **kwargs)
