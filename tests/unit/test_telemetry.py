"""Step telemetry (trainer/telemetry.py) and non-finite steps (trainer/nonfinite.py), in
process: the MFU formula and peak table, the step line's fields, the skip streak that fails a
run, the NaN injection's parsing, the `diverged` failure kind, the agent's gauges and counter,
the `skipped-step` event, and the `[metrics]` section's checks."""

from __future__ import annotations

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.api.events import render
from daemon.control.etcd_client import PUT
from daemon.control.keys import Keys
from daemon.control.records import Progress
from daemon.metrics import Metrics
from parallel.cost_model import flops_per_token
from parallel.job import ConfigError, loads
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.unit.test_metrics import JOB
from trainer.agreement import Agreement, StepAgreement, agree_step
from trainer.failure_kind import classify_failure
from trainer.fault_injection import NonFiniteInjection
from trainer.nonfinite import NonFiniteSteps, SkipStreak
from trainer.telemetry import mfu, model_flops_per_token, peak_flops, step_record

pytestmark = pytest.mark.unit


def test_mfu_is_model_flops_over_devices_times_the_tables_peak() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H200", "fp32") == 67e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("", "bf16") is None  # CPU
    assert peak_flops("Some Future GPU", "bf16") is None
    assert mfu(989e12, 2.0, 4, 989e12) == pytest.approx(0.125)
    assert mfu(1e12, 1.0, 1, None) is None
    job = loads(JOB)
    assert model_flops_per_token(job) == flops_per_token(job.model, job.train.seq_len) > 0


def _result(**changes):
    base = dict(step=3, loss=2.5, tokens=1000, step_seconds=0.5, lr=1e-3, grad_norm=0.7,
                mfu=None, skipped="")
    return SimpleNamespace(**{**base, **changes})


def test_a_step_line_carries_lr_grad_norm_tokens_per_s_and_mfu_as_valid_json() -> None:
    assert step_record(_result()) == {"lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 2000.0,
                                      "mfu": None}
    skipped = step_record(_result(grad_norm=math.nan, skipped="nonfinite_grad", mfu=0.41234567))
    assert skipped == {"lr": 1e-3, "grad_norm": None, "tokens_per_s": 2000.0, "mfu": 0.412346,
                       "skipped": "nonfinite_grad"}
    json.loads(json.dumps(skipped, allow_nan=False))  # no NaN reaches a JSON line


def test_the_skip_reason_names_the_loss_first_and_needs_no_group_in_one_process() -> None:
    seen = Agreement(stop=True, checkpoint_seq=3)
    assert agree_step(1.0, 2.0, seen, distributed=False) == StepAgreement("", seen)
    assert agree_step(math.nan, math.inf, Agreement(), distributed=False).skipped \
        == "nonfinite_loss"
    assert agree_step(1.0, math.inf, Agreement(), distributed=False).skipped == "nonfinite_grad"


def test_max_skipped_steps_in_a_row_fail_naming_the_step_and_an_applied_step_resets() -> None:
    streak = SkipStreak(3)
    streak.record(4, "nonfinite_loss")
    streak.record(5, "nonfinite_loss")
    streak.record(6, "")  # applied: the count starts again
    streak.record(7, "nonfinite_grad")
    streak.record(8, "nonfinite_grad")
    with pytest.raises(NonFiniteSteps, match=r"step 9 skipped \(nonfinite_loss\): 3 non-finite "
                       r"steps in a row \(steps 7-9\) reached train.max_skipped_steps=3"):
        streak.record(9, "nonfinite_loss")


def test_a_diverged_run_is_its_own_failure_kind() -> None:
    assert classify_failure("NonFiniteSteps: step 9 skipped (nonfinite_loss): ...") == "diverged"


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"ULTRA_FAULT_NAN_STEPS": "3"}, NonFiniteInjection(3, 3, "loss", None)),
    ({"ULTRA_FAULT_NAN_STEPS": "2-6", "ULTRA_FAULT_NAN_IN": "grad",
      "ULTRA_FAULT_NAN_RANKS": "1, 3"}, NonFiniteInjection(2, 6, "grad", frozenset({1, 3}))),
])
def test_nonfinite_injection_from_env(env, expected) -> None:
    assert NonFiniteInjection.from_env(env) == expected


def test_nonfinite_injection_applies_to_its_steps_ranks_and_place_and_typos_are_loud() -> None:
    inject = NonFiniteInjection(2, 4, "loss", frozenset({1}))
    assert inject.applies(2, 1, "loss") and inject.applies(4, 1, "loss")
    assert not inject.applies(5, 1, "loss") and not inject.applies(3, 0, "loss")
    assert not inject.applies(3, 1, "grad")
    with pytest.raises(ValueError):
        NonFiniteInjection.from_env({"ULTRA_FAULT_NAN_STEPS": "three"})
    with pytest.raises(ValueError, match="ULTRA_FAULT_NAN_IN"):
        NonFiniteInjection.from_env({"ULTRA_FAULT_NAN_STEPS": "3", "ULTRA_FAULT_NAN_IN": "x"})


