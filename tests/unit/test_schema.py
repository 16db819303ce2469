"""One decoder for every value of a job's namespace (daemon/control/schema.py): keys classified
by family, each kind's record read back as written (a stray write as the record's default, as
records are parsed leniently), a value that cannot be its record named by its kind, and the
view and the events renderer both going through it (such a value is skipped)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from daemon.api.events import render
from daemon.control.etcd_client import PUT
from daemon.control.keys import Keys
from daemon.control.records import ControlOp, ControlRequest, NodeRecord
from daemon.control.schema import RECORDS, Entry, MalformedRecord, decode, entry
from daemon.control.view import ClusterView

pytestmark = pytest.mark.unit
KEYS = Keys("job")


def _kv(name: str, value: bytes) -> SimpleNamespace:
    return SimpleNamespace(key=KEYS.prefix + name.encode(), value=value, lease=0,
                           create_revision=5, mod_revision=7)


def test_keys_are_classified_by_family() -> None:
    assert entry(KEYS, KEYS.node("a")) == Entry("nodes", "a")
    assert entry(KEYS, KEYS.control_request("r1")) == Entry("control", "r1")
    assert entry(KEYS, KEYS.snapshot_holdings("b")) == Entry("snapshots", "b")
    assert entry(KEYS, KEYS.cordon("c")) == Entry("cordons", "c")
    assert entry(KEYS, KEYS.spec) == Entry("spec")
    assert entry(KEYS, KEYS.rendezvous_round) == Entry("rendezvous/round")
    assert entry(KEYS, KEYS.rendezvous_store + b"k") == Entry("rendezvous/store/k")


@pytest.mark.parametrize("kind", sorted(set(RECORDS) - {"nodes"}))
def test_each_kind_reads_back_its_record_and_a_stray_write_as_its_default(kind: str) -> None:
    record = RECORDS[kind]()
    assert decode(kind, record.to_json()) == record
    assert decode(kind, b"{not json") == record  # records are parsed leniently


def test_a_node_record_needs_its_fields() -> None:
    node = NodeRecord("a", "h:1", "", 1)
    assert decode("nodes", node.to_json()) == node
    with pytest.raises(MalformedRecord, match="nodes"):
        decode("nodes", b"{not json")


def test_the_generation_and_the_leader() -> None:
    assert decode("leader", b"node-a") == "node-a"
    with pytest.raises(MalformedRecord, match="generation"):
        decode("generation", b'{"generation": "x"}')
    with pytest.raises(KeyError):
        decode("rendezvous/state", b"")  # torch's own bytes: no record of ours


def test_the_view_and_the_events_skip_a_malformed_value() -> None:
    view = ClusterView(etcd=None, keys=KEYS)  # type: ignore[arg-type]  # never connected
    good = ControlRequest(op=ControlOp.DRAIN, node="a", time=1.0)
    assert view._apply(_kv("control/r1", good.to_json()), put=True) == "control"
    assert view.control == {"r1": good}
    assert view._apply(_kv("nodes/a", b"[]"), put=True) == ""  # not a node record: skipped
    assert view.nodes == {}
    assert view._apply(_kv("generation", b'{"generation": "x"}'), put=True) == ""
    assert view.plan is None
    node = NodeRecord("a", "h:1", "", 1)
    assert view._apply(_kv("nodes/a", node.to_json()), put=True) == "nodes"
    assert view.nodes["a"].record == node
    assert view._apply(_kv("nodes/a", b""), put=False) == "nodes" and view.nodes == {}

    def event(name: str, value: bytes) -> SimpleNamespace:
        return SimpleNamespace(kv=_kv(name, value), type=PUT,
                               prev_kv=SimpleNamespace(key=b"", value=b""))

    assert render(KEYS, event("generation", b'{"generation": "x"}')) is None
    drained = render(KEYS, event("control/r1", good.to_json()))
    assert drained is not None and drained.message == "drain a requested"
