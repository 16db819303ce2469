"""What a step tells its readers: learning rate, gradient norm, throughput and MFU.

MFU (model FLOPs utilisation) = the step's model FLOPs / (step seconds x devices x the device's
peak FLOP/s). Model FLOPs count what the model needs (6·N plus attention, playbook "Memory usage
in Transformers", compute), never recomputation or padding, so layouts compare on one scale.
The peak comes from `PEAK_FLOPS`, a table of vendor dense (no sparsity) figures keyed by a
fragment of the device name; on CPU or a device the table lacks MFU is unknown (None).
docs/observability.md lists the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel.cost_model import flops_per_token
from parallel.job import JobConfig

# Dense peak FLOP/s per device (vendor data sheets, SXM parts), as (bf16, fp32 without TF32).
# Matched against torch.cuda.get_device_name() in this order: the first fragment found wins.
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
}


def model_flops_per_token(job: JobConfig) -> float:
    """Training FLOPs per token of the job's model: the one place that knows the formula's
    owner (the model's size formulas), so callers never do."""
    return flops_per_token(job.model, job.train.seq_len)


def peak_flops(device_name: str, mixed_precision: str) -> float | None:
    """The device's dense peak FLOP/s for the job's precision; None when the table lacks it."""
    for fragment, (bf16, fp32) in PEAK_FLOPS.items():
        if fragment in device_name:
            return bf16 if mixed_precision == "bf16" else fp32
    return None


def device_name(device: Any) -> str:
    """torch's name for an accelerator; "" on CPU (whose peak the table does not know)."""
    if getattr(device, "type", "cpu") != "cuda":
        return ""
    import torch

    return torch.cuda.get_device_name(device)


def mfu(flops: float, seconds: float, devices: int, peak: float | None) -> float | None:
    if peak is None or seconds <= 0 or devices < 1:
        return None
    return flops / (seconds * devices * peak)


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN: a non-finite value is written as null."""
    return value if value is not None and math.isfinite(value) else None


def perplexity(loss: float) -> float | None:
    """exp(mean token loss); None when that is not a finite number."""
    if not math.isfinite(loss):
        return None
    try:
        return math.exp(loss)
    except OverflowError:
        return None


def step_record(r: Any) -> dict[str, Any]:
    """The telemetry fields of a step line (steps.jsonl and --log-format json); r: StepResult."""
    record: dict[str, Any] = {
        "lr": r.lr,
        "grad_norm": finite_or_none(r.grad_norm),
        "tokens_per_s": round(r.tokens / r.step_seconds, 3) if r.step_seconds > 0 else None,
        "mfu": None if r.mfu is None else round(r.mfu, 6),
    }
    if r.skipped:
        record["skipped"] = r.skipped
    load = getattr(r, "expert_load", ())
    if load:  # the moe family: balancing loss, copies per expert, max / mean over experts
        record["aux_loss"] = finite_or_none(r.aux_loss)
        record["expert_load"] = [list(row) for row in load]
        record["expert_imbalance"] = round(max(
            max(row) * len(row) / max(1, sum(row)) for row in load), 6)
    eval_loss = getattr(r, "eval_loss", None)
    if eval_loss is not None:  # a step followed by an evaluation (trainer.evaluation)
        record["eval_loss"] = finite_or_none(eval_loss)
        record["eval_ppl"] = perplexity(eval_loss)
    return record


@dataclass(frozen=True)
class ExpertTelemetry:
    """A MoE step's expert figures for the agent's metrics (docs/observability.md)."""

    aux_loss: float
    load: dict[int, tuple[int, ...]]  # decoder layer -> routed copies per expert, all ranks
    dropped: int  # routed copies no expert computed, over every MoE layer


def expert_telemetry(r: Any, job: JobConfig) -> ExpertTelemetry | None:
    """r: StepResult. None for a dense model. `dropped` is what the routing asked for (every
    sample's tokens x top-k per MoE layer) minus what the experts counted: 0 while dropless."""
    rows = getattr(r, "expert_load", ())
    if not rows:
        return None
    from models.moe.config import moe_layers

    m, t = job.model, job.train
    asked = t.global_batch * t.seq_len * m.num_experts_per_tok
    load = dict(zip(moe_layers(m), (tuple(row) for row in rows), strict=True))
    return ExpertTelemetry(r.aux_loss, load, sum(asked - sum(row) for row in load.values()))


class TensorBoard:
    """`[metrics] tensorboard = true`: rank 0's step scalars as TensorBoard event files in
    <job.output_dir>/tensorboard (the optional `tensorboard` extra; the job check names the
    field when it is missing)."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def add(self, r: Any) -> None:
        scalars = {"train/loss": r.loss, "train/lr": r.lr, "train/grad_norm": r.grad_norm,
                   "train/tokens_per_s": r.tokens / r.step_seconds if r.step_seconds > 0 else None,
                   "train/mfu": r.mfu}
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, r.step)
        self.writer.add_scalar("train/skipped", 1.0 if r.skipped else 0.0, r.step)
        eval_loss = getattr(r, "eval_loss", None)
        if eval_loss is not None and math.isfinite(eval_loss):
            self.writer.add_scalar("eval/loss", eval_loss, r.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
