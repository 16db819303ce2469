"""The layout search: a valid, fitting, best-scored layout for every world, or reasons."""

from __future__ import annotations

import dataclasses

import pytest

from parallel import job as jobmod
from parallel.layout import resolve
from parallel.layout_search import (
    MEMORY_REASON,
    SearchResult,
    SearchSpace,
    World,
    search_layout,
)
from parallel.memory_model import peak_memory

pytestmark = pytest.mark.unit

GB = 10**9

# A ~0.85B GQA Llama: 24 GB per device is too little for some layouts, enough for others.
JOB = """
[model]
hidden_size = 2048
intermediate_size = 5632
num_hidden_layers = 16
num_attention_heads = 32
num_key_value_heads = 8
vocab_size = 32000
max_position_embeddings = 2048
[data]
source = "python-stdlib"
[train]
global_batch = 32
seq_len = 2048
[parallel]
mixed_precision = "bf16"
"""
BUDGET = 24 * GB


def _job(*overrides: str) -> jobmod.JobConfig:
    return jobmod.loads(JOB, overrides)


def _check(job: jobmod.JobConfig, result: SearchResult) -> None:
    """What every search result must satisfy, recomputed independently where possible."""
    world, model, train = result.world, job.model, job.train
    assert result.candidates, "the search must look at something"
    for c in result.rejected:
        assert c.reason and c.prediction is None
        if c.reason.startswith(MEMORY_REASON):
            assert c.layout is not None
            assert peak_memory(model, c.layout, train.seq_len).total > result.memory_per_device
    if result.best is None:
        assert not result.valid and result.reason_counts()
        return
    best = result.best
    assert best is result.candidates[0] and best.valid
    layout, pred = best.layout, best.prediction
    assert layout is not None and pred is not None
    # The constraints of the job, restated here rather than trusted to `resolve`.
    assert layout.dp * layout.tp * layout.pp * layout.cp == world.devices
    assert world.devices_per_node % layout.tp == 0
    assert model.num_attention_heads % layout.tp == 0
    assert model.num_key_value_heads % layout.tp == 0
    assert model.num_hidden_layers % (layout.pp * layout.virtual_stages) == 0
    assert train.seq_len % layout.cp == 0
    assert layout.dp <= train.global_batch
    assert layout.samples_per_step >= train.global_batch
    assert layout.samples_per_step - train.global_batch < layout.dp * layout.micro_batch
    # Its predictions are those of the models, it fits, and nothing valid scores higher.
    assert pred.memory == peak_memory(model, layout, train.seq_len)
    assert pred.memory.total <= result.memory_per_device
    assert 0 < pred.score <= 1 and 0 <= pred.bubble_ratio < 1 and 0 <= pred.recompute_ratio < 1
    assert all(c.prediction.score <= pred.score for c in result.valid)
    # It is a layout the job itself would resolve to with those choices.
    ch = best.choice
    parallel = dataclasses.replace(
        job.parallel, tp=ch.tp, pp=ch.pp, cp=ch.cp, zero=ch.zero,
        sequence_parallel=ch.sequence_parallel, pp_schedule=ch.pp_schedule,
        virtual_stages=ch.virtual_stages, recompute=ch.recompute, micro_batch=ch.micro_batch)
    again = resolve(dataclasses.replace(job, parallel=parallel), world.devices,
                    world.devices_per_node)
    assert again == layout


@pytest.mark.parametrize("devices", range(1, 65))
def test_every_world_up_to_64_devices_gets_a_layout_or_reasons(devices: int) -> None:
    job = _job()
    for per_node in (1, 2, 4, 8):
        if devices % per_node:
            continue
        world = World(devices // per_node, per_node)
        result = search_layout(job, world, BUDGET)
        _check(job, result)
        assert search_layout(job, world, BUDGET) == result  # deterministic


def test_both_outcomes_occur_and_reasons_name_the_constraint() -> None:
    job = _job()
    fits = search_layout(job, World(1, 8), BUDGET)
    assert fits.best is not None
    # 33 single-device nodes: tp 1, pp 1 (the only divisor of 33 that divides 16 layers),
    # so dp 33 > 32 samples.
    odd = search_layout(job, World(33, 1), BUDGET)
    assert odd.best is None
    assert any("parallel.dp must be <= train.global_batch" in r for r, _ in odd.reason_counts())


def test_the_answer_does_not_depend_on_the_order_of_the_space() -> None:
    job = _job()
    forward = SearchSpace(zero=(1, 2, 3), recompute=("none", "selective", "full"),
                          sequence_parallel=(False, True))
    backward = SearchSpace(zero=(3, 2, 1), recompute=("full", "selective", "none"),
                           sequence_parallel=(True, False), tp=(8, 4, 2, 1))
    for world in (World(1, 8), World(2, 4), World(4, 2)):
        a = search_layout(job, world, BUDGET, forward).best
        b = search_layout(job, world, BUDGET, backward).best
        assert a is not None and a == b


def test_tight_memory_chooses_recompute_and_too_little_memory_says_why() -> None:
    job = _job("parallel.zero=3")
    space = SearchSpace.from_job(job, free=("recompute",))
    world = World(1, 4)
    layouts = {
        mode: resolve(_job("parallel.zero=3", f'parallel.recompute="{mode}"'), 4, 4)
        for mode in ("none", "selective", "full")
    }
    need = {mode: peak_memory(job.model, lay, 2048).total for mode, lay in layouts.items()}
    assert need["none"] > need["selective"] > need["full"]

    roomy = search_layout(job, world, need["none"], space)
    assert roomy.best is not None and roomy.best.choice.recompute == "none"
    tight = search_layout(job, world, need["selective"], space)
    assert tight.best is not None and tight.best.choice.recompute == "selective"
    assert tight.best.prediction is not None and tight.best.prediction.recompute_ratio > 0
    too_small = search_layout(job, world, need["full"] - 1, space)
    assert too_small.best is None
    assert [c.choice.recompute for c in too_small.candidates] == ["none", "selective", "full"]
    assert all(c.reason.startswith(MEMORY_REASON) for c in too_small.candidates)


def test_fixed_dims_are_kept_or_refused_with_the_jobs_message() -> None:
    job = _job("parallel.tp=2", "parallel.micro_batch=2")
    kept = search_layout(job, World(3, 2), 10**15, SearchSpace.fixed(job))
    assert kept.best is not None and kept.best.layout is not None
    assert (kept.best.layout.tp, kept.best.layout.dp) == (2, 3)
    assert len(kept.candidates) == 1

    refused = search_layout(job, World(3, 1), 10**15, SearchSpace.fixed(job))
    assert refused.best is None
    assert "parallel.tp must divide the devices per node" in refused.candidates[0].reason

    # Free pp, fixed tp: only pp values of 16 layers, and tp 2 in every candidate.
    free_pp = search_layout(job, World(2, 4), 10**15, SearchSpace.from_job(job, ("pp",)))
    assert {c.choice.tp for c in free_pp.candidates} == {2}
    assert {c.choice.pp for c in free_pp.candidates} == {1, 2, 4}


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown search dimension"):
        SearchSpace.from_job(_job(), ("dp",))
    with pytest.raises(ValueError, match="world needs"):
        World(0, 8)
    with pytest.raises(ValueError, match="memory_per_device"):
        search_layout(_job(), World(1, 1), 0)
