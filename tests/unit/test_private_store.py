"""The snapshot store is private (docs/snapshots.md, "Where snapshots live"): a base or directory
another user made or could change is refused, never reused; nothing is written through a link
planted in the store; every file is 0600 and every directory 0700; the agent clears what a
crashed run left. Agent (keeper), worker (writer) and a peer's copy (keeper.store) alike."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    record_name,
    shard_name,
    step_dir,
    write_atomically,
)
from checkpoint.snapshot_writer import save_snapshot
from checkpoint.state import Progress, TrainState
from daemon.config import AgentConfig
from daemon.node.snapshot_files import Incoming
from daemon.node.snapshot_keeper import SnapshotKeeper
from tests.unit.test_snapshot_keeper import KEY, header, running, store

pytestmark = pytest.mark.unit

NOBODY = 65534  # nobody:nogroup
SECRET = b"root only: nothing may write here\n"
as_root = pytest.mark.skipif(os.geteuid() != 0,
                             reason="making a directory another user owns needs root")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A root-only file outside the store: what a planted link points at."""
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, SECRET)
    os.close(fd)
    return path


def agent_keeper(base: Path) -> SnapshotKeeper:
    config = AgentConfig(node_id="node-0", devices=1, etcd="http://127.0.0.1:1", job="job",
                         snapshot_base=base)
    # Node a trains ranks 0 and 1; node-0, its buddy, keeps a's copies.
    view = running({"a": (0, 1), "node-0": (2,)})
    keeper = SnapshotKeeper.for_agent(config, view, None, None, None,  # type: ignore[arg-type]
                                      lambda: 0, lambda *_: None, peer_key=lambda: KEY)
    assert keeper is not None
    keeper.restored(view.plan.generation, view.plan.restore.step)  # its workers restored
    return keeper


def tiny_state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.01), Progress())
    state.model(torch.randn(3, 4)).sum().backward()
    state.optimizer.step()
    state.progress.step = 5
    return state


def peer_copy(step: int, rank: int) -> tuple[Incoming, bytes]:
    """A copy of `rank`'s shard of `step` from node a, signed as a's keeper signs it."""
    data = bytes(range(256)) * 40
    return header(step, rank, data), data


def plant(directory: Path, names: list[str], target: Path) -> None:
    """`directory` (made with its parents), with a link to `target` at each of `names` and at
    each one's old, fixed temporary name."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        for planted in (name, f"{name}.tmp"):
            (directory / planted).symlink_to(target)


def give_away(top: Path) -> None:
    """Everything under `top`, `top` included, owned by nobody (links themselves, not targets)."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), NOBODY, NOBODY, follow_symlinks=False)
    os.chown(top, NOBODY, NOBODY)


def outcome(action: Callable[[], object]) -> str:
    """The error `action` raised ("" when none)."""
    try:
        action()
    except (Exception, CheckpointException) as exc:  # DCP wraps a rank's error in the latter
        return str(exc)
    return ""


@as_root
def test_an_agent_refuses_a_base_another_user_made_and_writes_nothing_through_it(shm, secret):
    base = shm / "base"
    keeper = agent_keeper(base)
    plant(step_dir(keeper.root, 5), [record_name(1), shard_name(1), METADATA_NAME, MANIFEST_NAME],
          secret)
    give_away(base)
    stored = outcome(lambda: store(keeper, *peer_copy(5, 1)))  # a peer's copy arrives
    started = outcome(keeper.clear)  # the agent starts
    assert secret.read_bytes() == SECRET, "a file outside the store was written through a link"
    assert f"snapshot directory {base} is owned by uid {NOBODY}" in started
    assert "refused" in stored  # by admission (a file is there) or by the directory check
    assert (step_dir(keeper.root, 5) / record_name(1)).is_symlink()  # nothing reused or removed


@as_root
def test_a_worker_refuses_a_root_another_user_made_and_writes_nothing_through_it(shm, secret):
    root = shm / "base" / "job" / "node-0"
    state = tiny_state()
    # Not the shard: it was already created O_EXCL; its record, the metadata and the manifest
    # were written through a fixed temporary name.
    plant(step_dir(root, 5), [record_name(0), METADATA_NAME, MANIFEST_NAME], secret)
    give_away(shm / "base")
    error = outcome(lambda: save_snapshot(state, root, layout={}))
    assert secret.read_bytes() == SECRET, "a file outside the store was written through a link"
    assert f"snapshot directory {root} is owned by uid {NOBODY}" in error


