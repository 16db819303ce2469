"""Which snapshot copies a node accepts from its peers (docs/snapshots.md, "Who is accepted").

Every file a peer sends over SnapshotPeer.Replicate starts with a header that names the file and
its chunk checksums, the node that sends it, the job submission and the generation it belongs
to, and an HMAC-SHA256 of all of those under the submission's peer key (daemon/control/
peer_key.py). A node keeps a copy only when
- a job runs (a plan and a spec exist), the copy is of that submission, signed with its key,
  and of the running generation;
- the sender is the node the running plan says writes the file (a rank's shard: the node that
  trains the rank; `.metadata` and the manifest: rank 0's node), it is not this node, and for a
  shard this node is the sender's buddy (daemon/control/snapshot_steps.py::buddy_of);
- the step is plausible: not beyond the window after the newest step this node has seen
  (snapshot_steps.step_horizon), and, when newer than the step the generation restored, only
  once this node's own workers have restored in it (their restore frees the newer steps of the
  replaced history, which a copy must not outlive or be mixed with);
- its declared size is plausible for the plan (`size_bound`).
Anything else is refused with the reason, before a byte of it is written.

The MAC proves the sender holds the submission's key, which only agents can read; it binds the
file's content through its crc32c chunk checksums, which catch accidents, not a forger, so a
copy's content in transit is as safe as the channel (mTLS between agents, docs/security.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Iterable
from typing import Any

from checkpoint.snapshot_format import CHUNK_BYTES, SnapshotInvalid, shard_rank
from daemon.control.peer_key import PeerKey
from daemon.control.snapshot_steps import buddy_of, step_horizon
from daemon.node.snapshot_files import Incoming

# The largest snapshot file a peer may send is this many times the state the plan predicts per
# rank (its fullest device's model and optimizer state, which is about what a shard holds),
# plus SIZE_FLOOR for small models, whose shards are mostly byte items and headers.
SIZE_FACTOR = 4
SIZE_FLOOR = 64 << 20
# A manifest is parsed in memory: a few hundred bytes per rank.
MANIFEST_BOUND = 4 << 20
_MAC_LABEL = "ultrascale-snapshot-copy/1"


def mac(header: Incoming, secret: str) -> bytes:
    """HMAC-SHA256 of every field of `header` but the MAC itself."""
    fields = [_MAC_LABEL, header.sender, header.spec_revision, header.generation, header.step,
              header.file, header.size, CHUNK_BYTES, header.rank, list(header.chunks)]
    message = json.dumps(fields, separators=(",", ":")).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def sign(header: Incoming, key: PeerKey) -> Incoming:
    return dataclasses.replace(header, mac=mac(header, key.secret))


def signed_as(node: str, view: Any, key: PeerKey | None, header: Incoming) -> Incoming | None:
    """`header` as `node` sends it: from it, of its running submission and generation, signed;
    None when it cannot sign (no job runs, or the submission's key is not here yet)."""
    plan, spec = view.plan, view.spec
    if key is None or plan is None or spec is None or key.spec_revision != spec.mod_revision:
        return None
    return sign(dataclasses.replace(header, sender=node, spec_revision=key.spec_revision,
                                    generation=plan.generation), key)


def size_bound(plan: Any, file: str) -> int:
    """The largest size a peer may declare for `file` under `plan` (None when no job runs:
    the floor, though nothing is accepted then)."""
    if file.endswith(".json"):
        return MANIFEST_BOUND
    memory = plan.predicted.memory_bytes if plan is not None else None
    state = memory.params + memory.optimizer if memory is not None else 0
    return SIZE_FACTOR * state + SIZE_FLOOR


def check(header: Incoming, node: str, view: Any, key: PeerKey | None,
          restored_generation: int, own_steps: Iterable[int], own_file: bool) -> None:
    """Raises SnapshotInvalid, naming the copy and the reason, unless `node` accepts it."""
    reason = refusal(header, node, view, key, restored_generation, own_steps, own_file)
    if reason:
        raise SnapshotInvalid(f"{header.where} refused: {reason}")


def refusal(header: Incoming, node: str, view: Any, key: PeerKey | None,
            restored_generation: int, own_steps: Iterable[int], own_file: bool) -> str:
    """Why `node` must not keep the copy `header` announces ("" when it may). `view` is the
    agent's ClusterView, `key` its current peer key, `restored_generation` the newest
    generation its own workers restored in, `own_steps` the steps its own workers wrote here,
    and `own_file` whether the file is here already, written by them."""
    plan, spec = view.plan, view.spec
    if plan is None or spec is None:
        return "no job runs here yet: a copy has no trainer, buddy or submission to belong to"
    submission = spec.mod_revision
    if key is None:
        return f"this node has no peer key of job submission {submission} yet"
    if header.spec_revision != submission:
        return (f"the copy is of job submission {header.spec_revision}, this node runs "
                f"submission {submission}")
    if not hmac.compare_digest(header.mac, mac(header, key.secret)):
        return "its header is not signed with this job submission's peer key"
    if header.generation != plan.generation:
        return (f"the copy is of generation {header.generation}, this node runs generation "
                f"{plan.generation}")
    sender = header.sender
    if sender not in plan.nodes:
        return f"{sender!r} is not a member of generation {plan.generation}"
    trainer = {r.global_rank: r.node for r in plan.ranks}
    rank = shard_rank(header.file)
    if rank is None:
        writer = trainer.get(0)
        if writer == node:
            return f"{header.file} of generation {plan.generation} is written by {node}, this node"
        if sender != writer:
            return f"{header.file} is written by {writer} (rank 0's node), not {sender}"
        if node not in plan.nodes:
            return f"this node is not a member of generation {plan.generation}"
    else:
        owner = trainer.get(rank)
        if owner is None or header.rank != rank:
            return f"rank {header.rank} ({header.file}) is not a rank of generation {plan.generation}"
        if owner == node:
            return f"rank {rank} is trained by {node}, this node: a copy never replaces its own"
        if owner != sender:
            return f"rank {rank} is trained by {owner}, not {sender}"
        buddy = buddy_of(sender, plan.nodes, view.nodes)
        if buddy != node:
            return f"the buddy of {sender} is {buddy}, not this node"
    if own_file:
        return "this node's own file is there: a copy never replaces it"
    # The newest step this node has seen: its own workers' newest snapshot, the job's progress
    # record, the step its generation restored.
    seen = max(view.progress.step, plan.restore.step, *own_steps)
    horizon = step_horizon(seen, plan.job.checkpoint.snapshot_every)
    if header.step > horizon:
        return (f"step {header.step} is beyond step {horizon}: the newest this node has seen "
                f"is {seen}")
    if header.step > plan.restore.step and restored_generation != plan.generation:
        return (f"step {header.step} is newer than step {plan.restore.step}, which generation "
                f"{plan.generation} restores, and this node's workers have not restored it yet")
    return ""
