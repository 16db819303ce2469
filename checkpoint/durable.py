"""Durable sharded checkpoints: DCP `async_save`, then a manifest written last.

Every rank checksums the files it writes as it writes them; rank 0 writes the manifest from
everyone's checksums once its save future completes: DCP's coordinator writes `.metadata` only
after gathering every rank's write results (ours ride along), so by then all shards are on disk,
flushed and fsynced with their directory, and so is `.metadata` (checkpoint/checksummed_storage.py).
A restore verifies in parallel: each rank checks the blocks it will read, and nothing it reads is
unpickled but by an allow-list (checkpoint/safe_unpickle.py): a checkpoint that would need more
is invalid like a corrupt one. Checkpoint collectives run on their own gloo group, because the
upload runs in a background thread while training collectives use the default group.

Retention runs only after a commit and never takes the newest committed checkpoint, nor one a
failed save left behind that is newer than it (docs/checkpoints.md, "Retention"). With
`fragments` (checkpoint.storage "node") each node's root is its own disk: every rank's shards
land on its node and the manifest and `.metadata` on global rank 0's. Nobody reads another rank's
file to write one (the manifest's checksums come from the writers); only rank 0's node knows
which steps were committed, so `wait` hands that list to every rank, and each prunes its own
node by it (`prune_fragments`). A restore loads exactly the step it is asked for.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from checkpoint.checksum import CURRENT, Scheme
from checkpoint.checksummed_storage import ChecksummingWriter, VerifyingReader, read_dcp_metadata
from checkpoint.manifest import (
    CheckpointInvalid,
    Manifest,
    apply_retention,
    check_manifest,
    checkpoint_dir,
    committed_steps,
    list_checkpoints,
    prune_fragments,
    verify_whole,
    write_manifest,
)
from checkpoint.safe_unpickle import SafeLoadPlanner
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
        scheme: Scheme = CURRENT,
        fragments: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.extra = extra  # written into every manifest (the model's fields: tools read them)
        self.fragments = fragments
        self.scheme = scheme
        self.keep = keep
        self.layout = layout
        self.log = log
        self.rank = dist.get_rank()
        # new_group would otherwise use torch's 30-minute default, not the default group's.
        self._timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None
        self._committed = threading.Event()
        self._committed.set()
        self._error: str | None = None
        # Rank 0 only: (step, path, seconds from save_async to manifest) of every checkpoint
        # whose manifest this process wrote, in order; appended from DCP's thread (one append,
        # so readers never see half an entry).
        self.commits: list[tuple[int, Path, float]] = []
        # The storage objects of the last save and load, for tests and benchmarks to inspect.
        self.last_writer: ChecksummingWriter | None = None
        self.last_reader: VerifyingReader | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        """Made at first use (a collective: every use is one, on every rank alike)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def save_async(self, state: TrainState) -> None:
        """Stage the state to host memory now and write it in the background."""
        self.wait()
        started = time.monotonic()
        step, consumed = state.progress.step, state.progress.consumed_samples
        path = checkpoint_dir(self.root, step)
        path.mkdir(parents=True, exist_ok=True)
        writer = self.last_writer = ChecksummingWriter(path, scheme=self.scheme)
        future = dcp.async_save({"state": state}, storage_writer=writer, process_group=self.group)
        if self.rank == 0:
            self._committed.clear()
            future.add_done_callback(
                lambda f: self._commit(f, writer, path, step, consumed, started)
            )
        self._pending = future

    def _commit(
        self,
        future: Future,
        writer: ChecksummingWriter,
        path: Path,
        step: int,
        consumed: int,
        started: float,
    ) -> None:
        try:
            future.result()
            # On a node-local root only this rank's shards and `.metadata` are here to stat.
            present = [e.path for e in writer.mine] + [".metadata"] if self.fragments else None
            write_manifest(
                path,
                step=step,
                consumed_samples=consumed,
                layout=self.layout,
                extra=self.extra,
                files=writer.files,
                scheme=self.scheme,
                present=present,
            )
            self.commits.append((step, path, time.monotonic() - started))
            if not self.fragments:  # else every rank prunes its node in `wait`
                apply_retention(self.root, self.keep)
        except Exception as exc:  # reported, never raised into DCP's executor thread
            self._error = f"checkpoint {path.name} failed: {exc}"
            self.log(self._error)
        finally:
            self._committed.set()

    def wait(self) -> None:
        """Block until the pending save (and on rank 0 its manifest) is done.

        On node-local roots, when a save was pending, every node's retention follows: a
        collective, as every rank saves (and so waits) alike."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
            if self.fragments:
                self._committed.wait()
                self._prune_nodes()
        # Done-callbacks run after result() wakes its waiters: wait for the manifest itself.
        self._committed.wait()
        if self._error:
            error, self._error = self._error, None
            raise RuntimeError(error)

    def _prune_nodes(self) -> None:
        """Every rank prunes its node's root by the steps committed on rank 0's (the only root
        holding manifests), once rank 0's commit of the last save is done or failed."""
        committed: list[list[int] | None] = [None]
        if self.rank == 0:
            try:
                committed[0] = committed_steps(self.root)
            except OSError as exc:  # nothing known committed: every node then keeps all
                self.log(f"listing checkpoints under {self.root} failed: {exc}")
        dist.broadcast_object_list(committed, src=0, group=self.group)
        try:
            prune_fragments(self.root, self.keep, committed[0] or [])
        except OSError as exc:  # a full disk must not stop training: the next save retries
            self.log(f"pruning checkpoints under {self.root} failed: {exc}")

    def load_latest(self, state: TrainState) -> Path | None:
        """Load the newest checkpoint that verifies into `state`, all ranks in step.

        Rank 0 proposes candidates, newest first, after the cheap checks (manifest, `.metadata`);
        each rank then verifies the blocks it reads, and a mismatch on any rank makes every rank
        log-and-skip to the next older candidate (VerifyingReader fails them all together).
        """
        candidates = iter(list_checkpoints(self.root)) if self.rank == 0 else iter(())
        while True:
            choice: list[tuple[Path, Manifest] | None] = [None]
            if self.rank == 0:
                choice[0] = self._next_candidate(candidates)
            dist.broadcast_object_list(choice, src=0, group=self.group)
            if choice[0] is None:
                return None
            path, manifest = choice[0]
            failed = self._load_verified(state, path, manifest)
            if failed is None:
                return path
            if self.rank == 0:
                self.log(f"checkpoint {path.name} is invalid ({failed.invalid}); trying an older one")

    def load_step(self, state: TrainState, step: int) -> tuple[str, tuple[int, ...]]:
        """Load the checkpoint of exactly `step` into `state`, with no fallback to another one:
        ("", ()) once loaded, else (why not, the ranks that could not), alike on every rank.

        For a node-local root: rank 0's node must hold the manifest, and every rank's node the
        `.metadata` and each shard its rank reads; all ranks agree on each check before reading.
        """
        path = checkpoint_dir(self.root, step)
        choice: list[Manifest | str] = [""]
        if self.rank == 0:
            try:
                choice[0] = check_manifest(path)
            except CheckpointInvalid as e:
                choice[0] = str(e)
        dist.broadcast_object_list(choice, src=0, group=self.group)
        manifest = choice[0]
        if isinstance(manifest, str):
            return manifest, (0,)
        problem = ""
        try:
            verify_whole(path, manifest, [".metadata"])  # DCP's planning reads it on every rank
            read_dcp_metadata(path)
        except CheckpointInvalid as e:
            problem = str(e)
        problems: list[str] = [""] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, problem, group=self.group)
        if any(problems):
            return next(p for p in problems if p), tuple(r for r, p in enumerate(problems) if p)
        failed = self._load_verified(state, path, manifest)
        return ("", ()) if failed is None else (str(failed.invalid), failed.invalid_ranks)

    def _load_verified(self, state: TrainState, path: Path, manifest: Manifest
                       ) -> VerifyingReader | None:
        """`dcp.load` through a VerifyingReader: None once loaded, the reader (with why) when it
        found the checkpoint invalid, on every rank alike; any other failure raises."""
        reader = self.last_reader = VerifyingReader(path, manifest, group=self.group)
        try:
            dcp.load({"state": state}, storage_reader=reader, planner=SafeLoadPlanner(),
                     process_group=self.group)
        except CheckpointException as exc:
            if not reader.agree_invalid():
                raise
            release_frames(exc, reader.invalid)
            return reader
        return None

    def _next_candidate(self, candidates: Iterator[tuple[int, Path]]) -> tuple[Path, Manifest] | None:
        for _, path in candidates:
            try:
                # The manifest and DCP's metadata, which every rank reads whole: small, so rank 0
                # checks them for everyone; the data files are each reader's to check.
                manifest = check_manifest(path)
                verify_whole(path, manifest, [".metadata"])
                read_dcp_metadata(path)  # refused when it would need more than DCP's classes
                return path, manifest
            except CheckpointInvalid as e:
                self.log(f"checkpoint {path.name} is invalid ({e}); trying an older one")
        return None


