"""Restore from a snapshot: a DCP `StorageReader` over a byte-range fetch (docs/snapshots.md).

`fetch(file, offset, length) -> bytes` is where the bytes come from: the local `SnapshotStore`
now, a peer agent later. The reader checks every byte it uses against the manifest's chunk
checksums itself, end to end, whatever the fetch did. DCP's planner decides which ranges a rank
needs for its new layout, so resharding to any world size is DCP's, not ours.

Nothing is loaded unless everything verifies: every rank fetches and verifies all it needs in
`prepare_local_plan`, then the ranks agree (one all-reduce) before any of them writes a tensor,
so a bad chunk on any rank fails every rank with the state untouched. Verifying includes what a
checksum cannot vouch for: `.metadata`, an index rather than a pickle, is parsed with every field
checked (checkpoint/snapshot_index.py), every byte item is unpickled by an allow-list
(checkpoint/safe_unpickle.py), and each tensor's dtype, shape and length must agree, so a forged
snapshot whose checksums match is refused like a corrupt one and nothing in it runs.

DCP's planner never sees the whole index: `SnapshotLoadPlanner` gives it, for each tensor, only
the saved chunks that overlap what this rank loads (`SnapshotReader.narrow`), so a rank's plan
costs what its own shard needs, not the saving world's size.

DCP runs with `no_dist`: a load plan is local to its rank anyway (a rank reads what its own
shards need), and DCP's own coordination, gathering every rank's plan to rank 0, scattering
it back and gathering the outcome as pickled objects, was more than half of a restore on the
recovery benchmark (docs/architecture.md, "Costs behind the code"). Two all-reduces of one
number replace it: the agreement above, and one on the outcome once the tensors are written, so
every rank takes the same branch (a failure of any is the failure of all, with every failing
rank's reason).
"""

from __future__ import annotations

import bisect
import io
import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_list,
    _create_read_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from checkpoint.safe_unpickle import SafeLoadPlanner, UnsafePickle, load_value
from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotInvalid,
    SnapshotItem,
    SnapshotManifest,
    chunk_span,
    parse_record,
    read_held,
    record_name,
    unslot,
    verify_span,
)
from checkpoint.snapshot_index import DTYPES, SnapshotIndex
from checkpoint.snapshot_store import SnapshotStore
from checkpoint.state import TrainState


@dataclass(frozen=True)
class Range:
    """Bytes [offset, offset + length) of a file of the step being read (length -1: to its end)."""

    file: str
    offset: int
    length: int


# fetch(ranges) -> each range's bytes, in order: everything one step of the reader needs, in
# one call, so that a fetch through the agent costs one round trip per holding peer.
Fetch = Callable[[Sequence[Range]], list[bytes]]
# agree(this rank's failure, "" for none): every failing rank's reason, joined ("" for none).
# A collective: every rank calls it the same number of times.
Agree = Callable[[str], str]


