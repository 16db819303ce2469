"""A receiving agent's SnapshotPeer listener alone, in a process of its own, so a test can
measure what receiving costs it: `python -m tests.integration.replicate_peer ROOT PORT_FILE
STATE_BYTES`. Node b of a two-node plan (a trains rank 0, b is its buddy); the plan predicts
STATE_BYTES of state per rank. Prints nothing; writes its port to PORT_FILE once it serves."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc

from daemon.api.auth import BearerTokenInterceptor
from daemon.api.grpc_limits import SERVER_OPTIONS
from daemon.api.snapshot_service import SnapshotPeerService
from daemon.control.peer_key import PeerKey
from daemon.control.records import Progress
from daemon.node.snapshot_keeper import SnapshotKeeper
from parallel import job as jobmod
from parallel.planner import MemoryBytes, NodeInfo, Predicted, plan_generation
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
SECRET, REV, GEN = "the-peer-key-of-the-memory-test-submission", 5, 2


def peer_view(state_bytes: int) -> SimpleNamespace:
    job = jobmod.loads((REPO / "examples" / "tiny.toml").read_text())
    plan = plan_generation(job, [NodeInfo("a", 1), NodeInfo("b", 1)], GEN, ("h", 1))
    plan = dataclasses.replace(plan, predicted=Predicted(
        memory_bytes=MemoryBytes(params=state_bytes // 3, optimizer=state_bytes
                                 - state_bytes // 3)))
    member = SimpleNamespace(record=SimpleNamespace(address="a:1"))
    return SimpleNamespace(snapshots={}, nodes={"a": member, "b": member}, plan=plan,
                           generation=GEN, spec=SimpleNamespace(mod_revision=REV),
                           progress=Progress(generation=GEN, step=0))


async def serve(root: Path, port_file: Path, state_bytes: int) -> None:
    keeper = SnapshotKeeper(root, "b", "", peer_view(state_bytes), None, None,  # type: ignore[arg-type]
                            None, lambda: 0, peer_key=lambda: PeerKey(REV, SECRET))
    keeper.restored(GEN, 0)
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor("admin", lambda: SECRET)],
                             options=SERVER_OPTIONS)  # the agent's own server's
    pb_grpc.add_SnapshotPeerServicer_to_server(SnapshotPeerService(keeper), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
