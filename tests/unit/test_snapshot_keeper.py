"""The agent's side of snapshots on real shared-memory files: what it keeps from peers (only
what verifies), what it says it holds, what it frees, what it serves. Which copies it accepts
at all is tests/unit/test_copy_admission.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    SnapshotInvalid,
    SnapshotManifest,
    chunk_checksums,
    record_name,
    shard_name,
    shard_rank,
    step_dir,
    write_atomically,
)
from checkpoint.snapshot_store import SnapshotStore
from daemon.control.peer_key import PeerKey
from daemon.control.records import HeldStep, Progress, SnapshotHoldings
from daemon.node.copy_admission import sign
from daemon.node.snapshot_files import Incoming
from daemon.node.snapshot_keeper import Listing, SnapshotKeeper
from parallel.planner import MemoryBytes
from tests.unit.test_snapshot_store import make_step

pytestmark = pytest.mark.unit


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


REV = 7  # the job submission the tests' views run
KEY = PeerKey(REV, "the-peer-key-of-submission-7-in-these-tests")


def plan_of(ranks: dict[str, tuple[int, ...]], generation: int, restored: int = 0
            ) -> SimpleNamespace:
    """What the keeper reads of a plan: which node trains which global rank."""
    infos = tuple(SimpleNamespace(node=n, global_rank=r) for n, rs in ranks.items() for r in rs)
    by_node = {n: tuple(i for i in infos if i.node == n) for n in ranks}
    return SimpleNamespace(nodes=tuple(sorted(ranks)), ranks=infos, world_size=len(infos),
                           ranks_of=lambda node: by_node.get(node, ()), generation=generation,
                           restore=SimpleNamespace(source="init", step=restored, locations=()),
                           job=SimpleNamespace(checkpoint=SimpleNamespace(snapshot_every=1)),
                           predicted=SimpleNamespace(memory_bytes=MemoryBytes()))


def running(ranks: dict[str, tuple[int, ...]] | None = None, generation: int = 1,
            restored: int = 0, step: int = 10) -> SimpleNamespace:
    """A view of submission REV's `generation`; by default a trains ranks 0-2 (and writes the
    manifest), b rank 3, so b keeps a's copies. Every node alive, at `step`."""
    ranks = ranks or {"a": (0, 1, 2), "b": (3,)}
    member = SimpleNamespace(record=SimpleNamespace(address="b:1"))
    return SimpleNamespace(snapshots={}, nodes={n: member for n in ranks},
                           plan=plan_of(ranks, generation, restored), generation=generation,
                           spec=SimpleNamespace(mod_revision=REV),
                           progress=Progress(generation=generation, step=step))


def keeper(root: Path, view=None, node: str = "b") -> SnapshotKeeper:
    """Node `node`'s keeper; its workers restored the plan's step (so newer copies are kept)."""
    view = view or running()
    root.mkdir(parents=True, exist_ok=True)  # as the keeper's run() does
    k = SnapshotKeeper(root, node, f"{node}:1", view, None, None, None,  # type: ignore[arg-type]
                       lambda: 0, peer_key=lambda: KEY)
    plan = getattr(view, "plan", None)
    if plan is not None and hasattr(plan, "generation"):
        k.restored(plan.generation, plan.restore.step)
    return k


def signed(step: int, file: str, data: bytes, rank: int, sender: str = "a",
           generation: int = 1) -> Incoming:
    return sign(Incoming(step, file, len(data), chunk_checksums(data), rank, sender=sender,
                         spec_revision=REV, generation=generation), KEY)


def header(step: int, rank: int, data: bytes, sender: str = "a", generation: int = 1
           ) -> Incoming:
    return signed(step, shard_name(rank), data, rank, sender, generation)


def store(k: SnapshotKeeper, header: Incoming, data: bytes) -> None:
    """Receive a whole copy at once, as SnapshotPeer.Replicate does piece by piece."""
    incoming = k.receive(header)
    try:
        incoming.write(data)
    except BaseException:
        incoming.discard()
        raise
    k.accept(incoming)


