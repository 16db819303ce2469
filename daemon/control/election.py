"""Leader election with fencing tokens.

The leader key is created under the leader's lease; its create_revision is the fencing token.
Locks in etcd are not mutual exclusion (a paused leader can wake up after its lease expired),
so every leader write is a transaction that also compares the leader key's create_revision
with the writer's token: a stale leader's write fails instead of corrupting state.
"""

from __future__ import annotations

import logging
from typing import Any

from daemon.control.etcd_client import Etcd
from daemon.control.keys import Keys

log = logging.getLogger(__name__)


class NotLeader(Exception):
    """A fenced write was rejected: the writer's token is not the current leader's."""


class Election:
    def __init__(self, etcd: Etcd, keys: Keys, node: str) -> None:
        self.etcd = etcd
        self.keys = keys
        self.node = node
        self.token = 0  # 0: not the leader

    @property
    def is_leader(self) -> bool:
        return self.token != 0

    async def campaign(self, lease_id: int) -> bool:
        """Take the leader key if it is free; True when this agent now leads."""
        key = self.keys.leader
        ok, responses = await self.etcd.txn(
            [self.etcd.tx.create(key) == 0],
            [self.etcd.tx.put(key, self.node.encode(), lease=lease_id)],
            [self.etcd.tx.get(key)],
        )
        if ok:
            # The txn's single put is the key's creation, at the txn's revision.
            self.token = responses[0].response_put.header.revision
            log.info("elected leader (fencing token %d)", self.token)
            return True
        held = responses[0][0][1] if responses and responses[0] else None
        if held is not None and held.value == self.node.encode() and held.lease == lease_id:
            self.token = held.create_revision  # our own key, e.g. after a re-campaign
            return True
        return False

    def drop(self, reason: str) -> None:
        if self.token:
            log.warning("dropping leadership (token %d): %s", self.token, reason)
        self.token = 0

    async def fenced_txn(self, compare: list[Any], success: list[Any],
                         token: int | None = None) -> list[Any]:
        """Run `success` iff the leader key still has `token` (default: ours) and `compare` holds.

        Raises NotLeader when the token is stale (and drops our leadership if it was ours),
        FencedConflict when only `compare` failed; returns the success responses.
        """
        token = self.token if token is None else token
        if not token:
            raise NotLeader("not the leader")
        leader = self.keys.leader
        ok, responses = await self.etcd.txn(
            [self.etcd.tx.create(leader) == token, *compare],
            success,
            [self.etcd.tx.get(leader)],
        )
        if ok:
            return responses
        held = responses[0][0][1] if responses and responses[0] else None
        if held is None or held.create_revision != token:
            if token == self.token:
                self.drop("a fenced write found another leader's token")
            raise NotLeader(f"fencing token {token} is stale")
        raise FencedConflict("a guarded key changed since it was read")


class FencedConflict(Exception):
    """The leader is still us, but a compared key changed concurrently; re-read and retry."""
