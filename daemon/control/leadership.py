"""Campaign for the leader key whenever it is free (or ours) and lead while elected."""

from __future__ import annotations

from collections.abc import Callable

from daemon.control.election import Election
from daemon.control.etcd_client import ETCD_ERRORS
from daemon.control.leader import Leader
from daemon.control.membership import Membership
from daemon.control.view import ClusterView
from daemon.tasks import Backoff


async def lead_when_elected(node: str, membership: Membership, view: ClusterView,
                            election: Election, leader: Leader, ttl: float,
                            leading: Callable[[bool], None]) -> None:
    """Forever: once joined and synced, campaign while no one else leads; when elected, lead
    until that ends. `leading(True/False)` is told when this node starts and stops leading."""
    backoff = Backoff(initial=0.1, maximum=ttl / 2)
    while True:
        await membership.joined.wait()
        await view.synced.wait()
        if view.leader is None or view.leader[0] == node:
            try:
                won = await election.campaign(membership.lease_id)
            except ETCD_ERRORS:
                await backoff.sleep()
                continue
            backoff.reset()
            if won:
                leading(True)
                try:
                    await leader.lead()
                finally:
                    election.drop("stopped leading")
                    leading(False)
                continue
        await view.wait_for(lambda: view.leader is None, timeout=ttl)
