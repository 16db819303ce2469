"""A node's run of replicated snapshot steps: what it may claim while its publication lags."""

from __future__ import annotations

import pytest

from daemon.node.replication_run import NO_RUN, ReplicationRun

pytestmark = pytest.mark.unit


def test_a_run_grows_with_each_replicated_step_and_ignores_the_one_in_flight():
    run = ReplicationRun()
    run.follow(2, after=8)
    assert run.span() == NO_RUN
    run.saw(9, False)            # written here, not yet at the buddy
    assert run.span() == NO_RUN
    run.saw(9, True)
    run.saw(10, True)
    run.saw(11, False)           # the step in flight
    assert run.span() == (9, 10)
    run.saw(10, False)           # replicated once, then freed or seen again: stays replicated
    assert run.span() == (9, 10)


def test_a_step_that_never_replicated_restarts_the_run_after_it():
    run = ReplicationRun()
    run.follow(1, after=0)
    for step in (1, 2):
        run.saw(step, True)
    run.saw(3, False)            # its buddy copy failed, and the step was freed so
    for step in (4, 5):
        run.saw(step, True)
    assert run.span() == (4, 5)
    run.saw(3, True)             # it went through after all: the run is whole again
    assert run.span() == (1, 5)


def test_a_new_generation_starts_over_and_older_steps_are_not_its_own():
    run = ReplicationRun()
    run.follow(1, after=0)
    run.saw(9, True)
    run.follow(1, after=5)       # the same generation again: nothing changes
    assert run.span() == (9, 9)
    run.follow(2, after=8)       # restored step 8
    assert run.span() == NO_RUN
    run.saw(8, True)             # the restored step itself: the old history's copy
    assert (run.generation, run.span()) == (2, NO_RUN)
    run.saw(9, True)
    assert run.span() == (9, 9)


def test_only_the_newest_steps_are_remembered():
    run = ReplicationRun(limit=4)
    run.follow(1, after=0)
    run.saw(1, False)
    for step in range(2, 8):
        run.saw(step, True)
    assert run.span() == (4, 7)  # the gap at 1 is forgotten; the run starts where memory does
