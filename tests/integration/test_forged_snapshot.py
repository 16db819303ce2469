"""A forged snapshot step delivered to an agent is never kept, never planned and never run
(docs/snapshots.md, "Who is accepted").

The job prefix observers read holds no peer key. An attacker who reads etcd anyway (here with no
RBAC at all: it finds the key under /ultrascale-private/, the strongest case, as if it held the
agents' own etcd credentials) streams a step 99999999 to a member over SnapshotPeer.Replicate:
a `.metadata` whose pickle would create a marker file when a worker restores it, a manifest, and
a shard per rank, each signed as the node the plan says writes it. Then a member is killed, so
the leader plans a restore. Real etcd, agents, workers and shared memory; the committed losses
are compared with an uninterrupted single-process run.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from pathlib import Path

import grpc
import pytest

from checkpoint.snapshot_format import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotManifest,
    chunk_checksums,
    shard_name,
)
from daemon.cli.local import LocalCluster, _call
from daemon.control.keys import Keys
from daemon.control.peer_key import PeerKey
from daemon.control.records import NodeRecord, SnapshotHoldings
from daemon.control.snapshot_steps import buddy_of
from daemon.node.copy_admission import sign
from daemon.node.snapshot_files import Incoming
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.conftest import small_job_text
from tests.distributed.reference import reference_run
from tests.integration.conftest import etcd_call, wait_until
from tests.integration.test_snapshot_recovery import restore_events
from tests.integration.test_training_recovery import committed_steps
from tests.processes import running

pytestmark = pytest.mark.integration
STEPS, BATCH, ATTACK_AFTER, EVERY = 20, 10, 6, 6
FORGED = 99_999_999


class _Marker:
    """Unpickling this calls open(path, "w"): the file appears iff a pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def steal(endpoint: str, ns: str) -> tuple[Plan, dict[str, str], PeerKey]:
    """What the attacker reads from etcd: the running plan, the members' addresses and the
    peer key; the job prefix, which observers may read, must not hold the key."""
    keys = Keys(ns)

    async def read(etcd) -> tuple[list, object, object]:
        kvs, _ = await etcd.get_prefix(b"/ultrascale/")
        return kvs, await etcd.get(keys.peer_key), await etcd.get(keys.generation)

    kvs, private, generation = etcd_call(endpoint, read)
    key = PeerKey.from_json(private.value)
    assert not [kv.key for kv in kvs if key.secret.encode() in kv.value], \
        "the peer key is readable under /ultrascale/"
    addresses = {}
    for kv in kvs:
        if kv.key.startswith(keys.nodes):
            record = NodeRecord.from_json(kv.value)
            addresses[record.node] = record.address
    return Plan.from_json(generation.value), addresses, key


def forged_files(marker: Path, world: int) -> list[tuple[str, int, bytes]]:
    """(name, rank, bytes) in the order a sender sends them: .metadata, manifest, shards."""
    metadata = pickle.dumps(_Marker(str(marker)))
    shards = [(shard_name(r), r, os.urandom(64)) for r in range(world)]
    entries = [FileEntry(name, r, len(data), None) for name, r, data in shards]
    entries.append(FileEntry(METADATA_NAME, 0, len(metadata), chunk_checksums(metadata)))
    manifest = SnapshotManifest(FORGED, FORGED * BATCH, world, {"dp": world}, tuple(entries))
    return [(METADATA_NAME, 0, metadata), (MANIFEST_NAME, -1, manifest.to_bytes()), *shards]


async def deliver(address: str, plan: Plan, key: PeerKey,
                  files: list[tuple[str, int, bytes]]) -> list[str]:
    """Stream the files to `address`; the acks' errors, in order ("" for a kept copy)."""
    trainer = {r.global_rank: r.node for r in plan.ranks}
    errors = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.SnapshotPeerStub(channel).Replicate(
            metadata=(("authorization", f"Bearer {key.secret}"),), timeout=30)
        for name, rank, data in files:
            # Signed as the node that writes the file: rank 0's for .metadata and the manifest.
            header = sign(Incoming(FORGED, name, len(data), chunk_checksums(data), rank,
                                   sender=trainer[max(rank, 0)], spec_revision=key.spec_revision,
                                   generation=plan.generation), key)
            await call.write(pb.FileChunk(
                step=FORGED, file=name, size=len(data), chunks=header.chunks,
                chunk_bytes=CHUNK_BYTES, rank=rank, sender=header.sender,
                spec_revision=header.spec_revision, generation=header.generation,
                mac=header.mac, data=data))
            ack = await call.read()
            errors.append(ack.error)
        await call.done_writing()
    return errors


async def held_steps(address: str, secret: str) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await pb_grpc.SnapshotPeerStub(channel).Holdings(
            pb.HoldingsRequest(), metadata=(("authorization", f"Bearer {secret}"),), timeout=10)
    return [h.step for h in SnapshotHoldings.from_json(reply.holdings_json).steps if h.metadata]


def test_a_forged_step_is_never_kept_planned_or_run(tmp_path: Path, token_file: Path):
    marker = tmp_path / "forged-metadata-ran"
    with running(LocalCluster(tmp_path / "state", nodes=3, devices_per_node=1, ttl=2)) as c:
        job_text = small_job_text(token_file, train={"steps": STEPS},
                                  checkpoint={"dir": "ckpt", "every": EVERY})
        (tmp_path / "job.toml").write_text(job_text)
        output = tmp_path / "output"
        token = c.token_file.read_text().strip()
        _call(c, token, "SubmitJob",
              pb.SubmitJobRequest(spec_toml=job_text, overrides=[f'job.output_dir="{output}"']))
        steps_file = output / "steps.jsonl"
        wait_until(lambda: max(committed_steps(steps_file), default=0) >= ATTACK_AFTER, 120,
                   f"step {ATTACK_AFTER}", 0.05)

        plan, addresses, key = steal(c.etcd.endpoint, c.namespace)
        coordinator = next(r.node for r in plan.ranks if r.global_rank == 0)
        target = buddy_of(coordinator, plan.nodes, addresses)
        assert target is not None
        acks = asyncio.run(deliver(addresses[target], plan, key,
                                   forged_files(marker, plan.world_size)))
        held = asyncio.run(held_steps(addresses[target], key.secret))

        victim = next(n for n in plan.nodes if n not in (coordinator, target))
        c.agents[victim].send_signal(signal.SIGKILL)
        finished = True
        try:
            wait_until(lambda: _call(c, token, "GetStatus", pb.GetStatusRequest()).finished,
                       240, "the job to finish", 0.25)
        except AssertionError:
            finished = False
        events = restore_events(c, token)
        final = Plan.from_json(etcd_call(c.etcd.endpoint,
                                         lambda e: e.get(Keys(c.namespace).generation)).value)

    assert not marker.exists(), "a worker unpickled the forged .metadata"
    assert final.restore.step != FORGED and not any(str(FORGED) in e for e in events), events
    assert all(acks), f"a forged file was kept: {acks}"
    assert FORGED not in held and held, f"{target} holds {held}"
    assert finished
    committed = committed_steps(steps_file)
    assert sorted(committed) == list(range(1, STEPS + 1))
    reference, _ = reference_run(tmp_path / "job.toml", STEPS)
    for step, record in committed.items():
        assert record["consumed_samples"] == step * BATCH, f"step {step}"
        assert record["loss"] == pytest.approx(reference[step], rel=1e-4), f"step {step}"
