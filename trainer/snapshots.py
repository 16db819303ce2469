"""A worker's in-memory snapshots: take one every `checkpoint.snapshot_every` steps, and restore
the tier the plan names, falling back to the next (docs/snapshots.md).

Snapshots go into the node's shared memory (`$ULTRA_SNAPSHOT_ROOT`, owned by the agent), so a
crashed worker loses nothing it finished writing (a snapshot is written off the step, moments
after it was taken); the agent replicates them to a buddy node
and serves them to restoring workers anywhere. Taking one is collective (DCP), and every rank
decides the same way (by step number), so no rank waits on another that skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.snapshot_fastpath import ResolvedTemplate
from checkpoint.snapshot_format import SnapshotInvalid
from checkpoint.snapshot_reader import Fetch, Range, load_snapshot
from checkpoint.snapshot_staging import HostStaging
from checkpoint.snapshot_writer import (
    CoordinatorTemplate,
    Template,
    save_snapshot,
    stage_rewrite,
    staging_for,
)
from checkpoint.state import TrainState
from trainer.thread_names import SNAPSHOT_WRITER
from trainer.writer_thread import Handoff, WriterThread


class CountingFetch:
    """A fetch that counts the bytes it returned."""

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.bytes = 0

    def __call__(self, ranges: Sequence[Range]) -> list[bytes]:
        fetched = self.fetch(ranges)
        self.bytes += sum(map(len, fetched))
        return fetched


class Snapshots:
    """This rank's snapshots in one generation: when they are due, and taking one without ever
    failing the step.

    The first is a full DCP save (collective: it plans where every item goes and writes the
    metadata), all of it on the step. Every later one rewrites the same items at the same
    offsets with no collective at all: the step pays only for fixing what to copy
    (`stage_rewrite`); the copy of the state into a host buffer, the shard's write, its
    checksums and the records happen on a thread of this rank's own while training goes on
    (checkpoint/snapshot_staging.py), and the next optimizer update waits for the copy
    (`fence`). A rewrite waits for the previous one's write (they share the buffer), and
    `drain()` for the last.
    """

    def __init__(self, root: Path, every: int, layout: dict[str, Any],
                 log: Callable[[str], None]) -> None:
        self.root, self.every, self.layout, self.log = Path(root), every, layout, log
        # The last snapshot's time on the training path, failed or not: its own, and what the
        # update after the snapshot before it waited for that one's copy (`fence`).
        self.blocking_seconds = 0.0
        self._fenced = 0.0  # what `fence` waited since the last `take`
        self.failures = 0
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._template: Template | None = None
        self._coordinator: CoordinatorTemplate | None = None
        self._resolved: ResolvedTemplate | None = None
        self._staging: HostStaging | None = None
        self._writer: WriterThread | None = None
        self._pending: tuple[int, Handoff] | None = None  # (step, its write)

    @property
    def next_is_full(self) -> bool:
        """The next `take` is a full save: none has worked yet in this generation."""
        return self._template is None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def take(self, state: TrainState) -> bool:
        """Snapshot `state` now. A failure (shared memory full) is logged, not raised: the step
        is committed, only protection is lost. The full save fails on every rank alike (DCP
        gathers failures), so every rank tries it again at the next snapshot; a rewrite fails
        on its rank alone, and that step cannot be assembled. False: this snapshot (or the
        previous one's write, found failed now) failed."""
        started = time.perf_counter()
        ok = self._settle()
        try:
            if self._template is None:
                writer = save_snapshot(state, self.root, layout=self.layout)
                self._template, self._coordinator = writer.template, writer.coordinator
            else:
                if self._staging is None:
                    self._staging = staging_for(state, self._template)
                if self._writer is None:
                    self._writer = WriterThread(SNAPSHOT_WRITER)
                staged = stage_rewrite(state, self.root, self._template, self._coordinator,
                                       layout=self.layout, staging=self._staging,
                                       resolved=self._resolved)
                self._resolved = staged.resolved
                self._pending = (staged.step, self._writer.submit(staged.write))
        except (CheckpointException, OSError, ValueError) as exc:
            if self._staging is not None:
                self._staging.complete()  # a copy queued and not handed over: made here
            self._took(started)
            self._failed(state.progress.step, exc)
            return False
        self._took(started)
        return ok

    def _took(self, started: float) -> None:
        self.blocking_seconds = time.perf_counter() - started + self._fenced
        self._fenced = 0.0

    def fence(self) -> None:
        """Before an update of the state in place: the last snapshot's copy must be done. On
        CPU this waits for the writer thread to have made it (the wait counts in the next
        snapshot's blocking time); on a GPU the training stream waits for the device-to-host
        copy and the host does not."""
        if self._staging is not None:
            self._fenced += self._staging.fence()

    def drain(self) -> bool:
        """Wait for the last snapshot's write (before the state is restored or the worker
        exits); False: it failed (logged)."""
        ok = self._settle()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return ok

    def _settle(self) -> bool:
        if self._pending is None:
            return True
        step, write = self._pending
        self._pending = None
        try:
            write.wait()
        except (OSError, ValueError) as exc:
            self._failed(step, exc)
            return False
        return True

    def _failed(self, step: int, exc: BaseException) -> None:
        self.failures += 1
        if self.failures == 1 or self.rank == 0:
            self.log(f"snapshot of step {step} failed on rank {self.rank}: {exc}"[:500])


def restore_snapshot(state: TrainState, step: int, fetch: Fetch) -> tuple[str, int]:
    """Load snapshot `step` through `fetch`; ("", bytes) or (why it failed, bytes) on every
    rank alike (the reader fails all ranks together before any tensor is written)."""
    counting = CountingFetch(fetch)
    try:
        load_snapshot(state, step, counting)
    except SnapshotInvalid as exc:
        return str(exc), counting.bytes
    return "", counting.bytes