def test_a_peers_shard_is_kept_with_its_record_once_it_verifies(root):
    k = keeper(root)
    data = bytes(range(256)) * 50
    store(k, header(7, 2, data), data)
    directory = step_dir(root, 7)
    assert (directory / shard_name(2)).read_bytes() == data
    record = json.loads((directory / record_name(2)).read_text())
    assert record["size"] == len(data) and record["step"] == 7
    assert k.held() == (HeldStep(7, (2,), 0, False),)


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "extra checksum"])
def test_a_damaged_copy_is_refused_and_nothing_is_kept(root, damage):
    k = keeper(root)
    data = bytes(range(256)) * 50
    h = header(7, 1, data)
    if damage == "bit flip":
        sent = bytearray(data)
        sent[1000] ^= 0x04
        sent = bytes(sent)
    elif damage == "truncated":
        sent = data[:-10]
    else:
        h = sign(dataclasses.replace(h, chunks=h.chunks + (1,)), KEY)
        sent = data
    with pytest.raises(SnapshotInvalid):
        store(k, h, sent)
    assert not (step_dir(root, 7) / shard_name(1)).exists()
    assert k.held() == ()


def test_a_damaged_manifest_is_refused(root):
    make_step(root, 3, [100, 200])
    blob = bytearray((step_dir(root, 3) / MANIFEST_NAME).read_bytes())
    blob[blob.index(b'"size"') + 8] ^= 1
    k = keeper(root / "other")
    with pytest.raises(SnapshotInvalid, match="manifest|checksum"):
        store(k, signed(3, MANIFEST_NAME, bytes(blob), -1), bytes(blob))


def test_file_names_outside_the_format_are_refused(root):
    k = keeper(root)
    for name in ("../escape", "rank_1.distcp", "notes.txt"):
        with pytest.raises(SnapshotInvalid, match="not a snapshot file name"):
            store(k, signed(1, name, b"x", 0), b"x")
        with pytest.raises(ValueError):
            k.read(1, name, 0, -1)
    assert shard_rank("rank_00003.distcp") == 3 and shard_rank("rank_3.distcp") is None


def test_held_steps_name_their_shards_world_size_and_metadata(root):
    make_step(root, 4, [100, 200, 300])
    (step_dir(root, 4) / shard_name(1)).unlink()  # not here
    with open(step_dir(root, 4) / shard_name(2), "r+b") as f:
        f.truncate(10)  # being written: not whole
    assert keeper(root).held() == (HeldStep(4, (0,), 3, True),)


def test_the_newest_two_steps_with_a_manifest_are_kept_and_older_ones_freed(root):
    for step in (1, 2, 3):
        make_step(root, step, [64])
    make_step(root, 4, [64], manifest=False)  # in progress
    k = keeper(root)
    k._prune(k._listing())
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003",
                                                      "step_00000004"]


def test_reads_serve_ranges_and_whole_files_and_none_when_absent(root):
    contents = make_step(root, 5, [1000])
    k = keeper(root)
    assert k.read(5, shard_name(0), 10, 20) == contents[shard_name(0)][10:30]
    assert k.read(5, shard_name(0), 0, -1) == contents[shard_name(0)]
    assert k.read(5, METADATA_NAME, 0, -1) is not None
    assert k.read(6, shard_name(0), 0, -1) is None


def _member(address: str) -> SimpleNamespace:
    return SimpleNamespace(record=SimpleNamespace(address=address))


def test_a_file_not_held_here_is_read_from_a_live_peer_that_holds_it(root):
    view = SimpleNamespace(
        nodes={"b": _member("b:1"), "c": _member("c:1")},
        snapshots={"b": SnapshotHoldings("b", "b:1", (HeldStep(5, (0,), 2, False),)),
                   "c": SnapshotHoldings("c", "c:1", (HeldStep(5, (1,), 2, True),)),
                   "d": SnapshotHoldings("d", "d:1", (HeldStep(5, (0, 1), 2, True),))},
        plan=None)
    k = keeper(root, view, node="a")
    assert k.holders(5, shard_name(0)) == ["b:1"]
    assert k.holders(5, shard_name(1)) == ["c:1"]
    assert k.holders(5, METADATA_NAME) == ["c:1"]  # d holds everything but is no member
    assert k.holders(4, shard_name(0)) == []


def test_the_plans_restore_locations_are_tried_after_the_published_holders(root):
    """Published holdings lag; the plan's locations come from asking every member."""
    restore = SimpleNamespace(source="snapshot", step=6, locations=("a", "b", "c", "d"))
    view = SimpleNamespace(
        nodes={"a": _member("a:1"), "b": _member("b:1"), "c": _member("c:1")},
        snapshots={"c": SnapshotHoldings("c", "c:1", (HeldStep(6, (0,), 2, True),))},
        plan=SimpleNamespace(restore=restore))
    k = keeper(root, view, node="a")
    assert k.holders(6, shard_name(0)) == ["c:1", "b:1"]  # not itself, nor d (no member)
    assert k.holders(6, shard_name(1)) == ["b:1", "c:1"]
    assert k.holders(5, shard_name(1)) == []  # not the step the plan restores


