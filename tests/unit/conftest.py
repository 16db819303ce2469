"""Fixtures shared by the unit tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory in shared memory (where snapshots live), removed afterwards."""
    path = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None,
                                 prefix="ultrascale-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
