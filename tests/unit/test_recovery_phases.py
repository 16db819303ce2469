"""A recovery split into detect, rendezvous, restore and first_step from the agent's timestamps
(daemon/recovery_phases.py): the phases add up to the total, none is negative, and events of
old or unrelated generations do not move them."""

from __future__ import annotations

import pytest

from daemon.recovery_phases import PHASES, Recovery, RecoveryPhases

pytestmark = pytest.mark.unit


def test_a_workers_report_splits_into_the_four_phases() -> None:
    clock = RecoveryPhases()
    clock.plan_seen(3, 1.0)
    clock.restored(3, 2.0)
    assert clock.stepped(3, 3.0) is None  # no failure: nothing to measure
    clock.failed(3, 10.0, detect_s=0.25)  # the worker saw its collective fail at 9.75
    clock.plan_seen(3, 10.5)  # the failed generation's plan again: not the next one
    clock.plan_seen(4, 12.0)
    clock.restored(4, 15.0)
    assert clock.stepped(3, 15.5) is None  # a straggler of the failed generation
    recovery = clock.stepped(4, 16.5)
    assert recovery == Recovery(detect=0.25, rendezvous=2.0, restore=3.0, first_step=1.5)
    assert recovery.total == pytest.approx(6.75)
    assert recovery.by_phase() == {"detect": 0.25, "rendezvous": 2.0, "restore": 3.0,
                                   "first_step": 1.5, "total": recovery.total}
    assert not clock.active
    assert clock.stepped(4, 17.5) is None  # one recovery, observed once


def test_a_failure_the_agent_saw_itself_has_no_detect_phase() -> None:
    clock = RecoveryPhases()
    clock.failed(1, 5.0)
    clock.plan_seen(2, 6.0)
    clock.restored(2, 6.5)
    assert clock.stepped(2, 7.0) == Recovery(0.0, 1.0, 0.5, 0.5)


def test_a_plan_seen_before_the_failure_was_known_leaves_no_rendezvous() -> None:
    # The leader replaced generation 5 on another agent's report before this agent's worker
    # reported its own failed collective.
    clock = RecoveryPhases()
    clock.plan_seen(5, 1.0)
    clock.plan_seen(6, 20.0)
    clock.failed(5, 20.5, detect_s=0.1)
    clock.restored(6, 22.0)
    recovery = clock.stepped(6, 23.0)
    assert recovery is not None
    assert recovery.rendezvous == 0.0
    assert recovery.restore == pytest.approx(1.5)
    assert recovery.total == pytest.approx(0.1 + 2.5)


def test_a_failure_during_the_recovery_extends_it_to_the_generation_that_trains() -> None:
    clock = RecoveryPhases()
    clock.failed(2, 10.0)
    clock.plan_seen(3, 11.0)
    clock.restored(3, 12.0)
    clock.failed(3, 13.0, detect_s=0.5)  # generation 3 failed before its first step
    clock.failed(1, 13.5)  # a late report of an older generation changes nothing
    assert clock.stepped(3, 13.8) is None
    clock.plan_seen(4, 15.0)
    clock.restored(4, 17.0)
    recovery = clock.stepped(4, 18.0)
    # From the first failure; rendezvous until the plan of the generation that trained.
    assert recovery == Recovery(detect=0.0, rendezvous=5.0, restore=2.0, first_step=1.0)


def test_a_missing_restore_report_counts_in_first_step() -> None:
    clock = RecoveryPhases()
    clock.failed(7, 1.0)
    clock.plan_seen(8, 2.0)
    assert clock.stepped(8, 4.0) == Recovery(0.0, 1.0, 0.0, 2.0)


def test_out_of_order_timestamps_never_make_a_phase_negative() -> None:
    clock = RecoveryPhases()
    clock.failed(1, 10.0, detect_s=-3.0)  # a clock step on the worker: no negative detect
    clock.plan_seen(2, 10.5)
    clock.restored(2, 9.0)  # before the plan: clamped to it
    recovery = clock.stepped(2, 11.0)
    assert recovery is not None
    assert all(getattr(recovery, p) >= 0 for p in PHASES)
    assert recovery == Recovery(0.0, 0.5, 0.0, 0.5)


def test_outside_a_recovery_only_the_newest_generation_is_remembered() -> None:
    clock = RecoveryPhases()
    for g in range(1, 50):
        clock.plan_seen(g, float(g))
        clock.restored(g, g + 0.5)
    assert set(clock.plans) == {49} and set(clock.restores) == {49}
