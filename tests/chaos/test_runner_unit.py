"""The chaos runner's pure parts: segments, consistency, stall and re-run accounting."""

from __future__ import annotations

import pytest

from tests.chaos.replay import ReplayResult, Segment, compare, segments, torchrun_runs
from tests.chaos.runner import Fault, committed, consistency_problems, fault_effect, steps_rerun

pytestmark = pytest.mark.unit


def line(step: int, gen: int, world: int, t: float, loss: float | None = None) -> dict:
    return {"step": step, "generation": gen, "world_size": world, "dp": world, "tp": 1,
            "pp": 1, "cp": 1, "consumed_samples": step * 10, "loss": loss if loss is not None else 1.0 / step,
            "time": t, "step_seconds": 0.1}


def history() -> list[dict]:
    # gen 1 (world 3) runs 1..10, checkpoint at 8; gen 2 (world 2) restores 8 and finishes at 12.
    return [line(s, 1, 3, float(s)) for s in range(1, 11)] + \
        [line(s, 2, 2, 20.0 + s) for s in range(9, 13)]


def test_segments_follow_the_committed_lines() -> None:
    assert segments(history()) == [Segment(1, 3, 3, 1, 8), Segment(2, 2, 2, 9, 12)]


def test_a_replanned_generation_is_its_own_segment_with_its_layout() -> None:
    lines = [line(s, 1, 2, float(s)) for s in range(1, 5)]
    lines = [{**x, "dp": 1, "pp": 2} for x in lines] + [line(s, 2, 1, 10.0 + s) for s in (5, 6)]
    assert segments(lines) == [Segment(1, 2, 1, 1, 4, tp=1, pp=2, cp=1),
                               Segment(2, 1, 1, 5, 6, tp=1, pp=1, cp=1)]


def test_consecutive_segments_of_one_layout_are_one_torchrun_run() -> None:
    # A worker replaced at the same size (gen 2), a node lost (gen 3) and back (gen 4, 5), then
    # a re-planned pp (gen 6): one run per change of layout, each as long as its segments.
    segs = [Segment(1, 3, 3, 1, 6), Segment(2, 3, 3, 7, 8), Segment(3, 2, 2, 9, 20),
            Segment(4, 3, 3, 21, 21), Segment(5, 3, 3, 22, 30),
            Segment(6, 3, 1, 31, 40, pp=3)]
    assert torchrun_runs(segs) == [Segment(1, 3, 3, 1, 8), Segment(3, 2, 2, 9, 20),
                                   Segment(4, 3, 3, 21, 30), Segment(6, 3, 1, 31, 40, pp=3)]
    # Not consecutive (a re-run that the committed lines would never give): left apart.
    gap = [Segment(1, 3, 3, 1, 6), Segment(2, 3, 3, 8, 9)]
    assert torchrun_runs(gap) == gap


def test_consistent_history_has_no_problem() -> None:
    assert consistency_problems(history(), 12) == []
    assert steps_rerun(history()) == 2


def test_interleaved_generations_are_split_brain() -> None:
    lines = history()
    lines.append(line(11, 1, 3, 40.0))
    problems = consistency_problems(lines, 12)
    assert any("split brain" in p for p in problems), problems


def test_missing_step_and_wrong_samples() -> None:
    lines = [x for x in history() if x["step"] != 12]
    lines[0]["consumed_samples"] = 11
    problems = consistency_problems(lines, 12)
    assert any("never committed: [12]" in p for p in problems)
    assert any("consumed_samples 11" in p for p in problems)


def test_fault_effect() -> None:
    stall, rerun = fault_effect(history(), Fault("x", 10.5, 1, 10, 0.1))
    assert stall == pytest.approx(29.0 - 10.5)
    assert rerun == 2


def test_compare_is_relative() -> None:
    c = committed(history())
    ref = ReplayResult({s: x["loss"] for s, x in c.items()}, {s: x["dp"] for s, x in c.items()})
    assert compare(c, ref).mismatches == [] and compare(c, ref).max_rel == 0.0
    ref.losses[5] *= 1 + 1e-5
    d = compare(c, ref)
    assert len(d.mismatches) == 1 and "step 5" in d.mismatches[0]
