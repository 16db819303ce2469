"""The step socket's wire format: protobuf messages on a unix stream socket, each one framed.

A worker sends its `StepReport` after every step and the agent answers each with a `StepReply`
(proto/ultrascale/v1/agent.proto) on one connection per worker, in order, one report in flight.
They travel on a socket of their own rather than as the `ReportStep` call of the WorkerControl
service: a gRPC call costs the worker several thread wake-ups per step (the caller's and
gRPC's event engine's); here a report is one `send` and its reply one `recv` on the worker's
own thread, no other thread involved.

A frame is the message's length as 4 bytes, big-endian, then the serialized message. A length
over MAX_FRAME_BYTES is refused before anything is read or allocated for it.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct(">I")
# Far above any step report: its one variable part, the expert loads of a MoE model, is a few
# integers per expert and layer (a 64-layer, 256-expert model: about 50 KB).
MAX_FRAME_BYTES = 1 << 22


class FrameError(ValueError):
    """A frame that cannot be one: too long."""


def frame(payload: bytes) -> bytes:
    """`payload` with its header."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes: at most {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload)) + payload


def payload_length(header: bytes) -> int:
    """The length a frame's header announces (FrameError when over MAX_FRAME_BYTES)."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame header announces {length} bytes: at most {MAX_FRAME_BYTES}")
    return length
