"""Which tier a new generation restores from: the leader's pure decision over what the live
members hold in memory (daemon/control/snapshot_steps.py), and when a step is complete."""

from __future__ import annotations

import dataclasses

import pytest

from daemon.control.decide import decide
from daemon.control.facts import ProbeResult, StartGeneration
from daemon.control.records import HeldStep, SnapshotHoldings
from daemon.control.snapshot_steps import newest_assemblable, newest_complete
from parallel.planner import Plan
from tests.unit.test_decide import NOW, REV, only, snap

pytestmark = pytest.mark.unit


def holds(node: str, *steps: HeldStep, job: int = REV) -> SnapshotHoldings:
    return SnapshotHoldings(node, f"{node}:1", steps, job)


def ring_of_three(step: int) -> dict[str, SnapshotHoldings]:
    """Ranks 0, 1, 2 on a, b, c; each node also holds its predecessor's shard (buddy copy);
    rank 0's node wrote the manifest and sent it to everyone."""
    return {
        "a": holds("a", HeldStep(step, (0, 2), 3, True)),
        "b": holds("b", HeldStep(step, (0, 1), 3, True)),
        "c": holds("c", HeldStep(step, (1, 2), 3, True)),
    }


def test_a_step_is_assemblable_from_the_survivors_when_the_lost_shard_has_a_buddy_copy():
    held = ring_of_three(12)
    del held["b"]  # b died: its rank 1 is on c
    assert newest_assemblable(held) == (12, ("a", "c"))


def test_the_newest_step_wins_and_an_incomplete_newer_one_is_passed_over():
    held = ring_of_three(12)
    # Step 13: c's shard not yet copied anywhere, and c is gone.
    held["a"] = holds("a", HeldStep(13, (0,), 3, True), *held["a"].steps)
    held["b"] = holds("b", HeldStep(13, (0, 1), 3, True), *held["b"].steps)
    del held["c"]
    assert newest_assemblable(held) == (12, ("a", "b"))
    held = ring_of_three(12)
    held["a"] = holds("a", HeldStep(13, (0, 2), 3, True), *held["a"].steps)
    held["b"] = holds("b", HeldStep(13, (0, 1), 3, True), *held["b"].steps)
    assert newest_assemblable(held)[0] == 13


def test_no_manifest_among_the_holders_means_not_assemblable():
    held = {"a": holds("a", HeldStep(5, (0, 1), 0, False)),
            "b": holds("b", HeldStep(5, (0, 1), 0, False))}
    assert newest_assemblable(held) == (-1, ())


def test_manifests_that_disagree_on_the_world_size_are_not_trusted():
    held = {"a": holds("a", HeldStep(5, (0, 1), 2, True)),
            "b": holds("b", HeldStep(5, (0, 1, 2), 3, True))}
    assert newest_assemblable(held) == (-1, ())


def test_nothing_held():
    assert newest_assemblable({}) == (-1, ())
    assert newest_complete({}, 1, ("a", "b")) == -1


def runs(generation: int = 1, **spans: tuple[int, int]) -> dict[str, SnapshotHoldings]:
    """Each node's published run of replicated steps, and nothing held (it does not count)."""
    return {node: SnapshotHoldings(node, f"{node}:1", (), REV, generation, since, through)
            for node, (since, through) in spans.items()}


def test_a_step_is_complete_once_inside_every_members_run_of_replicated_steps():
    # Published at different moments: a's says 9..14, b's (older) 9..10, c's 9..12.
    held = runs(a=(9, 14), b=(9, 10), c=(9, 12))
    assert newest_complete(held, 1, ("a", "b", "c")) == 10
    # Nothing the members hold now overlaps (a holds 13-14, b 9-10): the runs still tell.
    held = runs(a=(9, 14), b=(9, 10))
    held["a"] = dataclasses.replace(held["a"], steps=(HeldStep(13, (0, 1), 2, True),
                                                      HeldStep(14, (0, 1), 2, True)))
    assert newest_complete(held, 1, ("a", "b")) == 10


def test_a_member_without_a_run_in_this_generation_means_nothing_is_known_complete():
    assert newest_complete(runs(a=(9, 14), b=(-1, -1)), 1, ("a", "b")) == -1
    assert newest_complete(runs(a=(9, 14)), 1, ("a", "b")) == -1       # b published nothing
    old = runs(a=(9, 14)) | runs(0, b=(3, 8))                            # b's is generation 0's
    assert newest_complete(old, 1, ("a", "b")) == -1
    # Non-members do not count, and a single member can never hold a second copy.
    assert newest_complete(runs(a=(9, 14), b=(9, 10), z=(-1, -1)), 1, ("a", "b")) == 10
    assert newest_complete(runs(a=(9, 14)), 1, ("a",)) == -1


