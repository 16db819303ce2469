"""Which peer copies a keeper accepts (docs/snapshots.md, "Who is accepted"): only from the node
the running plan says trains the rank, only on that node's buddy, only for the running job
submission and generation, signed with the submission's peer key, never for this node's own
ranks, never for a step beyond what the node has seen, never before a job runs. A refused copy
leaves nothing and evicts nothing."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    SnapshotInvalid,
    chunk_checksums,
    record_name,
    shard_name,
    step_dir,
)
from daemon.control.peer_key import PeerKey
from daemon.control.records import Progress
from daemon.node.copy_admission import sign
from daemon.node.snapshot_files import Incoming
from daemon.node.snapshot_keeper import SnapshotKeeper
from parallel import job as jobmod
from parallel.planner import NodeInfo, plan_generation
from tests.unit.test_snapshot_keeper import store
from tests.unit.test_snapshot_store import make_step

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
JOB = jobmod.loads((REPO / "examples" / "tiny.toml").read_text())
REV, GEN = 7, 3
KEY = PeerKey(REV, "this-submissions-key")
OLD_KEY = PeerKey(REV - 1, "the-previous-submissions-key")


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _member(node: str) -> SimpleNamespace:
    return SimpleNamespace(record=SimpleNamespace(address=f"{node}:1"))


def view(live: tuple[str, ...] = ("a", "b", "c"), step: int = 20, running: bool = True
         ) -> SimpleNamespace:
    """Generation GEN of submission REV on a, b, c (ranks 0, 1, 2; buddies a->b->c->a)."""
    plan = plan_generation(JOB, [NodeInfo(n, 1) for n in ("a", "b", "c")], GEN, ("h", 1),
                           {"source": "snapshot", "step": 10, "locations": ["a", "b", "c"]}) \
        if running else None
    return SimpleNamespace(snapshots={}, nodes={n: _member(n) for n in live}, plan=plan,
                           generation=GEN if running else 0,
                           spec=SimpleNamespace(mod_revision=REV) if running else None,
                           progress=Progress(generation=GEN, step=step) if running
                           else Progress())


def keeper(root: Path, node: str, v: SimpleNamespace | None = None) -> SnapshotKeeper:
    root.mkdir(parents=True, exist_ok=True)  # as the keeper's run() does
    k = SnapshotKeeper(root, node, f"{node}:1", v or view(), None, None, None,  # type: ignore[arg-type]
                       lambda: 0, peer_key=lambda: KEY)
    k.restored(GEN, 10)  # this node's workers restored the plan's step in this generation
    return k


def copy(step: int, file: str, data: bytes, sender: str, *, generation: int = GEN,
         revision: int = REV, key: PeerKey = KEY) -> Incoming:
    rank = -1 if file == MANIFEST_NAME else 0 if file == METADATA_NAME else \
        int(file[5:10])
    header = Incoming(step, file, len(data), chunk_checksums(data), rank, sender=sender,
                      spec_revision=revision, generation=generation)
    return sign(header, key)


DATA = bytes(range(256)) * 40


def test_a_shard_from_its_trainer_to_its_buddy_is_kept(root):
    k = keeper(root, "b")
    store(k, copy(12, shard_name(0), DATA, "a"), DATA)
    assert (step_dir(root, 12) / shard_name(0)).read_bytes() == DATA
    assert [(h.step, h.ranks) for h in k.held()] == [(12, (0,))]


def test_a_copy_of_a_shard_of_this_nodes_own_rank_is_refused(root):
    """b trains rank 1: whoever sends it, the shard its own workers wrote stays."""
    make_step(root, 12, [64, 64, 64], manifest=False)
    own = (step_dir(root, 12) / shard_name(1)).read_bytes()
    k = keeper(root, "b")
    for sender in ("a", "c"):
        with pytest.raises(SnapshotInvalid, match="rank 1 is trained by b"):
            store(k, copy(12, shard_name(1), DATA, sender), DATA)
    assert (step_dir(root, 12) / shard_name(1)).read_bytes() == own
    assert (step_dir(root, 13) / shard_name(1)).exists() is False
    with pytest.raises(SnapshotInvalid, match="rank 1 is trained by b"):
        store(k, copy(13, shard_name(1), DATA, "a"), DATA)
    assert not step_dir(root, 13).exists()


def test_a_copy_of_the_manifest_on_the_node_that_writes_it_is_refused(root):
    """a trains rank 0, so it writes each step's manifest and .metadata itself."""
    make_step(root, 12, [64, 64, 64])
    manifest = (step_dir(root, 12) / MANIFEST_NAME).read_bytes()
    metadata = (step_dir(root, 12) / METADATA_NAME).read_bytes()
    k = keeper(root, "a")
    with pytest.raises(SnapshotInvalid, match="written by a"):
        store(k, copy(12, METADATA_NAME, b"x" * 300, "b"), b"x" * 300)
    with pytest.raises(SnapshotInvalid, match="written by a"):
        store(k, copy(12, MANIFEST_NAME, manifest, "b"), manifest)
    assert (step_dir(root, 12) / METADATA_NAME).read_bytes() == metadata
    assert (step_dir(root, 12) / MANIFEST_NAME).read_bytes() == manifest


