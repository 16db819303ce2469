"""bench.overhead's run order: counterbalanced, so a drift within a run loads no arm alone."""

from __future__ import annotations

import math

import pytest

from bench.overhead import ARMS, control_cpu_per_step, run_order

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


def test_a_count_sampled_partway_into_the_next_step_still_grows_by_its_calls_per_step() -> None:
    # Three collectives a step; each sample's count is read 0-3 calls into the next step.
    # The window's first sample lands at the step's boundary, its last three calls past one.
    steps = 150
    phases = [(7 * n) % 4 for n in range(steps)]
    phases[steps // 3], phases[steps - steps // 10] = 0, 3
    samples = [(n, float(3 * n + phases[n])) for n in range(steps)]
    assert control_cpu_per_step(samples, steps) == pytest.approx(3.0, abs=0.005)


def test_the_growth_of_a_steady_count_is_its_rate_and_too_few_steps_give_none() -> None:
    assert control_cpu_per_step([(n, 0.25 * n + 4) for n in range(30)], 30) == \
        pytest.approx(0.25)
    assert math.isnan(control_cpu_per_step([(12, 1.0), (12, 2.0)], 30))  # one step in it
