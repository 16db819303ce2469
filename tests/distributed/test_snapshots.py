"""In-memory snapshots: 4 FSDP2 (ZeRO-3) ranks snapshot into /dev/shm; 4, 3 and 2 ranks restore
through the byte-range reader, resharded by DCP, to exactly the saved state. Damaged snapshots
(bit flip, truncation, missing shard, a corrupted transfer) fail every rank and load nothing, and
so do forged ones whose checksums match: a `.metadata` that is a pickle which would run code (DCP's
form; a snapshot's is an index, never unpickled), an index whose chunk points past its file, a
byte item that is such a pickle. That code never runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotInvalid,
    SnapshotManifest,
    chunk_checksums,
    record_name,
    shard_name,
    shard_rank,
    slot,
    step_dir,
)
from checkpoint.snapshot_index import SnapshotIndex
from checkpoint.snapshot_reader import load_snapshot, local_fetch
from checkpoint.snapshot_store import SnapshotStore
from checkpoint.snapshot_writer import rewrite_snapshot, save_snapshot
from parallel.job import load
from parallel.layout import resolve
from parallel.mesh import build_mesh
from tests.conftest import REPO, small_job_text
from tests.forkserver import forkserver
from trainer.loop import Trainer
from trainer.teardown import leave_world

pytestmark = pytest.mark.distributed
STEP = 3
RESTORE_WORLDS = (4, 3, 2)
TIMEOUT = timedelta(seconds=120)


@contextlib.contextmanager
def _served_store() -> Iterator[int]:
    """A TCPStore served by the test process itself, on a port it bound (none picked ahead,
    which another process's connection could take first); yields its port."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)
    try:
        yield store.port
    finally:
        del store


def _join(rank: int, world: int, port: int, name: str) -> None:
    """Join world `name` of `world` ranks through the test's store (one per world, by prefix)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank,
                            world_size=world, timeout=TIMEOUT)


def _trainer(job: str, world: int) -> Trainer:
    cfg = load(job)
    layout = resolve(cfg, world)
    return Trainer(cfg, layout, build_mesh(layout, "cpu", TIMEOUT), torch.device("cpu"))


def _full_state(trainer: Trainer) -> dict:
    """Unsharded model and optimizer state (a collective), progress and RNG."""
    model, optim = get_state_dict(
        trainer.model,
        trainer.optimizer,
        options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
    )
    plain = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in model.items()}
    return {
        "model": plain,
        "optim": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in optim.items()},
        "progress": (trainer.progress.step, trainer.progress.consumed_samples),
        "rng": torch.get_rng_state(),
    }


def _save_then_restore(rank: int, job: str, root: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    _join(rank, 4, port, "save")
    trainer = _trainer(job, 4)
    for _ in range(STEP - 2):
        trainer.train_step()
    layout = trainer.layout.to_dict()
    # The generation's first snapshot is a full DCP save; the next rewrites it in place, looking
    # every item up (and finding what the fast path needs); the one after uses the fast path.
    first = save_snapshot(trainer.state, Path(root), layout=layout)
    assert first.template is not None and (first.coordinator is not None) == (rank == 0)
    trainer.train_step()
    second = rewrite_snapshot(trainer.state, Path(root), first.template, first.coordinator,
                              layout=layout)
    assert second.resolved is not None, "no fast path for FSDP2 + AdamW"
    trainer.train_step()
    torch.manual_seed(1000 + trainer.progress.step)  # an RNG state the restore must bring back
    third = rewrite_snapshot(trainer.state, Path(root), first.template, first.coordinator,
                             layout=layout, resolved=second.resolved)
    assert third.resolved is second.resolved  # it was used, not rebuilt
    # The same step through the full lookup: byte for byte the same shard.
    check = Path(root) / "full-lookup"
    rewrite_snapshot(trainer.state, check, first.template, first.coordinator, layout=layout)
    shard = shard_name(rank)
    assert (step_dir(check, STEP) / shard).read_bytes() == \
        (step_dir(Path(root), STEP) / shard).read_bytes(), f"rank {rank}: fast path differs"
    saved = _full_state(trainer)
    if rank == 0:
        torch.save(saved, Path(out) / "saved.pt")
    del trainer
    leave_world()
    for world in RESTORE_WORLDS:
        if rank >= world:
            continue
        _join(rank, world, port, f"restore-{world}")
        trainer = _trainer(job, world)
        torch.manual_seed(7)
        load_snapshot(trainer.state, STEP, local_fetch(Path(root), STEP))
        restored = _full_state(trainer)
        if rank == 0:
            torch.save(restored, Path(out) / f"restored_{world}.pt")
        del trainer
        leave_world()


@pytest.fixture(scope="module")
def snapshot(token_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """Snapshots of steps 1 (a full save), 2 (rewritten in place, no collective) and 3
    (rewritten through the fast path) from 4 ranks; step 3 restored on 4, 3 and 2 ranks in the
    same processes."""
    out = tmp_path_factory.mktemp("snapshot")
    job = out / "job.toml"
    job.write_text(small_job_text(token_file, parallel={"zero": 3}))
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    try:
        with _served_store() as port:
            mp.start_processes(
                _save_then_restore,
                args=(str(job), str(root), port, str(out)),
                nprocs=4,
                start_method=forkserver(),
            )
        yield job, root, out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _assert_same(saved: dict, restored: dict) -> None:
    assert restored["progress"] == saved["progress"] == (STEP, STEP * 10)
    assert torch.equal(restored["rng"], saved["rng"])
    for part in ("model", "optim"):
        assert restored[part].keys() == saved[part].keys()
        for key, value in saved[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(restored[part][key], value), f"{part} {key}"
            else:
                assert restored[part][key] == value, f"{part} {key}"


def test_snapshot_files_and_manifest(snapshot):
    _, root, _ = snapshot
    store = SnapshotStore(root)
    assert store.steps() == [STEP - 2, STEP - 1, STEP]
    manifest = store.manifest(STEP)
    assert store.manifest(STEP - 2).files == manifest.files  # the layout the full save fixed
    assert (manifest.step, manifest.consumed_samples, manifest.world_size) == (STEP, 30, 4)
    assert manifest.layout["dp"] == 4 and manifest.layout["zero"] == 3
    assert [(f.path, f.rank) for f in manifest.files] == [
        *((shard_name(r), r) for r in range(4)),
        (METADATA_NAME, 0),
    ]
    for entry in manifest.files:
        assert (step_dir(root, STEP) / entry.path).stat().st_size == entry.size > 0


@pytest.mark.parametrize("world", RESTORE_WORLDS)
def test_restore_reshards_to_the_saved_state_exactly(snapshot, world):
    _, _, out = snapshot
    saved = torch.load(out / "saved.pt", weights_only=False)
    restored = torch.load(out / f"restored_{world}.pt", weights_only=False)
    # Training moved the weights and Adam state away from their initial values, and the restore
    # started from a fresh initialisation: equality means the snapshot was loaded.
    assert any(v.abs().sum() > 0 for k, v in saved["optim"].items() if "exp_avg" in k)
    _assert_same(saved, restored)


def _flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


class _RunsCommand:
    """Pickles to a call of os.system: unpickling it runs `command`."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


MARKER = "ran"  # what a forged pickle creates in the snapshot root's parent: it must never exist


def _hostile(d: Path) -> bytes:
    return pickle.dumps(_RunsCommand(f"touch {shlex.quote(str(d.parent / MARKER))}"))


def _forge_metadata(d: Path) -> None:
    """`.metadata` becomes a hostile pickle (what DCP's `.metadata` is), and the manifest vouches
    for it."""
    _vouch_for_metadata(d, _hostile(d))


def _forge_byte_item(d: Path) -> None:
    """The progress byte item, which every rank loads, becomes a hostile pickle in its slot, and
    its rank's record vouches for the shard."""
    index = SnapshotIndex.parse((d / METADATA_NAME).read_bytes(), "test")
    item = index.byte_items["state.progress.step"]
    shard = bytearray((d / item.file).read_bytes())
    shard[item.offset:item.offset + item.length] = slot(_hostile(d), item.length)
    (d / item.file).write_bytes(bytes(shard))
    rank = shard_rank(item.file)
    assert rank is not None
    entry = FileEntry(item.file, rank, len(shard), chunk_checksums(bytes(shard)))
    (d / record_name(rank)).write_text(json.dumps({"step": STEP, **entry.to_json()}))


def _forge_index(d: Path) -> None:
    """`.metadata` is a well-formed index, and the manifest vouches for it, but one chunk of a
    tensor every rank loads claims bytes past the end of its shard."""
    index = SnapshotIndex.parse((d / METADATA_NAME).read_bytes(), "test")
    name = next(fqn for fqn, t in index.tensors.items() if len(t.rows))
    tensors = dict(index.tensors)
    rows = tensors[name].rows.copy()
    rows[0, -2] = (d / index.files[rows[0, -3]]).stat().st_size
    tensors[name] = dataclasses.replace(tensors[name], rows=rows)
    _vouch_for_metadata(d, dataclasses.replace(index, tensors=tensors).to_bytes())


def _vouch_for_metadata(d: Path, blob: bytes) -> None:
    (d / METADATA_NAME).write_bytes(blob)
    manifest = SnapshotManifest.parse((d / MANIFEST_NAME).read_bytes(), "test")
    files = tuple(dataclasses.replace(f, size=len(blob), chunks=chunk_checksums(blob))
                  if f.path == METADATA_NAME else f for f in manifest.files)
    (d / MANIFEST_NAME).write_bytes(dataclasses.replace(manifest, files=files).to_bytes())


# Each damage: (what it does to a copy of the snapshot directory, the error it must cause).
DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "bitflip-shard": (
        lambda d: _flip_bit(d / shard_name(1), (d / shard_name(1)).stat().st_size // 2),
        rf"step {STEP}: file rank_00001.distcp \(rank 1\): checksum mismatch",
    ),
    "bitflip-metadata": (
        lambda d: _flip_bit(d / METADATA_NAME, 40),
        rf"step {STEP}: file \.metadata \(rank 0\): checksum mismatch",
    ),
    "truncated-shard": (
        lambda d: os.truncate(d / shard_name(2), (d / shard_name(2)).stat().st_size // 2),
        rf"step {STEP}: file rank_00002.distcp \(rank 2\) is truncated",
    ),
    "missing-shard": (
        lambda d: (d / shard_name(3)).unlink(),
        rf"step {STEP}: file rank_00003.distcp \(rank 3\) is missing",
    ),
    "forged-metadata": (
        _forge_metadata,
        rf"step {STEP}: file \.metadata \(rank 0\): not a snapshot index",
    ),
    "forged-index": (
        _forge_index,
        rf"step {STEP}: file \.metadata \(rank 0\): a chunk of .* lies past the end of its file",
    ),
    "forged-byte-item": (
        _forge_byte_item,
        # DCP's planner picks the rank whose shard holds a replicated value.
        rf"step {STEP}: file rank_0000(\d)\.distcp \(rank \1\): byte item state\.progress\.step "
        r"refused: .*posix\.system",
    ),
}


def _corrupted_transfer(fetch):
    """A fetch whose bytes of rank 0's shard arrive with one bit flipped (a bad transfer)."""

    def flip(data: bytes) -> bytes:
        return data[:1] + bytes([data[1] ^ 0x01]) + data[2:] if data else data

    def flipped(ranges):
        return [flip(data) if r.file == shard_name(0) else data
                for r, data in zip(ranges, fetch(ranges), strict=True)]

    return flipped


def _manifest_lost_on_rank_1(fetch):
    """A fetch that cannot read the manifest on rank 1 only: that rank fails before the ranks
    agree, rank 0 verifies everything it needs; neither may load."""

    def lost(ranges):
        if any(r.file == MANIFEST_NAME for r in ranges) and dist.get_rank() == 1:
            raise OSError("the agent holding it is gone")
        return fetch(ranges)

    return lost


def _fails(*_: object) -> None:
    raise RuntimeError("the state refused it")


def _local_state(trainer: Trainer) -> dict:
    state = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    for i, per_param in enumerate(trainer.optimizer.state.values()):
        state.update({f"optim.{i}.{k}": v for k, v in per_param.items()})
    return {
        k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _load_damaged(rank: int, job: str, roots: dict[str, str], port: int, out: str) -> None:
    torch.set_num_threads(1)
    _join(rank, 2, port, "damaged")
    trainer = _trainer(job, 2)
    trainer.train_step()  # optimizer state exists and differs from the snapshot's
    results = {}
    for case, root in roots.items():
        before = _local_state(trainer)
        fetch = local_fetch(Path(root), STEP)
        if case == "corrupted-transfer":
            fetch = _corrupted_transfer(fetch)
        elif case == "manifest-lost-on-rank-1":
            fetch = _manifest_lost_on_rank_1(fetch)
        elif case == "load-fails-on-rank-0" and rank == 0:
            # After the agreement, while the tensors are written: rank 1 loads, rank 0 fails.
            trainer.state.load_state_dict = _fails
        try:
            load_snapshot(trainer.state, STEP, fetch)
            error = None
        except SnapshotInvalid as exc:
            error = str(exc)
        vars(trainer.state).pop("load_state_dict", None)
        after = _local_state(trainer)
        unchanged = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before
        )
        results[case] = (error, unchanged, trainer.progress.step)
    torch.save(results, Path(out) / f"damaged_{rank}.pt")
    del trainer
    leave_world()


def test_damaged_snapshots_fail_every_rank_and_load_nothing(snapshot, tmp_path):
    job, root, _ = snapshot
    roots = {}
    for case, (damage, _) in DAMAGES.items():
        copy = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
        shutil.copytree(step_dir(root, STEP), step_dir(copy, STEP))
        damage(step_dir(copy, STEP))
        roots[case] = str(copy)
    # The last four read the intact snapshot: through a corrupting transfer, through a fetch
    # that fails on one rank only, plainly, and into a state that fails to take it on one rank.
    roots["corrupted-transfer"] = roots["manifest-lost-on-rank-1"] = roots["intact"] = str(root)
    roots["load-fails-on-rank-0"] = str(root)  # last: it leaves rank 1's state loaded
    try:
        with _served_store() as port:
            mp.start_processes(
                _load_damaged, args=(str(job), roots, port, str(tmp_path)), nprocs=2,
                start_method=forkserver(),
            )
        ran = [case for case in DAMAGES if (Path(roots[case]) / MARKER).exists()]
    finally:
        for case in DAMAGES:
            shutil.rmtree(roots[case], ignore_errors=True)
    assert ran == [], "a forged snapshot's pickle ran code"
    expected = {case: pattern for case, (_, pattern) in DAMAGES.items()}
    expected["corrupted-transfer"] = rf"step {STEP}: file rank_00000.distcp \(rank 0\): checksum mismatch"
    expected["manifest-lost-on-rank-1"] = (
        rf"step {STEP}: {MANIFEST_NAME} could not be fetched: the agent holding it is gone")
    for rank in range(2):
        results = torch.load(tmp_path / f"damaged_{rank}.pt", weights_only=False)
        for case, pattern in expected.items():
            error, unchanged, step = results[case]
            assert error is not None, f"rank {rank} loaded {case}"
            assert re.search(pattern, error), f"rank {rank}, {case}: {error}"
            assert unchanged and step == 1, f"rank {rank}, {case}: state changed"
        # A failure while the tensors are written fails every rank too (the state of a rank
        # that wrote them is then the caller's to replace: it falls back to the next tier).
        error, _, _ = results["load-fails-on-rank-0"]
        assert error is not None and "RuntimeError: the state refused it" in error, (rank, error)
        error, unchanged, step = results["intact"]
        assert error is None and not unchanged and step == STEP, f"rank {rank}: {error}"


KILLED_WRITER = """
import sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from checkpoint.state import Progress, TrainState
from checkpoint.snapshot_store import SnapshotStore
from checkpoint.snapshot_writer import rewrite_snapshot, save_snapshot

store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights, 12 MiB with Adam's moments
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 1024)).sum().backward()
optimizer.step()
progress = Progress()
state = TrainState(model, optimizer, progress)
for step in range(1, 1000):
    progress.step, progress.consumed_samples = step, step * 10
    save_snapshot(state, Path(sys.argv[1]), layout={"dp": 1})
    SnapshotStore(Path(sys.argv[1])).prune()  # as the agent will, so memory stays bounded
    print(step, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_no_complete_step(tmp_path):
    """SIGSTOP the writer once its shard file exists and before its manifest does, then SIGKILL."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(root)], env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"1", "the writer never finished step 1"
        killed_at = None
        for step in range(2, 1000):
            shard = step_dir(root, step) / shard_name(0)
            while not shard.exists() and proc.poll() is None:
                time.sleep(0.001)
            os.kill(proc.pid, signal.SIGSTOP)
            if not (step_dir(root, step) / "manifest.json").exists():
                killed_at = step
                break
            os.kill(proc.pid, signal.SIGCONT)  # too late for this step: catch the next one
        assert killed_at is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        store = SnapshotStore(root)
        assert store.steps()[-1] == killed_at - 1
        assert not store.is_complete(killed_at)
        # The last complete step is whole: every byte of every file reads back verified.
        for entry in store.manifest(killed_at - 1).files:
            assert len(store.read(killed_at - 1, entry.path, 0, -1)) == entry.size
        store.prune()
        assert step_dir(root, killed_at).exists()  # newer than every complete step: kept
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
