"""SnapshotPeer.Replicate over real gRPC on loopback, into a real keeper's shared memory: many
files on one stream, a refused copy that leaves the stream usable, a stream cut inside a file
that keeps nothing, a wrong peer secret, and a peer that restarts."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from checkpoint.snapshot_format import CHUNK_BYTES, shard_name, step_dir
from daemon.api.auth import BearerTokenInterceptor
from daemon.api.grpc_limits import MESSAGE_OPTIONS
from daemon.api.replication_streams import CopyRefused, ReplicationStreams
from daemon.api.snapshot_service import MAX_STREAMS_PER_PEER, SnapshotPeerService
from daemon.node.snapshot_files import PIECE_BYTES, Incoming
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.unit.test_snapshot_keeper import KEY, REV, keeper, signed

pytestmark = pytest.mark.unit

SECRET = KEY.secret


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Peer:
    """A receiving agent's listener: the SnapshotPeer service behind the peer-secret check."""

    def __init__(self, root: Path, max_streams: int = MAX_STREAMS_PER_PEER) -> None:
        self.keeper = keeper(root)  # b: it keeps a's copies
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.max_streams = max_streams

    async def start(self, port: int = 0) -> str:
        self.server = grpc.aio.server(interceptors=[BearerTokenInterceptor("admin",
                                                                           lambda: SECRET)],
                                      options=MESSAGE_OPTIONS)
        pb_grpc.add_SnapshotPeerServicer_to_server(
            SnapshotPeerService(self.keeper, self.max_streams), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(grace=None)


class Sender:
    def __init__(self, secret: str = SECRET) -> None:
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.secret = secret
        self.streams = ReplicationStreams(self.channel,
                                          lambda: (("authorization", f"Bearer {self.secret}"),))

    def channel(self, address: str) -> grpc.aio.Channel:
        return self.channels.setdefault(address, grpc.aio.insecure_channel(address))

    async def close(self) -> None:
        self.streams.close()
        for channel in self.channels.values():
            await channel.close()


@contextlib.asynccontextmanager
async def linked(root: Path, secret: str = SECRET) -> AsyncIterator[tuple[Peer, Sender, str]]:
    """A listening peer, a sender, and the peer's address; both closed on the way out."""
    peer, sender = Peer(root), Sender(secret)
    address = await peer.start()
    try:
        yield peer, sender, address
    finally:
        await sender.close()
        await peer.stop()


async def pieces(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), PIECE_BYTES):
        yield data[start:start + PIECE_BYTES]


def shard(step: int, rank: int, data: bytes) -> Incoming:
    """a's copy of its rank's shard, signed."""
    return signed(step, shard_name(rank), data, rank)


