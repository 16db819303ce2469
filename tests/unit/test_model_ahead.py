"""A model built ahead of the next generation (trainer/model_ahead.py): taken only for the
config it was built for, once, and trained exactly as a module the Trainer builds itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from parallel.job import load
from parallel.layout import Layout
from trainer.loop import Trainer
from trainer.model_ahead import ModelAhead

pytestmark = pytest.mark.unit


def test_the_module_is_taken_once_and_only_for_its_config(small_job) -> None:
    cfg = load(small_job()).model
    ahead = ModelAhead()
    assert ahead.take(cfg) is None  # nothing built
    ahead.build(cfg)
    model = ahead.model
    assert model is not None
    assert all(p.device.type == "meta" for p in model.parameters())  # no memory yet
    assert ahead.take(cfg) is model
    assert ahead.take(cfg) is None  # one generation takes it
    ahead.build(cfg)
    other = dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1)
    assert ahead.take(other) is None  # another job's model: built afresh by its generation
    assert ahead.model is None


def test_a_trainer_given_the_module_built_ahead_trains_as_one_that_builds_its_own(
        small_job, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    job = load(small_job())
    layout = Layout(dp=1, micro_batch=2, grad_accum=5)
    ahead = ModelAhead()
    ahead.build(job.model)
    built = ahead.model
    given = Trainer(job, layout, None, torch.device("cpu"), model=ahead.take(job.model))
    assert given.model is built
    own = Trainer(job, layout, None, torch.device("cpu"))
    for _ in range(2):
        a, b = given.train_step(), own.train_step()
        assert a.loss == b.loss
    for (name, p), (other, q) in zip(given.model.named_parameters(),
                                     own.model.named_parameters(), strict=True):
        assert name == other
        assert torch.equal(p, q), name


def test_a_model_that_allocates_as_it_builds_is_not_kept(small_job, monkeypatch) -> None:
    """Memory held across a generation's end would add to the old world's, still held."""
    cfg = load(small_job()).model

    class Allocates:
        def build(self, cfg: object) -> torch.nn.Module:
            return torch.nn.Linear(4, 4)  # on the CPU, not the meta device

    monkeypatch.setattr("trainer.model_ahead.get_spec", lambda family: Allocates())
    ahead = ModelAhead()
    ahead.build(cfg)
    assert ahead.model is None and ahead.take(cfg) is None
