"""The c10d TCPStore of each generation, hosted by the agent the plan names (the leader).

A store outlives any worker, so a failing worker never takes the rendezvous down with it, and
a fresh port per generation keeps a straggler of the old generation from ever reaching the new
one (docs/architecture.md, "Generations"). torch is imported in a thread when the agent starts
(`preload`), so the first generation change does not wait for it.
"""

from __future__ import annotations

import asyncio
from typing import Any


class StoreHost:
    def __init__(self, host: str, keep: int = 2) -> None:
        self.host = host
        self.keep = keep
        self._stores: dict[int, Any] = {}

    async def open(self, generation: int) -> int:
        """Start the store of `generation` on a fresh port; returns the port."""
        store = await asyncio.to_thread(self._start)
        self._stores[generation] = store
        # Keep the previous generation's store a while: its workers may still be leaving.
        for old in sorted(self._stores)[:-self.keep]:
            del self._stores[old]
        return int(store.port)

    @staticmethod
    def preload() -> None:
        """Import torch.distributed (slow) ahead of the first generation."""
        import torch.distributed  # noqa: F401

    def _start(self) -> Any:
        from torch.distributed import TCPStore

        return TCPStore(self.host, 0, is_master=True, wait_for_workers=False)

    def close(self) -> None:
        self._stores.clear()
