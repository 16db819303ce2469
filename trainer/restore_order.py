"""Where a generation's starting state comes from, in one fixed order.

1. `snapshot`: the newest in-memory snapshot the plan names (docs/snapshots.md);
2. `checkpoint`: the newest valid durable checkpoint (docs/checkpoints.md);
3. `pretrained`: the job's `[init] hf` weights, at step 0 (trainer/pretrained.py);
4. `init`: random weights from (train.seed, parameter name).

The first tier that can serve does; each one before it says why it could not, and that list
travels with the result into the worker's log line and the agent's restore event. Every rank
takes the same branch: each tier agrees across ranks before it answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

ORDER = ("snapshot", "checkpoint", "pretrained", "init")


@dataclass(frozen=True)
class Served:
    """A tier's success: what it loaded (a checkpoint directory's name, "snapshot@<step>", the
    pretrained directory; "" for random init) and the snapshot bytes it fetched."""

    name: str = ""
    snapshot_bytes: int = 0


# A tier's attempt: Served, or why it could not serve.
Attempt = Callable[[], "Served | str"]


@dataclass(frozen=True)
class Restored:
    """What a generation's restore loaded, and why the faster tiers were passed over."""

    source: str  # one of ORDER
    step: int
    skipped: str = ""  # why the plan's snapshot was not used ("" when it was, or none was named)
    seconds: float = 0.0
    snapshot_bytes: int = 0
    name: str = ""  # the checkpoint directory's name, "snapshot@<step>", or the pretrained dir
    passed: tuple[tuple[str, str], ...] = ()  # (tier, why it could not serve), in ORDER

    def describe(self) -> str:
        what = {"init": "random initial weights (step 0)",
                "pretrained": f"pretrained weights {self.name} (step 0)"}.get(
                    self.source, f"{self.name} (step {self.step})")
        why = "; ".join(f"{tier}: {reason}" for tier, reason in self.passed)
        return what + (f" [not {why}]" if why else "")


def first_served(attempts: Mapping[str, Attempt]) -> tuple[str, Served, tuple[tuple[str, str], ...]]:
    """Try the tiers of `attempts` in ORDER; `init` must always serve."""
    passed: list[tuple[str, str]] = []
    for tier in ORDER:
        outcome = attempts[tier]()
        if isinstance(outcome, Served):
            return tier, outcome, tuple(passed)
        passed.append((tier, outcome))
    raise AssertionError("the init tier did not serve")
