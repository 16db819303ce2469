"""bench/cpu_busy.py: the machine's busy and stolen cores over a window, from /proc/stat."""

from __future__ import annotations

import time

import pytest

from bench.cpu_busy import TICK_S, CpuBusy, CpuTimes

pytestmark = pytest.mark.unit


def _stat(user: int, system: int, idle: int, steal: int) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice, then one line per CPU
    return f"cpu  {user} 0 {system} {idle} 7 1 2 {steal} 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\n"


def test_busy_counts_user_system_and_interrupts_not_idle_iowait_or_steal() -> None:
    times = CpuTimes.parse(_stat(user=300, system=100, idle=5000, steal=40))
    assert times.busy == pytest.approx((300 + 100 + 1 + 2) * TICK_S)
    assert times.steal == pytest.approx(40 * TICK_S)


def test_a_file_that_does_not_start_with_the_total_is_refused() -> None:
    with pytest.raises(ValueError, match="/proc/stat"):
        CpuTimes.parse("cpu0 1 2 3 4 5 6 7 8 0 0\n")


def test_the_window_takes_the_samples_around_it() -> None:
    load = CpuBusy()
    load.samples = [(10.0, CpuTimes(0.0, 0.0)), (10.5, CpuTimes(0.8, 0.1)),
                    (11.0, CpuTimes(1.6, 0.1)), (11.5, CpuTimes(2.6, 0.2))]
    busy, stolen = load.between(10.2, 11.0)  # type: ignore[misc]
    assert (busy, stolen) == (pytest.approx(1.6), pytest.approx(0.1))
    busy, stolen = load.between(10.5, 11.2)  # type: ignore[misc]
    assert (busy, stolen) == (pytest.approx(1.8), pytest.approx(0.1))
    assert load.between(9.0, 11.0) is None  # no sample before the window
    assert load.between(10.5, 12.0) is None  # none after it


def test_sampling_this_machine_sees_a_busy_loop_keep_a_core() -> None:
    load = CpuBusy(interval=0.01).start()
    t0 = time.time()
    while time.time() - t0 < 0.5:
        pass
    t1 = time.time()
    time.sleep(0.05)
    load.stop()
    busy, _ = load.between(t0, t1)  # type: ignore[misc]
    assert busy >= 0.7  # this loop alone keeps one core busy
    samples = len(load.samples)
    time.sleep(0.05)
    assert len(load.samples) == samples  # stopped
