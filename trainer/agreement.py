"""What every rank does after a step, agreed on by all of them inside the step.

Agents learn of a request (a new generation, a planned change, a checkpoint) at slightly
different times, so ranks see it in replies to different steps. A rank that acted alone would
leave, or checkpoint, while the others run the next step's collectives; so the ranks take the
element-wise maximum of what each has seen, and act on that.

The maximum rides on a collective the step performs anyway: the all-reduce (MAX) over the whole
world that decides whether the step's update is skipped (trainer.nonfinite). A step run by the
worker therefore issues exactly the collectives of the bare training loop (which carries zeros
in the same slots). The reply to step n's report is read when step n + 1 reaches that
all-reduce, long after it arrived, so the worker never waits on its agent between steps:

- a request first seen (by any rank) in the reply to step n takes effect at step n + 1, the
  same step on every rank;
- it is agreed before step n + 1 commits anything, so it never lands on a step a rank has
  already passed (a stop checkpoints step n + 1; "leave now" abandons it uncommitted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from proto.ultrascale.v1 import agent_pb2 as pb
from trainer.nonfinite import skip_reason


@dataclass(frozen=True)
class Agreement:
    """The agent's requests: as one rank saw them, or their maximum over every rank."""

    stop_now: bool = False  # leave at once, no checkpoint: a newer generation exists
    stop: bool = False  # planned change: durable checkpoint of this step, ReportDone(stopped), leave
    checkpoint_seq: int = 0  # the most checkpoint requests any rank has seen in this generation

    @classmethod
    def of(cls, reply: pb.StepReply) -> Agreement:
        return cls(stop_now=reply.stop_now, stop=reply.stop, checkpoint_seq=reply.checkpoint_seq)


@dataclass(frozen=True)
class StepAgreement:
    skipped: str  # why every rank skips this step's update ("" none): trainer.nonfinite
    requests: Agreement  # the maximum over the ranks of the requests each had seen


def agree_step(loss: float, grad_norm: float, seen: Agreement, distributed: bool
               ) -> StepAgreement:
    """One all-reduce (MAX) over the world when `distributed`: the non-finite flags of this
    rank's loss and gradient norm, and the requests it has seen."""
    fields = torch.tensor(
        [not math.isfinite(loss), not math.isfinite(grad_norm),
         seen.stop_now, seen.stop, seen.checkpoint_seq],
        dtype=torch.int64,
    )
    if distributed:
        dist.all_reduce(fields, op=dist.ReduceOp.MAX)
    loss_bad, grad_bad, stop_now, stop, seq = (int(x) for x in fields.tolist())
    return StepAgreement(skipped=skip_reason(bool(loss_bad), bool(grad_bad)),
                         requests=Agreement(stop_now=bool(stop_now), stop=bool(stop),
                                            checkpoint_seq=seq))


@dataclass(frozen=True)
class Action:
    leave_now: bool = False  # no checkpoint, no report
    stop: bool = False  # checkpoint durably, report done(stopped), leave
    checkpoint: bool = False  # checkpoint this step (in the background)


def decide(agreed: Agreement, checkpoint_seq_done: int) -> Action:
    """This step's action, given the last checkpoint request done in this generation."""
    if agreed.stop_now:
        return Action(leave_now=True)
    if agreed.stop:
        return Action(stop=True)  # its checkpoint answers any checkpoint request as well
    return Action(checkpoint=agreed.checkpoint_seq > checkpoint_seq_done)