def payload(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def test_files_go_one_after_another_on_one_stream_and_each_is_kept_once_acknowledged(root):
    async def main() -> None:
        async with linked(root) as (peer, sender, address):
            files = [(step, rank, payload(size, step + rank)) for step, rank, size in
                     [(1, 0, 3 * PIECE_BYTES + 5), (1, 1, 0), (2, 0, 1000), (2, 1, PIECE_BYTES)]]
            for step, rank, data in files:
                await sender.streams.send(address, shard(step, rank, data), pieces(data))
                # Acknowledged means kept: the copy is in place when send returns.
                assert (step_dir(root, step) / shard_name(rank)).read_bytes() == data
            assert len(sender.streams._streams) == 1  # noqa: SLF001 - one stream carried them all
            assert [h.step for h in peer.keeper.held()] == [1, 2]

    asyncio.run(main())


def test_a_copy_that_does_not_verify_is_refused_and_the_stream_goes_on(root):
    async def main() -> None:
        async with linked(root) as (peer, sender, address):
            data = payload(CHUNK_BYTES + 10, 3)
            flipped = bytearray(data)
            flipped[CHUNK_BYTES + 3] ^= 0x10
            with pytest.raises(CopyRefused, match="chunk 1"):
                await sender.streams.send(address, shard(4, 2, data), pieces(bytes(flipped)))
            assert not (step_dir(root, 4) / shard_name(2)).exists()
            stream = sender.streams._streams[address]  # noqa: SLF001
            await sender.streams.send(address, shard(4, 2, data), pieces(data))
            assert sender.streams._streams[address] is stream  # noqa: SLF001 - the same stream
            assert (step_dir(root, 4) / shard_name(2)).read_bytes() == data

    asyncio.run(main())


def test_a_stream_cut_inside_a_file_keeps_nothing_of_it(root):
    async def main() -> None:
        peer = Peer(root)
        address = await peer.start()
        channel = grpc.aio.insecure_channel(address)
        try:
            call = pb_grpc.SnapshotPeerStub(channel).Replicate(
                metadata=(("authorization", f"Bearer {SECRET}"),))
            data = payload(2 * PIECE_BYTES, 5)
            header = shard(6, 0, data)
            await call.write(pb.FileChunk(step=6, file=header.file, size=header.size,
                                          chunks=header.chunks, chunk_bytes=CHUNK_BYTES, rank=0,
                                          sender="a", spec_revision=REV, generation=1,
                                          mac=header.mac, data=data[:PIECE_BYTES]))
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call.read()
            assert failed.value.code() == grpc.StatusCode.DATA_LOSS
            assert f"ended after {PIECE_BYTES} of its {2 * PIECE_BYTES} bytes" in \
                (failed.value.details() or "")
            assert peer.keeper.held() == ()
        finally:
            await channel.close()
            await peer.stop()

    asyncio.run(main())


@pytest.mark.parametrize("size", [100, 64 * PIECE_BYTES])
def test_a_wrong_peer_secret_is_refused_and_nothing_is_kept(root, size):
    # 64 pieces: were the sender still writing when the peer ends the call, its write would fail
    # as "Internal error from Core"; the sender reports the peer's reason.
    async def main() -> None:
        async with linked(root, "wrong") as (peer, sender, address):
            data = payload(size, 1)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await sender.streams.send(address, shard(1, 0, data), pieces(data))
            assert failed.value.code() == grpc.StatusCode.UNAUTHENTICATED, failed.value
            assert peer.keeper.held() == ()
            sender.secret = SECRET  # a changed secret opens a new stream
            await sender.streams.send(address, shard(1, 0, data), pieces(data))
            assert [h.step for h in peer.keeper.held()] == [1]

    asyncio.run(main())


def test_a_peer_that_restarted_gets_a_new_stream(root):
    async def main() -> None:
        async with linked(root) as (peer, sender, address):
            data = payload(5000, 2)
            await sender.streams.send(address, shard(1, 0, data), pieces(data))
            await peer.stop()
            await peer.start(peer.port)
            # The old stream ended with its peer; a send fails at most once, then works.
            for attempt in range(2):
                try:
                    await sender.streams.send(address, shard(2, 0, data), pieces(data))
                    break
                except grpc.aio.AioRpcError:
                    assert attempt == 0
            assert (step_dir(root, 2) / shard_name(0)).read_bytes() == data

    asyncio.run(main())


def test_read_ranges_serves_ranges_and_whole_files_piece_by_piece(root):
    async def main() -> None:
        async with linked(root) as (peer, sender, address):
            data = payload(2 * PIECE_BYTES + 123, 9)
            await sender.streams.send(address, shard(3, 0, data), pieces(data))
            stub = pb_grpc.SnapshotPeerStub(sender.channel(address))
            metadata = (("authorization", f"Bearer {SECRET}"),)

            async def read(offset: int, length: int, step: int = 3) -> list[bytes]:
                pieces = [p async for p in stub.ReadRanges(pb.SnapshotRanges(
                    step=step, ranges=[pb.FileRange(file=shard_name(0), offset=offset,
                                                    length=length)]), metadata=metadata)]
                assert {p.range for p in pieces} == {0}
                return [p.data for p in pieces]

            whole = await read(0, -1)
            assert b"".join(whole) == data and max(map(len, whole)) == PIECE_BYTES
            assert b"".join(await read(PIECE_BYTES - 5, PIECE_BYTES + 10)) == \
                data[PIECE_BYTES - 5:2 * PIECE_BYTES + 5]
            assert await read(10, 0) == [b""]
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await read(0, -1, step=4)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND

            # Several ranges in one call: each answered, in the order asked.
            asked = [(PIECE_BYTES + 1, 7), (0, PIECE_BYTES + 2), (5, 0)]
            answer = [p async for p in stub.ReadRanges(pb.SnapshotRanges(step=3, ranges=[
                pb.FileRange(file=shard_name(0), offset=o, length=n) for o, n in asked]),
                metadata=metadata)]
            assert [p.range for p in answer] == [0, 1, 1, 2]
            for index, (offset, length) in enumerate(asked):
                assert b"".join(p.data for p in answer if p.range == index) == \
                    data[offset:offset + length]
            with pytest.raises(grpc.aio.AioRpcError) as too_many:
                [p async for p in stub.ReadRanges(pb.SnapshotRanges(step=3, ranges=[
                    pb.FileRange(file=shard_name(0), offset=0, length=1)] * 4097),
                    metadata=metadata)]
            assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ranges: 4097 in one call, at most 4096" in too_many.value.details()

    asyncio.run(main())


def test_streams_from_one_peer_host_are_limited(root):
    async def main() -> None:
        peer = Peer(root, max_streams=2)
        address = await peer.start()
        channel = grpc.aio.insecure_channel(address)
        metadata = (("authorization", f"Bearer {SECRET}"),)
        try:
            stub = pb_grpc.SnapshotPeerStub(channel)
            data = payload(100, 4)
            calls = []
            for step in (1, 2):  # one after another: the server sees them in this order
                call = stub.Replicate(metadata=metadata)
                calls.append(call)
                header = shard(step, 0, data)
                await call.write(pb.FileChunk(
                    step=step, file=header.file, size=header.size, chunks=header.chunks,
                    chunk_bytes=CHUNK_BYTES, rank=0, sender="a", spec_revision=REV,
                    generation=1, mac=header.mac, data=data))
                assert (await call.read()).error == ""  # both open and working
            calls.append(stub.Replicate(metadata=metadata))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await calls[2].read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await calls[0].done_writing()
            assert await calls[0].read() == grpc.aio.EOF
            # One closed: a new stream is let in.
            later = stub.Replicate(metadata=metadata)
            header = shard(5, 0, data)
            await later.write(pb.FileChunk(
                step=5, file=header.file, size=header.size, chunks=header.chunks,
                chunk_bytes=CHUNK_BYTES, rank=0, sender="a", spec_revision=REV, generation=1,
                mac=header.mac, data=data))
            assert (await later.read()).error == ""
            for call in (calls[1], later):
                call.cancel()
        finally:
            await channel.close()
            await peer.stop()

    asyncio.run(main())
