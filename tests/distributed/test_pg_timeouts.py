"""Every process group of a generation is bounded by the job's timeout, not torch's 30 minutes.

Four gloo ranks on a dp2 x tp2 mesh whose groups get a 3 s timeout while the default group has
60 s. Rank 1 all-reduces on its TP group, whose other member (rank 0) never joins; rank 3 does
the same on the checkpoint manager's group. Both must raise a gloo timeout after about 3 s.
Meanwhile rank 0 waits for them in a default-group all-reduce, and its heartbeat thread must
keep beating: gloo releases the interpreter lock while it waits.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from daemon.procutil import free_port
from parallel.job import loads
from parallel.layout import resolve
from tests.forkserver import forkserver

pytestmark = pytest.mark.distributed

SUB_TIMEOUT_S = 3.0
JOB = '[data]\nsource = "python-stdlib"\n[parallel]\ntp = 2\n'


def _rank(rank: int, port: int, out: str) -> None:
    from checkpoint.durable import CheckpointManager
    from parallel.mesh import build_mesh
    from trainer.failure_kind import classify_failure
    from trainer.heartbeat import Heartbeat

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=4, timeout=timedelta(seconds=60)
    )
    layout = resolve(loads(JOB), 4)
    assert (layout.dp, layout.tp) == (2, 2)
    sub = timedelta(seconds=SUB_TIMEOUT_S)
    mesh = build_mesh(layout, "cpu", sub)
    ckpt = CheckpointManager(Path(out) / "ckpt", 1, layout=layout.to_dict(), timeout=sub)
    cpu = torch.device("cpu")
    configured = {
        name: mesh[name].get_group()._get_backend(cpu).options._timeout.total_seconds()
        for name in ("pp", "dp", "cp", "tp")
    }
    configured["checkpoint"] = ckpt.group._get_backend(cpu).options._timeout.total_seconds()
    result: dict = {"configured": configured}
    beats: list[float] = []
    heartbeat = None
    if rank == 0:
        heartbeat = Heartbeat(lambda *_: beats.append(time.monotonic()), print, interval_s=0.1)
        heartbeat.start()
    group = {1: mesh["tp"].get_group(), 3: ckpt.group}.get(rank)
    if group is not None:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 - the error is the result
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["kind"] = classify_failure(result["error"])
        result["seconds"] = time.monotonic() - started
    # Rank 0 waits here for ranks 1 and 3, beating all along.
    started = time.monotonic()
    dist.all_reduce(torch.ones(1))
    if heartbeat is not None:
        heartbeat.stop()
        result["waited"] = time.monotonic() - started
        result["beats_while_waiting"] = sum(
            started <= t <= started + result["waited"] for t in beats
        )
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_sub_groups_and_the_checkpoint_group_time_out(tmp_path: Path):
    started = time.monotonic()
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=4, start_method=forkserver())
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert set(r["configured"].values()) == {SUB_TIMEOUT_S}, r["configured"]
    for rank in (1, 3):
        r = results[rank]
        assert r["error"] is not None, f"rank {rank}'s collective did not fail"
        assert "Timed out" in r["error"], r["error"]
        assert r["kind"] == "peer"
        assert SUB_TIMEOUT_S * 0.8 <= r["seconds"] <= SUB_TIMEOUT_S * 2, r
    waited, beats = results[0]["waited"], results[0]["beats_while_waiting"]
    assert waited >= SUB_TIMEOUT_S * 0.8
    # ~10 beats a second; a thread starved by a held interpreter lock would send about one
    assert beats >= waited * 10 / 2, results[0]
    assert time.monotonic() - started < 60


def _data_group_rank(rank: int, port: int, out: str) -> None:
    from parallel.mesh import build_mesh, data_mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=4, timeout=timedelta(seconds=60)
    )
    layout = resolve(loads('[data]\nsource = "python-stdlib"\n[parallel]\ncp = 2\n'), 4)
    mesh = build_mesh(layout, "cpu", timedelta(seconds=SUB_TIMEOUT_S))
    group = data_mesh(mesh).get_group()
    result = {
        "size": dist.get_world_size(group),
        "timeout": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_flattened_data_parallel_group_gets_the_timeout(tmp_path: Path):
    """dp2 x cp2: gradients reduce over a flattened dp x cp group, bounded like the others."""
    mp.start_processes(
        _data_group_rank, args=(free_port(), str(tmp_path)), nprocs=4, start_method=forkserver()
    )
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"size": 4, "timeout": SUB_TIMEOUT_S}, (rank, result)


@pytest.fixture
def world_of_one():
    """A one-rank gloo world in this process, with a 7 s timeout."""
    timeout = timedelta(seconds=7)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)
    try:
        yield timeout
    finally:
        dist.destroy_process_group()


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def test_a_dim_over_the_whole_world_is_the_default_group_only_with_its_timeout(
        world_of_one, tmp_path) -> None:
    from parallel.layout import Layout
    from parallel.mesh import build_mesh

    before = _groups()
    mesh = build_mesh(Layout(), "cpu", world_of_one)  # every dim of size 1: the whole world
    assert _groups() == before
    assert all(mesh[d].get_group() == dist.group.WORLD for d in ("pp", "dp", "cp", "tp"))
    other = timedelta(seconds=3)
    mesh = build_mesh(Layout(), "cpu", other)
    assert _groups() == before + 1  # the dims of size 1 share this rank's group of one
    cpu = torch.device("cpu")
    for d in ("pp", "dp", "cp", "tp"):
        assert mesh[d].get_group() != dist.group.WORLD
        assert mesh[d].get_group()._get_backend(cpu).options._timeout == other


def test_the_checkpoint_group_is_made_at_its_first_use(world_of_one, tmp_path) -> None:
    from checkpoint.durable import CheckpointManager

    before = _groups()
    ckpt = CheckpointManager(tmp_path / "ckpt", 1, layout={}, timeout=world_of_one)
    assert _groups() == before  # not on a generation's start
    group = ckpt.group
    assert _groups() == before + 1 and ckpt.group is group
    assert group._get_backend(torch.device("cpu")).options._timeout == world_of_one
