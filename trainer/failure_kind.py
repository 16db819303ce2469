"""Whose fault a failed generation is: another rank's ("peer") or this rank's own ("local").

The agent blames nobody here for a peer failure (the rank that is gone or hung is elsewhere)
and this node for a local one (its data, disk, or a bug). The error text is all a worker keeps
of an exception (the exception itself pins the old process group), so the decision is made on
"TypeName: message", as the worker reports it.
"""

from __future__ import annotations

import re
from typing import Literal

Kind = Literal["peer", "local", "storage", "disk", "diverged"]

# torch.distributed's own error types for a broken rendezvous or store connection, and this
# worker's for an agent that stopped answering.
PEER_TYPES = ("DistNetworkError", "DistStoreError", "AgentUnreachable", "PeerStorageNotShared")
# A checkpoint directory this rank cannot see, or a durable checkpoint spread over node-local
# directories that a restore needs: no retry can fix either (trainer/shared_storage.py).
STORAGE_TYPES = ("StorageNotShared", "CheckpointFragmented")
# train.max_skipped_steps non-finite steps in a row (trainer/nonfinite.py): every rank sees it at
# the same step, and a restore would replay the same steps, so the job fails at once.
DIVERGED_TYPES = ("NonFiniteSteps",)
# The filesystem itself failed (full, read-only, I/O errors): the job's shared storage, not this
# node, so nobody is blamed; a repeat at the same step fails the job with the cause.
DISK_PATTERNS = re.compile(
    r"no space left on device|disk quota exceeded|read-only file system|input/output error"
    r"|\[errno (28|122|30|5)\]",
    re.IGNORECASE,
)

PEER_PATTERNS = re.compile(
    "|".join(
        (
            # gloo (third_party/gloo/gloo/transport/tcp): a peer's socket went away or stalled
            r"connection closed by peer",
            r"connection reset by peer",
            r"broken pipe",
            r"timed out waiting \d+ ?ms for (recv|send) operation",
            r"socket timeout",
            r"\b(read|write) error \[",
            # c10d TCPStore and rendezvous
            r"client socket has timed out",
            r"wait timeout after \d+ ?ms",
            r"connection refused",
            r"failed to recv, got 0 bytes",
            # nccl (ProcessGroupNCCL / NCCLUtils)
            r"watchdog caught collective operation timeout",
            r"nccl communicator was aborted",
            r"remote process exited",
            r"ncclremoteerror",
        )
    ),
    re.IGNORECASE,
)


def classify_failure(text: str) -> Kind:
    """'peer' for a failed collective, rendezvous, store or agent call; 'storage' for a
    checkpoint directory that is not shared or a checkpoint a restore needs that is in pieces
    on node-local directories; 'disk' for a failing filesystem; 'diverged' for a run of
    non-finite steps; 'local'
    otherwise."""
    error_type = text.split(":", 1)[0].strip()
    if error_type in STORAGE_TYPES:
        return "storage"
    if error_type in DIVERGED_TYPES:
        return "diverged"
    if DISK_PATTERNS.search(text):
        return "disk"
    if error_type in PEER_TYPES or PEER_PATTERNS.search(text):
        return "peer"
    return "local"
