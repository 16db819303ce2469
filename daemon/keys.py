"""The control plane's key layout in etcd (ARCHITECTURE.md, "Control plane") and its values."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

NODE_STATES = ("ready", "draining", "cordoned")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def check_name(what: str, value: str) -> str:
    """Names become etcd key segments, so they are restricted to a safe alphabet."""
    if not _NAME.match(value):
        raise ValueError(f"{what} must match {_NAME.pattern} (got {value!r})")
    return value


@dataclass(frozen=True)
class Keys:
    """Keys of one job namespace: `/ultrascale/<job>/...`."""

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
    def directive(self) -> bytes:
        """The leader's standing order to the current generation: stop/checkpoint at a step."""
        return self._k("directive")

    @property
    def nodes(self) -> bytes:
        return self._k("nodes/")

    def node(self, node: str) -> bytes:
        return self.nodes + node.encode()

    @property
    def control(self) -> bytes:
        return self._k("control/")

    def control_request(self, request_id: str) -> bytes:
        return self.control + request_id.encode()

    def relative(self, key: bytes) -> str:
        return key[len(self.prefix):].decode()


@dataclass(frozen=True)
class NodeRecord:
    """The value of `nodes/<node>`, written by the node's own agent under its lease."""

    node: str
    address: str
    metrics_url: str
    devices: int
    state: str = "ready"
    pid: int = 0
    version: str = ""

    def with_state(self, state: str) -> NodeRecord:
        if state not in NODE_STATES:
            raise ValueError(f"node state must be one of {NODE_STATES} (got {state!r})")
        return replace(self, state=state)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeRecord:
        data: dict[str, Any] = json.loads(raw)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def loads(raw: bytes) -> dict[str, Any]:
    """A JSON object from etcd; anything else (a stray write) reads as empty."""
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
