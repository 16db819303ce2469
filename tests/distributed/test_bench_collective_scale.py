"""bench.collective_scale runs real gloo worlds and reports the time of one tiny all-reduce."""

from __future__ import annotations

import pytest

from bench.collective_scale import Row, seconds_per_call, table
from tests.forkserver import PRELOAD

pytestmark = pytest.mark.distributed


def test_every_run_of_a_real_world_times_its_all_reduces() -> None:
    # The suite's forkserver preload: whichever test starts the server, it is the same one.
    per_call = seconds_per_call(world=3, calls=10, runs=2, preload=PRELOAD)
    assert len(per_call) == 2
    # One all-reduce of 3 ranks over loopback: more than nothing, less than a second.
    assert all(0 < s < 1 for s in per_call), per_call


def test_the_table_shows_each_world_against_the_smallest() -> None:
    text = table([Row(2, 0.0001), Row(8, 0.0004)], calls=10, runs=2)
    lines = text.splitlines()
    assert lines[-2].split() == ["2", "100.0", "1.0x"]
    assert lines[-1].split() == ["8", "400.0", "4.0x"]