def _samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_agent_exports_lr_grad_norm_mfu_and_counts_skipped_steps_by_reason() -> None:
    metrics = Metrics()
    before = _samples(metrics)
    assert math.isnan(before[("ultra_train_mfu_ratio", ())])  # unknown until a step says
    for reason in ("nonfinite_loss", "nonfinite_grad"):
        assert before[("ultra_train_skipped_steps_total", (("reason", reason),))] == 0
    metrics.observe_step(pb.StepReport(generation=1, step=1, loss=3.0, learning_rate=1e-3,
                                       grad_norm=0.5, mfu=0.4))
    metrics.observe_step(pb.StepReport(generation=1, step=2, loss=math.nan, learning_rate=2e-3,
                                       grad_norm=math.nan, skipped="nonfinite_loss"))
    metrics.observe_step(pb.StepReport(generation=1, step=3, loss=math.inf, learning_rate=3e-3,
                                       grad_norm=math.inf, skipped="made-up"))
    got = _samples(metrics)
    assert got[("ultra_train_learning_rate", ())] == 3e-3
    assert got[("ultra_train_loss", ())] == 3.0  # a skipped step's loss is not the gauge's
    assert got[("ultra_train_grad_norm", ())] == 0.5
    assert math.isnan(got[("ultra_train_mfu_ratio", ())])  # the last report had none (CPU)
    assert got[("ultra_train_skipped_steps_total", (("reason", "nonfinite_loss"),))] == 1
    assert got[("ultra_train_skipped_steps_total", (("reason", "nonfinite_grad"),))] == 0
    assert not any(name == "ultra_train_skipped_steps_total" and ("reason", "made-up") in labels
                   for name, labels in got)  # a fixed label set, whatever a worker sends


def _progress_event(keys: Keys, now: Progress, before: Progress | None):
    kv = SimpleNamespace(key=keys.prefix + b"progress", value=now.to_json(),
                         mod_revision=7)
    prev = SimpleNamespace(key=kv.key if before else b"",
                           value=before.to_json() if before else b"")
    return render(keys, SimpleNamespace(kv=kv, type=PUT, prev_kv=prev))


def test_a_newly_skipped_step_in_the_progress_record_is_an_event_and_routine_progress_is_not(
) -> None:
    keys = Keys("job")
    plain = Progress(generation=2, step=4)
    assert _progress_event(keys, plain, Progress(generation=2, step=3)) is None
    skipped = Progress(generation=2, step=5, skipped_step=5, skipped_reason="nonfinite_grad")
    event = _progress_event(keys, skipped, plain)
    assert event is not None and event.kind == "skipped-step" and event.generation == 2
    assert "step 5 skipped on every rank (nonfinite_grad)" in event.message
    later = Progress(generation=2, step=6, skipped_step=5, skipped_reason="nonfinite_grad")
    assert _progress_event(keys, later, skipped) is None  # the same skip, not news again


def test_metrics_tensorboard_needs_the_output_dir_and_the_package() -> None:
    with pytest.raises(ConfigError, match="metrics.tensorboard = true needs job.output_dir"):
        loads(JOB + "[metrics]\ntensorboard = true\n")
    spec = JOB + '[metrics]\ntensorboard = true\n[job]\noutput_dir = "/tmp/out"\n'
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ConfigError, match=r"metrics.tensorboard = true needs the "
                                              r"tensorboard package"):
            loads(spec)
    else:
        assert loads(spec).metrics.tensorboard


def test_max_skipped_steps_is_positive_and_bounded() -> None:
    assert loads(JOB).train.max_skipped_steps == 5
    with pytest.raises(ConfigError, match=r"train.max_skipped_steps must be >= 1 \(got 0\)"):
        loads(JOB, ["train.max_skipped_steps=0"])
    with pytest.raises(ConfigError, match="train.max_skipped_steps must be <="):
        loads(JOB, [f"train.max_skipped_steps={10**10}"])


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="the optional tensorboard extra is not installed")
def test_tensorboard_writes_event_files_of_the_step_scalars(tmp_path) -> None:
    from trainer.telemetry import TensorBoard

    board = TensorBoard(tmp_path / "tensorboard")
    board.add(_result())
    board.add(_result(step=4, loss=math.nan, grad_norm=math.nan, skipped="nonfinite_loss"))
    board.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([1e-3, 1e-3])
    assert [e.step for e in events.Scalars("train/loss")] == [3]  # a NaN is not written
    assert [e.value for e in events.Scalars("train/skipped")] == [0.0, 1.0]
