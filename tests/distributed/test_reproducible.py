"""parallel.reproducible: the same bits whatever dp, the ZeRO stage and the resize history.

Every run is compared with the dp=1 run of the same job: the loss of every step as the exact
float of its JSON line, and the final parameters byte for byte (a DCP checkpoint of the last
step). The small test job's global batch (10) is uneven at dp 3 and dp 4, so those runs pad.
By default the small job covers every dp (1-4) and ZeRO stage, micro_batch 1 and 2, and a resize
across stages, sharing one 40-step dp=1 run; ULTRA_SLOW=1 adds the whole grid
(dp 1-4 × ZeRO 1-3 × micro_batch 1, 2) and the resize on 40 steps of examples/tiny.toml.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.compare import assert_params_close
from tests.conftest import REPO, slow
from tests.distributed.reference import reference_run
from tests.launch import RunResult, final_model_state, run_trainer

pytestmark = pytest.mark.distributed
STEPS = 8
ON = ("--set", "parallel.reproducible=true")

SLOW = slow("40 steps of examples/tiny.toml over the whole grid")


@dataclass(frozen=True)
class Run:
    losses: dict[int, float]
    params: dict[str, bytes]


def run(job: Path, dp: int, tmp: Path, steps: int, *args: str) -> tuple[RunResult, Path]:
    ckpt = tmp / "ckpt"
    result = run_trainer(
        job,
        dp,
        *ON,
        "--steps",
        str(steps),
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(steps),
        *args,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, ckpt / f"step_{steps:08d}"


def fingerprint(result: RunResult, last: Path, tmp: Path) -> Run:
    params = final_model_state(last, tmp)
    return Run(
        {step: rec["loss"] for step, rec in result.steps.items()},
        {name: t.contiguous().numpy().tobytes() for name, t in params.items()},
    )


def assert_identical(got: Run, expected: Run, label: str) -> None:
    assert got.losses == expected.losses, f"{label}: losses differ"
    different = sorted(n for n in expected.params if got.params.get(n) != expected.params[n])
    assert set(got.params) == set(expected.params) and not different, (
        f"{label}: parameters differ: {different}"
    )


def grid(job: Path, cases: list[tuple[int, int, int]], steps: int, tmp: Path) -> None:
    """(dp, zero, micro_batch) runs; each is compared with the dp=1 run of its micro_batch."""
    baseline: dict[int, Run] = {}
    for mb in sorted({mb for _, _, mb in cases}):
        base_dir = tmp / f"dp1-mb{mb}"
        result, last = run(job, 1, base_dir, steps, "--set", f"parallel.micro_batch={mb}")
        baseline[mb] = fingerprint(result, last, base_dir)
    for dp, zero, mb in cases:
        check_case(job, dp, zero, mb, steps, baseline[mb], tmp)


def check_case(
    job: Path, dp: int, zero: int, mb: int, steps: int, expected: Run, tmp: Path
) -> None:
    case_dir = tmp / f"dp{dp}-zero{zero}-mb{mb}"
    settings = ("--set", f"parallel.zero={zero}", "--set", f"parallel.micro_batch={mb}")
    result, last = run(job, dp, case_dir, steps, *settings)
    assert {rec["dp"] for rec in result.steps.values()} == {dp}
    assert_identical(fingerprint(result, last, case_dir), expected, case_dir.name)
    shutil.rmtree(case_dir / "ckpt")


def resize(job: Path, expected: Run, tmp: Path) -> None:
    """dp4 (ZeRO-1) to step 13, resumed at dp3 (ZeRO-2) to 27, then at dp2 (ZeRO-3) to 40."""
    ckpt = tmp / "resized"
    losses: dict[int, float] = {}
    for dp, zero, stop in ((4, 1, 13), (3, 2, 27), (2, 3, 40)):
        result = run_trainer(
            job,
            dp,
            *ON,
            "--set",
            f"parallel.zero={zero}",
            "--steps",
            str(stop),
            "--checkpoint-dir",
            str(ckpt),
            "--resume",
            timeout=1800,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert min(result.steps) == max(losses, default=0) + 1
        assert {rec["dp"] for rec in result.steps.values()} == {dp}
        losses.update({step: rec["loss"] for step, rec in result.steps.items()})
    got = fingerprint(
        RunResult(0, {s: {"loss": v} for s, v in losses.items()}, ""),
        ckpt / "step_00000040",
        tmp,
    )
    assert_identical(got, expected, "dp4 ZeRO-1 -> dp3 ZeRO-2 -> dp2 ZeRO-3")


def up_to(run_: Run, step: int, params: dict[str, bytes]) -> Run:
    return Run({s: v for s, v in run_.losses.items() if s <= step}, params)


@pytest.fixture(scope="module")
def baseline(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run, Run]:
    """The small job at dp=1 for 40 steps: (job, its first STEPS steps, all 40)."""
    from tests.conftest import small_job_text

    root = tmp_path_factory.mktemp("reproducible-dp1")
    job = root / "job.toml"
    job.write_text(small_job_text(token_file, train={"steps": 40}))
    every = ("--checkpoint-every", str(STEPS), "--set", "checkpoint.keep=10")
    result, last = run(job, 1, root, 40, *every)
    full = fingerprint(result, last, root)
    early = final_model_state(root / "ckpt" / f"step_{STEPS:08d}", root)
    short = up_to(full, STEPS, {n: t.contiguous().numpy().tobytes() for n, t in early.items()})
    return job, short, full


def test_dp_and_zero_give_the_same_bits(baseline, tmp_path):
    """Every ZeRO stage; dp 2, 3 and 4 (the global batch of 10 pads at dp 3 and dp 4)."""
    job, short, _ = baseline
    for dp, zero in ((2, 1), (3, 3), (4, 2)):
        check_case(job, dp, zero, 2, STEPS, short, tmp_path)


def test_resize_gives_the_same_bits(baseline, tmp_path):
    job, _, full = baseline
    resize(job, full, tmp_path)


def test_micro_batch_1_gives_the_same_bits(baseline, tmp_path):
    job, _, _ = baseline
    grid(job, [(3, 1, 1)], STEPS, tmp_path)


def test_close_to_the_fp32_run(baseline, tmp_path):
    """The exact sums change rounding, not results: within fp32 noise of the mode off."""
    job, short, _ = baseline
    ref_losses, ref_params = reference_run(job, STEPS)
    for step, loss in ref_losses.items():
        assert short.losses[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    got = {n: torch.frombuffer(bytearray(b), dtype=torch.float32).view(ref_params[n].shape)
           for n, b in short.params.items()}
    assert_params_close(got, ref_params, 1e-5)


@pytest.mark.slow
@SLOW
def test_tiny_job_whole_grid(tmp_path):
    # The dp=1 runs of the job's own stage (ZeRO-3) are the baselines.
    cases = [
        (dp, zero, mb)
        for mb in (1, 2)
        for zero in (1, 2, 3)
        for dp in (1, 2, 3, 4)
        if (dp, zero) != (1, 3)
    ]
    grid(REPO / "examples" / "tiny.toml", cases, 40, tmp_path)


@pytest.mark.slow
@SLOW
def test_tiny_job_resize(tmp_path):
    job = REPO / "examples" / "tiny.toml"
    result, last = run(job, 1, tmp_path / "dp1", 40)
    resize(job, fingerprint(result, last, tmp_path / "dp1"), tmp_path)
