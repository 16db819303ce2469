"""The `parallel.reproducible` job option: off by default, dp and ZeRO only."""

from __future__ import annotations

import pytest

from parallel.job import ConfigError, loads
from parallel.layout import resolve

pytestmark = pytest.mark.unit

BASE = '[data]\nsource = "python-stdlib"\n[train]\nglobal_batch = 10\n'


def test_off_by_default_and_parsed():
    assert loads(BASE).parallel.reproducible is False
    job = loads(BASE, ["parallel.reproducible=true", "parallel.zero=1"])
    assert job.parallel.reproducible is True
    # Any dp and ZeRO stage, uneven splits included.
    for world in (1, 2, 3, 4):
        assert resolve(job, world).dp == world
    with pytest.raises(ConfigError, match="parallel.reproducible must be bool"):
        loads(BASE, ["parallel.reproducible=1"])


@pytest.mark.parametrize("dim", ["tp", "pp", "cp"])
def test_other_dimensions_are_refused(dim):
    job = loads(BASE, ["parallel.reproducible=true", f"parallel.{dim}=2"])
    with pytest.raises(ConfigError, match=f"parallel.reproducible .* {dim} 2"):
        resolve(job, 4)
