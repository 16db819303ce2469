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