def test_steps_without_manifests_are_bounded_too(root):
    for step in range(1, 8):
        make_step(root, step, [64], manifest=False)  # the coordinator's node is unreachable
    k = keeper(root)
    k._prune(k._listing())
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:08d}" for s in (4, 5, 6, 7)]


def test_a_node_without_room_for_the_predicted_snapshots_says_so(tmp_path, caplog) -> None:
    from daemon.node.snapshot_files import check_room, free_bytes

    assert free_bytes(tmp_path / "not-yet" / "node-0") > 0  # its nearest existing parent's
    # Other tests write to tmp_path's filesystem meanwhile; /proc's free space is always 0.
    root = Path("/proc/not-yet/node-0")
    assert free_bytes(root) == 0
    with caplog.at_level("WARNING", logger="daemon.node.snapshot_files"):
        assert check_room(root, 1000, 1000) == 1000  # what is held counts as room
        assert not caplog.records
        check_room(root, 1000, 1001)
    assert "snapshots need about" in caplog.text and "restores fall back" in caplog.text


def _same_generation_step(root: Path, step: int, earlier: int) -> None:
    """The coordinator's next snapshot of a generation: the same files and .metadata as
    `earlier`, and a manifest of its own step."""
    shutil.copytree(step_dir(root, earlier), step_dir(root, step))
    manifest = SnapshotManifest.parse((step_dir(root, earlier) / MANIFEST_NAME).read_bytes(), "")
    write_atomically(step_dir(root, step) / MANIFEST_NAME,
                     dataclasses.replace(manifest, step=step).to_bytes())


def _send(k: SnapshotKeeper, source: Path, step: int, name: str) -> None:
    data = (step_dir(source, step) / name).read_bytes()
    store(k, signed(step, name, data, -1), data)


def test_a_manifest_links_the_metadata_its_node_holds_for_an_earlier_step(root):
    source = root / "coordinator"
    make_step(source, 3, [64])
    _same_generation_step(source, 4, 3)
    k = keeper(root / "member")
    _send(k, source, 3, METADATA_NAME)
    _send(k, source, 3, MANIFEST_NAME)
    _send(k, source, 4, MANIFEST_NAME)  # no .metadata sent for step 4
    held = step_dir(root / "member", 4) / METADATA_NAME
    assert held.read_bytes() == (step_dir(source, 3) / METADATA_NAME).read_bytes()
    assert [(h.step, h.metadata) for h in k.held()] == [(3, True), (4, True)]


@pytest.mark.parametrize("case", ["nothing held", "other metadata"])
def test_a_manifest_whose_metadata_is_not_here_is_refused(root, case):
    source = root / "coordinator"
    make_step(source, 3, [64])
    make_step(source, 4, [64])  # metadata of its own: another generation's
    k = keeper(root / "member")
    if case == "other metadata":
        _send(k, source, 3, METADATA_NAME)
        _send(k, source, 3, MANIFEST_NAME)
    with pytest.raises(SnapshotInvalid, match=r"\.metadata is not here"):
        _send(k, source, 4, MANIFEST_NAME)
    assert not (step_dir(root / "member", 4) / MANIFEST_NAME).exists()
    assert not (step_dir(root / "member", 4) / METADATA_NAME).exists()


class _Puts:
    def __init__(self) -> None:
        self.values: list[bytes] = []

    async def put(self, key: bytes, value: bytes, lease: int) -> None:
        self.values.append(value)


def test_holdings_are_published_at_most_once_a_period_but_at_once_for_a_new_generation(root):
    view = running()
    etcd = _Puts()
    k = SnapshotKeeper(root, "b", "b:1", view, etcd,  # type: ignore[arg-type]
                       SimpleNamespace(snapshot_holdings=lambda node: node.encode()),
                       None, lambda: 7, publish_s=3600, peer_key=lambda: KEY)  # type: ignore[arg-type]
    k.restored(1, 0)
    data = b"x" * 100

    async def scenario() -> None:
        store(k, header(5, 0, data), data)
        await k._publish()
        store(k, header(5, 1, data), data)
        await k._publish()  # changed, but within the period: waits
        assert k.pacer.unpublished
        view.generation = 2
        await k._publish()  # a new generation: at once
        await k._publish()  # unchanged: nothing

    asyncio.run(scenario())
    published = [SnapshotHoldings.from_json(v).steps for v in etcd.values]
    assert published == [(HeldStep(5, (0,), 0, False),), (HeldStep(5, (0, 1), 0, False),)]


