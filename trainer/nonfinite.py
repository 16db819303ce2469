"""Non-finite steps never commit: a NaN or infinite loss or gradient norm skips the update.

Every rank must skip the same steps, or the ranks' weights part ways (and ZeRO's collectives
pair different steps). A rank may be the only one to see the NaN: with tensor parallelism a
replicated loss or gradient is not reduced again, and a gradient that is only this rank's
(a pipeline stage's, or an unreduced replica) reaches nobody else. So the ranks agree with one
all-reduce (MAX) of two flags over the whole world, which also carries the agent's requests
(trainer.agreement).

A skipped step still consumes its samples and advances the step counter, as Megatron does:
the data stream stays a pure function of the step, so a run that skipped step N is exact
against a reference that skipped step N. `train.max_skipped_steps` skips in a row end the job:
the loss has diverged and a restore would replay the same steps (docs/observability.md).
"""

from __future__ import annotations

REASONS = ("nonfinite_loss", "nonfinite_grad")


class NonFiniteSteps(RuntimeError):
    """train.max_skipped_steps steps in a row were non-finite (trainer.failure_kind: no retry
    can help, the job fails naming the step)."""


def skip_reason(loss_bad: bool, grad_bad: bool) -> str:
    """Why the step is skipped ("" when it is not), from the flags agreed over every rank."""
    return REASONS[0] if loss_bad else REASONS[1] if grad_bad else ""


class SkipStreak:
    """Skipped steps in a row; raises NonFiniteSteps when they reach the limit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.first, self.count = limit, 0, 0

    def record(self, step: int, reason: str) -> None:
        """`step` (1-based) is done: skipped for `reason`, or committed when reason is ""."""
        if not reason:
            self.count = 0
            return
        self.first = self.first if self.count else step
        self.count += 1
        if self.count >= self.limit:
            raise NonFiniteSteps(
                f"step {step} skipped ({reason}): {self.count} non-finite steps in a row "
                f"(steps {self.first}-{step}) reached train.max_skipped_steps={self.limit}; "
                f"the loss has diverged (lower train.lr or raise train.warmup_steps)")
