"""The committed generated modules are exactly what `make proto` produces."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto import generate

pytestmark = pytest.mark.unit


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    written = generate.generate(tmp_path)
    assert written, "no .proto found"
    for path in written:
        committed = generate.PROTO_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto`"


def test_generated_modules_import_as_a_package() -> None:
    from proto.ultrascale.v1 import agent_pb2, agent_pb2_grpc

    assert agent_pb2.StepReply(checkpoint_seq=2).checkpoint_seq == 2
    assert hasattr(agent_pb2_grpc, "AgentStub") and hasattr(agent_pb2_grpc, "WorkerControlStub")
