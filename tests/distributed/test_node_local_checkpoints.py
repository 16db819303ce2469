"""Durable checkpoints on node-local directories (checkpoint.storage "node", docs/snapshots.md).

Two gloo ranks stand for two nodes: each saves into a root of its own, which the other never
sees. Saving must not read another rank's files (the manifest's checksums come from the writers),
each root keeps its newest `keep` steps, and the fragments make one valid checkpoint once they
are gathered into one directory. An exact load of the recorded step from the fragments names the
ranks that lack files instead of falling back to older state.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.ranks import init_gloo_rank
from checkpoint.manifest import MANIFEST_NAME, read_manifest, verify
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

WORLD, STEPS, KEEP = 2, 3, 2


def _rank(rank: int, port: int, mode: str, base: str) -> None:
    from checkpoint.durable import CheckpointManager

    init_gloo_rank(rank, WORLD, port, timedelta(seconds=60))
    logged: list[str] = []
    state = _train_state(WORLD, seed=0 if mode == "save" else 1)
    manager = CheckpointManager(
        Path(base) / f"node-{rank}", KEEP, layout={"dp": WORLD}, timeout=timedelta(seconds=60),
        log=logged.append, scheme=SCHEME, fragments=True,
    )
    result: dict[str, Any] = {"log": logged}
    if mode == "save":
        for _ in range(STEPS):
            _step(state)
            manager.save_async(state)
            manager.wait()
        dist.barrier()
        full = _full(state)
        if rank == 0:
            torch.save(full, Path(base) / "reference.pt")
        result["commits"] = [step for step, _, _ in manager.commits]
    else:
        problem, ranks = manager.load_step(state, STEPS)
        result.update(problem=problem, ranks=list(ranks))
        full = _full(state)
        if rank == 0 and not problem:
            result["differences"] = _differences(full, torch.load(Path(base) / "reference.pt"))
    (Path(base) / f"{mode}_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(mode: str, base: Path) -> list[dict[str, Any]]:
    mp.start_processes(_rank, args=(free_port(), mode, str(base)), nprocs=WORLD,
                       start_method=forkserver())
    return [json.loads((base / f"{mode}_rank{r}.json").read_text()) for r in range(WORLD)]


def test_each_node_keeps_its_fragments_which_gathered_make_the_checkpoint(tmp_path):
    ranks = _run("save", tmp_path)
    assert ranks[0]["commits"] == list(range(1, STEPS + 1)), ranks[0]["log"]
    assert not any(r["log"] for r in ranks), [r["log"] for r in ranks]
    kept = [f"step_{s:08d}" for s in range(STEPS - KEEP + 1, STEPS + 1)]
    node0, node1 = tmp_path / "node-0", tmp_path / "node-1"
    for node in (node0, node1):
        assert sorted(p.name for p in node.iterdir() if p.name.startswith("step_")) == kept
    last = kept[-1]
    # Rank 0's node: the manifest, `.metadata` and its own shard; rank 1's node: its shard only.
    assert sorted(p.name for p in (node0 / last).iterdir()) == [
        ".metadata", "__0_0.distcp", MANIFEST_NAME]
    assert sorted(p.name for p in (node1 / last).iterdir()) == ["__1_0.distcp"]
    manifest = read_manifest(node0 / last)
    assert [e.path for e in manifest.files] == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # Loading the recorded step from the fragments fails on every rank alike, naming rank 1.
    loads = _run("load", tmp_path)
    assert loads[0]["problem"] == loads[1]["problem"]
    assert ".metadata: file missing" in loads[0]["problem"]
    assert loads[0]["ranks"] == loads[1]["ranks"] == [1]

    # An operator gathers the fragments: the writers' checksums verify every byte, and it loads.
    shutil.copy(node1 / last / "__1_0.distcp", node0 / last)
    assert verify(node0 / last) == manifest
    shutil.rmtree(node1 / last)
    shutil.copytree(node0 / last, node1 / last)
    loads = _run("load", tmp_path)
    assert [r["problem"] for r in loads] == ["", ""]
    assert loads[0]["differences"] == []
