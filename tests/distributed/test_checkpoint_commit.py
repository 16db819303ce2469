"""A checkpoint counts once it is on disk, and retention never takes the last one that counts.

Two gloo ranks save through CheckpointManager (docs/checkpoints.md, "Commit" and "Retention"):
- every file the manifest lists was fsynced with all its bytes, and the step directory after its
  last rename, before the manifest is written (watched through os.fsync and os.rename/replace in
  both ranks' processes, in the order of the machine's monotonic clock);
- saves whose manifest is never written (rank 0 raises instead) leave the last committed
  checkpoint whole and restorable, on node-local and on shared directories, however many fail.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.ranks import init_gloo_rank
from checkpoint.manifest import MANIFEST_NAME, checkpoint_dir, read_manifest, verify
from daemon.procutil import free_port
from tests.distributed.test_checkpoint_integrity import (
    SCHEME,
    _differences,
    _full,
    _step,
    _train_state,
)
from tests.forkserver import forkserver

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT = timedelta(seconds=60)


# --- commit order (M5) ------------------------------------------------------------------------


def _watch_file_system(events: list[dict[str, Any]]) -> None:
    """Record every fsync (inode, size the kernel holds, directory or not) and rename here."""
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def watched_fsync(fd: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        st = os.fstat(fd)
        events.append({"t": time.monotonic_ns(), "op": "fsync", "ino": st.st_ino,
                       "size": st.st_size, "dir": stat.S_ISDIR(st.st_mode),
                       "path": os.readlink(f"/proc/self/fd/{fd}")})
        fsync(fd)

    def watched(original: Any, name: str) -> Any:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            original(src, dst, *args, **kwargs)
            events.append({"t": time.monotonic_ns(), "op": name, "path": os.fspath(dst)})
        return move

    os.fsync = watched_fsync
    os.rename, os.replace = watched(rename, "rename"), watched(replace, "replace")


def _tiny_state(world: int) -> Any:
    """One sharded weight and plain SGD: a `.metadata` smaller than a file object's write
    buffer (the file system's block size), so that bytes still buffered at an fsync are all of
    it, as in a small job."""
    from checkpoint.state import Progress, TrainState

    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=1e-2), Progress())


def _save_watched(rank: int, port: int, root: str, out: str) -> None:
    from checkpoint.durable import CheckpointManager

    init_gloo_rank(rank, WORLD, port, TIMEOUT)
    state = _tiny_state(WORLD)
    manager = CheckpointManager(Path(root), 2, layout={"dp": WORLD}, timeout=TIMEOUT,
                                scheme=SCHEME)
    _step(state)
    events: list[dict[str, Any]] = []
    _watch_file_system(events)
    manager.save_async(state)
    manager.wait()
    dist.barrier()
    (Path(out) / f"events_{rank}.json").write_text(json.dumps(events))
    dist.destroy_process_group()


def test_every_listed_file_and_its_directory_are_on_disk_before_the_manifest(tmp_path):
    root = tmp_path / "ckpt"
    mp.start_processes(_save_watched, args=(free_port(), str(root), str(tmp_path)),
                       nprocs=WORLD, start_method=forkserver())
    events = sorted((e for r in range(WORLD)
                     for e in json.loads((tmp_path / f"events_{r}.json").read_text())),
                    key=lambda e: e["t"])
    path = checkpoint_dir(root, 1)
    manifest = read_manifest(path)
    # The manifest's own temporary file is fsynced, then renamed: the first event naming it is
    # where the checkpoint starts to count.
    commit = next(e["t"] for e in events if Path(e["path"]).name.startswith(MANIFEST_NAME))
    before = [e for e in events if e["t"] < commit]
    assert manifest.entry(".metadata").size < (path / ".metadata").stat().st_blksize  # _tiny_state
    for entry in manifest.files:
        ino = (path / entry.path).stat().st_ino
        synced = [e["size"] for e in before if e["op"] == "fsync" and e["ino"] == ino]
        assert entry.size in synced, (
            f"{entry.path}: fsynced with {synced} of its {entry.size} bytes before the manifest")
    moved_in = [e["t"] for e in before if e["op"] in ("rename", "replace")
                and Path(e["path"]).parent == path]
    assert moved_in, "DCP renames `.metadata` into place"
    dir_ino = path.stat().st_ino
    assert any(e["op"] == "fsync" and e["ino"] == dir_ino and e["t"] > max(moved_in)
               for e in before), f"{path.name} not fsynced after its last rename, before the manifest"


# --- retention across failed commits (H3) -----------------------------------------------------

FAILING = (2, 3)  # steps whose manifest rank 0 never writes
LAST = 4


def _fail_commits(steps: tuple[int, ...]) -> None:
    """Rank 0 raises where it would write the manifest of `steps` (as if it died there)."""
    import checkpoint.durable as durable

    write = durable.write_manifest

    def failing(path: Path, *, step: int, **kwargs: Any) -> Path:
        if step in steps:
            raise OSError(f"injected: no manifest for step {step}")
        return write(path, step=step, **kwargs)

    durable.write_manifest = failing


def _node_root(base: Path, storage: str, rank: int) -> Path:
    return base / (f"node-{rank}" if storage == "node" else "shared")


def _listing(root: Path) -> dict[str, list[str]]:
    return {p.name: sorted(f.name for f in p.iterdir())
            for p in sorted(root.iterdir()) if p.name.startswith("step_")}


def _gather(base: Path, storage: str, step: int) -> Path:
    """Rank 0 only: one directory holding every node's files of `step`, as an operator makes."""
    if storage == "shared":
        return _node_root(base, storage, 0)
    gathered = base / "gathered"
    for rank in range(WORLD):
        part = checkpoint_dir(_node_root(base, storage, rank), step)
        if part.is_dir():  # a node that lost its part: the load finds the gap
            shutil.copytree(part, checkpoint_dir(gathered, step), dirs_exist_ok=True)
    return gathered


def _save_failing(rank: int, port: int, storage: str, keep: int, base: str) -> None:
    from checkpoint.durable import CheckpointManager

    init_gloo_rank(rank, WORLD, port, TIMEOUT)
    work = Path(base)
    state = _train_state(WORLD, seed=0)
    manager = CheckpointManager(_node_root(work, storage, rank), keep, layout={"dp": WORLD},
                                timeout=TIMEOUT, scheme=SCHEME, fragments=storage == "node")
    if rank == 0:
        _fail_commits(FAILING)
    result: dict[str, Any] = {"errors": []}
    reference = None
    while state.progress.step < LAST:
        _step(state)
        manager.save_async(state)
        try:
            manager.wait()
        except RuntimeError as exc:
            result["errors"].append(str(exc))
        if state.progress.step == 1:
            reference = copy.deepcopy(_full(state))  # optimizer steps update in place
        if state.progress.step == FAILING[-1]:
            dist.barrier()  # every node's retention of the failed saves is done
            result["after_failures"] = _listing(_node_root(work, storage, rank))
            # The committed step 1 restores exactly, every node's files gathered in one place.
            gathered = [str(_gather(work, storage, 1)) if rank == 0 else ""]
            dist.broadcast_object_list(gathered, src=0)
            fresh = _train_state(WORLD, seed=1)
            loader = CheckpointManager(Path(gathered[0]), keep, layout={"dp": WORLD},
                                       timeout=TIMEOUT, scheme=SCHEME)
            loaded = loader.load_latest(fresh)
            full = _full(fresh)
            result["restored"] = loaded.name if loaded else None
            if rank == 0:
                result["differences"] = _differences(full, reference)
    dist.barrier()
    result["after_commit"] = _listing(_node_root(work, storage, rank))
    (work / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("keep", [1, 2])
@pytest.mark.parametrize("storage", ["node", "shared"])
def test_failed_commits_never_cost_the_last_committed_checkpoint(storage, keep, tmp_path):
    mp.start_processes(_save_failing, args=(free_port(), storage, keep, str(tmp_path)),
                       nprocs=WORLD, start_method=forkserver())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    assert [e.split(": ")[0] for e in ranks[0]["errors"]] == [
        f"checkpoint step_{s:08d} failed" for s in FAILING]
    assert ranks[1]["errors"] == []
    step1 = "step_00000001"
    for rank, result in enumerate(ranks):
        # Step 1 is the newest committed checkpoint: every node still holds its part.
        assert step1 in result["after_failures"], (rank, result["after_failures"])
        assert f"__{rank}_0.distcp" in result["after_failures"][step1], rank
    assert [r["restored"] for r in ranks] == [step1] * WORLD
    assert ranks[0]["differences"] == []

    # Once step 4 is committed, the failed saves' leftovers go, and step 1 stays if keep allows.
    kept = ([step1] if keep > 1 else []) + [f"step_{LAST:08d}"]
    for rank, result in enumerate(ranks):
        assert sorted(result["after_commit"]) == kept, (rank, result["after_commit"])
    verify(checkpoint_dir(_gather(tmp_path, storage, LAST), LAST))
