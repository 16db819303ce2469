"""The agent's end of the step socket (`$ULTRA_STEP_SOCKET`): step reports in, replies out.

Every worker connects once and then, after each step, sends a framed `StepReport` and reads
the framed `StepReply` (proto/step_frames.py). The reply is the one `ReportStep` gives
(`WorkerControlService.step_reply`); the agent handles a report on its event loop as it
handles the gRPC calls, so the order of a worker's report and its other calls is kept (the
worker reads the reply before it makes any other call).

The socket is the user's alone (mode 0600, like the WorkerControl socket). A connection that
sends what is not a frame of a step report is closed, with a log line naming why; the others
go on.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from google.protobuf.message import DecodeError

from proto.step_frames import HEADER, FrameError, frame, payload_length
from proto.ultrascale.v1 import agent_pb2 as pb

log = logging.getLogger(__name__)

Answer = Callable[[pb.StepReport], pb.StepReply]


async def serve_step_socket(path: Path, answer: Answer) -> asyncio.AbstractServer:
    """Listen on `path` (replacing a stale socket there) until the server is closed."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                length = payload_length(await reader.readexactly(HEADER.size))
                report = pb.StepReport.FromString(await reader.readexactly(length))
                writer.write(frame(answer(report).SerializeToString()))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker closed its end (it exited, or gave up on a late reply)
        except (FrameError, DecodeError) as exc:
            log.warning("step socket: closing a connection that sent no step report: %s", exc)
        finally:
            writer.close()

    path.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(connection, path=str(path))
    os.chmod(path, 0o600)  # only this user's processes may report steps
    return server
