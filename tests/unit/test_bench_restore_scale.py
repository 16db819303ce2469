"""bench.restore_scale's simulated metadata is a snapshot's, and DCP's plan over it reads
exactly one restoring rank's shard, from DCP's pickle and from the index alike."""

from __future__ import annotations

import pytest

from bench.restore_scale import index_costs, pickle_costs, saved_metadata

pytestmark = pytest.mark.unit


def test_the_plan_reads_the_rank_shard_from_the_saved_chunks_it_overlaps() -> None:
    # Saved by 4 ranks, restored on 3; rank 1 of 3 holds rows [4, 8) of 10 and [3, 6) of 7,
    # which the saved chunks [3, 6) + [6, 9) and [2, 4) + [4, 6) hold.
    before, now = pickle_costs(4, [(10, 4), (7,)]), index_costs(4, [(10, 4), (7,)])
    assert before.plan.read_items == now.plan.read_items == 4
    assert before.plan.read_elements == now.plan.read_elements == 4 * 4 + 3
    assert min(before.size_bytes, now.size_bytes) > 0 and before.unpickle_s >= 0 \
        and now.narrow_s >= 0

def test_the_metadata_has_one_chunk_and_one_item_per_rank_and_tensor() -> None:
    metadata = saved_metadata(5, [(10, 4), (7,)])
    assert [len(m.chunks) for m in metadata.state_dict_metadata.values()] == [5, 5]
    assert len(metadata.storage_data) == 10
    rows = [c.sizes[0] for c in metadata.state_dict_metadata["state.t0"].chunks]
    assert rows == [2, 2, 2, 2, 2]
