"""Pipeline layouts without processes: which layouts are refused (and why), stage placement,
the stage split on the meta device, and the playbook's bubble prediction."""

from __future__ import annotations

import pytest

from models.llama.model import build_model
from parallel.job import ConfigError, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from parallel.layout import Layout, check_supported, predicted_bubble, resolve
from parallel.pipeline import split_stages, stage_ids

pytestmark = pytest.mark.unit


def job(layers: int = 8, global_batch: int = 8, tie: bool = False, **parallel) -> JobConfig:
    return JobConfig(
        model=ModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tie,
        ),
        train=TrainConfig(global_batch=global_batch, seq_len=16),
        parallel=ParallelConfig(micro_batch=2, **parallel),
    )


@pytest.mark.parametrize(
    ("cfg", "world", "message"),
    [
        (job(layers=6, pp=4), 4, "parallel.pp x parallel.virtual_stages must divide"),
        (job(pp=2, virtual_stages=3), 2, "parallel.pp x parallel.virtual_stages must divide"),
        (job(pp=2, pp_schedule="interleaved_1f1b"), 2, "virtual_stages >= 2"),
        (job(pp=2, pp_schedule="1f1b", virtual_stages=2), 2, "virtual_stages must be 1"),
        (job(pp=2, pp_schedule="gpipe", virtual_stages=2), 2, "virtual_stages must be 1"),
        (job(pp=2, pp_schedule="zero_bubble", zero=3), 2, "needs parallel.zero <= 2"),
        (job(pp=4, pp_schedule="1f1b", global_batch=6), 4, "at least parallel.pp micro-batches"),
        (
            job(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, global_batch=10),
            2,
            "multiple of max(1, grad_accum // pp)",
        ),
        (job(pp=2, tie=True), 2, "model.tie_word_embeddings needs parallel.pp = 1"),
        (job(virtual_stages=2), 1, "virtual_stages > 1 needs parallel.pp > 1"),
    ],
)
def test_impossible_pipeline_layouts_name_the_constraint(cfg, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(cfg, world)


def test_zero_bubble_v3_is_refused():
    with pytest.raises(ConfigError, match="virtual_stages 1 .ZB-H1. or 2 .ZB-V."):
        check_supported(Layout(pp=2, virtual_stages=3, pp_schedule="zero_bubble", zero=2))


def test_supported_pipeline_layouts_resolve():
    for sched, v, zero in [("gpipe", 1, 3), ("1f1b", 1, 3), ("interleaved_1f1b", 2, 3),
                           ("zero_bubble", 1, 2), ("zero_bubble", 2, 2)]:  # fmt: skip
        layout = resolve(job(pp=4, pp_schedule=sched, virtual_stages=v, zero=zero), 4)
        assert (layout.pp, layout.grad_accum) == (4, 4)


def test_stage_placement_loop_and_v():
    loop = Layout(pp=4, virtual_stages=2, pp_schedule="interleaved_1f1b")
    assert [stage_ids(loop, r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    v = Layout(pp=4, virtual_stages=2, pp_schedule="zero_bubble", zero=2)
    assert [stage_ids(v, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_ids(Layout(pp=2, pp_schedule="gpipe"), 1) == [1]


def test_split_keeps_full_model_names_and_shares_modules():
    model = build_model(job().model)
    full = {name for name, _ in model.named_parameters()}
    layout = Layout(pp=2, virtual_stages=2, pp_schedule="zero_bubble", zero=2)
    parts = split_stages(model, layout, pp_rank=0)  # stages 0 and 3 of 4: layers 0-1, 6-7
    assert list(model.layers) == ["0", "1", "6", "7"]
    assert model.embed_tokens is parts[0].embed_tokens is not None
    assert model.lm_head is parts[1].lm_head is not None
    assert parts[0].lm_head is None and parts[1].embed_tokens is None
    assert parts[1].layers["6"] is model.layers["6"]
    names = {n for part in parts for n, _ in part.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()} < full
    rank1 = split_stages(build_model(job().model), layout, pp_rank=1)  # stages 1, 2: layers 2-5
    assert names | {n for part in rank1 for n, _ in part.named_parameters()} == full


def test_predicted_bubble_is_the_playbook_ratio_as_a_fraction_of_the_step():
    # r = (p - 1) / (v m) bubble over ideal time; the idle fraction of a step is r / (1 + r).
    assert predicted_bubble(Layout(pp=2, grad_accum=2)) == pytest.approx(1 / 3)
    assert predicted_bubble(Layout(pp=4, grad_accum=8)) == pytest.approx(3 / 11)
    layout = Layout(pp=4, virtual_stages=2, grad_accum=8, pp_schedule="interleaved_1f1b")
    assert predicted_bubble(layout) == pytest.approx(3 / 19)
    assert predicted_bubble(Layout()) == 0.0
