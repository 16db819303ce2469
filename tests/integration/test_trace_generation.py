"""`python -m tools.trace_generation` follows both paths through a real three-node job (real
etcd, agents and workers, each recording its calls), and the paths stay short and never go
back to a file they left (docs/architecture.md, "Follow one generation change")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def test_both_paths_are_traced_short_and_without_returns(tmp_path: Path) -> None:
    out = tmp_path / "paths.json"
    env = {k: v for k, v in os.environ.items() if k != "ULTRA_TRACE_DIR"}
    proc = subprocess.run([sys.executable, "-m", "tools.trace_generation", "--workdir",
                           str(tmp_path / "work"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    paths = json.loads(out.read_text())
    generation, failure = paths["generation"], paths["failure"]
    assert generation["files"][0] == "daemon/control/view.py", proc.stdout
    assert generation["files"][-1] == "trainer/loop.py", proc.stdout
    assert "daemon/node/worker_service.py" in generation["files"], proc.stdout
    assert len(generation["files"]) <= 10 and generation["returns"] == [], proc.stdout
    assert failure["files"][0] == "trainer/generation.py", proc.stdout
    assert failure["files"][-1] == "daemon/control/decide.py", proc.stdout
    assert len(failure["files"]) <= 8 and failure["returns"] == [], proc.stdout
    # The leader's node and the victim's (its standby took the killed worker's rank): the same.
    for role in ("the leader's node", "the victim's node, its standby worker"):
        assert paths[f"generation on {role}"]["files"] == generation["files"], proc.stdout
        assert paths[f"generation on {role}"]["returns"] == [], proc.stdout
