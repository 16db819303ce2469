"""When to stop retrying: the crash-loop rule and the retry backoff of the leader (pure).

A failure that recurs with the same cause must not re-form the same world forever. The
failures since the last progress past the failing step are kept in `status` (decide.py); the
last `limit` of them decide:
- they all implicate the same node(s), and not the whole world → cordon those nodes;
- otherwise, they all happened at the same step → the job fails with the cause;
- `2 × limit` failures in a row without progress fail the job whatever their steps.
"""

from __future__ import annotations

from daemon.control.records import FailureRecord
from parallel.job import FaultConfig

_MAX_CAUSE = 500  # characters of a cause kept in the status


def retry_delay(fault: FaultConfig, failures: int) -> float:
    """Seconds to wait before re-forming after `failures` consecutive failures.

    The first failure is retried at once (a dead node must cost no more than detection); from
    the second on, the delay doubles from `backoff_s`, capped at `backoff_max_s`.
    """
    if failures <= 1:
        return 0.0
    return min(fault.backoff_max_s, fault.backoff_s * 2 ** (failures - 2))



def crash_loop_verdict(failures: tuple[FailureRecord, ...], limit: int,
                world: set[str]) -> str | tuple[tuple[str, ...], str] | None:
    """None: retry; (nodes, reason): cordon them; a string: fail the job with that cause."""
    if len(failures) < limit:
        return None
    last = failures[-limit:]
    cause = next((f.cause for f in reversed(last) if f.cause), "collectives failed")
    common = set.intersection(*(set(f.nodes) for f in last))
    if common and not world <= common:
        nodes = tuple(sorted(common))
        return nodes, f"failed {limit} times in a row: {cause}"[:_MAX_CAUSE]
    steps = {f.step for f in last}
    if len(steps) == 1:
        return f"workers failed {limit} times in a row at step {steps.pop()}: {cause}"
    if len(failures) >= 2 * limit:
        return f"{len(failures)} failures in a row without progress: {cause}"
    return None
