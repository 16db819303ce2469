"""Message-size limits of every gRPC server and channel of the daemon and ultractl, in one place.

gRPC's own defaults differ by direction (4 MiB to receive, unlimited to send) and the aio
server buffers a whole message before a handler sees it, so a limit is what bounds what one
message can make an agent hold. The largest message any of our services sends is a piece of a
snapshot file (daemon/node/snapshot_files.py, PIECE_BYTES) with its header: the chunk
checksums of the largest file a peer may send, at 4 bytes a chunk; everything else (specs,
plans, events, holdings) is far smaller.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 8 << 20

MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

# The agent's server, which receives snapshot copies (Replicate streams of 1 MiB pieces): a
# fixed 4 MiB flow-control window per stream instead of gRPC's BDP probing. Probing sizes the
# window from measured round trips, and a receiver descheduled on a busy node measures long
# ones: the window then grew until tens of MiB were buffered in the receiver ahead of its
# writes (tests/integration/test_replicate_memory.py, 74-99 MiB on a loaded machine against
# 15-25 MiB with this window). 4 MiB per round trip is still GB/s on a data-center network.
STREAM_WINDOW_BYTES = 4 << 20
SERVER_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_OPTIONS + (
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
)
