"""A standby's warm-up (trainer/warm_up.py) leaves nothing a generation could notice.

Two real processes form a 2-rank world and train; in one run rank 1 first warms up as a
standby does. The losses are the same bit for bit, the warm-up's world is gone (no process
group, no socket, no thread of its own left), and the global random state is as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from daemon.procutil import free_port
from parallel.job import load
from parallel.layout import resolve
from parallel.mesh import build_mesh
from tests.conftest import small_job_text
from tests.forkserver import forkserver
from trainer import warm_up as warm_up_module
from trainer.loop import Trainer
from trainer.teardown import Teardown, freeze_import_heap, leave_world
from trainer.warm_up import warm_up

pytestmark = pytest.mark.distributed


def _resources() -> tuple[int, int]:
    """(threads, sockets) of this process."""
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return threading.active_count(), sockets


def _rank(rank: int, job: str, port: int, warm: bool, out: str) -> None:
    torch.set_num_threads(1)
    freeze_import_heap()
    teardown = Teardown()
    teardown.refresh()
    report: dict = {}
    if warm and rank == 1:
        torch.manual_seed(11)
        before, rng = _resources(), torch.get_rng_state()
        messages: list[str] = []
        report["seconds"] = warm_up(teardown, messages.append)
        report.update(before=before, after=_resources(), messages=messages,
                      rng_kept=torch.equal(rng, torch.get_rng_state()),
                      initialized=dist.is_initialized())
    cfg = load(job)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    layout = resolve(cfg, 2)
    trainer = Trainer(cfg, layout, build_mesh(layout, "cpu", timedelta(seconds=60)),
                      torch.device("cpu"))
    report["losses"] = [trainer.train_step().loss for _ in range(3)]
    del trainer
    leave_world()
    torch.save(report, f"{out}.{rank}")


def _run(job: Path, warm: bool, out: Path) -> tuple[dict, dict]:
    mp.start_processes(_rank, args=(str(job), free_port(), warm, str(out)), nprocs=2,
                       start_method=forkserver())
    return tuple(torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1))


def test_a_warmed_up_rank_trains_as_a_fresh_one(token_file: Path, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file))
    cold = _run(job, False, tmp_path / "cold")
    warm = _run(job, True, tmp_path / "warm")
    report = warm[1]
    assert report["messages"] == [], report["messages"]  # it ran, it did not fail
    assert report["seconds"] > 0
    assert not report["initialized"]
    assert report["rng_kept"]
    threads, sockets = report["after"]
    assert sockets == report["before"][1] == 0, report
    assert threads == report["before"][0], report
    for rank in (0, 1):
        assert warm[rank]["losses"] == cold[rank]["losses"]


def test_a_failed_warm_up_is_logged_and_leaves_no_world(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails_half_way(directory: Path) -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.rand(3)  # draws from the global generator, which the warm-up must put back
        raise RuntimeError("no room in /tmp")

    monkeypatch.setattr(warm_up_module, "_one_generation", fails_half_way)
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    messages: list[str] = []
    warm_up(Teardown(), messages.append)
    assert not dist.is_initialized()
    assert len(messages) == 1 and "RuntimeError: no room in /tmp" in messages[0], messages
    assert torch.equal(torch.rand(2), expected)
