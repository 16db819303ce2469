"""Pipeline parallelism (the playbook's "Pipeline parallelism" section) on torch.distributed.pipelining.

The layer stack is cut into `pp x virtual_stages` stages of equal depth. Stage s holds layers
[s*L/S, (s+1)*L/S); the model family cuts the module there (its spec's `split_stages`, e.g.
models/llama/pipeline.py: the first stage also holds the embedding, the last the final norm and
head, and every parameter keeps its full-model name, so checkpoints load across layouts).

Schedules (playbook section, then torch class):
- `gpipe` -> all-forward-all-backward, `ScheduleGPipe` (v = 1).
- `1f1b` -> one-forward-one-backward, `Schedule1F1B` (v = 1).
- `interleaved_1f1b` -> `ScheduleInterleaved1F1B` (v >= 2), stages placed in a loop: stage s on
  pp rank s mod pp.
- `zero_bubble` -> v = 1: `ScheduleInterleavedZeroBubble` (ZB-H1, "ZB1P": backward split into
  input- and weight-gradient halves, weight halves fill the bubble); v = 2: `ScheduleZBVZeroBubble`
  (ZB-V) with stages placed in a V: rank r holds stages r and 2*pp-1-r, so the first and the
  last stage share rank 0.

Step and loss: the step's `grad_accum` micro-batches of this dp rank are concatenated and the
schedule splits them back (`tensor_split` along the batch, in order), so micro-batch m is the
data stream's micro-batch m and the step's sample set is unchanged. The loss of a micro-batch
is its token-summed cross-entropy over the global token count of the step, and the schedule is
built with `scale_grads=False`: its default divides gradients by n_microbatches, which is right
for per-micro-batch *mean* losses and wrong for ours (docs/architecture.md, "The promise" (c)).

Bubble: every stage action (forward, loss, full / input / weight backward, gradient reduction)
is timed; `1 - busy / step_time` per pp rank is the measured idle fraction. The playbook gives
the bubble relative to the ideal compute time as r = (p - 1) / (v * m) (pipeline parallelism,
"interleaving stages"); as a fraction of the step that is r / (1 + r), which is what we report
as predicted so both numbers lie in [0, 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from models import spec_of
from parallel.layout import Layout, check_pipeline

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Global stage indices held by `pp_rank`, in increasing order."""
    p, v = layout.pp, layout.virtual_stages
    if layout.pp_schedule == "zero_bubble" and v == 2:
        return sorted({pp_rank, 2 * p - 1 - pp_rank})
    return [pp_rank + i * p for i in range(v)]


def stage_layers(layout: Layout, num_layers: int, pp_rank: int) -> list[tuple[int, range]]:
    """(global stage index, its layer indices) of each stage `pp_rank` holds."""
    per_stage = num_layers // (layout.pp * layout.virtual_stages)
    return [(s, range(s * per_stage, (s + 1) * per_stage)) for s in stage_ids(layout, pp_rank)]


def split_stages(model: nn.Module, layout: Layout, pp_rank: int) -> list[nn.Module]:
    """Cut `model` (on meta) to this rank's stages, one module each in `stage_ids` order.

    `model` itself keeps the union of the rank's layers (it is what the optimizer and the
    checkpoint see); each stage module shares `model`'s submodules, so nothing is copied.
    """
    stages = stage_layers(layout, len(model.layers), pp_rank)
    return spec_of(model).split_stages(model, stages, layout.pp * layout.virtual_stages)


@dataclass
class ActionTimer:
    """Busy time of one pp rank within a step: the sum of its stage actions' durations.

    CPU: wall clock around each action. CUDA: events on the current stream around each action,
    read once at the end of the step (one synchronisation per step, not per action).
    """

    device: torch.device
    busy_s: float = 0.0
    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def reset(self) -> None:
        self.busy_s = 0.0
        self._events.clear()

    def timed(self, fn: Callable, *args, **kwargs):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def total(self) -> float:
        if self._events:
            torch.cuda.synchronize(self.device)
            self.busy_s += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()
        return self.busy_s


class TimedStage(PipelineStage):
    """A PipelineStage whose compute actions count towards the rank's busy time."""

    def __init__(self, *args, timer: ActionTimer,
                 before_forward: Callable[[int], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timer = timer
        self.before_forward = before_forward

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if self.before_forward is not None:
            self.before_forward(fwd_chunk_id)
        return self.timer.timed(super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self.timer.timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self.timer.timed(super().backward_weight_one_chunk, *args, **kwargs)

    def perform_reduce_grad(self, *args, **kwargs):
        return self.timer.timed(super().perform_reduce_grad, *args, **kwargs)


@dataclass(frozen=True)
class StepTiming:
    step_s: float
    busy_s: float

    @property
    def bubble(self) -> float:
        return max(0.0, 1.0 - self.busy_s / self.step_s) if self.step_s > 0 else 0.0


class Pipeline:
    """This rank's stages and the schedule that drives them for one step."""

    def __init__(
        self,
        parts: list[nn.Module],
        layout: Layout,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: LossFn,
        before_forward: Callable[[int], None] | None = None,
    ) -> None:
        """`before_forward(i)` runs before each stage forward of micro-batch i (not before
        torch's shape-inference forward of a first step)."""
        check_pipeline(layout)
        self.layout, self.device = layout, device
        self.timer = ActionTimer(device)
        n_stages = layout.pp * layout.virtual_stages
        ids = stage_ids(layout, dist.get_rank(pp_group))
        self.stages = [
            TimedStage(part, s, n_stages, device, group=pp_group, timer=self.timer,
                       before_forward=before_forward)
            for s, part in zip(ids, parts, strict=True)
        ]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        timed_loss = self._timed_loss(loss_fn)
        kwargs = {"n_microbatches": layout.grad_accum, "loss_fn": timed_loss, "scale_grads": False}
        sched = layout.pp_schedule
        if sched == "gpipe":
            self.schedule = ScheduleGPipe(self.stages[0], **kwargs)
        elif sched == "1f1b":
            self.schedule = Schedule1F1B(self.stages[0], **kwargs)
        elif sched == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, **kwargs)
        elif layout.virtual_stages == 2:
            self.schedule = ScheduleZBVZeroBubble(self.stages, **kwargs)
        else:
            self.schedule = ScheduleInterleavedZeroBubble(self.stages, **kwargs)

    def _timed_loss(self, loss_fn: LossFn) -> LossFn:
        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self.timer.timed(loss_fn, logits, targets)

        return loss

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, StepTiming]:
        """Forward and backward of one step; returns this rank's summed micro-batch losses
        (zero unless it holds the last stage) and the step's timing."""
        self.timer.reset()
        losses: list[torch.Tensor] = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        args = (inputs,) if self.has_first else ()
        self.schedule.step(
            *args,
            target=targets if self.has_last else None,
            losses=losses if self.has_last else None,
            return_outputs=False,
        )
        busy = self.timer.total()
        timing = StepTiming(step_s=time.perf_counter() - start, busy_s=busy)
        loss = (
            torch.stack([x.detach() for x in losses]).sum()
            if losses
            else torch.zeros((), device=inputs.device)
        )
        return loss, timing

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only, through the schedule's evaluation path (no backward, no gradient):
        this rank's summed micro-batch losses (zero unless it holds the last stage)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.schedule.eval(
            *args,
            target=targets if self.has_last else None,
            losses=losses if self.has_last else None,
            return_outputs=False,
        )
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([x.detach() for x in losses]).sum()
