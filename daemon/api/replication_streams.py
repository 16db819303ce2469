"""The sending side of SnapshotPeer.Replicate: one long-lived stream per peer (docs/snapshots.md).

A call per file cost about four times the CPU of a file on an open stream (call set-up,
metadata, deadline, a task to drain the request iterator, on both agents), and a snapshot
every step sends a few files a step. Sends to one peer go one after another: a file's pieces,
then its acknowledgement, which the peer sends once the copy verified and is kept.

A new stream's first file waits for the peer to take the call (its initial metadata, sent as
soon as it has checked the call's credentials and its stream count): a peer that refuses the
call ends it at once, and a file written into a call already ended fails as "Internal error
from Core", losing the peer's reason (UNAUTHENTICATED: a wrong peer secret). Waiting costs one
round trip per stream, not per file.

A stream that fails in any way (the peer went away, a deadline, an out-of-order answer) is
dropped, and the next send opens a new one; so is a stream that has ended, and one opened with
a peer key that has changed since (a new job submission).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from checkpoint.snapshot_format import CHUNK_BYTES
from daemon.node.snapshot_files import Incoming
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

Metadata = tuple[tuple[str, str], ...]


class CopyRefused(Exception):
    """The peer did not keep the file: its checksums did not match, or the peer does not accept
    such a copy from this node (the message says why)."""


class StreamOutOfStep(Exception):
    """The peer ended the stream, or acknowledged another file than the one sent."""


@dataclass
class _Stream:
    call: Any  # grpc.aio.StreamStreamCall
    metadata: Metadata
    lock: asyncio.Lock
    taken: bool = False  # the peer sent its initial metadata: it took the call


class ReplicationStreams:
    def __init__(self, channel: Callable[[str], grpc.aio.Channel],
                 metadata: Callable[[], Metadata]) -> None:
        self._channel, self._metadata = channel, metadata
        self._streams: dict[str, _Stream] = {}

    def _open(self, address: str) -> _Stream:
        metadata = self._metadata()
        stream = self._streams.get(address)
        if stream is not None and (stream.metadata != metadata or stream.call.done()):
            self._drop(address)
            stream = None
        if stream is None:
            call = pb_grpc.SnapshotPeerStub(self._channel(address)).Replicate(metadata=metadata)
            stream = self._streams[address] = _Stream(call, metadata, asyncio.Lock())
        return stream

    def _drop(self, address: str) -> None:
        stream = self._streams.pop(address, None)
        if stream is not None:
            stream.call.cancel()

    async def send(self, address: str, header: Incoming, pieces: AsyncIterator[bytes]) -> None:
        """Send one file to the agent at `address`; returns once that agent kept it. Raises
        CopyRefused when it did not; grpc.aio.AioRpcError, TimeoutError or StreamOutOfStep
        when the stream failed."""
        stream = self._open(address)
        async with stream.lock:
            try:
                async with asyncio.timeout(10 + header.size / 50e6):
                    if not stream.taken:
                        await stream.call.initial_metadata()
                        if stream.call.done():
                            await stream.call.read()  # raises the peer's status
                            raise StreamOutOfStep(f"{address} ended the stream at once")
                        stream.taken = True
                    await self._write(stream.call, header, pieces)
                    ack = await stream.call.read()
            except BaseException:
                if self._streams.get(address) is stream:
                    self._drop(address)
                raise
        if ack is grpc.aio.EOF or ack.step != header.step or ack.file != header.file:
            self._drop(address)
            raise StreamOutOfStep(f"{address} answered {ack!r} to snapshot step {header.step}: "
                                  f"{header.file}")
        if ack.error:
            raise CopyRefused(ack.error)

    @staticmethod
    async def _write(call: Any, header: Incoming, pieces: AsyncIterator[bytes]) -> None:
        first: pb.FileChunk | None = pb.FileChunk(
            step=header.step, file=header.file, size=header.size, chunks=header.chunks,
            chunk_bytes=CHUNK_BYTES, rank=header.rank, sender=header.sender,
            spec_revision=header.spec_revision, generation=header.generation, mac=header.mac)
        async for piece in pieces:
            if first is not None:
                first.data = piece
                message, first = first, None
            else:
                message = pb.FileChunk(data=piece)
            await call.write(message)
        if first is not None:
            await call.write(first)  # an empty file

    def close(self) -> None:
        for address in list(self._streams):
            self._drop(address)
