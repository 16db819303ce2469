"""Integrity that scales: each rank checksums the shard files it writes and verifies what it reads.

Four gloo ranks train a small FSDP2 MLP and save two checkpoints (steps 1 and 2) through
CheckpointManager; the loads below run on 4, 3 or 2 ranks into a differently-seeded model and are
compared, tensor for tensor, with the full state rank 0 recorded at save time. Checksum blocks are
4 KiB here (16 MiB in production) so that one rank's reads cover only part of a file.

A checkpoint whose manifest is valid but whose `.metadata` or a byte item is a pickle that would
run code is refused like a corrupt one, and nothing in it runs (docs/checkpoints.md, "Loading").
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import pickle
import re
import shlex
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.ranks import init_gloo_rank
from checkpoint.checksum import CRC32C, Scheme
from checkpoint.manifest import MANIFEST_NAME, read_manifest, verify, write_manifest
from daemon.procutil import free_port
from tests.forkserver import forkserver

pytestmark = pytest.mark.distributed

SAVE_WORLD = 4
BLOCK = 4096
SCHEME = Scheme(CRC32C, BLOCK)
STEPS = (1, 2)


def _train_state(world: int, seed: int) -> Any:
    from checkpoint.state import Progress, TrainState

    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return TrainState(model, optim, Progress())


def _step(state: Any) -> None:
    state.model(torch.randn(8, 64)).square().mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.progress.step += 1
    state.progress.consumed_samples += 8


def _full(state: Any) -> dict[str, Any]:
    # A collective: every rank gathers; rank 0 keeps full tensors on CPU.
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=opts)
    return {"model": model_sd, "optim": optim_sd, "step": state.progress.step,
            "consumed_samples": state.progress.consumed_samples}


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys whose values differ in any bit (an exact restore has none)."""
    flat_got, flat_want = _flatten(got), _flatten(want)
    if flat_got.keys() != flat_want.keys():
        return [f"keys differ: {sorted(flat_got.keys() ^ flat_want.keys())}"]
    return [
        k for k, w in flat_want.items()
        if not (torch.equal(flat_got[k], w) if isinstance(w, torch.Tensor) else flat_got[k] == w)
    ]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: tree}


def _rank(rank: int, world: int, port: int, mode: str, root: str, out: str) -> None:
    from checkpoint.durable import CheckpointManager

    gc.disable()  # what frees the groups below is dropping them, never a collection
    init_gloo_rank(rank, world, port, timedelta(seconds=60))
    logged: list[str] = []
    state = _train_state(world, seed=0 if mode == "save" else 1)
    manager = CheckpointManager(
        Path(root), 5, layout={"dp": world}, timeout=timedelta(seconds=60),
        log=logged.append, scheme=SCHEME,
    )
    result: dict[str, Any] = {}
    if mode == "save":
        for step in STEPS:
            _step(state)
            assert state.progress.step == step
            manager.save_async(state)
            manager.wait()
            assert manager.last_writer is not None
            result[str(step)] = [(e.path, e.size, list(e.digests)) for e in manager.last_writer.mine]
            full = _full(state)
            if rank == 0:
                torch.save(full, Path(out) / f"reference_{step}.pt")
        dist.barrier()  # rank 0's manifest is written once its wait() returns
    else:
        loaded = manager.load_latest(state)
        assert manager.last_reader is not None
        result = {
            "loaded": loaded.name if loaded else None,
            "checked": {k: list(v) for k, v in manager.last_reader.checked.items()},
            "log": logged,
        }
        full = _full(state)
        if rank == 0 and loaded is not None:
            want = Path(out) / f"reference_{state.progress.step}.pt"
            result["differences"] = (
                _differences(full, torch.load(want)) if want.exists()
                else [f"loaded step {state.progress.step}, which no save wrote"])
    dist.destroy_process_group()
    # A failed candidate must not leave the manager's group in a reference cycle: freed only by
    # the collector, or at interpreter shutdown, where freeing a gloo group can abort the
    # process (seen in CI). Dropping the manager frees its group's threads at once.
    threads = len(os.listdir("/proc/self/task"))
    del manager
    dropped = len(os.listdir("/proc/self/task"))
    gc.collect()
    result["threads_left_to_the_collector"] = dropped - len(os.listdir("/proc/self/task"))
    result["threads_freed_by_the_drop"] = threads - dropped
    (Path(out) / f"{mode}_rank{rank}.json").write_text(json.dumps(result))


