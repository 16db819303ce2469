"""Rank 0's progress, checkpoints and the end of the job, recorded in etcd so they cannot be lost.

The agent hosting global rank 0 of the running generation writes `checkpoint` and `progress`
itself, in one transaction guarded by the generation key's mod_revision: a report about a
generation that has been replaced is refused by etcd (a straggler cannot overwrite newer
progress), and a report about the running one needs no leader and no peer credentials. The
transaction also compares the progress key's mod_revision with the one our last write left, so
a write that timed out but reaches etcd later (etcd was stopped with it in a socket buffer)
cannot land on newer progress. A write that fails (etcd unreachable, a timeout) is retried with
backoff until it is acknowledged or its generation is replaced, so `finished` and the
checkpoint of a planned stop always arrive.
Routine step reports are coalesced to one write per `interval`; boundaries go at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.records import CheckpointRecord, Progress, RestoreRecord
from daemon.control.view import ClusterView
from daemon.tasks import Backoff

log = logging.getLogger(__name__)


class ProgressWriter:
    def __init__(self, etcd: Etcd, keys: Keys, view: ClusterView, interval: float = 0.5) -> None:
        self.etcd = etcd
        self.keys = keys
        self.view = view
        self.interval = interval
        self._progress: Progress | None = None
        self._checkpoint: CheckpointRecord | None = None
        self._restore: RestoreRecord | None = None
        self._urgent = asyncio.Event()
        self._pending = asyncio.Event()
        self._written_at = 0.0
        self.rejected = 0  # reports refused because their generation was replaced
        # mod_revision of the progress key after our last write; None: unknown (a write timed
        # out, its outcome unknown), read it again. Every write compares it, so a write that
        # timed out here but lands in etcd later (etcd was stopped with it in its socket
        # buffer) fails its compare instead of overwriting newer progress.
        self._mod: int | None = None

    def report(self, generation: int, urgent: bool = False, **fields: Any) -> None:
        """Merge `fields` into the progress of `generation` and schedule a write."""
        first = self._progress is None or self._progress.generation != generation
        # The first report of a generation goes at once: until it is in, the leader treats
        # the generation as not started and applies a planned change without a boundary.
        urgent = urgent or first
        base = Progress(generation=generation) if first else self._progress
        assert base is not None
        self._progress = dataclasses.replace(base, time=time.time(), **fields)
        self._schedule(urgent)

    def checkpoint(self, generation: int, step: int, path: str) -> None:
        self._checkpoint = CheckpointRecord(generation, step, path, time=time.time())
        self._schedule(urgent=True)

    def restored(self, record: RestoreRecord) -> None:
        """What the generation restored (an event for operators), with the next write."""
        self._restore = record
        self._schedule(urgent=True)

    def _schedule(self, urgent: bool) -> None:
        self._pending.set()
        if urgent:
            self._urgent.set()

    async def run(self) -> None:
        backoff = Backoff(initial=0.1, maximum=2.0)
        while True:
            await self._pending.wait()
            if not self._urgent.is_set():
                wait = self._written_at + self.interval - time.monotonic()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):  # keeps cancellations (wait_for may not)
                            await self._urgent.wait()
            self._pending.clear()
            self._urgent.clear()
            progress, checkpoint, restore = self._progress, self._checkpoint, self._restore
            try:
                await self._write(progress, checkpoint, restore)
                backoff.reset()
            except ETCD_ERRORS as exc:
                log.warning("progress not recorded yet (%s); retrying", type(exc).__name__)
                self._pending.set()
                self._urgent.set()
                await backoff.sleep()
                continue
            if self._checkpoint is checkpoint:
                self._checkpoint = None
            if self._restore is restore:
                self._restore = None
            self._written_at = time.monotonic()

    async def _write(self, progress: Progress | None, checkpoint: CheckpointRecord | None,
                     restore: RestoreRecord | None = None) -> None:
        newest = [r.generation for r in (progress, checkpoint, restore) if r is not None]
        generation = max(newest, default=0)
        if restore is not None and restore.generation != generation:
            restore = None  # about a replaced generation: not news
        if progress is not None and progress.generation != generation:
            progress = None
        view = self.view
        if view.generation != generation or not view.generation_mod_revision:
            if generation < view.generation:
                self.rejected += 1
                return  # replaced: a newer generation's reports are what count
            raise ConnectionError(f"the view has not seen generation {generation} yet")
        if self._mod is None:
            kv = await self.etcd.get(self.keys.progress)
            self._mod = kv.mod_revision if kv else 0
        puts = []
        if checkpoint is not None:
            puts.append(self.etcd.tx.put(self.keys.checkpoint, checkpoint.to_json()))
        if restore is not None:
            puts.append(self.etcd.tx.put(self.keys.restore, restore.to_json()))
        if progress is not None:
            puts.append(self.etcd.tx.put(self.keys.progress, progress.to_json()))
        if not puts:
            return
        tx = self.etcd.tx
        mod, self._mod = self._mod, None  # unknown until this write's outcome is
        ok, responses = await self.etcd.txn(
            [tx.mod(self.keys.generation) == view.generation_mod_revision,
             tx.mod(self.keys.progress) == mod], puts)
        if ok:
            self._mod = responses[-1].response_put.header.revision if progress else mod
            return
        if self.view.generation != generation:
            self.rejected += 1
            log.info("progress of generation %d refused: a newer generation exists", generation)
            return
        # Someone else's write (or one of ours, delayed) landed since we read the key: read it
        # again and write ours on top.
        raise ConnectionError("the progress key changed since it was read")
