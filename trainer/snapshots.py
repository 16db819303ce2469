"""A worker's in-memory snapshots: take one every `checkpoint.snapshot_every` steps, and restore
the tier the plan names, falling back to the next (docs/snapshots.md).

Snapshots go into the node's shared memory (`$ULTRA_SNAPSHOT_ROOT`, owned by the agent), so a
crashed worker loses nothing it finished writing; the agent replicates them to a buddy node
and serves them to restoring workers anywhere. Taking one is collective (DCP), and every rank
decides the same way (by step number), so no rank waits on another that skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.snapshot_format import SnapshotInvalid
from checkpoint.snapshot_reader import Fetch, load_snapshot
from checkpoint.snapshot_writer import save_snapshot
from checkpoint.state import TrainState


@dataclass(frozen=True)
class Restored:
    """What a generation's restore loaded, and why a faster tier was skipped."""

    source: str  # init | checkpoint | snapshot
    step: int
    skipped: str = ""  # why the plan's snapshot was not used ("" when it was, or none was named)
    seconds: float = 0.0
    snapshot_bytes: int = 0
    name: str = ""  # the checkpoint directory's name, or "snapshot@<step>"


class CountingFetch:
    """A fetch that counts the bytes it returned."""

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.bytes = 0

    def __call__(self, file: str, offset: int, length: int) -> bytes:
        data = self.fetch(file, offset, length)
        self.bytes += len(data)
        return data


class Snapshots:
    """This rank's snapshots: when they are due, and taking one without ever failing the step."""

    def __init__(self, root: Path, every: int, layout: dict[str, Any],
                 log: Callable[[str], None]) -> None:
        self.root, self.every, self.layout, self.log = Path(root), every, layout, log
        self.blocking_seconds = 0.0  # the last snapshot's time on the training path
        self.failures = 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def take(self, state: TrainState) -> bool:
        """Snapshot `state` now. A failure (shared memory full) is logged, not raised: every
        rank sees it (DCP gathers failures), the step is committed, only protection is lost."""
        started = time.perf_counter()
        try:
            save_snapshot(state, self.root, layout=self.layout)
        except (CheckpointException, OSError) as exc:
            self.failures += 1
            if dist.get_rank() == 0:
                self.log(f"snapshot of step {state.progress.step} failed: {exc}"[:500])
            return False
        self.blocking_seconds = time.perf_counter() - started
        return True


def restore_snapshot(state: TrainState, step: int, fetch: Fetch) -> tuple[str, int]:
    """Load snapshot `step` through `fetch`; ("", bytes) or (why it failed, bytes) on every
    rank alike (the reader fails all ranks together before any tensor is written)."""
    counting = CountingFetch(fetch)
    try:
        load_snapshot(state, step, counting)
    except SnapshotInvalid as exc:
        return str(exc), counting.bytes
    return "", counting.bytes