@pytest.mark.parametrize("unsafe", ["base is a link", "job directory is a link",
                                    "node directory is a link", "base writable by others",
                                    "job directory writable by group"])
def test_an_unsafe_component_is_refused_and_nothing_is_made_or_removed_through_it(shm, unsafe):
    base = shm / "base"
    keeper = agent_keeper(base)
    elsewhere = shm / "elsewhere"
    (elsewhere / "node-0" / "step_00000001").mkdir(parents=True)
    (elsewhere / "node-0" / "step_00000001" / "keep").write_bytes(b"not the agent's to free")
    component = {"base": base, "job": keeper.root.parent, "node": keeper.root}[unsafe.split()[0]]
    component.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if unsafe.endswith("link"):
        component.symlink_to(elsewhere / "node-0" if component == keeper.root else elsewhere)
        wrong = "is a symbolic link"
    else:
        component.mkdir(mode=0o700)
        component.chmod(0o777 if unsafe.endswith("others") else 0o770)
        wrong = "is writable by group or others"
    with pytest.raises(OSError, match=f"snapshot directory {component} {wrong}"):
        keeper.clear()
    assert (elsewhere / "node-0" / "step_00000001" / "keep").exists()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["node-0"]


@pytest.mark.parametrize("at", ["its old temporary name", "its own name"])
def test_an_atomic_write_never_goes_through_a_planted_link(shm, secret, at):
    path = shm / MANIFEST_NAME
    link = path.with_name(f"{path.name}.tmp") if at == "its old temporary name" else path
    link.symlink_to(secret)
    write_atomically(path, b"the manifest")
    assert secret.read_bytes() == SECRET
    assert not path.is_symlink() and path.read_bytes() == b"the manifest"
    assert (path.stat().st_mode & 0o777) == 0o600
    # The temporary file is gone: only what was planted and what was written remain.
    assert sorted(p.name for p in shm.iterdir()) == sorted({link.name, path.name})


def test_a_private_file_is_created_new_never_through_what_is_there(shm, secret):
    from checkpoint.snapshot_format import create_private_file

    (shm / "planted").symlink_to(secret)
    with pytest.raises(FileExistsError):
        create_private_file(shm / "planted")
    assert secret.read_bytes() == SECRET
    os.close(create_private_file(shm / "new"))
    assert ((shm / "new").stat().st_mode & 0o777) == 0o600


def test_every_file_of_the_store_is_0600_and_every_directory_0700(shm):
    old = os.umask(0o022)  # the usual umask: what a file or directory gets unless made private
    try:
        base = shm / "base"
        keeper = agent_keeper(base)
        keeper.clear()  # the agent starts
        save_snapshot(tiny_state(), keeper.root, layout={})  # its worker snapshots step 5
        store(keeper, *peer_copy(5, 1))  # and a peer's copy of step 5, rank 1, arrives
    finally:
        os.umask(old)
    modes, names = {}, set()
    for dirpath, _, filenames in os.walk(base):
        modes[dirpath] = os.lstat(dirpath).st_mode & 0o7777
        for name in filenames:
            names.add(name)
            modes[os.path.join(dirpath, name)] = os.lstat(os.path.join(dirpath, name)).st_mode \
                & 0o7777
    assert names == {shard_name(0), record_name(0), shard_name(1), record_name(1),
                     METADATA_NAME, MANIFEST_NAME}
    wrong = {path: f"{mode:04o}" for path, mode in modes.items()
             if mode != (0o700 if os.path.isdir(path) else 0o600)}
    assert wrong == {}


def test_an_agent_clears_what_a_crashed_run_left_at_start(shm):
    base = shm / "base"
    keeper = agent_keeper(base)
    leftover = step_dir(keeper.root, 3)
    leftover.mkdir(parents=True)
    (leftover / shard_name(0)).write_bytes(b"a crashed run's shard")
    keeper.clear()
    assert not keeper.root.exists() and keeper.root.parent.is_dir()
