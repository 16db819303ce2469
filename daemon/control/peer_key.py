"""The job submission's peer key: the secret agents authenticate each other's SnapshotPeer calls
with and sign snapshot copies under (daemon/node/copy_admission.py; docs/security.md).

It lives at `/ultrascale-private/<job>/peer_key` (Keys.peer_key), outside the job prefix that
operators and observers read: the etcd RBAC the deployment ships lets only the agents' role read
it. It is bound to one submission, the spec key's mod_revision, and replaced when the job is
submitted again: whichever agent first sees the new submission writes a fresh key, in a
transaction that succeeds only while that spec is current and the stored key is older than it,
so racing agents all end up with the same key and a key never outlives its submission. A call
or a copy made with the previous submission's key is refused.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.view import ClusterView
from daemon.tasks import Backoff

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerKey:
    spec_revision: int  # the job submission it belongs to (the spec key's mod_revision)
    secret: str

    def to_json(self) -> bytes:
        return json.dumps({"spec_revision": self.spec_revision, "secret": self.secret}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PeerKey:
        try:
            value = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"peer_key: not JSON ({exc})") from None
        revision = value.get("spec_revision") if isinstance(value, dict) else None
        secret = value.get("secret") if isinstance(value, dict) else None
        if not isinstance(revision, int) or isinstance(revision, bool) or revision <= 0:
            raise ValueError(f"peer_key: field 'spec_revision' must be an int > 0 "
                             f"(got {revision!r})")
        if not isinstance(secret, str) or len(secret) < 32:
            raise ValueError("peer_key: field 'secret' must be a string of 32 characters or more")
        return cls(revision, secret)


class PeerKeys:
    """This agent's copy of the running submission's peer key, kept current by `run()`."""

    def __init__(self, etcd: Etcd, keys: Keys, view: ClusterView) -> None:
        self.etcd, self.keys, self.view = etcd, keys, view
        self._key: PeerKey | None = None

    def current(self) -> PeerKey | None:
        """The key of the submission this agent's view runs; None before a job is submitted
        or while the key of a new submission is not read yet."""
        spec = self.view.spec
        key = self._key
        return key if spec is not None and key is not None \
            and key.spec_revision == spec.mod_revision else None

    def secret(self) -> str:
        """The bearer secret of SnapshotPeer calls ("" when there is none: calls are refused)."""
        key = self.current()
        return key.secret if key is not None else ""

    async def run(self) -> None:
        backoff = Backoff(initial=0.2, maximum=5.0)
        while True:
            spec = self.view.spec
            revision = spec.mod_revision if spec is not None else 0
            if revision and self.current() is None:
                try:
                    await self._obtain(revision)
                except ETCD_ERRORS as exc:
                    log.debug("peer key of submission %d not read yet (%s); retrying",
                              revision, type(exc).__name__)
                if self.current() is None:
                    await backoff.sleep()
                    continue
            backoff.reset()
            await self.view.wait_for(lambda r=revision: _revision(self.view) != r)

    async def _obtain(self, revision: int) -> None:
        """Read the key of submission `revision`, writing a new one if the stored key is an
        earlier submission's (or there is none)."""
        tx, fresh = self.etcd.tx, PeerKey(revision, secrets.token_urlsafe(32))
        written, _ = await self.etcd.txn(
            [tx.mod(self.keys.spec) == revision, tx.mod(self.keys.peer_key) < revision],
            [tx.put(self.keys.peer_key, fresh.to_json())])
        if written:
            self._key = fresh
            log.info("new peer key for job submission %d", revision)
            return
        stored = await self.etcd.get(self.keys.peer_key)
        if stored is None:
            return  # the spec changed meanwhile: the caller looks again
        try:
            key = PeerKey.from_json(stored.value)
        except ValueError as exc:
            log.warning("ignoring %s: %s", self.keys.peer_key.decode(), exc)
            return
        if key.spec_revision == revision:
            self._key = key


def _revision(view: ClusterView) -> int:
    return view.spec.mod_revision if view.spec is not None else 0
