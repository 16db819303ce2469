"""Agent-to-agent snapshot replication and reads: the SnapshotPeer service (docs/snapshots.md).

An agent streams the files of each snapshot step to its peers over one long-lived stream per
peer (`Replicate`: per file a header, then the data in pieces of at most 1 MiB; one FileAck per
file back), reads byte ranges of files another agent holds (`ReadRange`), and
the leader asks what each holds (`Holdings`).
Calls carry the job's peer secret (`authorization: Bearer <secret>`, auth.py), which every
agent reads from etcd: admin tokens stay per node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from checkpoint.snapshot_format import SnapshotInvalid
from daemon.node.snapshot_files import PIECE_BYTES, Incoming
from daemon.node.snapshot_keeper import SnapshotKeeper
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

# The largest file a peer may send (a shard of one rank): beyond it the sender is broken.
MAX_FILE_BYTES = 1 << 40


class SnapshotPeerService(pb_grpc.SnapshotPeerServicer):
    def __init__(self, keeper: SnapshotKeeper) -> None:
        self.keeper = keeper

    async def Replicate(self, request_iterator: AsyncIterator[pb.FileChunk],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FileAck]:
        header: Incoming | None = None
        data = bytearray()
        async for message in request_iterator:
            if header is None:
                if message.step < 0 or not message.file or not 0 <= message.size <= \
                        MAX_FILE_BYTES:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "step, file and size: a file's first message names it")
                header = Incoming(message.step, message.file, message.size,
                                  tuple(message.chunks), message.rank)
                data = bytearray()
            data += message.data
            if len(data) > header.size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{header.file}: more than its {header.size} bytes")
            if len(data) == header.size:
                try:
                    self.keeper.store(header, bytes(data))
                    error = ""
                except SnapshotInvalid as exc:  # refused; the stream goes on
                    error = str(exc)
                yield pb.FileAck(step=header.step, file=header.file, error=error)
                header = None
        if header is not None:
            # The sender went away inside a file: nothing of it is kept.
            await context.abort(grpc.StatusCode.DATA_LOSS,
                                f"snapshot step {header.step}: {header.file} ended after "
                                f"{len(data)} of its {header.size} bytes")

    async def ReadRange(self, request: pb.SnapshotRange,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SnapshotBytes]:
        try:
            data = self.keeper.read(request.step, request.file, request.offset, request.length)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"snapshot step {request.step}: {request.file} is not held here")
        for start in range(0, len(data), PIECE_BYTES):
            yield pb.SnapshotBytes(data=data[start:start + PIECE_BYTES])
        if not data:
            yield pb.SnapshotBytes(data=b"")

    async def Holdings(self, request: pb.HoldingsRequest,
                       context: grpc.aio.ServicerContext) -> pb.HoldingsReply:
        return pb.HoldingsReply(holdings_json=self.keeper.holdings().to_json().decode())