def _run(world: int, mode: str, root: Path, out: Path) -> list[dict[str, Any]]:
    mp.start_processes(
        _rank, args=(world, free_port(), mode, str(root), str(out)), nprocs=world,
        start_method=forkserver(),
    )
    ranks = [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(world)]
    for r in ranks:
        assert r["threads_freed_by_the_drop"] > 0 and r["threads_left_to_the_collector"] == 0, r
    return ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    """Two checkpoints written by 4 ranks; the per-rank entries each writer reported."""
    work = tmp_path_factory.mktemp("integrity")
    per_rank = _run(SAVE_WORLD, "save", work / "ckpt", work)
    return work / "ckpt", work, per_rank


def _copy(saved: tuple[Path, Path, Any], tmp_path: Path) -> Path:
    ckpt, out, _ = saved
    for ref in out.glob("reference_*.pt"):
        shutil.copy(ref, tmp_path / ref.name)
    shutil.copytree(ckpt, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _crc32c_blocks(data: bytes) -> list[str]:
    return [f"{crc32c.crc32c(data[i : i + BLOCK]):08x}" for i in range(0, len(data), BLOCK)]


def test_each_rank_checksums_exactly_the_shards_it_wrote(saved):
    ckpt, _, per_rank = saved
    for step in STEPS:
        path = ckpt / f"step_{step:08d}"
        manifest = verify(path)  # the single-process verifier agrees with every entry
        assert (manifest.version, manifest.scheme) == (2, SCHEME)
        on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST_NAME)
        assert [e.path for e in manifest.files] == on_disk
        for entry in manifest.files:
            data = (path / entry.path).read_bytes()
            assert entry.size == len(data)
            assert list(entry.digests) == _crc32c_blocks(data), entry.path
        for rank, reported in enumerate(per_rank):
            mine = {p: (size, digests) for p, size, digests in reported[str(step)]}
            assert sorted(mine) == [f"__{rank}_0.distcp"]
            entry = manifest.entry(f"__{rank}_0.distcp")
            assert entry is not None and mine[entry.path] == (entry.size, list(entry.digests))


def test_resharded_load_4_to_3_verifies_in_parallel_and_restores_exactly(saved, tmp_path):
    root = _copy(saved, tmp_path)
    ranks = _run(3, "load", root, tmp_path)

    assert [r["loaded"] for r in ranks] == ["step_00000002"] * 3
    assert ranks[0]["differences"] == []
    manifest = read_manifest(root / "step_00000002")
    shards = {e.path: len(e.digests) for e in manifest.files if e.path.endswith(".distcp")}
    union: dict[str, set[int]] = {path: set() for path in shards}
    for r in ranks:
        checked = r["checked"]
        assert set(checked) <= set(shards) and checked
        # Each rank verifies part of the checkpoint, not all of it ...
        assert sum(map(len, checked.values())) < sum(shards.values())
        for path, blocks in checked.items():
            union[path].update(blocks)
    # ... and together they verify every block, since every saved byte is loaded by someone.
    assert union == {path: set(range(n)) for path, n in shards.items()}


