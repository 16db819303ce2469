"""What one Replicate stream costs the receiving agent (docs/snapshots.md, "Bounded streams"):
a declared 1 GiB file goes to disk piece by piece, so the receiver's resident memory grows by a
few MiB whatever the size; a size beyond what the plan makes plausible is refused at once,
naming the field. The receiver is a process of its own (tests/integration/replicate_peer.py),
so its memory is its alone."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from checkpoint.snapshot_format import CHUNK_BYTES, checksum, shard_name, step_dir
from daemon.api.grpc_limits import MESSAGE_OPTIONS
from daemon.control.peer_key import PeerKey
from daemon.node.copy_admission import sign
from daemon.node.snapshot_files import Incoming
from daemon.procutil import parent_death_env, terminate
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.integration.conftest import wait_until
from tests.integration.replicate_peer import GEN, REV, SECRET

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
PIECE = 1 << 20
STATE_BYTES = 512 << 20  # the plan's predicted state per rank: 1 GiB shards are plausible


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.replicate_peer",
                             str(root), str(port_file), str(STATE_BYTES)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **parent_death_env()})
    try:
        wait_until(lambda: port_file.exists() and port_file.read_text() or proc.poll(), 60,
                   "the peer to listen")
        assert proc.poll() is None, "the peer died"
        yield proc, f"127.0.0.1:{port_file.read_text()}", root
    finally:
        terminate(proc)
        shutil.rmtree(root, ignore_errors=True)


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def first_message(step: int, size: int, chunks: tuple[int, ...]) -> pb.FileChunk:
    header = sign(Incoming(step, shard_name(0), size, chunks, 0, sender="a",
                           spec_revision=REV, generation=GEN), PeerKey(REV, SECRET))
    return pb.FileChunk(step=step, file=header.file, size=size, chunks=chunks,
                        chunk_bytes=CHUNK_BYTES, rank=0, sender=header.sender,
                        spec_revision=REV, generation=GEN, mac=header.mac)


async def stream(address: str, first: pb.FileChunk, pieces: int, piece: bytes,
                 deadline_s: float) -> pb.FileAck:
    async with grpc.aio.insecure_channel(address, options=MESSAGE_OPTIONS) as channel:
        call = pb_grpc.SnapshotPeerStub(channel).Replicate(
            metadata=(("authorization", f"Bearer {SECRET}"),), timeout=deadline_s)
        first.data = piece
        await call.write(first)
        for _ in range(pieces - 1):
            await call.write(pb.FileChunk(data=piece))
        ack = await call.read()
        await call.done_writing()
        return ack


def test_a_declared_gibibyte_costs_the_receiver_a_few_mebibytes(peer):
    proc, address, root = peer
    block = os.urandom(PIECE) * (CHUNK_BYTES // PIECE)  # one chunk, repeated
    chunks = (checksum(block),) * (GIB // CHUNK_BYTES)
    # The peak resident size is measured from here: clear_refs 5 resets VmHWM to VmRSS.
    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
    before = status_kib(proc.pid, "VmRSS")
    ack = asyncio.run(stream(address, first_message(1, GIB, chunks), GIB // PIECE,
                             block[:PIECE], 300))
    grown_mib = (status_kib(proc.pid, "VmHWM") - before) / 1024
    assert ack.error == "", ack.error
    assert (step_dir(root, 1) / shard_name(0)).stat().st_size == GIB
    assert grown_mib < 64, f"the receiver's resident memory grew by {grown_mib:.0f} MiB"


def test_a_size_beyond_what_the_plan_makes_plausible_is_refused_naming_the_field(peer):
    _, address, root = peer
    size = 8 * GIB
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(stream(address, first_message(1, size, (0,) * (size // CHUNK_BYTES)), 1,
                           b"x" * PIECE, 30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "size" in (refused.value.details() or "")
    assert not step_dir(root, 1).exists()
