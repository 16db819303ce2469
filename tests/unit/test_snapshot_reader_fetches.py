"""What a restore asks its fetch for (checkpoint/snapshot_reader.py): every chunk once, and all
the data of all files in one call, so that a fetch through the agent costs one round trip per
holding peer. One process, no process group (DCP's single-process mode)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoint.snapshot_format import (
    MANIFEST_NAME,
    METADATA_NAME,
    SnapshotInvalid,
    record_name,
    shard_name,
)
from checkpoint.snapshot_reader import (
    Range,
    SnapshotLoadPlanner,
    SnapshotReader,
    load_snapshot,
    local_fetch,
)
from checkpoint.snapshot_writer import save_snapshot
from checkpoint.state import Progress, TrainState

pytestmark = pytest.mark.unit


def _saved(root: Path) -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.01), Progress(step=3))
    save_snapshot(state, root, layout={})
    return state


def test_a_restore_fetches_each_chunk_once_and_all_data_in_one_call(shm: Path):
    state = _saved(shm)
    calls: list[list[Range]] = []
    inner = local_fetch(shm, 3)

    def fetch(ranges: Sequence[Range]) -> list[bytes]:
        calls.append(list(ranges))
        return inner(ranges)

    # Items apart from each other in the shard (the first and the last layer's weights, not
    # the middle one's), as a rank of a resharded layout needs them.
    wanted = {"0.weight": torch.zeros(8, 4), "4.weight": torch.zeros(2, 8)}
    reader = SnapshotReader(3, fetch, agree=lambda reason: reason)
    dcp.load({"state": {"model": wanted}}, storage_reader=reader,
             planner=SnapshotLoadPlanner(reader), no_dist=True)
    model = state.model
    assert torch.equal(wanted["0.weight"], model[0].weight)
    assert torch.equal(wanted["4.weight"], model[4].weight)
    shard = shard_name(0)
    size = (shm / "step_00000003" / shard).stat().st_size
    assert calls == [
        [Range(MANIFEST_NAME, 0, -1)],
        [Range(METADATA_NAME, 0, (shm / "step_00000003" / METADATA_NAME).stat().st_size)],
        # The record (chunk checksums) and the one chunk that holds both items, together.
        [Range(record_name(0), 0, -1), Range(shard, 0, size)],
    ]


def _other(widths: tuple[int, ...]) -> TrainState:
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(widths):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    return TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.01), Progress())


@pytest.mark.parametrize("widths, says", [
    ((4, 8, 8, 2, 2), "Missing key in checkpoint state_dict: state.model.6.weight"),
    ((4, 8, 8, 3), "Size mismatch between saved torch.Size([2, 8]) and current: "
                   "torch.Size([3, 8]) for state.model.4.weight"),
])
def test_a_state_the_snapshot_does_not_fit_fails_the_load_naming_the_key(
        shm: Path, widths: tuple[int, ...], says: str) -> None:
    _saved(shm)  # widths 4, 8, 8, 2
    fetched: list[Sequence[Range]] = []
    inner = local_fetch(shm, 3)

    def fetch(ranges: Sequence[Range]) -> list[bytes]:
        fetched.append(ranges)
        return inner(ranges)

    state = _other(widths)
    before = [p.detach().clone() for p in state.model.parameters()]
    with pytest.raises(SnapshotInvalid, match="^snapshot step 3 does not fit the state: .*"
                       + re.escape(says)):
        load_snapshot(state, 3, fetch)
    assert len(fetched) == 2  # the manifest and the index: no data for a load that cannot be
    assert all(torch.equal(p, q) for p, q in zip(state.model.parameters(), before, strict=True))
    assert state.progress.step == 0
