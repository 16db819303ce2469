"""[eval] (trainer/evaluation.py) in process: parsing and errors naming the field, its path
fields checked like any other, the held-out set's split over ranks and rounds, the step line's
eval_loss and eval_ppl, the agent's ultra_eval_loss gauge and the `eval` event."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.control.keys import Keys
from daemon.control.records import Progress
from daemon.metrics import Metrics
from parallel.job import MAX, ConfigError, DataSource, EvalConfig, loads
from parallel.job_paths import set_paths
from proto.ultrascale.v1 import agent_pb2 as pb
from trainer.telemetry import step_record

pytestmark = pytest.mark.unit

MINIMAL = '[data]\nsource = "python-stdlib"\n'


def test_eval_is_off_by_default_and_parses_a_path_or_a_blend() -> None:
    assert loads(MINIMAL).eval == EvalConfig()
    one = loads(MINIMAL + '[eval]\npath = "held.bin"\nevery = 50\nsamples = 64\n').eval
    assert one == EvalConfig(path="held.bin", every=50, samples=64)
    blend = loads(
        MINIMAL + "[eval]\nevery = 10\nsamples = 8\n"
        '[[eval.sources]]\npath = "a.bin"\nweight = 0.25\n'
        '[[eval.sources]]\npath = "b.bin"\nweight = 0.75\n'
    ).eval
    assert blend.sources == (DataSource("a.bin", 0.25), DataSource("b.bin", 0.75))
    assert loads(MINIMAL, ["eval.every=3", 'eval.path="h.bin"', "eval.samples=2"]).eval.every == 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("every = -1\n", "eval.every must be >= 0"),
        ('path = "h.bin"\nevery = 2\n', "eval.samples must be >= 1"),
        ('path = "h.bin"\nevery = 2\nsamples = -3\n', "eval.samples must be >= 0"),
        ("every = 2\nsamples = 4\n", "eval.path"),
        ('path = "h.bin"\nevery = 2\nsamples = 4\n[[eval.sources]]\npath = "a.bin"\n',
         "eval.path"),
        ('every = 2\nsamples = 4\n[[eval.sources]]\nweight = 1.0\n', "eval.sources[0].path"),
        ('every = 2\nsamples = 4\n[[eval.sources]]\npath = "a.bin"\nweight = 0\n',
         "eval.sources[0].weight"),
        ('every = "often"\n', "eval.every must be int"),
        ("steps = 3\n", "unknown key eval.steps"),
        (f'path = "h.bin"\nevery = 2\nsamples = {MAX["eval.samples"] + 1}\n',
         "eval.samples must be <="),
        (f'path = "h.bin"\nevery = {MAX["eval.every"] + 1}\nsamples = 1\n',
         "eval.every must be <="),
    ],
)
def test_bad_eval_names_the_field(body: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        loads(MINIMAL + "[eval]\n" + body)
    assert field in str(err.value)


def test_eval_paths_are_job_paths_checked_like_data_paths() -> None:
    cfg = loads(MINIMAL + '[eval]\npath = "/h.bin"\n[[eval.sources]]\npath = "/a.bin"\n')
    assert {"eval.path", "eval.sources[0].path"} <= set(set_paths(cfg))


def test_a_missing_held_out_file_is_refused_naming_eval_path(tmp_path: Path) -> None:
    from trainer.evaluation import open_eval_stream

    cfg = loads(MINIMAL + f'[eval]\npath = "{tmp_path}/none.bin"\nevery = 1\nsamples = 1\n')
    with pytest.raises(ConfigError, match=r"^eval\.path: "):
        open_eval_stream(cfg)


@pytest.mark.parametrize(("dp", "micro_batch", "grad_accum", "cp"),
                         [(1, 2, 5, 1), (2, 2, 3, 1), (3, 1, 2, 2)])
def test_every_held_out_sample_is_read_once_whatever_the_layout(dp, micro_batch, grad_accum,
                                                                 cp) -> None:
    import numpy as np

    from trainer.data import SampleStream
    from trainer.evaluation import eval_micro_batches, eval_rounds

    samples, seq_len = 7, 8
    stream = SampleStream(np.arange(1000, dtype=np.uint16) % 97, seq_len, seed=5)
    seen, tokens = [], 0
    for r in range(eval_rounds(samples, dp, micro_batch, grad_accum)):
        for rank in range(dp):
            for c in range(cp):
                batches = eval_micro_batches(stream, r, samples, dp, rank, micro_batch,
                                             grad_accum, cp, c)
                assert len(batches) == grad_accum  # every rank runs the same micro-batches
                for mb in batches:
                    assert mb.inputs.shape == (micro_batch, seq_len // cp)
                    tokens += int((mb.targets >= 0).sum())
                    if c == 0:
                        seen += [i for i in mb.sample_ids if i >= 0]
    assert sorted(seen) == list(range(samples))
    assert tokens == samples * seq_len


def _result(**changes):
    base = dict(step=4, loss=2.5, tokens=1000, step_seconds=0.5, lr=1e-3, grad_norm=0.7,
                mfu=None, skipped="", eval_loss=None)
    return SimpleNamespace(**{**base, **changes})


def test_a_step_line_has_eval_loss_and_ppl_only_after_an_evaluation() -> None:
    assert "eval_loss" not in step_record(_result())
    line = step_record(_result(eval_loss=2.0))
    assert line["eval_loss"] == 2.0 and line["eval_ppl"] == pytest.approx(math.exp(2.0))
    for bad in (math.nan, math.inf, 1e6):  # exp(1e6) overflows: no perplexity
        line = step_record(_result(eval_loss=bad))
        assert line["eval_ppl"] is None
        json.loads(json.dumps(line, allow_nan=False))


def _eval_gauge(metrics: Metrics) -> float:
    text = generate_latest(metrics.registry).decode()
    return next(s.value for fam in text_string_to_metric_families(text)
                if fam.name == "ultra_eval_loss" for s in fam.samples)


def test_the_agent_exports_the_last_evaluations_loss() -> None:
    metrics = Metrics()
    assert math.isnan(_eval_gauge(metrics))  # no evaluation yet
    metrics.observe_step(pb.StepReport(step=2, loss=3.0, eval_loss=2.75))
    assert _eval_gauge(metrics) == 2.75
    metrics.observe_step(pb.StepReport(step=3, loss=2.9))  # a step without an evaluation
    assert _eval_gauge(metrics) == 2.75


def test_a_new_evaluation_in_the_progress_record_is_an_event() -> None:
    from tests.unit.test_telemetry import _progress_event

    keys = Keys("job")
    plain = Progress(generation=2, step=3)
    evaluated = Progress(generation=2, step=4, eval_step=4, eval_loss=2.3456789)
    event = _progress_event(keys, evaluated, plain)
    assert event is not None and event.kind == "eval" and event.generation == 2
    assert event.message == "step 4: eval_loss 2.34568"
    later = Progress(generation=2, step=5, eval_step=4, eval_loss=2.3456789)
    assert _progress_event(keys, later, evaluated) is None  # the same evaluation, not news
    assert Progress.from_json(evaluated.to_json()) == evaluated
