"""What a node's agent owns: the snapshot steps in its shared memory (docs/snapshots.md).

Lists the complete steps, keeps the newest `keep` of them (freeing the shared memory of older
ones), and serves checksum-validated byte ranges, which is all a restoring worker, local now
or remote through its agent later, needs. Pure Python, no torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    SnapshotInvalid,
    SnapshotManifest,
    chunk_span,
    discarded_name,
    is_discarded,
    parse_record,
    parse_step_dir,
    pread_all,
    read_manifest,
    record_name,
    record_rank,
    step_dir,
    verify_span,
)


class SnapshotStore:
    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        self.root = Path(root)
        self.keep = keep

    def _step_dirs(self) -> dict[int, Path]:
        if not self.root.is_dir():
            return {}
        found = {}
        for entry in self.root.iterdir():
            step = parse_step_dir(entry.name)
            if step is not None and entry.is_dir():
                found[step] = entry
        return found

    def is_complete(self, step: int) -> bool:
        """A manifest that parses, and every file it lists present at its full size."""
        directory = step_dir(self.root, step)
        try:
            manifest = read_manifest(directory, step)
        except SnapshotInvalid:
            return False
        for entry in manifest.files:
            try:
                if (directory / entry.path).stat().st_size != entry.size:
                    return False
                if entry.chunks is None and not (directory / record_name(entry.rank)).is_file():
                    return False  # a shard is whole once its record is written after it
            except FileNotFoundError:
                return False
        return True

    def steps(self) -> list[int]:
        """The complete snapshot steps held here, oldest first."""
        return sorted(s for s in self._step_dirs() if self.is_complete(s))

    def manifest(self, step: int) -> SnapshotManifest:
        return read_manifest(step_dir(self.root, step), step)

    def prune(self) -> list[int]:
        """Keep the newest `keep` complete steps; free the rest. Returns the freed steps.

        Also frees incomplete steps older than the newest complete one: a snapshot save is
        collective, so no step older than a completed one is still being written. Incomplete
        steps newer than it stay: they may be being written now.
        """
        complete = self.steps()
        if not complete:
            return []
        kept = set(complete[-self.keep :])
        freed = []
        for step, directory in sorted(self._step_dirs().items()):
            if step not in kept and step < complete[-1]:
                shutil.rmtree(directory, ignore_errors=True)
                freed.append(step)
        return freed

    def free_after(self, step: int) -> list[int]:
        """Discard every step newer than `step`: a restore went back to `step`, so newer ones
        belong to a history that no longer counts. Returns the discarded steps.

        Each is renamed out of the steps' names, one rename apiece: from then on nothing lists,
        serves or restores it, as if it were removed. Removing it is `purge_discarded`'s (the
        agent's keeper, off the restoring worker's path): in a recovery, removing a step's
        files took a worker 12 ms of waiting before its first step, the rename 0.03 ms."""
        discarded = sorted(s for s in self._step_dirs() if s > step)
        for s in discarded:
            with contextlib.suppress(FileNotFoundError):  # the keeper pruned it meanwhile
                os.rename(step_dir(self.root, s), self.root / discarded_name(s))
        return discarded

    def discarded(self) -> list[Path]:
        """The directories `free_after` discarded and nobody removed yet."""
        with contextlib.suppress(FileNotFoundError):
            return [Path(e.path) for e in os.scandir(self.root) if is_discarded(e.name)]
        return []

    def purge_discarded(self) -> int:
        """Remove what `free_after` discarded; how many directories."""
        found = self.discarded()
        for directory in found:
            shutil.rmtree(directory, ignore_errors=True)
        return len(found)

    def read(self, step: int, file: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of `file` (length -1: to its end), checksum-verified.

        The manifest itself is served whole and verified by its own checksum.
        """
        directory = step_dir(self.root, step)
        if file == MANIFEST_NAME:
            return self.manifest(step).to_bytes()
        if record_rank(file) is not None:
            try:
                return (directory / file).read_bytes()  # the reader checks it
            except FileNotFoundError:
                raise SnapshotInvalid(f"snapshot step {step}: record {file} is missing") from None
        entry = self.manifest(step).file(file)
        where = f"snapshot step {step}: file {file} (rank {entry.rank})"
        if entry.chunks is None:
            try:
                entry = parse_record((directory / record_name(entry.rank)).read_bytes(), step,
                                     entry, where)
            except FileNotFoundError:
                raise SnapshotInvalid(f"{where}: its record is missing") from None
        if length == -1:
            length = entry.size - offset
        start, end = chunk_span(entry, offset, length, where)
        try:
            fd = os.open(directory / file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SnapshotInvalid(f"{where} is missing") from None
        try:
            data = pread_all(fd, end - start, start)
        finally:
            os.close(fd)
        verify_span(entry, start, end, data, where)
        return data[offset - start : offset - start + length]

