"""The step loop: one optimizer step over the step's global batch.

Loss normalisation (ARCHITECTURE.md, promise (c)): every micro-batch's token-summed loss is
divided by the global token count of the step, and FSDP sums gradients over data-parallel
ranks. The gradient is then that of the mean token loss over the whole global batch, whatever
dp, micro_batch and the padding are, so any layout follows the same trajectory.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from checkpoint.state import Progress, TrainState
from ops.loss import count_tokens, cross_entropy_sum
from parallel.job import JobConfig, TrainConfig
from parallel.layout import Layout
from parallel.parallelize import parallelize
from trainer.data import SampleStream, open_stream, step_micro_batches
from trainer.model import Llama, build_model, init_weights


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based number of the step just completed
    loss: float
    consumed_samples: int
    tokens: int
    grad_norm: float
    step_seconds: float


def learning_rate(t: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine (or constant) decay to min_lr at train.steps; step is 0-based.

    Depends on the job's total steps only, never on where a run was stopped or resumed.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    # Decay matrices only; norms (1-D) keep their scale. DTensor.ndim is the global ndim.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )


class Trainer:
    """Builds the model for a layout and runs steps. `mesh=None` is the single-process reference."""

    def __init__(
        self,
        cfg: JobConfig,
        layout: Layout,
        mesh: DeviceMesh | None,
        device: torch.device,
        stream: SampleStream | None = None,
    ) -> None:
        self.cfg, self.layout, self.mesh, self.device = cfg, layout, mesh, device
        self.model: Llama = build_model(cfg.model)
        if mesh is not None:
            parallelize(self.model, layout, mesh)
        self.model.to_empty(device=device)
        init_weights(self.model, cfg.train.seed)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.progress = Progress()
        self.state = TrainState(self.model, self.optimizer, self.progress)
        self.stream = stream or open_stream(
            cfg.data, cfg.train.seq_len, cfg.train.seed, cfg.model.vocab_size
        )
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.dp_group = mesh["dp"].get_group() if mesh is not None else None

    @property
    def step_tokens(self) -> int:
        """Target tokens in a step's global batch: the loss denominator (padding excluded)."""
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    def train_step(self) -> StepResult:
        t, layout = self.cfg.train, self.layout
        step = self.progress.step
        start = time.perf_counter()
        lr = learning_rate(t, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = step_micro_batches(
            self.stream,
            step,
            t.global_batch,
            layout.dp,
            self.dp_rank,
            layout.micro_batch,
            layout.grad_accum,
        )
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        for mb in batches:
            inputs, targets = mb.inputs.to(self.device), mb.targets.to(self.device)
            loss = cross_entropy_sum(self.model(inputs), targets) / self.step_tokens
            loss.backward()
            loss_sum += loss.detach()
            tokens += count_tokens(targets)
        if self.dp_group is not None:
            reduced = torch.stack([loss_sum, tokens.to(loss_sum.dtype)])
            dist.all_reduce(reduced, group=self.dp_group)
            loss_sum, counted = reduced[0], int(reduced[1].item())
        else:
            counted = int(tokens.item())
        if counted != self.step_tokens:
            raise RuntimeError(
                f"step {step + 1} consumed {counted} target tokens, expected {self.step_tokens}"
            )
        grad_norm = self._clip_gradients(t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.consumed_samples += t.global_batch
        return StepResult(
            step=self.progress.step,
            loss=float(loss_sum.item()),
            consumed_samples=self.progress.consumed_samples,
            tokens=self.step_tokens,
            grad_norm=grad_norm,
            step_seconds=time.perf_counter() - start,
        )

    def _clip_gradients(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm.item())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Unsharded model parameters (a collective under a mesh): for tests and export."""
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        return out
