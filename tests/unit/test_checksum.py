"""Block checksums: fed in any pieces, equal to crc32c of each block; range → block mapping."""

from __future__ import annotations

import hashlib
import io
import os

import crc32c
import pytest

from checkpoint.checksum import CRC32C, LEGACY, BlockHasher, Scheme, bad_blocks, digest_stream

pytestmark = pytest.mark.unit

SCHEME = Scheme(CRC32C, 1000)


def test_crc32c_is_the_castagnoli_polynomial() -> None:
    # The standard check value of CRC-32C (iSCSI, RFC 3720) for "123456789".
    hasher = BlockHasher(Scheme(CRC32C, 0))
    hasher.update(b"123456789")
    assert hasher.digests() == ("e3069283",)


@pytest.mark.parametrize("piece", [1, 7, 999, 1000, 1001, 4096])
def test_digests_do_not_depend_on_how_the_bytes_are_fed(piece: int) -> None:
    data = os.urandom(3500)
    hasher = BlockHasher(SCHEME)
    for i in range(0, len(data), piece):
        hasher.update(memoryview(data)[i : i + piece])
    want = tuple(f"{crc32c.crc32c(data[i : i + 1000]):08x}" for i in range(0, 3500, 1000))
    assert hasher.size == 3500 and hasher.digests() == want
    assert digest_stream(io.BytesIO(data), SCHEME) == (3500, want)


def test_empty_file_has_no_blocks_but_a_whole_file_digest() -> None:
    assert digest_stream(io.BytesIO(b""), SCHEME) == (0, ())
    assert digest_stream(io.BytesIO(b""), LEGACY) == (0, (hashlib.sha256(b"").hexdigest(),))
    assert (SCHEME.block_count(0), SCHEME.block_count(1000), SCHEME.block_count(1001)) == (0, 1, 2)


def test_blocks_covering_byte_ranges() -> None:
    assert SCHEME.blocks_covering([(0, 1000)]) == {0}
    assert SCHEME.blocks_covering([(999, 2), (2500, 0)]) == {0, 1}
    assert SCHEME.blocks_covering([(2000, 1500)]) == {2, 3}
    assert LEGACY.blocks_covering([(5, 1)]) == {0}


def test_bad_blocks_reads_only_the_blocks_asked_for() -> None:
    data = bytearray(os.urandom(3500))
    _, want = digest_stream(io.BytesIO(bytes(data)), SCHEME)
    data[2100] ^= 1
    f = io.BytesIO(bytes(data))
    assert bad_blocks(f, SCHEME, want, [0, 1, 3]) == []
    assert bad_blocks(f, SCHEME, want, [0, 1, 2, 3]) == [2]
    assert bad_blocks(io.BytesIO(bytes(data[:2500])), SCHEME, want, [3]) == [3]  # truncated


def test_scheme_rejects_unknown_algorithms() -> None:
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        Scheme("md5", 0)
