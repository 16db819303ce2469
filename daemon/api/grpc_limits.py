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
