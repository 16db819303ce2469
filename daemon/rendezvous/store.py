"""A c10d `Store` on etcd v3, for torchrun's agents: one etcd key per store key under the
run's `rendezvous/store/` prefix.

torchrun's agent uses the store its rendezvous returns to agree on worker ranks, to publish the
address of rank 0 (MASTER_ADDR/MASTER_PORT) and for its exit barrier: a few keys per round, so
every operation is a plain etcd call. `get` and `wait` block until the key exists (a watch, not
polling) or the store's timeout passes; `add` and `compare_set` are compare-and-set loops on the
key's mod revision, so concurrent agents never lose an update. Reads and puts are retried while
etcd does not answer (retry.py); `add` and `compare_set` are not, since a repeat of one that
was applied but whose answer was lost would apply it twice.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from daemon.control.etcd_sync import KeyTimeout, SyncEtcd
from daemon.rendezvous.retry import EtcdSilent, Retry

T = TypeVar("T")


def _bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    def __init__(self, etcd: SyncEtcd, prefix: bytes,
                 timeout: timedelta = timedelta(seconds=300), retry: Retry | None = None) -> None:
        super().__init__()
        self._etcd = etcd
        self._prefix = prefix
        self._retry = retry or Retry()
        self.set_timeout(timeout)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return self._retry.call(fn)
        except EtcdSilent as exc:
            raise dist.DistStoreError(str(exc)) from exc

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _seconds(self, timeout: timedelta | None) -> float:
        return (timeout if timeout is not None else self.timeout).total_seconds()

    def set(self, key: str, value: str | bytes) -> None:
        full, data = self._key(key), _bytes(value)
        self._call(lambda: self._etcd.put(full, data))

    def get(self, key: str) -> bytes:
        try:
            return self._call(lambda: self._etcd.wait_for(self._key(key),
                                                          self._seconds(None))).value
        except KeyTimeout as exc:
            raise dist.DistStoreError(f"store key {key!r}: {exc}") from None

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._seconds(timeout)
        for key in keys:
            try:
                self._call(lambda k=key: self._etcd.wait_for(self._key(k), seconds))
            except KeyTimeout as exc:
                raise dist.DistStoreError(f"store key {key!r}: {exc}") from None

    def check(self, keys: list[str]) -> bool:
        return all(self._call(lambda k=key: self._etcd.get(self._key(k))) is not None
                   for key in keys)

    def add(self, key: str, amount: int) -> int:
        full, tx = self._key(key), self._etcd.tx
        while True:
            kv = self._etcd.get(full)
            value = (int(kv.value) if kv is not None else 0) + amount
            compare = [tx.mod(full) == kv.mod_revision] if kv else [tx.create(full) == 0]
            ok, _ = self._etcd.txn(compare, [tx.put(full, str(value).encode())])
            if ok:
                return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """c10d's semantics: set `desired` if the key holds `expected` (or is absent and
        `expected` is empty); answer what the key holds afterwards (absent: `expected`)."""
        full, tx = self._key(key), self._etcd.tx
        want, new = _bytes(expected), _bytes(desired)
        while True:
            kv = self._etcd.get(full)
            if kv is None and want:
                return want
            if kv is not None and kv.value != want:
                return kv.value
            compare = [tx.mod(full) == kv.mod_revision] if kv else [tx.create(full) == 0]
            ok, _ = self._etcd.txn(compare, [tx.put(full, new)])
            if ok:
                return new

    def delete_key(self, key: str) -> bool:
        return self._etcd.delete(self._key(key))

    def num_keys(self) -> int:
        kvs, _ = self._call(lambda: self._etcd.get_prefix(self._prefix))
        return len(kvs)
