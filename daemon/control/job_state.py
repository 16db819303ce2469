"""The job's state as operators see it (GetStatus, metrics, ultractl wait)."""

from __future__ import annotations

from daemon.control.records import JobState
from daemon.control.view import ClusterView


def job_state(view: ClusterView) -> tuple[JobState, str]:
    """The job's state and its reason: the leader's status when it is about the stored
    submission, else `pending` (a new submission the leader has not planned yet)."""
    if view.spec is None:
        return JobState.NONE, "no job submitted"
    status = view.status
    if status.spec_revision != view.spec.mod_revision:
        return JobState.PENDING, "waiting for the leader to plan the job"
    return status.state, status.reason
