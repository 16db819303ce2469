"""The control plane's key layout in etcd (docs/architecture.md, "etcd keys"); values are in
records.py."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def check_name(what: str, value: str) -> str:
    """Names become etcd key segments, so they are restricted to a safe alphabet."""
    if not _NAME.match(value):
        raise ValueError(f"{what} must match {_NAME.pattern} (got {value!r})")
    return value


@dataclass(frozen=True)
class Keys:
    """Keys of one job namespace: `/ultrascale/<job>/...`, which operators and observers may
    read, and `/ultrascale-private/<job>/...`, which only the agents' etcd role may read
    (deploy/: the etcd RBAC)."""

    job: str

    def __post_init__(self) -> None:
        check_name("job", self.job)

    @property
    def prefix(self) -> bytes:
        return f"/ultrascale/{self.job}/".encode()

    def _k(self, rest: str) -> bytes:
        return self.prefix + rest.encode()

    @property
    def spec(self) -> bytes:
        return self._k("spec")

    @property
    def leader(self) -> bytes:
        return self._k("leader")

    @property
    def generation(self) -> bytes:
        return self._k("generation")

    @property
    def progress(self) -> bytes:
        return self._k("progress")

    @property
    def checkpoint(self) -> bytes:
        return self._k("checkpoint")

    @property
    def status(self) -> bytes:
        return self._k("status")

    @property
    def cordons(self) -> bytes:
        return self._k("cordons/")

    def cordon(self, node: str) -> bytes:
        return self.cordons + node.encode()

    @property
    def directive(self) -> bytes:
        """The leader's standing order to the current generation: stop/checkpoint at a step."""
        return self._k("directive")

    @property
    def nodes(self) -> bytes:
        return self._k("nodes/")

    def node(self, node: str) -> bytes:
        return self.nodes + node.encode()

    @property
    def restore(self) -> bytes:
        return self._k("restore")

    @property
    def rendezvous(self) -> bytes:
        """Plain torchrun's rendezvous of run id `job` (daemon/rendezvous/, docs/torchrun.md)."""
        return self._k("rendezvous/")

    @property
    def rendezvous_state(self) -> bytes:
        """torch's rendezvous state, written compare-and-set on its mod revision."""
        return self.rendezvous + b"state"

    @property
    def rendezvous_round(self) -> bytes:
        """A readable summary of the state (records.RendezvousRound), in the same txn."""
        return self.rendezvous + b"round"

    @property
    def rendezvous_store(self) -> bytes:
        """The torchrun agents' c10d store: one key per store key."""
        return self.rendezvous + b"store/"

    @property
    def private_prefix(self) -> bytes:
        return f"/ultrascale-private/{self.job}/".encode()

    @property
    def peer_key(self) -> bytes:
        """The job submission's key for agent-to-agent snapshot calls and copies, replaced
        with each submission (daemon/control/peer_key.py)."""
        return self.private_prefix + b"peer_key"

    @property
    def snapshots(self) -> bytes:
        return self._k("snapshots/")

    def snapshot_holdings(self, node: str) -> bytes:
        return self.snapshots + node.encode()

    @property
    def control(self) -> bytes:
        return self._k("control/")

    def control_request(self, request_id: str) -> bytes:
        return self.control + request_id.encode()

    def relative(self, key: bytes) -> str:
        return key[len(self.prefix):].decode()
