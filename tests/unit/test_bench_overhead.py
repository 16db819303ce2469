"""bench.overhead's run order: counterbalanced, so a drift within a run loads no arm alone."""

from __future__ import annotations

import pytest

from bench.overhead import ARMS, run_order

pytestmark = pytest.mark.unit


def test_each_arm_runs_at_each_position_once_over_as_many_runs_as_arms() -> None:
    arms = list(ARMS)
    orders = [run_order(arms, run) for run in range(len(arms))]
    assert orders[0] == arms
    for order in orders:
        assert sorted(order) == sorted(arms)
    for position in range(len(arms)):
        assert sorted(order[position] for order in orders) == sorted(arms)
    # Then it starts over: run 3 is run 0's order again.
    assert run_order(arms, len(arms)) == arms
    assert run_order(["bare", "ultrad"], 1) == ["ultrad", "bare"]
