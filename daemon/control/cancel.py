"""`ultractl job cancel`, as the leader carries it out: a pure step of decide.py.

Once a cancel is consumed (`JobStatus.cancelling`), the running generation is asked to stop at
a step boundary the workers agree on, with a durable checkpoint (the same `directive.stop` as a
planned change); when it has stopped, the job is `cancelled` instead of re-planned. A job
without a generation is cancelled at once; a generation that failed, or that does not reach a
boundary within the planned-stop timeout, is cancelled without a new checkpoint, and the reason
says so and names the last durable one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from daemon.control.records import CheckpointRecord, Directive, FailureRecord, Progress
from parallel.planner import Plan

CANCELLING = "cancelling: stopping at the next step boundary after a durable checkpoint"


@dataclass(frozen=True)
class CancelStep:
    cancelled: bool           # the job is `cancelled` now (reason says how)
    reason: str
    directive: Directive      # the running generation's directive, with `stop` asked
    wake_at: float | None = None


def cancel_step(plan: Plan | None, progress: Progress, directive: Directive,
                checkpoint: CheckpointRecord, failures: tuple[FailureRecord, ...],
                boundary_timeout: float, now: float) -> CancelStep:
    c = checkpoint
    saved = f"last durable checkpoint: step {c.step}" if c.step >= 0 and c.path else \
        "no durable checkpoint"
    if plan is None:
        return CancelStep(True, "cancelled before any generation started", directive)
    if progress.generation == plan.generation and progress.stopped:
        return CancelStep(True, f"cancelled at step {progress.step} ({saved})", directive)
    if failures and failures[-1].generation == plan.generation:
        return CancelStep(True, f"cancelled after generation {plan.generation} failed "
                                f"({saved})", directive)
    if not directive.stop:  # a planned stop already asked serves the cancel as well
        directive = dataclasses.replace(directive, stop=True, reason="cancel", time=now)
    deadline = directive.time + boundary_timeout
    if now < deadline:
        return CancelStep(False, CANCELLING, directive, deadline)
    return CancelStep(True, f"cancelled without a checkpoint: generation {plan.generation} did "
                            f"not stop at a step boundary within {boundary_timeout:.0f}s "
                            f"({saved})", directive)
