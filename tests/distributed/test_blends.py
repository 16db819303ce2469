"""A two-source blend reads the same samples in the same order at dp 1, at dp 3, and after a
resize from dp 3 to dp 2 through a checkpoint (sample ids and their origins, from the trainer's
own reads via ULTRA_DATA_TRACE), and the losses follow."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import small_job_text
from tests.launch import RunResult, run_trainer
from trainer.blend import Blend
from trainer.tokens import write_token_file

pytestmark = pytest.mark.distributed
WEIGHTS = (0.3, 0.7)
SEED, G, STEPS, RTOL = 7, 10, 8, 1e-5  # small_job_text's seed and global batch


def _source(path: Path, low: int) -> Path:
    """Documents of random-walk tokens in [low, low + 64): a sample's tokens name its file."""
    rng = np.random.default_rng(low)
    tokens = (np.cumsum(rng.integers(-2, 3, size=60_000)) % 64 + low).astype(np.uint16)
    starts = np.arange(0, len(tokens), 500)
    write_token_file(path, tokens, vocab_size=256, source=f"walk {low}", tokenizer="bytes",
                     doc_starts=starts)
    return path


def _blend_job(root: Path) -> Path:
    a, b = _source(root / "a.bin", 32), _source(root / "b.bin", 160)
    text = small_job_text(a).replace(f'[data]\npath = "{a}"\n', "")
    for path, weight in zip((a, b), WEIGHTS, strict=True):
        text += f'[[data.sources]]\npath = "{path}"\nweight = {weight}\n'
    job = root / "job.toml"
    job.write_text(text)
    return job


def _reads(trace: Path) -> dict[int, dict[int, tuple[int, int]]]:
    """step -> {global sample id: (source, position)}, checking each sample is read once."""
    steps: dict[int, Counter] = {}
    origins: dict[int, dict[int, tuple[int, int]]] = {}
    for f in trace.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            for i, origin in zip(rec["ids"], rec["origins"], strict=True):
                if i >= 0:
                    steps.setdefault(rec["step"], Counter())[i] += 1
                    origins.setdefault(rec["step"], {})[i] = tuple(origin)
    for step, seen in steps.items():
        assert seen == Counter(range(step * G, (step + 1) * G)), f"step {step}"
    return origins


def _run(monkeypatch, trace: Path, nproc: int | None, *args: str) -> RunResult:
    monkeypatch.setenv("ULTRA_DATA_TRACE", str(trace))
    trace.mkdir(parents=True)
    result = run_trainer(trace.parent / "job.toml", nproc, "--steps", str(STEPS), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_blend_reads_the_same_samples_at_any_dp_and_after_a_resize(tmp_path, monkeypatch):
    _blend_job(tmp_path)
    one = _run(monkeypatch, tmp_path / "dp1", None)
    ckpt = tmp_path / "ckpt"
    three = _run(monkeypatch, tmp_path / "dp3", 3, "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "4")
    resumed_ckpt = tmp_path / "resumed"
    shutil.copytree(ckpt / "step_00000004", resumed_ckpt / "step_00000004")
    two = _run(monkeypatch, tmp_path / "dp3to2", 2, "--resume", "--checkpoint-dir",
               str(resumed_ckpt))
    assert "step_00000004" in two.stderr

    blend = Blend(WEIGHTS, SEED)
    expected = {s: {i: blend.origin(i) for i in range(s * G, (s + 1) * G)} for s in range(STEPS)}
    assert _reads(tmp_path / "dp1") == expected
    assert _reads(tmp_path / "dp3") == expected
    assert _reads(tmp_path / "dp3to2") == {s: expected[s] for s in range(4, STEPS)}
    assert {k for s in expected.values() for k, _ in s.values()} == {0, 1}

    assert sorted(two.steps) == list(range(5, STEPS + 1))
    for run in (three, two):
        for step, rec in run.steps.items():
            assert rec["consumed_samples"] == step * G
            assert rec["loss"] == pytest.approx(one.steps[step]["loss"], rel=RTOL), f"step {step}"
