"""The worker's end of the step socket (`$ULTRA_STEP_SOCKET`, proto/step_frames.py).

`send` writes a step report and returns; `reply` reads the agent's answer to it, waiting at most
the deadline. Both run on the calling thread (the training loop's), with no other thread and
no gRPC: a report costs the step one `send` and its reply one `recv`. Any failure (no agent,
a missed deadline, a closed or garbled connection) raises OSError and closes the connection,
so a late reply can never be taken for the answer to a later report; the next `send`
connects again.
"""

from __future__ import annotations

import socket

from proto.step_frames import HEADER, frame, payload_length
from proto.ultrascale.v1 import agent_pb2 as pb


class StepSocket:
    """One connection to the agent's step socket, opened at the first report."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None

    def send(self, report: pb.StepReport, timeout: float) -> None:
        try:
            sock = self._connected(timeout)
            sock.settimeout(timeout)
            sock.sendall(frame(report.SerializeToString()))
        except OSError:
            self.close()
            raise

    def reply(self, timeout: float) -> pb.StepReply:
        sock = self._sock
        if sock is None:
            raise ConnectionError("step socket: no report in flight")
        try:
            sock.settimeout(timeout)
            length = payload_length(self._read(sock, HEADER.size))
            return pb.StepReply.FromString(self._read(sock, length))
        except (OSError, ValueError) as exc:  # DecodeError and FrameError are ValueErrors
            self.close()
            if isinstance(exc, OSError):
                raise
            raise ConnectionError(f"step socket: not a step reply ({exc})") from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connected(self, timeout: float) -> socket.socket:
        if self._sock is None:
            if not self.path:
                raise FileNotFoundError("ULTRA_STEP_SOCKET is not set")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        """Exactly `n` bytes (one recv, as a reply normally arrives whole; an empty reply, all
        fields at their defaults, is 0 bytes)."""
        data = sock.recv(n)
        while len(data) < n:
            more = sock.recv(n - len(data))
            if not more:
                raise ConnectionResetError("step socket: the agent closed the connection")
            data += more
        return data
