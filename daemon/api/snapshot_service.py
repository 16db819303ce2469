"""Agent-to-agent snapshot replication and reads: the SnapshotPeer service (docs/snapshots.md).

An agent streams the files of each snapshot step to its peers over one long-lived stream per
peer (`Replicate`: per file a header, then the data in pieces of at most 1 MiB; one FileAck per
file back), reads byte ranges of files another agent holds (`ReadRanges`), and
the leader asks what each holds (`Holdings`).
Calls carry the job submission's peer key (`authorization: Bearer <key>`, auth.py), which only
agents can read from etcd (daemon/control/peer_key.py): admin tokens stay per node.

What one stream may cost the receiver is bounded: a file's data goes to disk as it arrives, and
ReadRanges reads what it sends a piece at a time (one piece in memory either way); a declared
size beyond what the plan makes plausible ends the stream with INVALID_ARGUMENT before anything
is written; and one peer host has at most MAX_STREAMS_PER_PEER Replicate streams open at once.
A copy the keeper refuses (daemon/node/copy_admission.py) is read to its end and dropped, and
its FileAck names the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from checkpoint.snapshot_format import CHUNK_BYTES, MAX_RANGES_PER_CALL, SnapshotInvalid
from daemon.node.copy_admission import size_bound
from daemon.node.snapshot_files import PIECE_BYTES, Incoming, IncomingFile
from daemon.node.snapshot_keeper import SnapshotKeeper
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Replicate streams one peer host may hold open: a sender keeps one per receiver, and a local
# test cluster runs all its agents on one loopback address.
MAX_STREAMS_PER_PEER = 16
REFUSALS_WARNED_S = 10.0


class SnapshotPeerService(pb_grpc.SnapshotPeerServicer):
    def __init__(self, keeper: SnapshotKeeper,
                 max_streams_per_peer: int = MAX_STREAMS_PER_PEER) -> None:
        self.keeper = keeper
        self.max_streams_per_peer = max_streams_per_peer
        self._streams: dict[str, int] = {}  # peer host -> Replicate streams open
        self._warned_at: dict[str, float] = {}  # peer host -> when a refusal was last a warning

    async def Replicate(self, request_iterator: AsyncIterator[pb.FileChunk],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FileAck]:
        host = _host(context.peer())
        if self._streams.get(host, 0) >= self.max_streams_per_peer:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{host} has {self.max_streams_per_peer} Replicate streams "
                                "open to this agent already")
        self._streams[host] = self._streams.get(host, 0) + 1
        try:
            # The call is taken: the sender waits for this before its first file
            # (daemon/api/replication_streams.py).
            await context.send_initial_metadata(())
            async for ack in self._replicate(host, request_iterator, context):
                yield ack
        finally:
            self._streams[host] -= 1
            if not self._streams[host]:
                del self._streams[host]

    async def _replicate(self, host: str, request_iterator: AsyncIterator[pb.FileChunk],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FileAck]:
        header: Incoming | None = None
        incoming: IncomingFile | None = None
        refused, received = "", 0
        try:
            async for message in request_iterator:
                if header is None:
                    header = await self._header(message, context)
                    refused, received = "", 0
                    try:
                        incoming = self.keeper.receive(header)
                    except SnapshotInvalid as exc:  # read to its end, then refused
                        refused = str(exc)
                received += len(message.data)
                if received > header.size:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"{header.file}: more than its {header.size} bytes")
                if incoming is not None:
                    try:
                        incoming.write(message.data)
                    except (SnapshotInvalid, OSError) as exc:
                        refused = str(exc)
                        incoming.discard()
                        incoming = None
                if received < header.size:
                    continue
                if incoming is not None:
                    try:
                        self.keeper.accept(incoming)
                    except (SnapshotInvalid, OSError) as exc:
                        refused = str(exc)
                    incoming = None
                if refused:
                    self._log_refusal(host, refused)
                yield pb.FileAck(step=header.step, file=header.file, error=refused)
                header = None
            if header is not None:
                # The sender went away inside a file: nothing of it is kept.
                await context.abort(grpc.StatusCode.DATA_LOSS,
                                    f"snapshot step {header.step}: {header.file} ended after "
                                    f"{received} of its {header.size} bytes")
        finally:
            if incoming is not None:
                incoming.discard()

    def _log_refusal(self, host: str, refused: str) -> None:
        """A warning at most every REFUSALS_WARNED_S per peer host, the rest at debug level: a
        sender retries a refused copy every poll."""
        now = time.monotonic()
        if now >= self._warned_at.get(host, -REFUSALS_WARNED_S) + REFUSALS_WARNED_S:
            self._warned_at[host] = now
            log.warning("%s", refused)
        else:
            log.debug("%s", refused)

    async def _header(self, message: pb.FileChunk,
                      context: grpc.aio.ServicerContext) -> Incoming:
        """The header a file's first message carries; a malformed or implausible one ends the
        stream with INVALID_ARGUMENT naming the field."""
        problem = ""
        if message.step < 0:
            problem = f"step must be >= 0 (got {message.step})"
        elif not message.file:
            problem = "file: a file's first message names it"
        elif message.chunk_bytes != CHUNK_BYTES:
            problem = f"chunk_bytes must be {CHUNK_BYTES} (got {message.chunk_bytes})"
        elif not 0 <= message.size <= (bound := size_bound(self.keeper.view.plan, message.file)):
            problem = (f"size of {message.file} must be between 0 and {bound} bytes, what the "
                       f"running plan makes plausible (got {message.size})")
        elif len(message.chunks) != -(-message.size // CHUNK_BYTES):
            problem = (f"chunks must hold one checksum per {CHUNK_BYTES} bytes of size "
                       f"(got {len(message.chunks)} for {message.size} bytes)")
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"snapshot step {message.step}: {problem}")
        return Incoming(message.step, message.file, message.size, tuple(message.chunks),
                        message.rank, message.sender, message.spec_revision,
                        message.generation, message.mac)

    async def ReadRanges(self, request: pb.SnapshotRanges,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SnapshotPiece]:
        if len(request.ranges) > MAX_RANGES_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"ranges: {len(request.ranges)} in one call, at most "
                                f"{MAX_RANGES_PER_CALL}")
        # Read and sent a piece at a time: a whole shard is never held in memory.
        for index, asked in enumerate(request.ranges):
            offset, remaining, first = asked.offset, asked.length, True
            while True:
                want = PIECE_BYTES if remaining < 0 else min(PIECE_BYTES, remaining)
                try:
                    piece = self.keeper.read(request.step, asked.file, offset, want)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                if piece is None:
                    await context.abort(grpc.StatusCode.NOT_FOUND,
                                        f"snapshot step {request.step}: {asked.file} is not "
                                        "held here")
                if piece or first:
                    yield pb.SnapshotPiece(range=index, data=piece)
                first = False
                offset += len(piece)
                remaining -= len(piece) if remaining >= 0 else 0
                if len(piece) < want or remaining == 0:
                    break

    async def Holdings(self, request: pb.HoldingsRequest,
                       context: grpc.aio.ServicerContext) -> pb.HoldingsReply:
        return pb.HoldingsReply(holdings_json=self.keeper.holdings().to_json().decode())


def _host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`)."""
    address = peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return address.rpartition(":")[0] or address
