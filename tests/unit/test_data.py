"""The global sample stream: deterministic, and each sample of a step used exactly once for any split."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.loss import IGNORE_INDEX
from parallel.context_parallel import zigzag_positions
from parallel.job import ConfigError, DataConfig
from trainer.data import SampleStream, open_stream, slot_ids, step_micro_batches
from trainer.prepare import prepare
from trainer.tokens import TokenFileError, read_header, sidecar_path

pytestmark = pytest.mark.unit


@settings(max_examples=300, deadline=None)
@given(g=st.integers(1, 48), data=st.data())
def test_every_sample_of_a_step_goes_to_exactly_one_slot(g, data):
    dp = data.draw(st.integers(1, g))
    mb = data.draw(st.integers(1, g))
    step = data.draw(st.integers(0, 1000))
    grad_accum = -(-g // (dp * mb))
    seen = Counter()
    for r in range(dp):
        for m in range(grad_accum):
            ids = slot_ids(step, g, dp, r, m, mb)
            assert len(ids) == mb  # every rank runs equally shaped micro-batches
            seen.update(i for i in ids if i >= 0)
    assert seen == Counter(range(step * g, (step + 1) * g))


def test_stream_is_deterministic_and_covers_each_epoch():
    tokens = np.arange(1001, dtype=np.uint16) % 256
    a, b = SampleStream(tokens, 10, seed=3), SampleStream(tokens, 10, seed=3)
    assert a.windows == 100
    starts = {int(a.sample(i)[0]) for i in range(100)}
    assert len(starts) == 100  # one epoch = each window once
    assert all(np.array_equal(a.sample(i), b.sample(i)) for i in (0, 57, 99, 100, 250))
    assert not np.array_equal(a.sample(0), SampleStream(tokens, 10, seed=4).sample(0))
    assert [int(a.sample(i)[0]) for i in range(100)] != [
        int(a.sample(i)[0]) for i in range(100, 200)
    ]


def test_padding_slots_carry_no_targets(token_file):
    stream = open_stream(DataConfig(path=str(token_file)), 16, 1, 256)
    batches = step_micro_batches(stream, 2, 10, 3, 2, 2, 2)
    assert batches[0].sample_ids == (24, 25)
    assert batches[1].sample_ids == (-1, -1)
    assert (batches[1].targets == IGNORE_INDEX).all()
    sample = stream.sample(24)
    assert batches[0].inputs[0].tolist() == sample[:-1].tolist()
    assert batches[0].targets[0].tolist() == sample[1:].tolist()


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_ranks_share_the_tokens_of_the_same_samples(cp):
    """The cp ranks of a dp rank read its micro-batches; their zig-zag shares put together are
    every token of every sample once, inputs and targets alike."""
    stream = SampleStream(np.arange(5000, dtype=np.uint16) % 256, 16, seed=1)
    whole = step_micro_batches(stream, 3, 10, 2, 1, 2, 3)
    shares = [step_micro_batches(stream, 3, 10, 2, 1, 2, 3, cp, r) for r in range(cp)]
    for m, full in enumerate(whole):
        parts = [s[m] for s in shares]
        assert all(p.sample_ids == full.sample_ids for p in parts)
        for field in ("inputs", "targets"):
            tokens = torch.cat([getattr(p, field) for p in parts], dim=1)
            order = torch.cat([zigzag_positions(16, cp, r) for r in range(cp)])
            assert tokens.shape == getattr(full, field).shape
            assert torch.equal(tokens, getattr(full, field)[:, order])
    assert sorted(torch.cat([zigzag_positions(16, cp, r) for r in range(cp)]).tolist()) == list(
        range(16)
    )


def test_prepare_bytes_roundtrip(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("world")
    out = tmp_path / "t.bin"
    header = prepare(out, [tmp_path / "a.txt", tmp_path / "b.txt"])
    assert header.num_tokens == len(b"hello\n\nworld") and header.dtype == "uint16"
    assert bytes(np.fromfile(out, dtype=np.uint16).astype(np.uint8)) == b"hello\n\nworld"


def test_bad_token_files_name_the_file(tmp_path):
    out = tmp_path / "t.bin"
    (tmp_path / "a.txt").write_text("x" * 100)
    prepare(out, [tmp_path / "a.txt"])
    with open(out, "ab") as f:
        f.write(b"\0")
    with pytest.raises(TokenFileError, match="t.bin"):
        read_header(out)
    side = sidecar_path(out)
    side.write_text(json.dumps({"dtype": "int8"}))
    with pytest.raises(TokenFileError, match="t.json"):
        read_header(out)
    with pytest.raises(ConfigError, match="data.path"):
        open_stream(DataConfig(path=str(tmp_path / "missing.bin")), 16, 1, 256)
