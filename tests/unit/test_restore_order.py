"""The restore order: the first tier that serves wins, and each earlier one says why not."""

from __future__ import annotations

import pytest

from trainer.restore_order import ORDER, Restored, Served, first_served

pytestmark = pytest.mark.unit


def test_order_is_snapshot_checkpoint_pretrained_init() -> None:
    assert ORDER == ("snapshot", "checkpoint", "pretrained", "init")


def test_first_tier_that_serves_wins_and_later_ones_are_not_tried() -> None:
    tried: list[str] = []

    def tier(name: str, outcome: Served | str):
        def attempt() -> Served | str:
            tried.append(name)
            return outcome
        return attempt

    source, served, passed = first_served({
        "snapshot": tier("snapshot", "the plan names init"),
        "checkpoint": tier("checkpoint", "no valid checkpoint under /c"),
        "pretrained": tier("pretrained", Served("/models/tiny")),
        "init": tier("init", Served()),
    })
    assert (source, served.name) == ("pretrained", "/models/tiny")
    assert passed == (("snapshot", "the plan names init"),
                      ("checkpoint", "no valid checkpoint under /c"))
    assert tried == ["snapshot", "checkpoint", "pretrained"]
    line = Restored(source, 0, name=served.name, passed=passed).describe()
    assert line == ("pretrained weights /models/tiny (step 0) [not snapshot: the plan names "
                    "init; checkpoint: no valid checkpoint under /c]")


def test_init_must_serve() -> None:
    with pytest.raises(AssertionError):
        first_served(dict.fromkeys(ORDER, lambda: "no"))
