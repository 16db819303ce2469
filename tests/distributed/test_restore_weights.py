"""A generation that restores its state draws no random weights; one that starts fresh does.

Drawing the initial weights costs every rank a full tensor per parameter (models/llama/model.py),
which a restore from a snapshot or a checkpoint overwrites at once. `GenerationDriver` builds
its model with the values undrawn and the restore tiers (trainer/restore_order.py) draw them
only for the pretrained and random tiers. Two real ranks: a run from random weights trains and
checkpoints; a second driver, its parameters poisoned with NaN before the restore, resumes from
the checkpoint without drawing and holds exactly the checkpointed state; a third, asked not to
resume, draws once and holds exactly the first run's initial weights.
"""

from __future__ import annotations

import os
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

pytestmark = pytest.mark.distributed

TIMEOUT = timedelta(seconds=60)


def _local_state(driver) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter and optimizer state tensor."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    trainer = driver.trainer
    out = {f"param.{n}": local(p) for n, p in trainer.model.named_parameters()}
    for i, per_param in enumerate(trainer.optimizer.state.values()):
        out |= {f"optim.{i}.{k}": local(v) for k, v in per_param.items()
                if isinstance(v, torch.Tensor)}
    return out


def _rank(rank: int, job: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    from trainer import loop
    from trainer.driver import GenerationDriver

    draws: list[int] = []
    draw = loop.Trainer.draw_initial_weights

    def counted(self) -> None:
        draws.append(1)
        draw(self)

    loop.Trainer.draw_initial_weights = counted  # this rank process only
    cfg = load(job)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    layout = resolve(cfg, 2)
    mesh = build_mesh(layout, "cpu", TIMEOUT)

    def driver() -> GenerationDriver:
        return GenerationDriver(cfg, layout, mesh, torch.device("cpu"), timeout=TIMEOUT,
                                last_step=cfg.train.steps)

    report: dict = {}
    first = driver()
    report["built_draws"] = len(draws)
    report["fresh"] = first.restore_start(resume=False).source
    report["fresh_draws"] = len(draws)
    initial = {k: v for k, v in _local_state(first).items() if k.startswith("param.")}
    for _ in range(2):
        first.train_step()
    first.save_durably()
    saved = _local_state(first)
    first.close()

    draws.clear()
    resumed = driver()
    with torch.no_grad():
        for p in resumed.trainer.model.parameters():
            p.fill_(float("nan"))
    report["resumed"] = resumed.restore_start(resume=True).source
    report["resumed_draws"] = len(draws)
    got = _local_state(resumed)
    report["resumed_equal"] = got.keys() == saved.keys() and all(
        torch.equal(got[k], saved[k]) for k in saved)
    resumed.close()

    draws.clear()
    again = driver()
    report["again"] = again.restore_start(resume=False).source
    report["again_draws"] = len(draws)
    got = _local_state(again)
    report["again_equal"] = all(torch.equal(got[k], initial[k]) for k in initial)
    again.close()
    dist.destroy_process_group()
    torch.save(report, f"{out}.{rank}")


def test_a_restore_draws_no_weights_and_a_fresh_start_draws_them_once(
        token_file: Path, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file, checkpoint={"dir": str(tmp_path / "ckpt"),
                                                          "every": 100}))
    out = tmp_path / "report"
    mp.start_processes(_rank, args=(str(job), free_port(), str(out)), nprocs=2,
                       start_method=forkserver())
    for rank in (0, 1):
        report = torch.load(f"{out}.{rank}", weights_only=False)
        assert report["built_draws"] == 0, report
        assert (report["fresh"], report["fresh_draws"]) == ("init", 1), report
        assert (report["resumed"], report["resumed_draws"]) == ("checkpoint", 0), report
        assert report["resumed_equal"], report
        assert (report["again"], report["again_draws"]) == ("init", 1), report
        assert report["again_equal"], report
    assert not os.path.exists(f"{out}.2")