def _two_node_view(generation: int, restored: int = 0) -> SimpleNamespace:
    """Node a runs rank 0 (and so writes the manifest), b rank 1; both alive."""
    return running({"a": (0,), "b": (1,)}, generation, restored)


def _sender(root: Path, view: SimpleNamespace, send) -> SnapshotKeeper:
    return SnapshotKeeper(root, "a", "a:1", view, None, None, send,  # type: ignore[arg-type]
                          lambda: 0, peer_key=lambda: KEY)


def test_the_run_of_replicated_steps_follows_what_the_buddy_acknowledged(root):
    view = _two_node_view(generation=2, restored=8)
    sent: list[tuple[int, str]] = []
    refuse = {"on": False}

    async def send(address, header, pieces) -> None:
        async for _ in pieces:
            pass
        if refuse["on"]:
            raise ConnectionError("b is unreachable")
        sent.append((header.step, header.file))

    k = _sender(root, view, send)

    def run_of() -> tuple[int, int, int]:
        h = k.holdings()
        return h.generation, h.replicated_since, h.replicated_through

    async def scenario() -> None:
        k.restored(2, 8)
        make_step(root, 9, [100])
        await k._replicate(k._listing(), ())
        assert set(sent) == {(9, shard_name(0)), (9, METADATA_NAME), (9, MANIFEST_NAME)}
        assert run_of() == (2, 9, 9)
        refuse["on"] = True
        make_step(root, 10, [100])
        await k._replicate(k._listing(), ())
        assert run_of() == (2, 9, 9)  # step 10 is on this node only
        assert k.replicator.retry
        refuse["on"] = False
        await k._replicate(k._listing(), ())
        assert run_of() == (2, 9, 10)
        # Generation 3 restored step 9: the workers freed step 10 and train it again. It is
        # a new step 10, sent again, and the new run starts after the restored step.
        view.plan = _two_node_view(3, restored=9).plan
        k.restored(3, 9)
        assert run_of() == (3, -1, -1)
        shutil.rmtree(step_dir(root, 10))
        make_step(root, 10, [100])
        await k._replicate(k._listing(), ())
        assert sent.count((10, shard_name(0))) == 2
        assert run_of() == (3, 10, 10)

    asyncio.run(scenario())


def test_a_copy_received_before_a_restore_is_not_taken_for_a_peers_afterwards(root):
    """Generation 2's rank 0 ran on another node whose shard this node kept; from generation 3
    this node runs rank 0, and its own step 10 must go to its buddy."""
    view = running({"a": (1,), "b": (0,)}, generation=2)
    sent: list[tuple[int, str]] = []

    async def send(address, header, pieces) -> None:
        sent.append((header.step, header.file))

    k = _sender(root, view, send)
    k.restored(2, 0)
    data = b"y" * 100
    store(k, header(10, 0, data, sender="b", generation=2), data)
    view.plan = _two_node_view(3, restored=9).plan
    k.restored(3, 9)
    shutil.rmtree(step_dir(root, 10))  # the restoring worker freed it
    make_step(root, 10, [100])
    asyncio.run(k._replicate(k._listing(), ()))
    assert (10, shard_name(0)) in sent


def test_the_keeper_removes_what_a_restore_discarded_after_it_is_told_of_the_restore(root):
    view = _two_node_view(generation=2, restored=8)
    k = _sender(root, view, None)
    for step in (8, 9):
        make_step(root, step, [100])

    async def scenario() -> None:
        await k.purge_discarded()  # nothing discarded yet: nothing removed
        assert sorted(p.name for p in root.iterdir()) == ["step_00000008", "step_00000009"]
        SnapshotStore(root).free_after(8)  # generation 3's worker restored 8
        names = sorted(p.name for p in root.iterdir())
        assert names[0].startswith(".discarded-step_00000009-")
        assert names[1:] == ["step_00000008"]
        k.restored(3, 8)
        assert k._purge_due and k.wake.is_set()
        await k.purge_discarded()
        assert sorted(p.name for p in root.iterdir()) == ["step_00000008"]
        assert not k._purge_due

    asyncio.run(scenario())


