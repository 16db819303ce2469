"""Fast leader failover: a survivor that confirms the leader's agent dead revokes its lease, so
the others elect a new leader at once instead of waiting out the TTL (docs/architecture.md,
"Failure handling").

Confirmation takes two things: this node's workers saw a collective fail (the world is broken,
so a peer is gone or hung), and the leader's agent does not answer two health probes in a row.
Revoking is safe under the fencing rules: every leader write compares the leader key's
create_revision, so once the key is gone a stale leader can write nothing; its node key goes
with the same lease, so the new leader replaces the generation without it; and an agent that was
only slow finds its lease gone at its next keepalive and fences itself, as after a TTL expiry.
A false alarm therefore costs a generation change, never a second writer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.view import ClusterView

log = logging.getLogger(__name__)

Probe = Callable[[str], Awaitable[bool]]


async def revoke_dead_leader(view: ClusterView, etcd: Etcd, keys: Keys, probe: Probe,
                             node: str, probes: int = 2) -> bool:
    """Revoke the leader's lease when its agent does not answer `probes` probes; True if done."""
    held = view.leader
    if held is None or held[0] == node:
        return False
    leader, token = held
    member = view.nodes.get(leader)
    if member is None:
        return False  # its key is already gone: the election is under way
    for _ in range(probes):
        if await probe(member.record.address):
            return False
    try:
        kv = await etcd.get(keys.leader)
        if kv is None or kv.create_revision != token or not kv.lease:
            return False  # a new leader already
        await etcd.revoke(kv.lease)
    except ETCD_ERRORS as exc:
        log.warning("could not revoke the lease of leader %s (%s): the TTL will", leader,
                    type(exc).__name__)
        return False
    log.warning("leader %s does not answer probes after a failed collective: revoked its lease "
                "(fencing token %d) so a new leader is elected now", leader, token)
    return True
