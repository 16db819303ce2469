"""Serving a restoring worker's byte ranges of a snapshot step (WorkerControl.FetchSnapshot).

What this node holds is read here; the rest is read from the peers that hold it with one
`SnapshotPeer.ReadRanges` call per peer, all peers at once. A range goes to the first of its
holders (`SnapshotKeeper.holders`: those whose published holdings list it, then the nodes the
plan restores from); when a peer's call fails, each of its ranges moves to its next holder, and
only a range with no holder left fails the fetch. The worker verifies every byte itself
(checkpoint/snapshot_reader.py), so nothing here checks content.

A peer's answer is held in memory until its call ends (a failure part-way then costs nothing
sent): about what the worker asked of that peer, which it holds in memory itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from checkpoint.snapshot_format import MAX_RANGES_PER_CALL
from daemon.node.snapshot_files import PIECE_BYTES
from daemon.node.snapshot_keeper import SnapshotKeeper
from proto.ultrascale.v1 import agent_pb2 as pb

# read_peer(address, request) -> the pieces of each of request's ranges, from that agent.
ReadPeer = Callable[[str, pb.SnapshotRanges], Awaitable[list[list[bytes]]]]


@dataclass(frozen=True)
class RelayError(Exception):
    """Why the fetch cannot be served, as the gRPC status to end the call with."""

    code: grpc.StatusCode
    details: str


async def fetch_ranges(keeper: SnapshotKeeper, read_peer: ReadPeer, request: pb.SnapshotRanges
                       ) -> AsyncIterator[pb.SnapshotPiece]:
    """The pieces of every range of `request`: this node's first, then each peer's as its call
    ends. Raises RelayError (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE)."""
    if len(request.ranges) > MAX_RANGES_PER_CALL:
        raise RelayError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"ranges: {len(request.ranges)} in one call, at most "
                         f"{MAX_RANGES_PER_CALL}")
    remote: dict[int, list[str]] = {}  # range index -> its holders not tried yet
    for index, asked in enumerate(request.ranges):
        try:
            data = keeper.read(request.step, asked.file, asked.offset, asked.length)
        except ValueError as exc:
            raise RelayError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if data is not None:
            for start in range(0, max(1, len(data)), PIECE_BYTES):
                yield pb.SnapshotPiece(range=index, data=bytes(data[start:start + PIECE_BYTES]))
            continue
        holders = keeper.holders(request.step, asked.file)
        if not holders:
            raise RelayError(grpc.StatusCode.NOT_FOUND,
                             f"snapshot step {request.step}: no live agent holds {asked.file}")
        remote[index] = list(holders)
    failures: list[str] = []
    while remote:
        by_peer: dict[str, list[int]] = {}
        for index, holders in remote.items():
            by_peer.setdefault(holders[0], []).append(index)
        answers = await asyncio.gather(
            *(read_peer(address, pb.SnapshotRanges(
                step=request.step, ranges=[request.ranges[i] for i in indices]))
              for address, indices in by_peer.items()),
            return_exceptions=True)
        for (address, indices), answer in zip(by_peer.items(), answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, grpc.aio.AioRpcError | ValueError):
                    raise answer
                failures.append(f"{address}: {_describe(answer)}")
                for index in indices:
                    remote[index].pop(0)
                    if not remote[index]:
                        raise RelayError(
                            grpc.StatusCode.UNAVAILABLE,
                            f"snapshot step {request.step}: reading "
                            f"{request.ranges[index].file} failed from " + "; ".join(failures))
                continue
            for index, pieces in zip(indices, answer, strict=True):
                for piece in pieces:
                    yield pb.SnapshotPiece(range=index, data=piece)
                del remote[index]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
