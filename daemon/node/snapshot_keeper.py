"""This node's in-memory snapshots, from the agent's side (docs/snapshots.md).

Workers write each snapshot step into the node's shared memory (`root`); the keeper, a task of
the agent, then
- replicates every shard this node's workers wrote to the node's **buddy** (the next node of
  the running generation, in name order, that is alive) and the coordinator's `.metadata` and
  manifest to every member, over the peers' SnapshotPeer service (daemon/node/
  snapshot_replicator.py), and follows how far that got in the running generation;
- answers what the node holds (`holdings`, asked by the leader before it writes a generation,
  which plans a restore from the newest step the live members can assemble), and publishes it
  (`snapshots/<node>`, under the agent's lease, so it vanishes with the node) at most once a
  `publish_period()` (N nodes: once every N snapshot steps, so one put per step for the whole
  job), for metrics and `ultractl`: a put per change, several a step on every node, each a
  watch event to every agent, was a large part of what snapshots cost the agents;
- keeps the newest `keep` steps it holds a manifest for (and anything newer) and frees the rest;
- serves byte ranges of what it holds, to its own workers and to peers.

A peer's copy is kept only when this node accepts it (daemon/node/copy_admission.py), written
to a temporary file verified chunk by chunk as it arrives and renamed into place when whole;
what a restoring worker reads is verified again, end to end, by its reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotManifest,
    parse_step_dir,
    private_dirs,
    read_held,
    record_name,
    record_rank,
    shard_rank,
    snapshot_root,
    step_dir,
)
from checkpoint.snapshot_store import SnapshotStore
from daemon.config import AgentConfig
from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.peer_key import PeerKey
from daemon.control.records import HeldStep, SnapshotHoldings
from daemon.control.snapshot_steps import newest_assemblable, peers_holding
from daemon.control.view import ClusterView
from daemon.node import copy_admission
from daemon.node.holdings_pacer import HoldingsPacer
from daemon.node.snapshot_files import (
    Incoming,
    IncomingFile,
    ParsedFiles,
    parse_step_manifest,
    size_of,
)
from daemon.node.snapshot_replicator import Replicator, Send

log = logging.getLogger(__name__)

# step -> (its directory, the names in it); plain strings, not pathlib (ParsedFiles says why)
Listing = dict[int, tuple[str, frozenset[str]]]

# on_held(bytes held here, newest step the live members can assemble (-1: none), job's step)
OnHeld = Callable[[int, int, int], None]


class SnapshotKeeper:
    def __init__(self, root: Path, node: str, address: str, view: ClusterView, etcd: Etcd,
                 keys: Keys, send: Send, lease: Callable[[], int], keep: int = 2,
                 poll_s: float = 0.05, on_held: OnHeld = lambda *_: None,
                 publish_s: float = 0.5, base: Path | None = None,
                 peer_key: Callable[[], PeerKey | None] = lambda: None) -> None:
        self.root, self.node, self.address = Path(root), node, address
        self.base = self.root if base is None else Path(base)  # see private_dirs
        self.on_held, self.pacer = on_held, HoldingsPacer(publish_s)
        self.view, self.etcd, self.keys = view, etcd, keys
        self.lease, self.keep, self.poll_s, self.peer_key = lease, keep, poll_s, peer_key
        self.wake = asyncio.Event()
        self.replicator = Replicator(node, view, send, peer_key)
        # (step, name) of every copy received from a peer, and of its shard record
        self._received: set[tuple[int, str]] = set()
        self._received_pending = False  # copies came in since the last pass
        self._passed_at = 0.0  # monotonic time of the last pass
        self._spec_revision = 0  # the job submission the snapshots here belong to
        self._parsed = ParsedFiles()
        self._last_signature: tuple[object, ...] = ()
        # step -> (its own names, see _own; the cluster context) when all of it was last sent
        self._replicated: dict[int, tuple[frozenset[str], tuple[object, ...]]] = {}
        self._retry = False  # a publication failed: work again at the next poll
        self._retry_failing = False  # the last publication failed (logged once until one works)
        self._purge_due = True  # a restore discarded newer steps (SnapshotStore.free_after)
        self.bytes_held = 0

    @classmethod
    def for_agent(cls, config: AgentConfig, view: ClusterView, etcd: Etcd, keys: Keys,
                  send: Send, lease: Callable[[], int], on_held: OnHeld,
                  peer_key: Callable[[], PeerKey | None]) -> SnapshotKeeper | None:
        """The keeper of an agent that runs workers (None for a control-plane-only agent)."""
        if not config.workers:
            return None
        root = snapshot_root(config.job, config.snapshot_base) / config.node_id
        return cls(root, config.node_id, "", view, etcd, keys, send, lease, on_held=on_held,
                   base=config.snapshot_base, peer_key=peer_key)

    @staticmethod
    def env(keeper: SnapshotKeeper | None) -> dict[str, str]:
        """The workers' environment: where they write snapshots (unset: they take none)."""
        return {"ULTRA_SNAPSHOT_ROOT": str(keeper.root)} if keeper is not None else {}

    # -- lifecycle ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Free everything, at agent start (what a crashed run left) and at a clean stop."""
        private_dirs(self.base, self.root)  # first: refuses a directory another user controls
        shutil.rmtree(self.root, ignore_errors=True)

    async def run(self) -> None:
        private_dirs(self.base, self.root)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await self.wake.wait()
            self.wake.clear()
            if self._purge_due:
                await self.purge_discarded()
            listing = self._listing()
            self._note_newest(listing, time.monotonic())
            signature = self._signature(listing)
            changed = self._pass_due(signature, time.monotonic())
            if changed:
                if self._follow_job():
                    listing = self._listing()
                await self._replicate(listing, signature[1:])
                if self._prune(listing):
                    listing = self._listing()
                self._last_signature = self._signature(listing)
            if changed or self.pacer.due_again(len(self.view.nodes), time.monotonic()):
                try:
                    await self._publish()
                except ETCD_ERRORS as exc:
                    # Retried every poll while etcd is away: said once, not twenty times a second.
                    (log.debug if self._retry_failing else log.warning)(
                        "snapshot holdings not published (%s); retrying", type(exc).__name__)
                    self._retry = self._retry_failing = True
                else:
                    if self._retry_failing:
                        log.info("snapshot holdings published again")
                    self._retry_failing = False
                live = {n: h for n, h in self.view.snapshots.items()
                        if n in self.view.nodes and h.spec_revision == self._spec_revision}
                self.on_held(self.bytes_held, newest_assemblable(live)[0],
                             self.view.progress.step)

    def publish_period(self) -> float:
        """How long a routine change of the holdings waits (daemon/node/holdings_pacer.py)."""
        return self.pacer.period(len(self.view.nodes))

    def _note_newest(self, listing: Listing, now: float) -> None:
        self.pacer.note_newest(max(listing, default=-1), now)

    def _pass_due(self, signature: tuple[object, ...], now: float) -> bool:
        """Whether this poll makes a pass (and note it made one): this node's workers finished a
        shard, or rank 0 a manifest; a step was freed; the cluster changed (a new generation, a
        node came or went); a send must be retried; or copies came in from peers, which wait
        for the next pass, at most a `publish_s` (nothing about them is urgent)."""
        if signature == self._last_signature and not (self._retry or self.replicator.retry) \
                and not (self._received_pending and now >= self._passed_at + self.pacer.publish_s):
            return False
        self._retry = self.replicator.retry = self._received_pending = False
        self._passed_at = now
        return True

    def _listing(self) -> Listing:
        """Each step directory held here and the names in it: one listing per poll, shared by
        everything the poll does. Names, not mtimes: files appear by create or rename, and
        without multigrain timestamps (older kernels) a directory's mtime comes from a coarse
        clock, so two files created within one tick (milliseconds) would leave it unchanged."""
        found: Listing = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                step = parse_step_dir(entry.name)
                if step is not None:
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        found[step] = (entry.path, frozenset(os.listdir(entry.path)))
        return found

    def _own(self, step: int, names: frozenset[str]) -> frozenset[str]:
        """The names in a step's listing that call for a pass: records of shards this node's
        workers finished (written once the shard is whole) and a manifest written here; not a
        shard being written, a temporary file or a peer's copy (twice the passes, before)."""
        return frozenset(n for n in names if n.endswith(".json")
                         and (step, n) not in self._received)

    def _signature(self, listing: Listing) -> tuple[object, ...]:
        """What the keeper's work depends on, cheaply: the steps held and what this node wrote
        of each, the generation, the live nodes, the lease and the job. Unchanged, a poll does
        nothing (most polls, between two steps)."""
        spec = self.view.spec
        own = ((step, self._own(step, names)) for step, (_, names) in listing.items())
        return (tuple(sorted((step, names) for step, names in own if names)),
                self.view.generation, tuple(sorted(self.view.nodes)), self.lease(),
                spec.mod_revision if spec is not None else 0)

    def _follow_job(self) -> bool:
        """A new job submission makes every snapshot held here worthless: free them (True when
        it did)."""
        spec = self.view.spec
        revision = spec.mod_revision if spec is not None else 0
        freed = False
        if revision != self._spec_revision:
            if self._spec_revision:
                self.clear()
                private_dirs(self.base, self.root)
                self.replicator.forget()
                self._received.clear()
                self._replicated.clear()
                freed = True
            self._spec_revision = revision
        return freed

    def restored(self, generation: int, step: int) -> None:
        """This node's workers of `generation` restored `step` and discarded every newer one
        (on every member): what was sent or received of those steps was the replaced
        history's. Removing what they discarded is the next poll's (`purge_discarded`)."""
        self._purge_due = True
        self.wake.set()
        run = self.replicator.run
        if generation == run.generation:
            return
        run.follow(generation, step)
        self.replicator.forget(newer_than=step)
        self._received = {k for k in self._received if k[0] <= step}
        # Newer steps will be trained again: the same names, new content.
        self._replicated = {k: v for k, v in self._replicated.items() if k <= step}

    async def purge_discarded(self) -> None:
        """Remove the step directories a restoring worker renamed away: its restore does not
        wait for their removal (SnapshotStore.free_after), and this loop does not either (a
        thread removes them)."""
        self._purge_due = False
        await asyncio.to_thread(SnapshotStore(self.root).purge_discarded)

    # -- what is here -------------------------------------------------------------------------

    def _record(self, directory: str, rank: int) -> FileEntry | None:
        name = record_name(rank)
        value = self._parsed.get(os.path.join(directory, name),
                             lambda raw: FileEntry.from_json(json.loads(raw), name))
        return value if isinstance(value, FileEntry) else None

    def held(self) -> tuple[HeldStep, ...]:
        """Every step with at least one whole shard or a manifest here, oldest first."""
        out, total = [], 0
        for step, (directory, names) in sorted(self._listing().items()):
            manifest = self._manifest(directory, step)
            ranks = []
            for name, rank in ((n, shard_rank(n)) for n in names):
                entry = self._record(directory, rank) if rank is not None else None
                size = size_of(os.path.join(directory, name)) if entry is not None else -1
                if entry is not None and size == entry.size:  # a record follows a whole shard
                    ranks.append(rank)
                    total += size
            metadata = manifest is not None and manifest.file(METADATA_NAME).size == \
                size_of(os.path.join(directory, METADATA_NAME))
            if ranks or metadata:
                out.append(HeldStep(step, tuple(sorted(ranks)),
                                    manifest.world_size if manifest else 0, metadata))
        self.bytes_held = total
        return tuple(out)

    def _manifest(self, directory: str, step: int) -> SnapshotManifest | None:
        value = self._parsed.get(os.path.join(directory, MANIFEST_NAME),
                                 lambda raw: parse_step_manifest(raw, step))
        return value if isinstance(value, SnapshotManifest) else None

    def read(self, step: int, file: str, offset: int, length: int) -> bytes | None:
        """Raw bytes of a file held here (None: not here). Readers verify them themselves."""
        return read_held(self.root, step, file, offset, length)

    def holders(self, step: int, file: str) -> list[str]:
        """Addresses of live peers to read `file` of `step` from, most likely first: those
        whose published holdings list it, then the nodes the plan restores from (published
        holdings lag by up to `publish_period()`; the plan's come from asking every member)."""
        rank = shard_rank(file)
        rank = record_rank(file) if rank is None else rank
        peers = {n: h for n, h in self.view.snapshots.items()
                 if n != self.node and n in self.view.nodes}
        plan = self.view.plan
        planned = tuple(n for n in plan.restore.locations if n != self.node and n in
                        self.view.nodes) if plan is not None and plan.restore.source == \
            "snapshot" and plan.restore.step == step else ()
        return [peers[n].address if n in peers else self.view.nodes[n].record.address
                for n in peers_holding(peers, step, rank, planned)]

    def holdings(self) -> SnapshotHoldings:
        """What this node holds now."""
        run = self.replicator.run
        since, through = run.span()
        return SnapshotHoldings(self.node, self.address, self.held(), self._spec_revision,
                                run.generation, since, through)

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, header: Incoming) -> IncomingFile:
        """Start receiving a peer's copy; SnapshotInvalid (the reason) when it is refused."""
        self._admit(header)
        return IncomingFile(step_dir(self.root, header.step), header)

    def accept(self, incoming: IncomingFile) -> None:
        """Put a received copy in place once whole, verified and still accepted (the plan may
        have changed while it streamed); else discard it and raise SnapshotInvalid."""
        try:
            self._admit(incoming.header)
            placed = incoming.place(self._manifest)
        except BaseException:
            incoming.discard()
            raise
        self._received.update((incoming.header.step, name) for name in placed)
        self._received_pending = True

    def _admit(self, header: Incoming) -> None:
        listing = self._listing()
        names = listing.get(header.step, ("", frozenset()))[1]  # own names are never replaced
        copy_admission.check(
            header, self.node, self.view, self.peer_key(), self.replicator.run.generation,
            own_steps=[step for step, (_, held) in listing.items() if self._own(step, held)],
            own_file=header.file in names and (header.step, header.file) not in self._received)

    # -- replicating --------------------------------------------------------------------------

    async def _replicate(self, listing: Listing, context: tuple[object, ...]) -> None:
        """Send what this node wrote of its newest steps. A step whose files and cluster
        `context` are as they were when all of it was sent is not looked at again."""
        for step in sorted(listing)[-(self.keep + 1):]:
            directory, names = listing[step]
            own = self._own(step, names)
            if self._replicated.get(step) == (own, context):
                continue
            shards = []
            for name in sorted(names):
                rank = shard_rank(name)
                if rank is None or (step, name) in self._received:
                    continue
                entry = self._record(directory, rank)
                if entry is not None and size_of(os.path.join(directory, name)) == entry.size:
                    shards.append(entry)
            manifest = self._manifest(directory, step) if MANIFEST_NAME in names and \
                (step, MANIFEST_NAME) not in self._received else None
            failed_before, self.replicator.retry = self.replicator.retry, False
            await self.replicator.replicate(step, Path(directory), shards, manifest)
            if self.replicator.retry:
                self._replicated.pop(step, None)
            else:
                self._replicated[step] = (own, context)
            self.replicator.retry |= failed_before

    # -- retention and publication ------------------------------------------------------------

    def _prune(self, listing: Listing) -> bool:
        """Keep the newest `keep` steps with a manifest here and anything newer; and never more
        than `keep + 2` steps in all, so a node whose manifests stop arriving (its peers are
        gone) still does not fill its memory. True when it freed a step."""
        steps = sorted(listing)
        with_manifest = [s for s in steps if MANIFEST_NAME in listing[s][1]
                         and self._manifest(listing[s][0], s) is not None]
        bounds = [steps[-(self.keep + 2)]] if len(steps) > self.keep + 2 else []
        if len(with_manifest) >= self.keep:
            bounds.append(with_manifest[-self.keep])
        if not bounds:
            return False
        oldest_kept = max(bounds)
        freed = False
        for step in steps:
            if step < oldest_kept:
                shutil.rmtree(listing[step][0], ignore_errors=True)
                freed = True
        self.replicator.forget_older(oldest_kept)
        self._parsed.keep_only({listing[s][0] for s in steps if s >= oldest_kept})
        self._received = {k for k in self._received if k[0] >= oldest_kept}
        self._replicated = {k: v for k, v in self._replicated.items() if k >= oldest_kept}
        return freed

    async def _publish(self) -> None:
        """Publish the holdings when they changed: at once for a new lease, job or generation,
        else at most once a `publish_period()`."""
        lease = self.lease()
        if not lease:
            return
        # A generation's restore, and its first replicated step, are news at once.
        run = self.replicator.run
        context = (lease, self._spec_revision, self.view.generation, run.generation,
                   run.span()[1] >= 0)
        now = time.monotonic()
        # Within the period, not even a look (listing what is held costs stats and parses).
        if self.pacer.holds_back(context, len(self.view.nodes), now):
            return
        holdings = self.holdings()
        if self.pacer.published == (lease, holdings):
            return
        await self.etcd.put(self.keys.snapshot_holdings(self.node), holdings.to_json(),
                            lease=lease)
        self.pacer.sent(lease, holdings, context, now)