def release_frames(*errors: BaseException | None) -> None:
    """Clear the finished frames of a failed DCP load's tracebacks.

    DCP keeps a rank's exception in a frame of its traceback (a cycle), and the reader keeps
    the error it raised (`invalid`), whose frames hold the reader; the frames hold the process
    group. Uncleared, a failed candidate keeps the group's gloo threads alive until the collector
    runs, or until interpreter shutdown, where freeing a gloo group can abort the process.
    """
    for error in errors:
        if error is not None:
            traceback.clear_frames(error.__traceback__)
            error.__traceback__ = None


def open_offline(ckpt_dir: Path) -> tuple[Manifest, Metadata]:
    """A checkpoint's manifest and DCP metadata, for a tool in one process with no process
    group (e.g. `ultrascale-hf export`): the manifest checked, `.metadata` verified whole."""
    manifest = check_manifest(ckpt_dir)
    verify_whole(ckpt_dir, manifest, [".metadata"])
    return manifest, VerifyingReader(ckpt_dir, manifest, group=None).read_metadata()


def load_offline(ckpt_dir: Path, manifest: Manifest, tensors: dict[str, Any]) -> None:
    """Fill `tensors` (keys as in the metadata, e.g. "state.model.norm.weight") from the
    checkpoint in one process, verifying the blocks it reads."""
    reader = VerifyingReader(ckpt_dir, manifest, group=None)
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    if reader.invalid is not None:
        raise reader.invalid