def test_a_file_that_appears_in_a_step_already_sent_is_sent_too(root):
    """A step whose files were all sent is skipped while nothing in it changes; a file that
    appears later (the manifest after the shards, within the same clock tick or not) changes
    the keeper's signature and goes out at the next pass."""
    view = _two_node_view(generation=2, restored=8)
    sent: list[tuple[int, str]] = []

    async def send(address, header, pieces) -> None:
        sent.append((header.step, header.file))

    k = _sender(root, view, send)
    k.restored(2, 8)
    make_step(root, 9, [100])
    manifest = step_dir(root, 9) / MANIFEST_NAME
    aside = root / "manifest-aside"
    manifest.rename(aside)

    async def scenario() -> None:
        await k._replicate(k._listing(), ())
        assert sent == [(9, shard_name(0))]
        before = k._signature(k._listing())
        await k._replicate(k._listing(), ())
        assert sent == [(9, shard_name(0))]
        aside.rename(manifest)
        assert k._signature(k._listing()) != before
        await k._replicate(k._listing(), ())
        assert sent == [(9, shard_name(0)), (9, METADATA_NAME), (9, MANIFEST_NAME)]

    asyncio.run(scenario())


def test_only_what_this_nodes_workers_finish_calls_for_a_pass(root):
    """A shard being written, a temporary file and a copy received from a peer leave the
    signature as it was; a finished shard's record and a manifest written here change it.
    Received copies make a pass of their own only once a publication period has passed."""
    k = keeper(root, _two_node_view(generation=2), node="a")
    k.pacer.publish_s = 0.5
    assert k._pass_due(k._signature(k._listing()), now=100.0)
    k._last_signature = k._signature(k._listing())
    directory = step_dir(root, 9)
    directory.mkdir()
    (directory / shard_name(0)).write_bytes(b"x" * 10)  # being written
    (directory / (record_name(0) + ".tmp")).write_bytes(b"{}")
    data = b"y" * 100
    store(k, header(9, 1, data, sender="b", generation=2), data)  # a peer's copy, and its record
    signature = k._signature(k._listing())
    assert signature == k._last_signature and not k._pass_due(signature, now=100.1)
    (directory / (record_name(0) + ".tmp")).rename(directory / record_name(0))
    assert k._signature(k._listing()) != signature
    k._last_signature = k._signature(k._listing())
    write_atomically(directory / MANIFEST_NAME, b"{}")
    assert k._signature(k._listing()) != k._last_signature
    k._last_signature = k._signature(k._listing())
    assert not k._pass_due(k._last_signature, now=100.2)
    assert k._pass_due(k._last_signature, now=100.6)  # the peer's copy, a period later
    assert not k._pass_due(k._last_signature, now=100.7)


def test_only_shards_of_the_ranks_this_node_trains_now_are_sent(root):
    """Step 9 was written in generation 1, when a trained ranks 0 and 1 (and wrote the
    manifest); generation 2 restored it with rank 0 on b. b accepts from a only rank 1's shard
    now, so nothing else is sent (it would be refused, again at every poll)."""
    view = running({"a": (1,), "b": (0,)}, generation=2, restored=9)
    sent: list[tuple[int, str]] = []

    async def send(address, header, pieces) -> None:
        sent.append((header.step, header.file))

    k = _sender(root, view, send)
    k.restored(2, 9)
    make_step(root, 9, [100, 100])
    asyncio.run(k._replicate(k._listing(), ()))
    assert sent == [(9, shard_name(1))]


def test_n_nodes_publish_once_every_n_snapshot_steps_so_the_job_writes_one_per_step(root):
    view = running({"a": (0,), "b": (1,), "c": (2,), "d": (3,)})
    k = SnapshotKeeper(root, "b", "b:1", view, None, None, None,  # type: ignore[arg-type]
                       lambda: 7, publish_s=0.5, peer_key=lambda: KEY)
    assert k.publish_period() == 0.5  # no step seen yet
    steps: Listing = {}
    for n, at in enumerate((100.0, 102.0, 104.0, 106.0)):  # a snapshot step every 2 s
        steps[n + 1] = ("", frozenset())
        k._note_newest(steps, at)
    assert k.publish_period() == pytest.approx(4 * 2.0)  # 4 nodes: each once every 4 steps
    del view.nodes["d"]
    assert k.publish_period() == pytest.approx(3 * 2.0)
    k._note_newest({1: ("", frozenset())}, 107.0)  # a restore went back: no gap from it
    k._note_newest({1: ("", frozenset()), 2: ("", frozenset())}, 107.1)
    assert k.publish_period() == pytest.approx(3 * (0.8 * 2.0 + 0.2 * 0.1))
    k.pacer.publish_s = 60.0
    assert k.publish_period() == 60.0  # never more often than publish_s