def agreement(group: dist.ProcessGroup | None = None) -> Agree:
    """The ranks of `group` agree on whether any failed (a MAX all-reduce), and gather their
    reasons only when one did. Without a process group there is nobody to agree with."""

    def agree(reason: str) -> str:
        if not dist.is_initialized():
            return reason
        failed = torch.tensor([int(bool(reason))], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if not failed.item():
            return ""
        reasons: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(reasons, reason, group=group)
        return "; ".join(sorted({r for r in reasons if r}))

    return agree


class SnapshotReader(StorageReader):
    """Reads one snapshot step through `fetch`, for DCP with `no_dist`.

    A failure before the agreement (a manifest, metadata or chunk that does not verify, a state
    the snapshot does not cover) is kept in `failure`, not raised, so that this rank still
    reaches the agreement in `prepare_local_plan`; there every rank raises alike."""

    def __init__(self, step: int, fetch: Fetch, agree: Agree | None = None) -> None:
        super().__init__()
        self.step = step
        self.fetch = fetch
        self.agree: Agree = agree or agreement()
        self.manifest: SnapshotManifest | None = None
        self.storage_data: dict[MetadataIndex, SnapshotItem] = {}
        self._verified: dict[MetadataIndex, bytes] = {}
        self._values: dict[MetadataIndex, Any] = {}  # byte items, unpickled safely
        self._records: dict[str, FileEntry] = {}
        self.failure: SnapshotInvalid | None = None
        self.index: SnapshotIndex | None = None  # `.metadata`, once read
        # What the agreement returned (None: not reached): "" none failed, else every reason.
        self.agreed: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            raise ValueError("SnapshotReader reads through its fetch; pass checkpoint_id=None")
        self._verified, self._values = {}, {}

    def _entry(self, file: str) -> FileEntry:
        """The manifest's entry for `file`, with its chunk checksums: a shard's come from its
        rank's record (`_fetch_spans` fetches those it lacks)."""
        assert self.manifest is not None
        entry = self.manifest.file(file)
        return entry if entry.chunks is not None else self._records[file]

    def _where(self, file: str) -> str:
        assert self.manifest is not None
        return f"snapshot step {self.step}: file {file} (rank {self.manifest.file(file).rank})"

    def _fetch(self, ranges: Sequence[Range], what: str) -> list[bytes]:
        try:
            fetched = self.fetch(ranges)
        except SnapshotInvalid:
            raise
        except (OSError, KeyError) as exc:
            raise SnapshotInvalid(f"snapshot step {self.step}: {what} could not be fetched: "
                                  f"{exc}") from None
        if len(fetched) != len(ranges):
            raise SnapshotInvalid(f"snapshot step {self.step}: fetching {what} returned "
                                  f"{len(fetched)} ranges of {len(ranges)}")
        return fetched

    def _fetch_spans(self, spans: dict[str, list[tuple[int, int]]]) -> dict[str, list[bytes]]:
        """Chunk-aligned spans (`chunk_span`) of files, with the records of shards whose chunk
        checksums this reader lacks, in one fetch; each span verified."""
        assert self.manifest is not None
        records = sorted({record_name(self.manifest.file(f).rank) for f in spans
                          if self.manifest.file(f).chunks is None and f not in self._records})
        ranges = [Range(name, 0, -1) for name in records] + [
            Range(file, lo, hi - lo) for file, runs in spans.items() for lo, hi in runs]
        fetched = self._fetch(ranges, ", ".join(sorted(spans)))
        by_name = dict(zip(records, fetched, strict=False))
        for file in spans:
            entry = self.manifest.file(file)
            if entry.chunks is None and file not in self._records:
                where = self._where(file)
                self._records[file] = parse_record(by_name[record_name(entry.rank)], self.step,
                                                   entry, where)
        out: dict[str, list[bytes]] = {}
        data = iter(fetched[len(records):])
        for file, runs in spans.items():
            where, entry = self._where(file), self._entry(file)
            out[file] = []
            for lo, hi in runs:
                chunk = next(data)
                verify_span(entry, lo, hi, chunk, where)
                out[file].append(chunk)
        return out

    def _get(self, file: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of `file`, fetched chunk-aligned and verified."""
        assert self.manifest is not None
        where = self._where(file)
        start, end = chunk_span(self.manifest.file(file), offset, length, where)
        data = self._fetch_spans({file: [(start, end)]})[file][0]
        return data[offset - start : offset - start + length]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata()
        except SnapshotInvalid as exc:
            # An empty placeholder: the planner plans nothing and the agreement fails.
            self.failure = exc
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        where = f"snapshot step {self.step}: {MANIFEST_NAME}"
        raw = self._fetch([Range(MANIFEST_NAME, 0, -1)], MANIFEST_NAME)[0]
        self.manifest = SnapshotManifest.parse(raw, where)
        if self.manifest.step != self.step:
            raise SnapshotInvalid(f"{where}: field 'step' is {self.manifest.step}, not {self.step}")
        entry = self.manifest.file(METADATA_NAME)
        blob = self._get(METADATA_NAME, 0, entry.size)
        # Checksums say these are the bytes the manifest lists, not that its writer was honest:
        # every field is checked, and nothing in it is unpickled.
        where = self._where(METADATA_NAME)
        self.index = SnapshotIndex.parse(blob, where)
        self.index.check_files({f.path: f.size for f in self.manifest.files}, where)
        return self.index.skeleton()

    def narrow(self, metadata: Metadata, state_dict: dict[str, Any]
               ) -> dict[str, list[ChunkStorageMetadata]]:
        """Give `metadata` (the skeleton `read_metadata` returned) the saved chunks that
        overlap what this rank loads of each tensor of `state_dict` (flattened), and this
        reader their storage records: DCP's planner then looks at those alone. Returns what
        this rank holds of each of those tensors (its chunks), for the plan."""
        local: dict[str, list[ChunkStorageMetadata]] = {}
        if self.index is None:
            return local
        for fqn, obj in state_dict.items():
            md = metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or not isinstance(obj, torch.Tensor):
                continue  # the plan says what is wrong with it
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # not on this rank's mesh: the plan reads nothing of it
            local[fqn] = _create_chunk_list(obj)
            picked = self.index.narrow(fqn, local[fqn])
            md.chunks = [chunk for chunk, _, _ in picked]
            self.storage_data.update((index, item) for _, index, item in picked)
        return local

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self.failure is not None:
            return
        if metadata.storage_data is None:
            self.failure = SnapshotInvalid(
                f"snapshot step {self.step}: {METADATA_NAME} has no storage data")
            return
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Verify everything this rank will load now, then agree: a failure on any rank fails
        # every rank's load before any of them has written a tensor.
        if self.failure is None:
            try:
                self._fetch_and_verify(plan)
            except SnapshotInvalid as exc:
                self.failure = exc
        self.agreed = self.agree(str(self.failure) if self.failure is not None else "")
        if self.agreed:
            raise SnapshotInvalid(self.agreed)
        return plan

    def _fetch_and_verify(self, plan: LoadPlan) -> None:
        self._verified, self._values = {}, {}
        by_file: dict[str, list[MetadataIndex]] = {}
        for read_item in plan.items:
            index = read_item.storage_index
            item = self.storage_data[index]
            if read_item.type != LoadItemType.BYTE_IO:
                self._check_tensor(item, index)
            by_file.setdefault(item.file, []).append(index)
        # Each chunk is fetched and verified once, all files in one fetch: the items'
        # chunk-aligned spans merged per file (a file up to 4 MiB is one span).
        assert self.manifest is not None
        spans = {}
        for file, indices in by_file.items():
            where, entry = self._where(file), self.manifest.file(file)
            spans[file] = _merge(chunk_span(entry, self.storage_data[i].offset,
                                            self.storage_data[i].length, where) for i in indices)
        fetched = self._fetch_spans(spans)
        for file, indices in by_file.items():
            starts = [lo for lo, _ in spans[file]]
            for index in indices:
                item = self.storage_data[index]
                k = bisect.bisect_right(starts, item.offset) - 1
                begin = item.offset - starts[k]
                self._verified[index] = fetched[file][k][begin : begin + item.length]
        for read_item in plan.items:
            if read_item.type == LoadItemType.BYTE_IO:
                index = read_item.storage_index
                file = self.storage_data[index].file
                try:
                    self._values[index] = load_value(
                        unslot(self._verified[index], self.step, file))
                except UnsafePickle as exc:
                    raise SnapshotInvalid(
                        f"{self._where(file)}: byte item {index.fqn} {exc}") from None

    def _check_tensor(self, item: SnapshotItem, index: MetadataIndex) -> None:
        """A tensor item's dtype, shape and length agree (else the reader would fail halfway
        through writing the state, or build a tensor from the wrong bytes)."""
        dtype = DTYPES.get(item.dtype) if isinstance(item.dtype, str) else None
        shape = item.shape
        if dtype is None or not isinstance(shape, tuple) or not all(
                isinstance(n, int) and n >= 0 for n in shape) or \
                math.prod(shape) * dtype.itemsize != item.length:
            raise SnapshotInvalid(
                f"snapshot step {self.step}: file {item.file}: {index.fqn} is stored as "
                f"{item.dtype!r} of shape {shape!r} in {item.length} bytes, which do not agree")

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for read_item in plan.items:
            item = self.storage_data[read_item.storage_index]
            data = self._verified.get(read_item.storage_index)
            if data is None:  # a planner that changed the plan after prepare_local_plan
                data = self._get(item.file, item.offset, item.length)
            if read_item.type == LoadItemType.BYTE_IO:
                # Unpickled (by the allow-list) before the ranks agreed. Another planner wants
                # DCP's torch.save form.
                value = self._values[read_item.storage_index] \
                    if read_item.storage_index in self._values else \
                    load_value(unslot(data, self.step, item.file))
                if isinstance(planner, SafeLoadPlanner):
                    planner.load_value(read_item, value)
                else:
                    buffer = io.BytesIO()
                    torch.save(value, buffer)
                    buffer.seek(0)
                    planner.load_bytes(read_item, buffer)
                continue
            self._check_tensor(item, read_item.storage_index)
            dtype = DTYPES[item.dtype]
            tensor = torch.frombuffer(bytearray(data), dtype=dtype).view(item.shape) if data else (
                torch.empty(item.shape, dtype=dtype)
            )
            tensor = narrow_tensor_by_index(tensor, read_item.storage_offsets, read_item.lengths)
            target = planner.resolve_tensor(read_item).detach()
            if target.size() != tensor.size():
                raise SnapshotInvalid(
                    f"snapshot step {self.step}: file {item.file}: {read_item.storage_index.fqn} "
                    f"has shape {tuple(tensor.size())}, the target {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(read_item, target)
        self._verified, self._values = {}, {}
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


class SnapshotLoadPlanner(SafeLoadPlanner):
    """DCP's default load planner, taking a byte item's value as the reader unpickled it: a
    snapshot stores plain pickles, and a round trip through torch.save/torch.load for each of the
    optimizer's hundreds of hyper-parameter entries adds up. With a `reader`, a plan that cannot be
    made (the snapshot lacks a key of the state, or the reader already failed) is an empty one
    and the reader's failure, so that the rank still reaches the agreement."""

    def __init__(self, reader: SnapshotReader | None = None) -> None:
        super().__init__()
        self.reader = reader

    def create_local_plan(self) -> LoadPlan:
        if self.reader is None:
            return super().create_local_plan()
        if self.reader.failure is None:
            try:
                assert self.metadata is not None
                local = self.reader.narrow(self.metadata, self.state_dict)
                return local_load_plan(self.state_dict, self.metadata, local)
            except (RuntimeError, KeyError, ValueError) as exc:
                self.reader.failure = SnapshotInvalid(
                    f"snapshot step {self.reader.step} does not fit the state: {exc}"[:1000])
        return LoadPlan([])


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata,
                    local: dict[str, list[ChunkStorageMetadata]]) -> LoadPlan:
    """DCP's default local load plan (strict: every key of `state_dict` must be saved), with
    each tensor's chunks on this rank as `narrow` computed them (DCP's planner would compute
    them all again: a DTensor's are a sharding computation each). A snapshot is always in the
    current key format, so the planner's fallback to the keys of torch 2.3 does not apply."""
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None \
                and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: "
                             f"{obj.size()} for {fqn}")
        chunks = local.get(fqn)
        if chunks is not None:
            requests += create_read_items_for_chunk_list(fqn, md, chunks)
        elif not (isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None):
            requests += _create_read_items(fqn, md, obj)  # a byte item (or a mismatch)
    return LoadPlan(requests)


