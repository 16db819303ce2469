"""Durable sharded checkpoints: DCP `async_save`, then a manifest written last.

Rank 0 writes the manifest (checksums of every file) once its save future completes: DCP's
coordinator writes `.metadata` only after gathering every rank's write results, so by then all
shards are on disk and fsynced. Checkpoint collectives run on their own gloo group, because the
upload runs in a background thread while training collectives use the default group.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from checkpoint.manifest import apply_retention, checkpoint_dir, latest_valid, write_manifest
from checkpoint.state import TrainState


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class CheckpointManager:
    def __init__(
        self,
        root: Path,
        keep: int,
        *,
        layout: dict[str, Any],
        timeout: timedelta,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        self.root = root
        self.keep = keep
        self.layout = layout
        self.log = log
        self.rank = dist.get_rank()
        # new_group would otherwise use torch's 30-minute default, not the default group's.
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: Future | None = None
        self._committed = threading.Event()
        self._committed.set()
        self._error: str | None = None
        # Rank 0 only: (step, path, seconds from save_async to manifest) of every checkpoint
        # whose manifest this process wrote, in order; appended from DCP's thread (one append,
        # so readers never see half an entry).
        self.commits: list[tuple[int, Path, float]] = []

    def save_async(self, state: TrainState) -> None:
        """Stage the state to host memory now and write it in the background."""
        self.wait()
        started = time.monotonic()
        step, consumed = state.progress.step, state.progress.consumed_samples
        path = checkpoint_dir(self.root, step)
        path.mkdir(parents=True, exist_ok=True)
        future = dcp.async_save({"state": state}, checkpoint_id=str(path), process_group=self.group)
        if self.rank == 0:
            self._committed.clear()
            future.add_done_callback(lambda f: self._commit(f, path, step, consumed, started))
        self._pending = future

    def _commit(
        self, future: Future, path: Path, step: int, consumed: int, started: float
    ) -> None:
        try:
            future.result()
            write_manifest(path, step=step, consumed_samples=consumed, layout=self.layout)
            self.commits.append((step, path, time.monotonic() - started))
            apply_retention(self.root, self.keep)
        except Exception as exc:  # reported, never raised into DCP's executor thread
            self._error = f"checkpoint {path.name} failed: {exc}"
            self.log(self._error)
        finally:
            self._committed.set()

    def wait(self) -> None:
        """Block until the pending save (and on rank 0 its manifest) is done."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        # Done-callbacks run after result() wakes its waiters: wait for the manifest itself.
        self._committed.wait()
        if self._error:
            error, self._error = self._error, None
            raise RuntimeError(error)

    def load_latest(self, state: TrainState) -> Path | None:
        """Load the newest valid checkpoint into `state`; every rank uses rank 0's choice."""
        choice: list[str | None] = [None]
        if self.rank == 0:
            found = latest_valid(self.root, on_skip=self.log)
            choice[0] = str(found[1]) if found else None
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        dcp.load({"state": state}, checkpoint_id=choice[0])
        return Path(choice[0])
