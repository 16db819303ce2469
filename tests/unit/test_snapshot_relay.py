"""The agent's side of a restoring worker's fetch (daemon/node/snapshot_relay.py): what this node
holds is read here, the rest with one call per holding peer, a failed peer's ranges from their
next holder. The keeper and the peers are in-memory fakes: this tests the routing above them
(the real ReadRanges is tested in test_replication_stream.py, the whole path by
tests/integration/test_snapshot_recovery.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from checkpoint.snapshot_format import SnapshotInvalid
from daemon.node.snapshot_relay import RelayError, fetch_ranges
from proto.ultrascale.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit

STEP = 5
FILES = {  # what each agent holds; "here" is this node
    "here": {"rank_00000.distcp": b"zero" * 10},
    "a": {"rank_00001.distcp": b"one!" * 10, "rank_00001.json": b"{1}"},
    "b": {"rank_00001.distcp": b"one!" * 10, "rank_00002.distcp": b"two!" * 10,
          "rank_00002.json": b"{2}"},
}


class FakeKeeper:
    def __init__(self, holders: dict[str, list[str]]) -> None:
        self._holders = holders

    def read(self, step: int, file: str, offset: int, length: int) -> bytes | None:
        if not file.startswith("rank_"):
            raise SnapshotInvalid(f"snapshot step {step}: {file!r} is not a snapshot file name")
        data = FILES["here"].get(file)
        return None if data is None else data[offset:None if length < 0 else offset + length]

    def holders(self, step: int, file: str) -> list[str]:
        return self._holders.get(file, [])


class Peers:
    """read_peer over FILES, recording each call; `down` agents fail every call."""

    def __init__(self, down: frozenset[str] = frozenset()) -> None:
        self.down = down
        self.calls: list[tuple[str, list[str]]] = []

    async def __call__(self, address: str, request: pb.SnapshotRanges) -> list[list[bytes]]:
        self.calls.append((address, [r.file for r in request.ranges]))
        if address in self.down:
            raise ValueError(f"{address} is down")
        held = FILES[address]
        return [[held[r.file][r.offset:None if r.length < 0 else r.offset + r.length]]
                for r in request.ranges]


def _request(*ranges: tuple[str, int, int]) -> pb.SnapshotRanges:
    return pb.SnapshotRanges(step=STEP, ranges=[
        pb.FileRange(file=f, offset=o, length=n) for f, o, n in ranges])


def _fetch(keeper: FakeKeeper, peers: Peers, request: pb.SnapshotRanges) -> dict[int, bytes]:
    async def main() -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        async for piece in fetch_ranges(keeper, peers, request):
            out[piece.range] = out.get(piece.range, b"") + piece.data
        return out
    return asyncio.run(main())


HOLDERS = {"rank_00001.distcp": ["a", "b"], "rank_00001.json": ["a"],
           "rank_00002.distcp": ["b"], "rank_00002.json": ["b"]}


def test_one_call_per_holding_peer_and_local_ranges_read_here():
    peers = Peers()
    request = _request(("rank_00001.json", 0, -1), ("rank_00002.json", 0, -1),
                       ("rank_00000.distcp", 4, 8), ("rank_00001.distcp", 0, 12),
                       ("rank_00002.distcp", 8, -1), ("rank_00001.distcp", 36, 4))
    got = _fetch(FakeKeeper(HOLDERS), peers, request)
    assert got == {0: b"{1}", 1: b"{2}", 2: b"zero" * 2, 3: b"one!" * 3, 4: b"two!" * 8,
                   5: b"one!"}
    assert sorted(peers.calls) == [
        ("a", ["rank_00001.json", "rank_00001.distcp", "rank_00001.distcp"]),
        ("b", ["rank_00002.json", "rank_00002.distcp"])]


def test_a_failed_peers_ranges_go_to_their_next_holder():
    peers = Peers(down=frozenset({"a"}))
    request = _request(("rank_00001.distcp", 0, 4), ("rank_00002.distcp", 0, 4))
    assert _fetch(FakeKeeper(HOLDERS), peers, request) == {0: b"one!", 1: b"two!"}
    assert sorted(peers.calls) == [("a", ["rank_00001.distcp"]), ("b", ["rank_00001.distcp"]),
                                   ("b", ["rank_00002.distcp"])]


def test_a_range_with_no_holder_left_fails_naming_the_file_and_peers():
    peers = Peers(down=frozenset({"a", "b"}))
    with pytest.raises(RelayError) as failed:
        _fetch(FakeKeeper(HOLDERS), peers, _request(("rank_00001.distcp", 0, 4)))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert "reading rank_00001.distcp failed from a: a is down; b: b is down" in \
        failed.value.details


def test_a_range_nobody_holds_is_not_found_before_any_peer_is_asked():
    peers = Peers()
    with pytest.raises(RelayError) as missing:
        _fetch(FakeKeeper(HOLDERS), peers, _request(("rank_00001.distcp", 0, 4),
                                                    ("rank_00003.distcp", 0, 4)))
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert "no live agent holds rank_00003.distcp" in missing.value.details
    assert peers.calls == []


@pytest.mark.parametrize(("request_", "code", "words"), [
    (_request(*[("rank_00000.distcp", 0, 1)] * 4097), grpc.StatusCode.INVALID_ARGUMENT,
     "ranges: 4097 in one call, at most 4096"),
    (_request(("../etc/passwd", 0, -1)), grpc.StatusCode.INVALID_ARGUMENT,
     "is not a snapshot file name"),
])
def test_bad_requests_are_refused_naming_the_field(request_, code, words):
    with pytest.raises(RelayError) as refused:
        _fetch(FakeKeeper(HOLDERS), Peers(), request_)
    assert refused.value.code == code and words in refused.value.details
