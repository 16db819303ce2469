"""A rewrite's two halves: the capture that holds the step, and the copy and writing that do not.

A rewrite (`snapshot_writer.rewrite_snapshot`) puts the same items at the same offsets of a
shard every step. Only one thing has to happen before the next step may change the state:
copying the state's tensors somewhere the step cannot overwrite, and the first thing that
overwrites them is the next optimizer update. So a rewrite is split:

- `stage_rewrite` (on the step, in checkpoint/snapshot_writer.py): every tensor item's source
  is fixed (a view of the live tensor's memory, or a tensor read now: the RNG state) and every
  byte item's current value is captured. The copy of the tensors into their places in a
  `HostStaging` buffer (host memory allocated once per generation, its pages touched up front;
  pinned when the state is on a GPU) is queued, not done: on CPU it runs first thing on the
  rank's writer thread, following a `CopyPlan` on the fast path (one `torch.cat` into the
  buffer per run of adjacent items, not one copy per tensor, whose dispatch cost more than the
  bytes on a small model; else one `torch._foreach_copy_`); on a GPU it is queued on a side
  stream after the step's own work. Either way the next step's forward and backward run while
  it copies, and `fence()`, called just before the next optimizer update, waits for it: on CPU
  the host waits (the time is the snapshot's, `fence` returns it), on a GPU the training
  stream does and the host does not;
- `StagedShard.write` (off the step, `trainer.snapshots` runs it on a thread): makes the copy
  (CPU) or waits for it (GPU), pickles the byte items into their slots in the buffer, writes
  the buffer as the shard file with `pwritev`, checksums it, writes the rank's record and
  (coordinator) `.metadata` and the manifest. The next stage of the same buffer waits for it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpoint.snapshot_fastpath import ByteValues, ResolvedTemplate, same, tensor_as_bytes
from checkpoint.snapshot_format import (
    FileEntry,
    chunk_checksums,
    create_private_file,
    private_dirs,
    pwritev_all,
    record_bytes,
    record_name,
    shard_name,
    slot,
    step_dir,
    write_atomically,
)

# A template's items: (DCP WriteItem, offset, length) in shard order.
Items = tuple[tuple[Any, int, int], ...]

# The widest element `CopyPlan` copies a run as: ATen's single-threaded concatenation has a
# vectorised kernel for floating types only (uint8 goes through a copy per input). The bytes
# are moved, never computed on, so any bit pattern comes through as it was.
_WIDE = torch.float32
_WIDE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class _Run:
    """Items next to each other in the buffer whose sources are views of live memory."""

    out: torch.Tensor  # the run's slice of the buffer
    sources: list[torch.Tensor]  # in buffer order, as `out`'s dtype


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """How the fast path's rewrites copy into a CPU `HostStaging`, worked out once per
    `ResolvedTemplate`: each run of items that sit next to each other in the buffer and whose
    source is a view of a live tensor's memory (`ResolvedTemplate.tensors`) is one `torch.cat`
    into the run's slice of the buffer, as float32 when every address and length of the run
    allows it; an item whose source is made anew for every rewrite (the RNG state, a
    non-contiguous tensor) is copied alone."""

    resolved: ResolvedTemplate
    runs: tuple[_Run, ...]
    alone: tuple[tuple[torch.Tensor, Callable[[], torch.Tensor] | torch.Tensor], ...]

    @staticmethod
    def build(buffer: torch.Tensor, destinations: list[torch.Tensor],
              resolved: ResolvedTemplate) -> CopyPlan:
        runs: list[_Run] = []
        alone = []
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, view)

        def close_run() -> None:
            if pending:
                runs.append(_run(buffer, pending))
                pending.clear()

        for destination, (view, source) in zip(destinations, resolved.tensors, strict=True):
            if view is None:
                close_run()
                alone.append((destination, source))
                continue
            if pending and _end(pending[-1][0]) != destination.data_ptr():
                close_run()
            pending.append((destination, view))
        close_run()
        return CopyPlan(resolved, tuple(runs), tuple(alone))

    def capture(self) -> Callable[[], None]:
        """The copy of every item as it is now, to run later: an item read anew for every
        rewrite (the RNG state) is read here; the views of live tensors are read when the copy
        runs, so the caller must not let anything change those tensors before it has."""
        runs = self.runs
        alone = [(destination, source() if callable(source) else source)
                 for destination, source in self.alone]

        def copy() -> None:
            for run in runs:
                torch.cat(run.sources, out=run.out)
            for destination, source in alone:
                destination.copy_(tensor_as_bytes(source))

        return copy


def _end(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel()


def _run(buffer: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _Run:
    start = pairs[0][0].data_ptr() - buffer.data_ptr()
    out = buffer[start:start + sum(d.numel() for d, _ in pairs)]
    if all(t.data_ptr() % _WIDE_BYTES == 0 and t.numel() % _WIDE_BYTES == 0
           for pair in pairs for t in pair):
        return _Run(out.view(_WIDE), [v.view(_WIDE) for _, v in pairs])
    return _Run(out, [v for _, v in pairs])


class HostStaging:
    """One rank's shard as host memory: `size` bytes, each tensor item's bytes at its offset.

    Allocated when a generation's first rewrite needs it and reused by every later one, so a
    rewrite copies into memory that is already mapped. `device` is the state's: on a GPU the
    buffer is pinned (the device-to-host copy is a DMA that need not wait for the host) and
    copies run on a stream of their own.
    """

    def __init__(self, items: Items, size: int, tensor_items: list[int],
                 device: torch.device) -> None:
        self.items, self.device = items, device
        accelerated = device.type == "cuda"
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=accelerated)
        self.buffer.fill_(0)  # every page mapped now, not on the first step that copies
        # Where each tensor item of `tensor_items` (template indices, non-empty) goes.
        self.destinations = [self.buffer[items[i][1]:items[i][1] + items[i][2]]
                             for i in tensor_items]
        self.stream = torch.cuda.Stream(device) if accelerated else None
        self.copied: torch.cuda.Event | None = None  # the last stage's copies, on `stream`
        # CPU: the last stage's copy, not yet made, and a lock held until it is (released by
        # the thread that makes it, `complete()`).
        self._queued: Callable[[], None] | None = None
        self._copying = threading.Lock()
        self.held: ByteValues | None = None  # what the byte items' slots hold (None: unknown)
        self._plan: CopyPlan | None = None  # the last fast path's, on CPU

    def memory(self) -> memoryview:
        return memoryview(self.buffer.numpy())

    def fence(self) -> float:
        """Before anything overwrites what the last stage copies from: on a GPU the current
        (training) stream waits for its copies and the host does not; on CPU the host waits
        until `complete()` has made the copy. The seconds the host waited."""
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            return 0.0
        if not self._copying.locked():
            return 0.0
        started = time.perf_counter()
        with self._copying:
            pass
        return time.perf_counter() - started

    def _queue(self, copy: Callable[[], None]) -> None:
        if self._queued is not None:
            raise RuntimeError("a snapshot stage was queued before the last one was copied")
        self._copying.acquire()
        self._queued = copy

    def complete(self) -> None:
        """Make the last stage's copy, if it is still queued (CPU), or wait for it (GPU):
        after this the buffer holds every tensor item's bytes. Any thread may call it."""
        copy, self._queued = self._queued, None
        if copy is not None:
            try:
                copy()
            finally:
                self._copying.release()
        if self.copied is not None:
            self.copied.synchronize()

    def copy(self, sources: list[torch.Tensor]) -> None:
        """Copy each tensor item's bytes (`snapshot_fastpath.tensor_as_bytes`), in
        `destinations`' order, into its place: queued for `complete()` on CPU, on the side
        stream on a GPU. Nothing may change the sources before `fence()`."""
        destinations = self.destinations
        if not destinations:
            return
        if self.stream is None:
            self._queue(lambda: torch._foreach_copy_(destinations, sources))  # noqa: SLF001
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # after the step's own update of the state
        with torch.cuda.stream(self.stream):
            for destination, source in zip(destinations, sources, strict=True):
                if source.device.type == "cuda":
                    source.record_stream(self.stream)
                destination.copy_(source, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(self.stream)

    def copy_resolved(self, resolved: ResolvedTemplate) -> None:
        """Copy the fast path's tensor items (`ResolvedTemplate.tensors`, in `destinations`'
        order) into their places, as `copy` does: on CPU through a `CopyPlan`, made again
        only when `resolved` is another one."""
        if self.stream is not None:
            self.copy(resolved.tensor_bytes())
            return
        if self._plan is None or self._plan.resolved is not resolved:
            self._plan = CopyPlan.build(self.buffer, self.destinations, resolved)
        self._queue(self._plan.capture())

    def put_values(self, values: ByteValues) -> None:
        """Pickle each byte value into the slots of the items that hold it, except a value
        the same as the one its slots already hold (`snapshot_fastpath.same`: the same items
        and the same immutable value). ValueError: a value outgrew its slot."""
        last, self.held = self.held, None  # if this fails half-way, the slots are unknown
        unchanged = last is not None and last.holders is values.holders
        memory, items = self.memory(), self.items
        for j, value in enumerate(values.values):
            if unchanged and same(last.values[j], value):
                continue
            raw = pickle.dumps(value)
            for index in values.holders[j]:
                _, offset, length = items[index]
                memory[offset:offset + length] = slot(raw, length)
        self.held = values


@dataclasses.dataclass
class StagedShard:
    """A rewrite whose tensors are queued for copying into `staging`: what is left to do.
    `values` holds the byte items' values, captured when staged."""

    root: Path  # the step's directory under it is made off the step, in `write`
    rank: int
    step: int
    values: ByteValues
    staging: HostStaging
    resolved: ResolvedTemplate | None
    finish_coordinator: Callable[[Path], None] | None  # writes .metadata and the manifest
    stage_seconds: float = 0.0  # what the step paid
    write_seconds: float = 0.0  # the shard's copy (or the wait for it) and write
    checksum_seconds: float = 0.0

    def write(self) -> None:
        """Write the shard, its record and (coordinator) `.metadata` and the manifest. Raises
        OSError or ValueError (a byte item outgrew its slot, an unsafe directory) with the
        shard or its record missing, so the step cannot be assembled."""
        started = time.perf_counter()
        self.staging.complete()
        directory = step_dir(self.root, self.step)
        self.staging.put_values(self.values)
        memory = self.staging.memory()
        private_dirs(directory.parent, directory)
        name = shard_name(self.rank)
        fd = create_private_file(directory / name)  # O_EXCL, as a full save's shard
        try:
            pwritev_all(fd, [memory])
        finally:
            os.close(fd)
        written = time.perf_counter()
        chunks = chunk_checksums(memory)
        self.write_seconds = written - started
        self.checksum_seconds = time.perf_counter() - written
        entry = FileEntry(path=name, rank=self.rank, size=len(memory), chunks=chunks)
        write_atomically(directory / record_name(self.rank), record_bytes(self.step, entry))
        if self.finish_coordinator is not None:
            self.finish_coordinator(directory)

