"""Checking, at the start of every generation, that every rank sees the same checkpoint.dir.

A checkpoint written by ranks on different nodes is only a checkpoint if they all write into
one filesystem; a directory local to each node would leave every node with a fragment (only
rank 0's node gets DCP's `.metadata`) and each generation would fail to restore, forever.
Global rank 0 writes a marker named after the generation's unique store prefix; after a
barrier every rank looks for it. A rank that cannot see it raises `StorageNotShared` naming its
node and the path, which the agent reports as a `storage` failure and the leader turns into a
failed job at once (retrying cannot fix a mount).

A job that says its directories are per node (checkpoint.storage "node") skips the check and
accepts the fragments: its restores come from peer memory. When one has to come from a durable
checkpoint instead, the ranks raise `CheckpointFragmented`, another `storage` failure, rather
than start over from older state (trainer/driver.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.distributed as dist


class StorageNotShared(RuntimeError):
    """This rank cannot see the checkpoint directory rank 0 writes to."""


class CheckpointFragmented(RuntimeError):
    """The durable checkpoint a restore needs is spread over node-local directories."""


class PeerStorageNotShared(RuntimeError):
    """Another rank cannot see it: this rank is not the one to blame."""


def marker_name(store_prefix: str) -> str:
    return ".shared-" + re.sub(r"[^A-Za-z0-9_.-]", "-", store_prefix or "run")


def check_shared(root: Path, store_prefix: str, node: str) -> None:
    """Collective over the default group: raise on the ranks that do not see rank 0's marker."""
    marker = root / marker_name(store_prefix)
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{node}\n")
        for old in root.glob(".shared-*"):
            if old != marker:
                old.unlink(missing_ok=True)
    dist.barrier()
    seen = torch.tensor([1 if marker.exists() else 0], dtype=torch.int32)
    # Every rank learns whether all saw it, so the ones that did fail as "peer", not hang.
    everyone = seen.clone()
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not seen.item():
        writer = marker.read_text().strip() if marker.exists() else "global rank 0's node"
        raise StorageNotShared(
            f"checkpoint.dir is not shared: {node} cannot see {marker} written by {writer} "
            f"(host {os.uname().nodename}); put checkpoint.dir on a filesystem every node mounts")
    if not everyone.item():
        raise PeerStorageNotShared("checkpoint.dir is not shared: another rank cannot see "
                                   f"{marker}")
