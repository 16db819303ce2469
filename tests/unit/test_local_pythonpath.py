"""`ultrad local`'s agents import this checkout's packages, installed or not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.cli.local import _pythonpath

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def test_the_agents_path_starts_at_the_checkout_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert _pythonpath() == str(REPO)
    first = Path(_pythonpath().split(os.pathsep)[0])
    for package in ("daemon", "trainer", "checkpoint", "parallel", "models", "proto"):
        assert (first / package / "__init__.py").is_file(), package
    # What the caller had stays, after it.
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    assert _pythonpath() == f"{REPO}{os.pathsep}/opt/site"