def test_a_shard_from_a_node_that_does_not_train_its_rank_is_refused(root):
    k = keeper(root, "b")
    with pytest.raises(SnapshotInvalid, match="rank 0 is trained by a, not c"):
        store(k, copy(12, shard_name(0), DATA, "c"), DATA)
    with pytest.raises(SnapshotInvalid, match="not a member"):
        store(k, copy(12, shard_name(0), DATA, "z"), DATA)
    assert k.held() == () and not step_dir(root, 12).exists()


def test_a_shard_for_a_node_that_is_not_the_senders_buddy_is_refused(root):
    k = keeper(root, "c")  # a's buddy is b while b is alive
    with pytest.raises(SnapshotInvalid, match="buddy of a is b"):
        store(k, copy(12, shard_name(0), DATA, "a"), DATA)
    assert k.held() == ()
    k.view.nodes.pop("b")  # b died: c is a's buddy now
    store(k, copy(12, shard_name(0), DATA, "a"), DATA)
    assert [(h.step, h.ranks) for h in k.held()] == [(12, (0,))]


@pytest.mark.parametrize("case", ["older generation", "newer generation",
                                  "previous submission", "previous submission's key"])
def test_a_copy_for_another_generation_or_submission_is_refused(root, case):
    k = keeper(root, "b")
    header = {"older generation": lambda: copy(12, shard_name(0), DATA, "a",
                                               generation=GEN - 1),
              "newer generation": lambda: copy(12, shard_name(0), DATA, "a",
                                               generation=GEN + 1),
              "previous submission": lambda: copy(12, shard_name(0), DATA, "a",
                                                  revision=REV - 1, key=OLD_KEY),
              "previous submission's key": lambda: copy(12, shard_name(0), DATA, "a",
                                                        key=OLD_KEY)}[case]()
    reason = {"older generation": "generation", "newer generation": "generation",
              "previous submission": "submission", "previous submission's key": "peer key"}
    with pytest.raises(SnapshotInvalid, match=reason[case]):
        store(k, header, DATA)
    assert k.held() == () and not step_dir(root, 12).exists()


def test_a_copy_with_a_field_changed_after_signing_is_refused(root):
    k = keeper(root, "b")
    signed = copy(12, shard_name(0), DATA, "a")
    moved = dataclasses.replace(signed, step=13)
    with pytest.raises(SnapshotInvalid, match="peer key"):
        store(k, moved, DATA)
    assert k.held() == ()


def test_a_far_future_step_is_refused_and_evicts_nothing(root):
    """A forged manifest of a step far beyond what the node has seen would have become the
    newest step with a manifest, and retention would have freed the genuine ones."""
    for step in (18, 19):
        make_step(root, step, [64, 64, 64])
    source = root / "forger"
    make_step(source, 99_999_999, [64, 64, 64])
    k = keeper(root / "member", "c")
    for step in (18, 19):
        shutil.copytree(step_dir(root, step), step_dir(root / "member", step))
    for name, sender in ((METADATA_NAME, "a"), (MANIFEST_NAME, "a"), (shard_name(1), "b")):
        data = (step_dir(source, 99_999_999) / name).read_bytes()
        with pytest.raises(SnapshotInvalid, match="beyond"):
            store(k, copy(99_999_999, name, data, sender), data)
    k._prune(k._listing())
    assert [h.step for h in k.held()] == [18, 19]
    assert not step_dir(root / "member", 99_999_999).exists()


def test_a_step_sent_before_the_first_job_is_refused_and_never_held(root):
    """Before a job runs there is no trainer, no buddy and no submission to bind a copy to."""
    v = view(running=False)
    k = keeper(root, "b", v)
    with pytest.raises(SnapshotInvalid, match="no job"):
        store(k, copy(1, shard_name(0), DATA, "a", generation=1), DATA)
    assert not step_dir(root, 1).exists()
    running = view()
    v.__dict__.update(running.__dict__)  # the first job's first generation is written
    k._follow_job()
    assert k.held() == ()


def test_a_refused_copy_leaves_no_temporary_file(root):
    k = keeper(root, "b")
    header = copy(12, shard_name(0), DATA, "a")
    bad = bytearray(DATA)
    bad[7] ^= 1
    with pytest.raises(SnapshotInvalid, match="checksum"):
        store(k, header, bytes(bad))
    assert not step_dir(root, 12).exists() or list(step_dir(root, 12).iterdir()) == []
    store(k, header, DATA)
    assert sorted(p.name for p in step_dir(root, 12).iterdir()) == [shard_name(0),
                                                                    record_name(0)]


def test_a_step_of_the_replaced_history_is_refused_until_this_nodes_workers_restored(root):
    """Generation GEN restores step 10: a step 12 arriving before this node's workers restored
    (and freed the replaced history's 11, 12...) could be the old history's, and mixed into the
    new step 12 it would still verify."""
    root.mkdir(parents=True, exist_ok=True)
    k = SnapshotKeeper(root, "b", "b:1", view(), None, None, None,  # type: ignore[arg-type]
                       lambda: 0, peer_key=lambda: KEY)
    with pytest.raises(SnapshotInvalid, match="have not restored it yet"):
        store(k, copy(12, shard_name(0), DATA, "a"), DATA)
    store(k, copy(10, shard_name(0), DATA, "a"), DATA)  # the restored step is both histories'
    k.restored(GEN, 10)
    store(k, copy(12, shard_name(0), DATA, "a"), DATA)
    assert [h.step for h in k.held()] == [10, 12]
