"""A testing aid: make a worker fail at a chosen step, as a local error.

`ULTRA_FAULT_FAIL_AT_STEP=N` makes the worker raise `RuntimeError("injected fault at step N")`
right after it completes step N, every time it reaches step N (so a job that keeps restoring
to before N keeps failing: a crash loop). `ULTRA_FAULT_FAIL_NODES=node-1,node-2` limits it to
workers whose `ULTRA_NODE_ID` is listed; unset, every node fails. Unset N: no effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultInjection:
    fail_at_step: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FaultInjection | None:
        raw = env.get("ULTRA_FAULT_FAIL_AT_STEP", "").strip()
        if not raw:
            return None
        step = int(raw)  # a typo must fail loudly, not turn the test's fault off
        nodes = {n.strip() for n in env.get("ULTRA_FAULT_FAIL_NODES", "").split(",") if n.strip()}
        if nodes and env.get("ULTRA_NODE_ID", "") not in nodes:
            return None
        return cls(step)

    def check(self, step: int) -> None:
        """Raise if `step` (just completed) is the step to fail at."""
        if step == self.fail_at_step:
            raise RuntimeError(f"injected fault at step {step}")


@dataclass(frozen=True)
class NonFiniteInjection:
    """A testing aid: make chosen steps non-finite on chosen ranks.

    `ULTRA_FAULT_NAN_STEPS=3` or `=3-7` (1-based steps, a single step or an inclusive range)
    multiplies the step's loss by NaN before backward (`ULTRA_FAULT_NAN_IN=loss`, the default:
    the loss and, through backward, the gradients turn NaN) or sets the step's gradients to
    +inf after backward (`=grad`: a finite loss with a non-finite gradient norm), on the global
    ranks in `ULTRA_FAULT_NAN_RANKS=1,3` (unset: every rank). With `loss`, only ranks that
    compute the loss (the last pipeline stage) are affected.
    """

    first: int
    last: int
    where: str  # "loss" | "grad"
    ranks: frozenset[int] | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NonFiniteInjection | None:
        raw = env.get("ULTRA_FAULT_NAN_STEPS", "").strip()
        if not raw:
            return None
        first, _, last = raw.partition("-")
        where = env.get("ULTRA_FAULT_NAN_IN", "loss").strip() or "loss"
        if where not in ("loss", "grad"):
            raise ValueError(f"ULTRA_FAULT_NAN_IN must be loss or grad (got {where!r})")
        ranks = {int(r) for r in env.get("ULTRA_FAULT_NAN_RANKS", "").split(",") if r.strip()}
        return cls(int(first), int(last or first), where, frozenset(ranks) if ranks else None)

    def applies(self, step: int, rank: int, where: str) -> bool:
        """Whether 1-based `step` on global `rank` is to be made non-finite at `where`."""
        return (where == self.where and self.first <= step <= self.last
                and (self.ranks is None or rank in self.ranks))
