"""Checksums of checkpoint files, per fixed-size block, fed as the bytes go by.

A file's checksum is a list: the digest of each `block_bytes`-sized block (the last one may be
shorter). Per-block digests let a rank that reads part of a file (a resharded load reads slices of
other ranks' shards) verify only the blocks it reads, and let a writer checksum its bytes as it
writes them, in one pass.

Two schemes are read:
- `crc32c` in 16 MiB blocks, written by this version. CRC32C is computed by a CPU instruction
  (SSE4.2 on x86, the CRC extension on ARMv8): ~16 GB/s per core here, far above disk speed, and
  it releases the interpreter lock, so checksumming in DCP's writer thread does not stall training.
  It detects every error burst of up to 32 bits and all but 2^-32 of other corruptions of a
  block. That is integrity against storage and transfer faults, not security: anyone who can
  write the files can also fix up the checksums. docs/checkpoints.md compares it with xxh3.
- `sha256` over the whole file (block_bytes 0: one digest), what version-1 manifests hold.

Pure Python plus the `crc32c` extension; no torch, so the agent and ultractl can verify too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

import crc32c

CRC32C = "crc32c"
SHA256 = "sha256"
_DIGEST_HEX = {CRC32C: 8, SHA256: 64}
# Big enough that a 1 TB checkpoint's manifest stays under a megabyte of digests, small enough
# that a rank reading a few tensors from another rank's shard reads little beyond them.
DEFAULT_BLOCK_BYTES = 16 << 20
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Scheme:
    algorithm: str  # CRC32C or SHA256
    block_bytes: int  # 0: one digest over the whole file

    def __post_init__(self) -> None:
        if self.algorithm not in _DIGEST_HEX:
            raise ValueError(f"unknown checksum algorithm {self.algorithm!r}")
        if self.block_bytes < 0:
            raise ValueError(f"block_bytes must be >= 0 (got {self.block_bytes})")

    @property
    def digest_hex(self) -> int:
        """Length of one digest in hex digits."""
        return _DIGEST_HEX[self.algorithm]

    def block_count(self, size: int) -> int:
        """How many digests a file of `size` bytes has."""
        if self.block_bytes == 0:
            return 1
        return -(-size // self.block_bytes)

    def blocks_covering(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        """Indices of the blocks that the byte ranges (offset, length) touch."""
        if self.block_bytes == 0:
            return {0}
        found: set[int] = set()
        for offset, length in ranges:
            if length > 0:
                found.update(
                    range(offset // self.block_bytes, (offset + length - 1) // self.block_bytes + 1)
                )
        return found


CURRENT = Scheme(CRC32C, DEFAULT_BLOCK_BYTES)
LEGACY = Scheme(SHA256, 0)


class BlockHasher:
    """Digests of consecutive blocks of one byte stream, fed in pieces of any size."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.size = 0
        self._digests: list[str] = []
        self._fill = 0  # bytes in the current block
        self._crc = 0
        self._sha = hashlib.sha256()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        block = self.scheme.block_bytes
        while view:
            take = len(view) if block == 0 else min(len(view), block - self._fill)
            self._feed(view[:take])
            self._fill += take
            view = view[take:]
            if block and self._fill == block:
                self._close_block()

    def digests(self) -> tuple[str, ...]:
        """The digests so far, the partial last block included (a whole-file digest always)."""
        done = list(self._digests)
        if self._fill or self.scheme.block_bytes == 0:
            done.append(self._current())
        return tuple(done)

    def _feed(self, view: memoryview) -> None:
        if self.scheme.algorithm == CRC32C:
            self._crc = crc32c.crc32c(view, self._crc)
        else:
            self._sha.update(view)

    def _current(self) -> str:
        if self.scheme.algorithm == CRC32C:
            return f"{self._crc:08x}"
        return self._sha.hexdigest()

    def _close_block(self) -> None:
        self._digests.append(self._current())
        self._fill, self._crc, self._sha = 0, 0, hashlib.sha256()


def digest_stream(f: BinaryIO, scheme: Scheme) -> tuple[int, tuple[str, ...]]:
    """Size and block digests of everything left in `f`."""
    hasher = BlockHasher(scheme)
    buf = bytearray(_READ_BYTES)
    while n := f.readinto(buf):  # type: ignore[attr-defined]
        hasher.update(memoryview(buf)[:n])
    return hasher.size, hasher.digests()


def bad_blocks(f: BinaryIO, scheme: Scheme, want: tuple[str, ...], blocks: Iterable[int]) -> list[int]:
    """The blocks among `blocks` whose digest is not `want[i]`; reads only those blocks."""
    if scheme.block_bytes == 0:
        f.seek(0)
        return [] if digest_stream(f, scheme)[1] == want else [0]
    bad = []
    for i in sorted(blocks):
        f.seek(i * scheme.block_bytes)
        hasher = BlockHasher(scheme)
        left = scheme.block_bytes
        buf = bytearray(min(_READ_BYTES, left))
        while left and (n := f.readinto(memoryview(buf)[: min(len(buf), left)])):  # type: ignore[attr-defined]
            hasher.update(memoryview(buf)[:n])
            left -= n
        if hasher.digests() != (want[i],):
            bad.append(i)
    return bad
