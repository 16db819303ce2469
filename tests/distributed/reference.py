"""The single-process reference: the same Trainer with no mesh, run in the test process."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel.job import load
from parallel.layout import Layout
from trainer.loop import Trainer


def reference_run(config: Path, steps: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    cfg = load(config)
    torch.manual_seed(0)
    layout = Layout(
        dp=1,
        micro_batch=cfg.parallel.micro_batch,
        grad_accum=-(-cfg.train.global_batch // cfg.parallel.micro_batch),
    )
    trainer = Trainer(cfg, layout, mesh=None, device=torch.device("cpu"))
    losses = {}
    for _ in range(steps):
        r = trainer.train_step()
        losses[r.step] = r.loss
    return losses, trainer.full_state()