def _merge(ranges: Any) -> list[tuple[int, int]]:
    """Sorted, merged [lo, hi) ranges: adjacent items are fetched and verified once."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def load_snapshot(
    state: TrainState,
    step: int,
    fetch: Fetch,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load snapshot `step` into `state`, resharded to the current layout.

    Raises SnapshotInvalid on every rank, with every failing rank's reason, when any rank's
    bytes are missing, truncated or fail their checksums (`state` is then untouched), or when
    writing them fails on any rank.
    """
    agree = agreement(process_group)
    reader = SnapshotReader(step, fetch, agree)
    reason = ""
    try:
        with warnings.catch_warnings():  # no_dist is meant: DCP's warning says it is assumed
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({"state": state}, storage_reader=reader,
                     planner=SnapshotLoadPlanner(reader), no_dist=True)
    except CheckpointException as exc:
        if reader.agreed:  # every rank failed the agreement and raises the same
            raise SnapshotInvalid(reader.agreed) from None
        reason = "; ".join(sorted({f"{type(e).__name__}: {e}" for e, _ in
                                   exc.failures.values()}))[:2000] or str(exc)[:2000]
    except Exception as exc:  # noqa: BLE001 - the state's own load_state_dict, outside DCP's
        reason = f"{type(exc).__name__}: {exc}"[:2000]
    # Every rank agrees a second time (or, one that failed before the first agreement, for
    # the first time: the others then fail theirs and stop there).
    reasons = agree(reason)
    if reasons:
        raise SnapshotInvalid(f"snapshot step {step} could not be loaded: {reasons}")


def local_fetch(root: Path, step: int) -> Fetch:
    """A fetch from this node's shared memory."""
    store = SnapshotStore(root)
    return lambda ranges: [store.read(step, r.file, r.offset, r.length) for r in ranges]


def local_first_fetch(root: Path, step: int, remote: Fetch) -> Fetch:
    """A fetch that reads what this node's shared memory holds straight from it and asks
    `remote` (the agent, which reads a peer's memory) for the rest, in one call. The bytes are
    raw either way, as the agent serves them: the reader verifies everything it uses. A
    restoring worker reads most of its bytes locally, without a gRPC round trip for them."""

    def fetch(ranges: Sequence[Range]) -> list[bytes]:
        held = [read_held(root, step, r.file, r.offset, r.length) for r in ranges]
        missing = [r for r, data in zip(ranges, held, strict=True) if data is None]
        asked = iter(remote(missing) if missing else ())
        return [next(asked) if data is None else data for data in held]

    return fetch
