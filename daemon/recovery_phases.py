"""The phases of a recovery as one agent sees it: `ultra_recovery_duration_seconds{phase}`.

Pure bookkeeping fed with the agent's monotonic timestamps: a failure this agent learned of
(`failed`), every generation's plan the first time the agent saw it (`plan_seen`), this node's
reporting rank's restore done (`restored`) and its first step (`stepped`). The phases, defined
in docs/observability.md ("Recovery phases"):

    happened ── detect ──▶ known ── rendezvous ──▶ plan seen ── restore ──▶ restored
             ── first_step ──▶ first step of a generation newer than every failed one

Each boundary is clamped between its neighbours, so every phase is >= 0 and the four add up
to `total` exactly. A failure while a recovery is in progress (the new generation failed too)
extends it: the recovery ends at the first step of a generation newer than both, and its
rendezvous lasts until this agent saw that generation's plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PHASES = ("detect", "rendezvous", "restore", "first_step")


@dataclass(frozen=True)
class Recovery:
    """Seconds spent in each phase of one recovery."""

    detect: float
    rendezvous: float
    restore: float
    first_step: float

    @property
    def total(self) -> float:
        return self.detect + self.rendezvous + self.restore + self.first_step

    def by_phase(self) -> dict[str, float]:
        """Every phase, and "total"."""
        return {**{p: getattr(self, p) for p in PHASES}, "total": self.total}


def _clamp(t: float, low: float, high: float) -> float:
    return min(max(t, low), high)


@dataclass
class RecoveryPhases:
    """The recovery in progress on this agent, if any, and what it needs to split it."""

    failed_generation: int = 0  # the newest generation a failure was known in
    happened_at: float | None = None  # None: no recovery in progress
    known_at: float = 0.0
    # generation -> when this agent first saw its plan / its reporting rank's restore done.
    # Outside a recovery only the newest is kept: a failure may become known after the plan
    # that replaces it (another agent's report reached the leader first).
    plans: dict[int, float] = field(default_factory=dict)
    restores: dict[int, float] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.happened_at is not None

    def failed(self, generation: int, known_at: float, detect_s: float = 0.0) -> None:
        """A failure in `generation` became known at `known_at`, `detect_s` after it happened
        (a worker's report: since it saw its error; 0 for what the agent saw itself). The
        first failure of a recovery starts it; later ones only move the generation to beat."""
        if self.happened_at is None:
            self.happened_at = known_at - max(0.0, detect_s)
            self.known_at = known_at
            self.failed_generation = generation
        else:
            self.failed_generation = max(self.failed_generation, generation)
        self._forget(lambda g: g <= self.failed_generation)

    def plan_seen(self, generation: int, at: float) -> None:
        if generation in self.plans:
            return
        self.plans[generation] = at
        if not self.active:
            self._forget(lambda g: g < generation)

    def restored(self, generation: int, at: float) -> None:
        if generation in self.restores or (self.active and generation <= self.failed_generation):
            return
        self.restores[generation] = at
        if not self.active:
            self._forget(lambda g: g < generation)

    def stepped(self, generation: int, at: float) -> Recovery | None:
        """A step of `generation` was reported at `at`: the recovery it ends, if it ends one."""
        if self.happened_at is None or generation <= self.failed_generation:
            return None
        happened, known = self.happened_at, self.known_at
        at = max(at, known)
        # A plan or restore this agent never saw (not expected: the workers get their plan
        # from it; the restore report is best effort) counts as a phase of 0 s.
        plan = _clamp(self.plans.get(generation, known), known, at)
        restored = _clamp(self.restores.get(generation, plan), plan, at)
        self.happened_at = None
        self._forget(lambda g: g < generation)
        return Recovery(detect=known - happened, rendezvous=plan - known,
                        restore=restored - plan, first_step=at - restored)

    def _forget(self, old: Callable[[int], bool]) -> None:
        self.plans = {g: t for g, t in self.plans.items() if not old(g)}
        self.restores = {g: t for g, t in self.restores.items() if not old(g)}
