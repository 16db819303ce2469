"""Files of the in-memory snapshots as the agent handles them: a peer's incoming file, reading
one in pieces, and small stat helpers (daemon/node/snapshot_keeper.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from checkpoint.snapshot_format import MANIFEST_NAME, SnapshotInvalid, SnapshotManifest

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # one gRPC message of file data (gRPC's default limit is 4 MiB)


@dataclass(frozen=True)
class Incoming:
    """The header of a file a peer sends (the first message of PutFile)."""

    step: int
    file: str
    size: int
    chunks: tuple[int, ...]
    rank: int


def parse_step_manifest(raw: bytes, step: int) -> SnapshotManifest:
    manifest = SnapshotManifest.parse(raw, f"snapshot step {step}: {MANIFEST_NAME}")
    if manifest.step != step:
        raise SnapshotInvalid(f"snapshot step {step}: {MANIFEST_NAME} is of step {manifest.step}")
    return manifest


async def file_pieces(path: Path) -> AsyncIterator[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while True:
            piece = os.pread(fd, PIECE_BYTES, offset)
            if not piece:
                return
            offset += len(piece)
            yield piece
    finally:
        os.close(fd)


def listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem holding `path` (its nearest existing ancestor)."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return 0


def check_room(root: Path, held: int, predicted: int) -> int:
    """Bytes `root` can hold for snapshots (free now plus the `held` bytes already there);
    warns when that is less than a plan's `predicted` host memory of a node's snapshots."""
    available = free_bytes(root) + held
    if predicted > available:
        log.warning("snapshots need about %.1f MB on this node (its shards and its buddy's, "
                    "3 steps) but %s has room for %.1f MB: snapshots will fail, and restores "
                    "fall back to the durable checkpoint", predicted / 1e6, root, available / 1e6)
    return available
