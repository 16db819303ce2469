"""checkpoint.storage = "node": every node's checkpoint.dir is its own disk (docs/snapshots.md).

Each agent (and so its worker) runs in a mount namespace of its own with a different directory
bound over the job's checkpoint.dir: the same path, a different disk per node, as on a cluster
without a shared filesystem. kill -9 of one of three agents mid-run:

- with snapshots, the survivors restore from peer memory and finish exactly as an
  uninterrupted run; the durable checkpoints are fragments, one per node;
- without them, the restore needs the durable checkpoint, which no node holds whole: the job
  fails at once naming the step, the node and the directory, having committed no step of a
  restart from older state.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from daemon.cli.local import LocalCluster, _call
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.integration.conftest import wait_until
from tests.integration.test_shared_storage import _can_unshare
from tests.integration.test_snapshot_recovery import (
    EVERY,
    check_exact,
    restore_events,
    run_until_a_kill,
    submit_and_kill,
)
from tests.processes import running

pytestmark = pytest.mark.integration
NODES = ("node-0", "node-1", "node-2")


def node_local_cluster(tmp_path: Path) -> LocalCluster:
    """Three agents, each seeing its own `disks/<node>` at `output/ckpt`, and a /dev/shm of its
    own (as separate machines have: snapshots reach other nodes only through their agents)."""
    reason = _can_unshare()
    if reason:
        pytest.skip(reason)
    ckpt = tmp_path / "output" / "ckpt"
    ckpt.mkdir(parents=True)
    prefix = {}
    for node in NODES:
        disk = tmp_path / "disks" / node
        disk.mkdir(parents=True)
        prefix[node] = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f'mount --bind "{disk}" "{ckpt}" && mount -t tmpfs tmpfs /dev/shm '
                        '&& exec "$0" "$@"']
    return LocalCluster(tmp_path / "state", nodes=len(NODES), devices_per_node=1, ttl=2,
                        launch_prefix=prefix)


def non_leader(cluster: LocalCluster) -> str:
    token = cluster.token_file.read_text().strip()
    leader = wait_until(lambda: _call(cluster, token, "GetStatus", pb.GetStatusRequest()).leader,
                        60, "a leader")
    return next(node for node in reversed(NODES) if node != leader)


def test_node_local_dirs_restore_from_peer_memory(tmp_path: Path, token_file: Path) -> None:
    with running(node_local_cluster(tmp_path)) as cluster:
        victim = non_leader(cluster)
        token, _, steps_file = run_until_a_kill(cluster, token_file, tmp_path, victim,
                                                storage="node")
        status = _call(cluster, token, "GetStatus", pb.GetStatusRequest())
        assert status.state == "finished", status
        lines = [json.loads(line) for line in steps_file.read_text().splitlines()]
        restored = min(r["step"] for r in lines if r["world_size"] == 2) - 1
        assert restored > EVERY, "not the durable checkpoint: the snapshot, from memory"
        events = restore_events(cluster, token)
        assert any(f"restored snapshot@{restored} from memory" in e for e in events), events
        check_exact(steps_file, tmp_path / "job.toml")

    disks = tmp_path / "disks"
    assert not list(disks.glob("*/.shared-*")), "no shared-directory check with storage node"
    # The final checkpoint is in fragments: one node has the manifest and `.metadata`, each of
    # the two survivors its own shard, and the output directory itself nothing.
    final = [disks / node / "step_00000016" for node in NODES if node != victim]
    with_manifest = [d for d in final if (d / "manifest.json").exists()]
    assert len(with_manifest) == 1, final
    for d in final:
        assert len(list(d.glob("*.distcp"))) == 1, sorted(p.name for p in d.iterdir())
    assert not (tmp_path / "output" / "ckpt" / "step_00000016").exists()


def test_node_local_dirs_without_snapshots_fail_the_job_naming_the_step(
        tmp_path: Path, token_file: Path) -> None:
    with running(node_local_cluster(tmp_path)) as cluster:
        token, _, steps_file = submit_and_kill(cluster, token_file, tmp_path, "node-2",
                                               storage="node", snapshot_every=0)

        def failed() -> pb.Status | None:
            s = _call(cluster, token, "GetStatus", pb.GetStatusRequest())
            assert s.state != "finished", s
            return s if s.state == "failed" else None

        final = wait_until(failed, 120, "the job to fail", 0.25)
    reason = final.reason
    found = re.search(r"cannot restore checkpoint step (\d+)", reason)
    assert found, reason
    step = int(found.group(1))
    assert step > 0 and step % EVERY == 0, reason
    assert 'checkpoint.storage is "node"' in reason
    assert re.search(r"node\(s\) node-[01]\b", reason), reason
    assert str(tmp_path / "output" / "ckpt") in reason
    # Nothing was trained again from the initial weights (or any other state), and the first
    # generation after the kill was the last: re-forming does not gather fragments.
    lines = [json.loads(line) for line in steps_file.read_text().splitlines()]
    assert {r["world_size"] for r in lines} == {3}, lines
    assert final.generation == max(r["generation"] for r in lines) + 1, final
