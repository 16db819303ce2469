"""HangDetector: heartbeat silence, phase deadlines, the step deadline from observed step times."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.node.watchdog import HangDetector
from daemon.procutil import is_stopped
from parallel.job import FaultConfig

pytestmark = pytest.mark.unit

FAULT = FaultConfig()  # floor 10 s, factor 5, join 60 s, restore/first step 120 s, beat 5 s


def beat_until(det: HangDetector, rank: int, phase: str, step: int, start: float, end: float,
               generation: int = 1) -> None:
    """Beat once a second from `start` to `end` inclusive without progress."""
    t = start
    while t <= end:
        det.beat(rank, generation, phase, step, t)
        t += 1.0


def hung_ranks(det: HangDetector, now: float) -> list[int]:
    return [rank for rank, _ in det.hung(now, FAULT)]


def steady_steps(det: HangDetector, rank: int, seconds: float, count: int = 8) -> float:
    """`count` completed steps of `seconds` each; returns the time of the last one."""
    det.started(rank, 0.0)
    det.beat(rank, 1, "step", 0, 0.0)
    t = 0.0
    for step in range(1, count + 1):
        t += seconds
        det.step_done(rank, step, seconds, t)
        det.beat(rank, 1, "step", step, t)
    return t


def test_a_healthy_beating_worker_is_not_hung() -> None:
    det = HangDetector()
    det.started(0, 0.0)
    beat_until(det, 0, "step", 0, 0.0, 30.0)
    assert det.hung(30.5, FAULT) == []


def test_heartbeat_silence_is_a_hang_in_any_phase() -> None:
    for phase in ("idle", "join", "step"):
        det = HangDetector()
        det.started(0, 0.0)
        det.beat(0, 1, phase, 0, 1.0)
        assert det.hung(1.0 + FAULT.heartbeat_timeout_s - 0.1, FAULT) == []
        ((rank, reason),) = det.hung(1.0 + FAULT.heartbeat_timeout_s + 0.1, FAULT)
        assert rank == 0 and "heartbeat silent" in reason and phase in reason


def test_a_worker_that_never_beats_has_the_join_deadline() -> None:
    det = HangDetector()
    det.started(3, 100.0)
    assert det.hung(100.0 + FAULT.join_timeout_s - 1, FAULT) == []
    ((rank, reason),) = det.hung(100.0 + FAULT.join_timeout_s + 1, FAULT)
    assert rank == 3 and "no heartbeat" in reason


def test_a_worker_stopped_before_its_first_beat_is_hung_after_the_heartbeat_timeout() -> None:
    """No import explains a stopped process: it gets the heartbeat timeout from when it was
    first seen stopped, not the join deadline; one that resumes gets the join deadline again."""
    det, stopped = HangDetector(), {3}
    det.started(3, 100.0)
    assert det.hung(101.0, FAULT, stopped=lambda r: r in stopped) == []  # first seen stopped
    assert det.hung(101.0 + FAULT.heartbeat_timeout_s - 0.1, FAULT,
                    stopped=lambda r: r in stopped) == []
    ((rank, reason),) = det.hung(101.0 + FAULT.heartbeat_timeout_s + 0.1, FAULT,
                                 stopped=lambda r: r in stopped)
    assert rank == 3 and "stopped for" in reason and "before its first heartbeat" in reason
    det = HangDetector()
    det.started(3, 100.0)
    det.hung(101.0, FAULT, stopped=lambda r: True)
    det.hung(104.0, FAULT, stopped=lambda r: False)  # resumed (SIGCONT): the clock restarts
    assert det.hung(101.0 + FAULT.heartbeat_timeout_s + 1, FAULT, stopped=lambda r: True) == []
    assert det.hung(100.0 + FAULT.join_timeout_s - 1, FAULT) == []


def test_is_stopped_reads_a_real_process_state() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not is_stopped(proc.pid):
            assert time.monotonic() < deadline, "SIGSTOP never showed in /proc"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGCONT)
        while is_stopped(proc.pid):
            assert time.monotonic() < deadline, "SIGCONT never showed in /proc"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert not is_stopped(proc.pid)  # gone


@pytest.mark.parametrize(("phase", "limit"), [
    ("join", FAULT.join_timeout_s),
    ("restore", FAULT.restore_timeout_s),
    ("checkpoint", FAULT.restore_timeout_s),
    ("step", FAULT.first_step_timeout_s),  # no step time observed yet: the first step
])
def test_phase_deadlines(phase: str, limit: float) -> None:
    det = HangDetector()
    det.started(0, 0.0)
    beat_until(det, 0, phase, 0, 0.0, limit + 2)
    assert det.hung(limit - 0.5, FAULT) == []
    ((rank, reason),) = det.hung(limit + 0.5, FAULT)
    assert rank == 0 and f"in phase {phase}" in reason and f"deadline {limit:.1f}s" in reason


def test_a_phase_change_is_progress() -> None:
    det = HangDetector()
    det.started(0, 0.0)
    beat_until(det, 0, "join", 0, 0.0, 50.0)
    beat_until(det, 0, "restore", 0, 51.0, 51.0 + FAULT.restore_timeout_s - 2)
    # 170 s after start, far past the join deadline, but only 118 s into the restore.
    assert det.hung(51.0 + FAULT.restore_timeout_s - 1.5, FAULT) == []


def test_fast_steps_get_the_floor() -> None:
    det = HangDetector()
    last = steady_steps(det, 0, 0.05)
    beat_until(det, 0, "step", 8, last + 1, last + 20)
    assert det.hung(last + FAULT.hang_floor_s - 0.5, FAULT) == []
    ((_, reason),) = det.hung(last + FAULT.hang_floor_s + 0.5, FAULT)
    assert "deadline 10.0s" in reason and "at step 8" in reason


def test_slow_steps_get_factor_times_the_median() -> None:
    det = HangDetector()
    last = steady_steps(det, 0, 30.0)
    beat_until(det, 0, "step", 8, last + 1, last + 160)
    assert det.hung(last + 149.0, FAULT) == []
    ((_, reason),) = det.hung(last + 151.0, FAULT)
    assert "deadline 150.0s" in reason


def test_the_median_ignores_one_outlier() -> None:
    det = HangDetector()
    det.started(0, 0.0)
    t = 0.0
    for step, seconds in enumerate([30.0, 30.0, 400.0, 30.0, 30.0], start=1):
        t += seconds
        det.step_done(0, step, seconds, t)
    beat_until(det, 0, "step", 5, t, t + 160)
    assert hung_ranks(det, t + 151.0) == [0]


def test_completed_steps_are_progress() -> None:
    det = HangDetector()
    last = steady_steps(det, 0, 2.0, count=100)  # 200 s of 2 s steps, never 10 s without one
    assert det.hung(last + 1.0, FAULT) == []


def test_idle_is_never_hung_while_beating() -> None:
    det = HangDetector()
    det.started(0, 0.0)
    beat_until(det, 0, "idle", 0, 0.0, 10_000.0)
    assert det.hung(10_000.5, FAULT) == []


def test_a_peer_blocked_in_a_collective_is_hung_only_after_the_step_deadline() -> None:
    det = HangDetector()
    last = 0.0
    for rank in (0, 1):
        last = steady_steps(det, rank, 0.05)
    # Rank 0 is stopped (silent); rank 1 waits for it in a collective and keeps beating.
    beat_until(det, 1, "step", 8, last + 1, last + 30)
    silent_at = last + FAULT.heartbeat_timeout_s + 0.5
    assert hung_ranks(det, silent_at) == [0]
    assert hung_ranks(det, last + FAULT.hang_floor_s - 0.5) == [0]
    assert hung_ranks(det, last + FAULT.hang_floor_s + 0.5) == [0, 1]


def test_forget_removes_a_rank() -> None:
    det = HangDetector()
    det.started(0, 0.0)
    det.started(1, 0.0)
    det.forget(0)
    det.forget(7)  # unknown: no error
    assert hung_ranks(det, FAULT.join_timeout_s + 1) == [1]
    det.step_done(0, 1, 1.0, 1.0)  # a late report of a forgotten rank does not revive it
    assert hung_ranks(det, FAULT.join_timeout_s + 1) == [1]


def test_a_new_generation_is_progress() -> None:
    det = HangDetector()
    last = steady_steps(det, 0, 0.05)
    beat_until(det, 0, "step", 8, last, last + 9)
    beat_until(det, 0, "step", 0, last + 9.5, last + 15, generation=2)
    # Generation 2 began at last + 9.5 (step 0 again): the step deadline counts from there.
    assert det.hung(last + 15.5, FAULT) == []


@pytest.mark.parametrize("phase", ["join", "restore", "step", "checkpoint"])
def test_a_worker_busy_in_a_replaced_generation_is_killed_after_the_grace(phase: str) -> None:
    det = HangDetector()
    det.started(0, 0.0)
    beat_until(det, 0, phase, 3, 0.0, 4.0, generation=1)
    # Generation 2 is first seen at t=4: the grace counts from then, not from the last progress.
    assert det.hung(4.0, FAULT, current=2, obsolete_grace=2.0) == []
    beat_until(det, 0, phase, 3, 5.0, 6.0, generation=1)
    assert det.hung(5.9, FAULT, current=2, obsolete_grace=2.0) == []
    ((rank, reason),) = det.hung(6.1, FAULT, current=2, obsolete_grace=2.0)
    assert rank == 0 and f"phase {phase} of generation 1" in reason and "generation 2" in reason


def test_the_replaced_generation_grace_restarts_with_progress_and_spares_idle_workers() -> None:
    det = HangDetector()
    for rank in (0, 1):
        det.started(rank, 0.0)
    det.beat(0, 1, "step", 3, 0.0)
    det.beat(1, 1, "idle", 3, 0.0)  # left generation 1, waiting for the next plan
    assert det.hung(1.0, FAULT, current=2, obsolete_grace=2.0) == []
    det.step_done(0, 4, 0.5, 2.5)  # still finishing a step of generation 1: progress
    det.beat(0, 1, "step", 4, 2.5)
    det.beat(1, 1, "idle", 3, 2.5)
    assert det.hung(4.0, FAULT, current=2, obsolete_grace=2.0) == []
    det.beat(1, 1, "idle", 3, 4.5)
    assert [r for r, _ in det.hung(4.6, FAULT, current=2, obsolete_grace=2.0)] == [0]


def test_the_current_generation_is_not_obsolete() -> None:
    det = HangDetector()
    det.started(0, 0.0)
    beat_until(det, 0, "step", 3, 0.0, 8.0, generation=2)
    assert det.hung(8.0, FAULT, current=2, obsolete_grace=2.0) == []


def test_a_program_started_with_the_parent_death_prefix_dies_with_its_parent() -> None:
    """How etcd is started: no preexec_fn (which would fork a gRPC process), and still no
    orphan when the agent that started it dies."""
    from daemon.procutil import die_with_parent_prefix

    prefix = die_with_parent_prefix()
    if not prefix:
        pytest.skip("setpriv is not installed")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         f"child = subprocess.Popen({prefix!r} + ['sleep', '60']); "
         "print(child.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10  # setpriv sets the signal, then execs sleep
        while Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline, "the child never became sleep"
            time.sleep(0.01)
        parent.kill()
        parent.wait()

        def running() -> bool:  # a killed child is a zombie until its new parent reaps it
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] \
                    != "Z"
            return False

        deadline = time.monotonic() + 10
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running()
    finally:
        parent.kill()