def _weight_bytes_only_rank_reads(path: Path, rank: int) -> tuple[str, int]:
    """A shard file of `rank` and an offset inside a tensor that only `rank` loads (4→4)."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    name = f"__{rank}_0.distcp"
    for index, info in metadata.storage_data.items():
        if info.relative_path == name and index.fqn == "state.model.1.weight":
            return name, info.offset + info.length // 2
    raise AssertionError(f"no model.1.weight shard in {name}")


@pytest.mark.parametrize("damage", ["bit flip", "truncation"])
def test_damaged_shard_is_found_by_its_reader_and_every_rank_falls_back(damage, saved, tmp_path):
    root = _copy(saved, tmp_path)
    newest = root / "step_00000002"
    name, offset = _weight_bytes_only_rank_reads(newest, rank=2)
    data = bytearray((newest / name).read_bytes())
    if damage == "bit flip":
        data[offset] ^= 0x10
        expected = f"checksum mismatch in step_00000002/{name} (block {offset // BLOCK}"
    else:
        data = data[:offset]
        expected = f"step_00000002/{name}: size {offset} != "
    (newest / name).write_bytes(bytes(data))

    ranks = _run(SAVE_WORLD, "load", root, tmp_path)

    assert [r["loaded"] for r in ranks] == ["step_00000001"] * SAVE_WORLD
    assert ranks[0]["differences"] == []
    (skipped,) = ranks[0]["log"]
    assert skipped.startswith(f"checkpoint step_00000002 is invalid ({expected}")
    assert skipped.endswith("; trying an older one")
    # The rank loading that tensor finds it; a size check also trips every other rank that
    # reads anything from the file (replicated values live in one rank's shard).
    finders = re.search(r"found by rank ([\d, ]+)\)", skipped)
    assert finders is not None and "2" in finders.group(1).split(", ")
    assert all(r["log"] == [] for r in ranks[1:])  # rank 0 speaks for all


def _rewrite_as_version_1(path: Path) -> None:
    """The manifest an earlier build wrote: one sha256 per file, hashed here from the bytes."""
    doc = json.loads((path / MANIFEST_NAME).read_text())
    del doc["checksum"]
    doc["version"] = 1
    doc["files"] = [
        {"path": f["path"], "size": f["size"],
         "sha256": hashlib.sha256((path / f["path"]).read_bytes()).hexdigest()}
        for f in doc["files"]
    ]
    (path / MANIFEST_NAME).write_text(json.dumps(doc))


def test_version_1_manifest_still_restores(saved, tmp_path):
    root = _copy(saved, tmp_path)
    _rewrite_as_version_1(root / "step_00000002")
    assert verify(root / "step_00000002").version == 1

    ranks = _run(2, "load", root, tmp_path)

    assert [r["loaded"] for r in ranks] == ["step_00000002"] * 2
    assert ranks[0]["differences"] == []
    assert all(r["log"] == [] for r in ranks)
    # A version-1 file is one checksum: a rank that touches a file verifies all of it.
    assert all(set(map(tuple, r["checked"].values())) == {(0,)} for r in ranks)


class _RunsCommand:
    """Pickles to a call of os.system: unpickling it runs `command`."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def _genuine_metadata(path: Path) -> Any:
    # The `.metadata` this test's own save wrote, before any forging: trusted here.
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def _recommit(path: Path) -> None:
    """A fresh, valid manifest over whatever the directory now holds."""
    old = read_manifest(path)
    (path / MANIFEST_NAME).unlink()
    write_manifest(path, step=old.step, consumed_samples=old.consumed_samples, layout=old.layout,
                   scheme=SCHEME)


def _forge_metadata(path: Path, marker: Path) -> str:
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCommand(f"touch {shlex.quote(str(marker))}")))
    return ".metadata"


def _forge_byte_item(path: Path, marker: Path) -> str:
    """The progress byte item, which every rank loads, becomes a torch.save of a call."""
    metadata = _genuine_metadata(path)
    (index, info), = [(i, s) for i, s in metadata.storage_data.items()
                      if i.fqn == "state.progress.step"]
    forged = io.BytesIO()
    torch.save(_RunsCommand(f"touch {shlex.quote(str(marker))}"), forged)
    shard = path / info.relative_path
    end = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(forged.getvalue())
    info.offset, info.length = end, len(forged.getvalue())
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return info.relative_path


@pytest.mark.parametrize("forge", [_forge_metadata, _forge_byte_item],
                         ids=["metadata", "byte item"])
def test_pickle_that_would_run_code_is_refused_and_every_rank_falls_back(forge, saved, tmp_path):
    root = _copy(saved, tmp_path)
    newest = root / "step_00000002"
    marker = tmp_path / "ran"
    forged = forge(newest, marker)
    _recommit(newest)
    verify(newest)  # every checksum matches: only the content is hostile

    try:
        ranks: Any = _run(2, "load", root, tmp_path)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        ranks = exc  # the marker is the first thing to check either way
    assert not marker.exists(), "restoring the checkpoint ran the pickle's code"
    assert isinstance(ranks, list), ranks
    assert [r["loaded"] for r in ranks] == ["step_00000001"] * 2
    assert ranks[0]["differences"] == []
    (skipped,) = ranks[0]["log"]
    assert skipped.startswith(f"checkpoint step_00000002 is invalid (step_00000002/{forged}: "), \
        skipped
    assert "posix.system" in skipped and "refused" in skipped, skipped
