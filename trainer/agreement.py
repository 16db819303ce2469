"""What every rank does after a step, agreed on by all of them.

Agents learn of a request (a new generation, a planned change, a checkpoint) at slightly
different times, so ranks see it in replies to different steps. One all-reduce (MAX) of each
rank's reply after every step makes it take effect at the first step any rank saw it, the same
step on every rank, and never at a step some rank has already passed. A rank that acted alone
would leave, or checkpoint, while the others run the next step's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from proto.ultrascale.v1 import agent_pb2 as pb


@dataclass(frozen=True)
class Agreement:
    stop_now: bool  # leave at once, no checkpoint: a newer generation exists
    stop: bool  # planned change: durable checkpoint of this step, ReportDone(stopped), leave
    checkpoint_seq: int  # the most checkpoint requests any rank has seen in this generation


def agree(reply: pb.StepReply, group: dist.ProcessGroup | None = None) -> Agreement:
    """The element-wise maximum of every rank's reply (a collective over `group`)."""
    fields = torch.tensor(
        [int(reply.stop_now), int(reply.stop), int(reply.checkpoint_seq)], dtype=torch.int64
    )
    dist.all_reduce(fields, op=dist.ReduceOp.MAX, group=group)
    stop_now, stop, seq = (int(x) for x in fields.tolist())
    return Agreement(stop_now=bool(stop_now), stop=bool(stop), checkpoint_seq=seq)


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
