"""A rewrite's two halves: the copy that holds the step, and the writing that does not.

A rewrite (`snapshot_writer.rewrite_snapshot`) puts the same items at the same offsets of a
shard every step. Only one part of it has to happen before the next step may change the state:
copying the state's tensors somewhere the step cannot overwrite. So a rewrite is split:

- `stage_rewrite` (on the step, in checkpoint/snapshot_writer.py): every tensor item is
  copied into its place in a `HostStaging` buffer (host memory allocated once per generation,
  its pages touched up front; pinned when the state is on a GPU), and every byte item's
  current value is captured. On CPU that is one `torch._foreach_copy_` of the items' bytes.
  On a GPU the copies are queued on a side stream after the step's own work, the host does
  not wait for them, and `fence()` makes the training stream wait for them (not the host)
  before the next optimizer update, the first thing that overwrites what was copied;
- `StagedShard.write` (off the step, `trainer.snapshots` runs it on a thread): waits for the
  copy, pickles the byte items into their slots in the buffer, writes the buffer as the shard
  file with `pwritev`, checksums it, writes the rank's record and (coordinator) `.metadata`
  and the manifest. The next stage of the same buffer waits for it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpoint.snapshot_fastpath import ByteValues, ResolvedTemplate, same
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
    write_atomically,
)

# A template's items: (DCP WriteItem, offset, length) in shard order.
Items = tuple[tuple[Any, int, int], ...]


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
        self.held: ByteValues | None = None  # what the byte items' slots hold (None: unknown)

    def memory(self) -> memoryview:
        return memoryview(self.buffer.numpy())

    def fence(self) -> None:
        """Make the current (training) stream wait for the last stage's copies; the host does
        not wait. A no-op on CPU, where a stage's copies are done when it returns."""
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)

    def copy(self, sources: list[torch.Tensor]) -> None:
        """Copy each tensor item's bytes (`snapshot_fastpath.tensor_as_bytes`), in
        `destinations`' order, into its place."""
        destinations = self.destinations
        if not destinations:
            return
        if self.stream is None:
            torch._foreach_copy_(destinations, sources)  # noqa: SLF001
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

    def wait(self) -> None:
        """Block until the last stage's copies are in the buffer."""
        if self.copied is not None:
            self.copied.synchronize()


@dataclasses.dataclass
class StagedShard:
    """A rewrite whose tensors are copied (or being copied) into `staging`: what is left to
    write. `values` holds the byte items' values, captured when staged."""

    directory: Path
    rank: int
    step: int
    values: ByteValues
    staging: HostStaging
    resolved: ResolvedTemplate | None
    finish_coordinator: Callable[[], None] | None  # writes .metadata and the manifest
    stage_seconds: float = 0.0  # what the step paid
    write_seconds: float = 0.0  # the shard's write, after waiting for its copy
    checksum_seconds: float = 0.0

    def write(self) -> None:
        """Write the shard, its record and (coordinator) `.metadata` and the manifest. Raises
        OSError or ValueError (a byte item outgrew its slot, an unsafe directory) with the
        shard or its record missing, so the step cannot be assembled."""
        started = time.perf_counter()
        self.staging.wait()
        self.staging.put_values(self.values)
        memory = self.staging.memory()
        private_dirs(self.directory.parent, self.directory)
        name = shard_name(self.rank)
        fd = create_private_file(self.directory / name)  # O_EXCL, as a full save's shard
        try:
            pwritev_all(fd, [memory])
        finally:
            os.close(fd)
        written = time.perf_counter()
        chunks = chunk_checksums(memory)
        self.write_seconds = written - started
        self.checksum_seconds = time.perf_counter() - written
        entry = FileEntry(path=name, rank=self.rank, size=len(memory), chunks=chunks)
        write_atomically(self.directory / record_name(self.rank), record_bytes(self.step, entry))
        if self.finish_coordinator is not None:
            self.finish_coordinator()

