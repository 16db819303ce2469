"""A testing aid: make a worker fail, or hang, at a chosen step.

`ULTRA_FAULT_FAIL_AT_STEP=N` makes the worker raise `RuntimeError("injected fault at step N")`
right after it completes step N, every time it reaches step N (so a job that keeps restoring
to before N keeps failing: a crash loop). `ULTRA_FAULT_HANG_AT_STEP=N` makes it sleep forever
there instead, in `injected_hang`, as a worker stuck in Python would: its heartbeat thread keeps
beating, so the watchdog's progress deadline finds it (and asks for its stacks first).
`ULTRA_FAULT_FAIL_NODES=node-1,node-2` limits both to workers whose `ULTRA_NODE_ID` is listed;
unset, every node fails. Neither step set: no effect.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass


def _step(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "").strip()
    return int(raw) if raw else 0  # a typo must fail loudly, not turn the test's fault off


@dataclass(frozen=True)
class FaultInjection:
    fail_at_step: int = 0
    hang_at_step: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FaultInjection | None:
        fail, hang = _step(env, "ULTRA_FAULT_FAIL_AT_STEP"), _step(env, "ULTRA_FAULT_HANG_AT_STEP")
        if not (fail or hang):
            return None
        nodes = {n.strip() for n in env.get("ULTRA_FAULT_FAIL_NODES", "").split(",") if n.strip()}
        if nodes and env.get("ULTRA_NODE_ID", "") not in nodes:
            return None
        return cls(fail, hang)

    def check(self, step: int) -> None:
        """Hang or raise if `step` (just completed) is the step to do so at."""
        if step == self.hang_at_step:
            injected_hang(step)
        if step == self.fail_at_step:
            raise RuntimeError(f"injected fault at step {step}")


def injected_hang(step: int) -> None:
    """Never returns: the name a hung worker's stacks show (tests look for it)."""
    while True:
        time.sleep(3600)


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