def test_runs_that_do_not_meet_name_no_complete_step():
    """b's part of step 12 never reached its buddy: its run restarted at 13. a's publication
    still ends at 11, so no step lies in both."""
    assert newest_complete(runs(a=(9, 11), b=(13, 15)), 1, ("a", "b")) == -1
    assert newest_complete(runs(a=(9, 16), b=(13, 15)), 1, ("a", "b")) == 15


def failed_b(**changes):
    """b's agent died (its key and holdings are gone, its probe failed) in generation 1."""
    return snap(members=("a", "c"), missing_since={"b": NOW - 1},
                probes={"b": ProbeResult(False, NOW - 0.5)}, **changes)


def test_a_failure_restores_the_newest_snapshot_the_survivors_hold():
    held = ring_of_three(41)
    del held["b"]
    start = only(decide(failed_b(holdings=held)), StartGeneration)
    r = start.plan.restore
    assert (r.source, r.step, r.locations) == ("snapshot", 41, ("a", "c"))
    # The durable checkpoint a failed snapshot load must fall back to, carried in the plan.
    assert r.checkpoint_step == 40
    assert Plan.from_json(start.plan.to_json()).restore == r


def test_a_snapshot_older_than_the_durable_checkpoint_is_not_used():
    held = ring_of_three(39)  # the checkpoint is at 40
    del held["b"]
    r = only(decide(failed_b(holdings=held)), StartGeneration).plan.restore
    assert (r.source, r.step) == ("checkpoint", 40)


def test_a_snapshot_of_the_checkpoints_step_is_preferred_memory_is_faster():
    held = ring_of_three(40)
    del held["b"]
    r = only(decide(failed_b(holdings=held)), StartGeneration).plan.restore
    assert (r.source, r.step) == ("snapshot", 40)


def test_holdings_of_a_node_that_is_no_member_do_not_count():
    # b's holdings record outlived its key for a moment (watch order): it must not be used.
    held = ring_of_three(41)
    held["c"] = holds("c", HeldStep(41, (2,), 3, True))  # rank 1 only on b
    r = only(decide(failed_b(holdings=held)), StartGeneration).plan.restore
    assert (r.source, r.step) == ("checkpoint", 40)


def test_snapshots_of_an_earlier_job_submission_are_never_restored():
    held = {n: holds(n, *h.steps, job=REV - 1) for n, h in ring_of_three(41).items()}
    del held["b"]
    r = only(decide(failed_b(holdings=held)), StartGeneration).plan.restore
    assert (r.source, r.step) == ("checkpoint", 40)


def test_a_restore_that_loses_steps_says_why_memory_could_not_serve_it():
    held = ring_of_three(41)
    del held["b"], held["c"]  # b's only copy was on c
    s = snap(members=("a",), missing_since={"b": NOW - 1, "c": NOW - 1},
             probes={n: ProbeResult(False, NOW - 0.5) for n in "bc"}, holdings=held)
    r = only(decide(s), StartGeneration).plan.restore
    assert (r.source, r.step) == ("checkpoint", 40)
    assert r.reason == "no snapshot the live nodes hold whole is newer"


def test_a_step_far_beyond_what_the_job_reached_is_never_restored():
    """Defence in depth behind the keepers' own window (copy_admission.py): even if the live
    members held a whole forged step far in the future, the leader restores the newest step
    within the window after the progress it has seen."""
    held = ring_of_three(41)
    del held["b"]
    forged = HeldStep(99_999_999, (0, 1, 2), 3, True)
    held["a"] = holds("a", forged, *held["a"].steps)
    r = only(decide(failed_b(holdings=held)), StartGeneration).plan.restore
    assert (r.source, r.step) == ("snapshot", 41)
    # Progress is at 42 (snap's default); a step within the window of it is still restored.
    held["a"] = holds("a", HeldStep(44, (0, 1, 2), 3, True), *held["a"].steps)
    r = only(decide(failed_b(holdings=held)), StartGeneration).plan.restore
    assert (r.source, r.step) == ("snapshot", 44)
