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
