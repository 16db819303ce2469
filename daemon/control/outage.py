"""Is etcd down for everyone, or only for this agent?

An agent whose lease keepalives go unanswered must tell two cases apart: etcd is unreachable
for every member (nobody can change membership, so workers may keep training for the outage
allowance), or only this agent is cut off (the others will soon form a generation without it,
so it must fence itself first). Agents answer the question for each other through the
`etcd` service of their gRPC health endpoint, which `publish_etcd_health` keeps current.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Protocol


class HealthPeers(Protocol):
    async def etcd_health(self, address: str) -> bool | None: ...

    async def set_etcd_health(self, connected: bool) -> None: ...


async def outage_check(io: HealthPeers, peers: list[tuple[str, str]]) -> str | None:
    """None when every peer (name, address) is cut off from etcd too; else why we must fence.

    A few random peers are asked first: when etcd is fine for them (the common case: only our
    own acknowledgements are late) one answer settles it, and N agents whose loops lag at once
    do not flood each other with N² calls. Only if they are all cut off too is everyone asked,
    since holding on needs every peer's word.
    """
    peers = list(peers)
    random.shuffle(peers)
    for batch in (peers[:3], peers[3:]):
        answers = await asyncio.gather(*(io.etcd_health(a) for _, a in batch))
        for (node, _), answer in zip(batch, answers, strict=True):
            if answer is None:
                return f"{node} did not answer"
            if answer:
                return f"{node} still reaches etcd"
    return None


async def publish_etcd_health(io: HealthPeers, connected: Callable[[], bool]) -> None:
    """Publish whether our keepalives are acknowledged, for peers' outage checks."""
    while True:
        await io.set_etcd_health(connected())
        await asyncio.sleep(0.1)
