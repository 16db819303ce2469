"""Shared fixtures: a small synthetic token file, small job files, and a torchrun launcher."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

from trainer.tokens import write_token_file

REPO = Path(__file__).resolve().parent.parent


def slow(reason: str) -> pytest.MarkDecorator:
    """Skip unless ULTRA_SLOW=1: tests whose ground a faster sibling in the default suite covers,
    or that need minutes of CPU. `reason` says what the test costs or which sibling covers it."""
    return pytest.mark.skipif(os.environ.get("ULTRA_SLOW", "") in ("", "0"),
                              reason=f"{reason}; set ULTRA_SLOW=1 to run")


@pytest.fixture(scope="session", autouse=True)
def allowed_job_paths(tmp_path_factory: pytest.TempPathFactory):
    """Agents that tests start allow job paths under pytest's temporary directory, where every
    test keeps its data and output (ULTRA_ALLOWED_PATHS; tests of the check narrow it)."""
    old = os.environ.get("ULTRA_ALLOWED_PATHS")
    os.environ["ULTRA_ALLOWED_PATHS"] = str(tmp_path_factory.getbasetemp())
    yield
    if old is None:
        del os.environ["ULTRA_ALLOWED_PATHS"]
    else:
        os.environ["ULTRA_ALLOWED_PATHS"] = old


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200k byte tokens: a seeded random walk over a small alphabet, so there is something to learn."""
    rng = np.random.default_rng(0)
    tokens = (np.cumsum(rng.integers(-2, 3, size=200_000)) % 64 + 32).astype(np.uint16)
    path = tmp_path_factory.mktemp("data") / "walk.bin"
    write_token_file(
        path, tokens, vocab_size=256, source="synthetic random walk", tokenizer="bytes"
    )
    return path


def small_job_text(token_file: Path, **sections: dict) -> str:
    """A 2-layer GQA Llama job whose global batch (10) is divisible by neither 3 nor 4."""
    base = {
        "model": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 64,
        },
        "data": {"path": str(token_file)},
        "train": {
            "steps": 12,
            "global_batch": 10,
            "seq_len": 32,
            "seed": 7,
            "lr": 1e-2,
            "min_lr": 1e-3,
            "warmup_steps": 2,
        },
        "parallel": {"micro_batch": 2},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    out = []
    for name, values in base.items():
        out.append(f"[{name}]")
        for key, value in values.items():
            if isinstance(value, bool):
                out.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                out.append(f'{key} = "{value}"')
            else:
                out.append(f"{key} = {value}")
    return textwrap.dedent("\n".join(out)) + "\n"


@pytest.fixture
def small_job(tmp_path: Path, token_file: Path):
    def make(**sections: dict) -> Path:
        path = tmp_path / "job.toml"
        path.write_text(small_job_text(token_file, **sections))
        return path

    return make


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
    )
    return env
