"""What SubmitJob stores: `prepare_spec` checks the layout on the smallest world the job could
run on before anything reaches etcd."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.control.job_submit import prepare_spec
from parallel.job import ConfigError
from tests.conftest import small_job_text

MOE = {"family": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _spec(token_file: Path, **parallel: object):
    text = small_job_text(token_file, model=MOE, parallel=dict(parallel))
    return prepare_spec(text, [], "job.toml", [token_file.parent])


def test_expert_parallel_job_with_dp_auto_is_checked_at_dp_equal_to_ep(token_file: Path) -> None:
    """dp "auto" at ep 4: the smallest world is dp 4 (ep takes its ranks from dp), not dp 1."""
    spec = _spec(token_file, ep=4)
    assert spec.config["parallel"]["ep"] == 4


def test_an_ep_that_cannot_divide_the_experts_is_refused_naming_the_field(
        token_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"parallel\.ep must divide model\.num_experts"):
        _spec(token_file, ep=3)
