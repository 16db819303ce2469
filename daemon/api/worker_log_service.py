"""ReadWorkerLog: one of this node's workers' output, for `ultractl logs NODE` (bounded, read
only from the node's worker log files: daemon/node/worker_logs.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from daemon.config import AgentConfig
from daemon.node.worker_logs import LogNotFound, follow, log_path, tail
from proto.ultrascale.v1 import agent_pb2 as pb


def log_dir(config: AgentConfig) -> Path:
    """Where the supervisor writes its workers' logs (agent.py: `state_dir / "logs"`)."""
    return config.state_dir / "logs"


async def read(node_id: str, config: AgentConfig, request: pb.WorkerLogRequest,
               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkerLogChunk]:
    if request.node != node_id:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"node: this agent is {node_id!r}, not {request.node!r}")
    if not config.workers:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"node {node_id!r} runs no workers")
    if not 0 <= request.local_rank < config.devices:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"rank: node {node_id!r} has local ranks 0..{config.devices - 1} "
                            f"(got {request.local_rank})")
    if request.tail_lines < 0:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"tail: expected lines >= 0 (got {request.tail_lines})")
    path = log_path(log_dir(config), str(request.local_rank))
    try:
        data, offset = tail(path, request.tail_lines)
    except LogNotFound as exc:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"node {node_id!r} local rank {request.local_rank}: {exc}")
        return
    if data:
        yield pb.WorkerLogChunk(data=data)
    if request.follow:
        async for chunk in follow(path, offset, lambda: False):
            yield pb.WorkerLogChunk(data=chunk)
