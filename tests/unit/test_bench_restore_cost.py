"""bench.restore_cost measures a real build and restore, and checks what the restore brought
back (a restore that loaded nothing would fail it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.restore_cost import measure

pytestmark = pytest.mark.unit


def test_it_times_every_round_of_a_build_and_a_checked_restore(tmp_path: Path) -> None:
    times = measure(tmp_path, runs=2)
    assert len(times["build"]) == len(times["restore"]) == 2
    assert all(t > 0 for ts in times.values() for t in ts)
