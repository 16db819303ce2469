"""The single-process reference: the same Trainer with no mesh, run in the test process."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel.job import load
from parallel.layout import Layout
from trainer.fault_injection import NonFiniteInjection
from trainer.loop import StepResult, Trainer


def reference_run(config: Path, steps: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    results, params = reference_results(config, steps)
    return {step: r.loss for step, r in results.items()}, params


def reference_results(
    config: Path, steps: int, inject: NonFiniteInjection | None = None
) -> tuple[dict[int, StepResult], dict[str, torch.Tensor]]:
    """Every step's result and the final parameters; `inject` makes chosen steps non-finite
    (the reference is global rank 0)."""
    cfg = load(config)
    torch.manual_seed(0)
    layout = Layout(
        dp=1,
        micro_batch=cfg.parallel.micro_batch,
        grad_accum=-(-cfg.train.global_batch // cfg.parallel.micro_batch),
    )
    trainer = Trainer(cfg, layout, mesh=None, device=torch.device("cpu"), inject=inject)
    results = {}
    for _ in range(steps):
        r = trainer.train_step()
        results[r.step] = r
    return results, trainer.full_state()
