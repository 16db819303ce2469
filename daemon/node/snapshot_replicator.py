"""Sending this node's snapshot files to the peers that keep copies (docs/snapshots.md): every
shard its workers wrote to its buddy, and the coordinator's `.metadata` and manifest to every
member, over the peers' SnapshotPeer service; and how far that got (daemon/node/replication_run.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotManifest,
    chunk_checksums,
)
from daemon.control.peer_key import PeerKey
from daemon.control.snapshot_steps import buddy_of
from daemon.control.view import ClusterView
from daemon.node.copy_admission import signed_as
from daemon.node.replication_run import ReplicationRun
from daemon.node.snapshot_files import Incoming, file_pieces, size_of

log = logging.getLogger(__name__)

# send(address, header, pieces): one file to a peer, returning once the peer kept it
# (SnapshotPeer.Replicate, daemon/api/replication_streams.py).
Send = Callable[[str, Incoming, AsyncIterator[bytes]], Awaitable[None]]


class Replicator:
    def __init__(self, node: str, view: ClusterView, send: Send,
                 peer_key: Callable[[], PeerKey | None]) -> None:
        self.node, self.view, self.send, self.peer_key = node, view, send, peer_key
        # (step, file) -> {node: the chunk checksums of the copy it acknowledged}: a step
        # trained again after a restore is new content under the same name, and goes again.
        self.sent: dict[tuple[int, str], dict[str, tuple[int, ...] | None]] = {}
        self.metadata_sent: dict[str, tuple[int, object]] = {}  # node -> (size, chunks) it has
        self.failing: set[str] = set()  # peers the last send to failed
        self.retry = False  # a send failed: try again at the next poll
        self.run = ReplicationRun()

    def forget(self, newer_than: int = -1) -> None:
        """Forget what was sent of the steps newer than `newer_than` (default: everything):
        the peers freed them."""
        self.sent = {k: v for k, v in self.sent.items() if k[0] <= newer_than}
        if newer_than < 0:
            self.metadata_sent.clear()
            self.run = ReplicationRun()

    def forget_older(self, oldest_kept: int) -> None:
        self.sent = {k: v for k, v in self.sent.items() if k[0] >= oldest_kept}

    async def replicate(self, step: int, directory: Path, shards: list[FileEntry],
                        manifest: SnapshotManifest | None) -> None:
        """Send `shards` (whole ones this node's workers wrote) of `step` to the buddy and, when
        this node wrote it, the `manifest` to every member; then note whether this node's part
        of the step is replicated: every shard of its ranks, and the manifest where rank 0 runs."""
        plan = self.view.plan
        if plan is not None and step > plan.restore.step and self.run.generation != \
                plan.generation:
            # A step newer than the one this generation restores, while this node's workers
            # have not restored yet: the replaced history's, which their restore frees.
            self.retry = True
            return
        buddy = buddy_of(self.node, plan.nodes, self.view.nodes) if plan is not None else None
        own = {r.global_rank for r in plan.ranks_of(self.node)} if plan is not None else set()
        done = set()
        # Only what peers accept from this node (copy_admission.py): shards of the ranks it
        # trains now, and the manifest where rank 0 runs; not what its workers wrote of other
        # ranks in an earlier generation.
        for entry in shards:
            if entry.rank in own and buddy is not None and \
                    await self._send_to(buddy, step, directory, entry):
                done.add(entry.rank)
        if manifest is not None and 0 in own and \
                await self._send_manifest(step, directory, manifest):
            done.add(-1)
        self.run.saw(step, bool(own) and buddy is not None
                     and done >= own | ({-1} if 0 in own else set()))

    async def _send_manifest(self, step: int, directory: Path,
                             manifest: SnapshotManifest) -> bool:
        """.metadata, then the manifest, to every member; whether every live member has them
        now. The metadata is the same for every step of a generation: a member sent it for an
        earlier step links that copy when the manifest arrives (and refuses the manifest when it
        cannot)."""
        plan, metadata = self.view.plan, manifest.file(METADATA_NAME)
        try:
            blob = (directory / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            return False  # the step was freed meanwhile (a restore, a new job)
        entry = FileEntry(MANIFEST_NAME, -1, len(blob), chunk_checksums(blob))
        everywhere = True
        for node in sorted(set(plan.nodes) if plan else ()):
            if node == self.node or node not in self.view.nodes:
                continue
            if self.metadata_sent.get(node) != (metadata.size, metadata.chunks) and \
                    self.sent.get((step, MANIFEST_NAME), {}).get(node) != entry.chunks:
                if not await self._send_to(node, step, directory, metadata):
                    everywhere = False
                    continue
                self.metadata_sent[node] = (metadata.size, metadata.chunks)
            if not await self._send_to(node, step, directory, entry):
                self.metadata_sent.pop(node, None)  # send it again with the next try
                everywhere = False
        return everywhere

    async def _send_to(self, node: str, step: int, directory: Path, entry: FileEntry) -> bool:
        """Whether `node` has the file now (sent before, or by this call)."""
        done = self.sent.setdefault((step, entry.path), {})
        if done.get(node) == entry.chunks:
            return True
        member = self.view.nodes.get(node)
        if member is None or size_of(directory / entry.path) != entry.size:
            return False  # gone, or the file was freed meanwhile
        header = signed_as(self.node, self.view, self.peer_key(),
                           Incoming(step, entry.path, entry.size, entry.chunks, entry.rank))
        if header is None:  # no job runs, or the submission's peer key is not here yet
            self.retry = True
            return False
        try:
            await self.send(member.record.address, header, file_pieces(directory / entry.path))
        except Exception as exc:  # noqa: BLE001 - a peer's failure must not end the keeper
            # Once per peer until a send works again: retries come every poll.
            (log.debug if node in self.failing else log.warning)(
                "snapshot step %d: sending %s to %s failed: %s", step, entry.path, node,
                str(exc)[:300])
            self.failing.add(node)
            self.retry = True
            return False
        if node in self.failing:
            self.failing.discard(node)
            log.info("snapshot step %d: sending to %s works again", step, node)
        done[node] = entry.chunks
        return True
