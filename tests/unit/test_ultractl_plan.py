"""`ultractl plan` what-if: argument parsing, the search on a job file, the rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.cli import ultractl, whatif
from parallel import job as jobmod
from parallel.layout import resolve
from parallel.layout_search import World
from parallel.memory_model import peak_memory

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.toml"


@pytest.mark.parametrize(("text", "value"), [
    ("80G", 80 * 10**9), ("24GiB", 24 * 2**30), ("1.5g", 1_500_000_000), ("4096", 4096),
    ("512MiB", 512 * 2**20), ("2e9", 2 * 10**9),
])
def test_memory_sizes(text: str, value: int) -> None:
    assert whatif.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "8 PB"])
def test_bad_memory_names_the_flag(text: str) -> None:
    with pytest.raises(whatif.WhatIfError, match="--memory"):
        whatif.parse_bytes(text)


def test_world_and_free_dimensions() -> None:
    assert whatif.parse_world("4x8") == World(4, 8)
    assert whatif.parse_world(" 2X1 ") == World(2, 1)
    for bad in ("4", "4x", "x8", "0x8", "4*8"):
        with pytest.raises(whatif.WhatIfError, match="--world"):
            whatif.parse_world(bad)
    assert whatif.parse_free("tp, pp") == ("tp", "pp")
    with pytest.raises(whatif.WhatIfError, match="--free: unknown dimension.*banana"):
        whatif.parse_free("tp,banana")


def test_world_of_a_plan_counts_nodes_and_their_ranks() -> None:
    ranks = [{"node": n, "local_rank": i} for n in ("a", "b", "c") for i in range(2)]
    assert whatif.world_of(ranks) == World(3, 2)


def test_search_on_a_job_file_keeps_the_job_layout_unless_freed(capsys) -> None:
    job = jobmod.loads(TINY.read_text())
    fixed = whatif.search(job, World(2, 2), 10**9, ())
    # The job's own layout, with the memory the model predicts for it.
    layout = resolve(job, 4, devices_per_node=2)
    assert fixed["best"]["memory_bytes"]["total"] == peak_memory(job.model, layout,
                                                                 job.train.seq_len).total
    assert fixed["valid_count"] == 1
    freed = whatif.search(job, World(2, 2), 10**9, ("tp", "zero"))
    assert freed["valid_count"] > 1 and freed["best"]["score"] >= fixed["best"]["score"]
    # Too little memory: no layout, and the reason says so.
    none = whatif.search(job, World(2, 2), 1000, ())
    assert none["best"] is None and "memory" in none["rejected"][0]["reason"]
    assert any("no valid layout" in line for line in whatif.render(none, explain=False))


def test_ultractl_plan_with_a_job_file_needs_no_cluster(capsys) -> None:
    assert ultractl.main(["plan", "--job", str(TINY), "--world", "2x2", "--memory", "1G",
                          "--free", "tp", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["search"]["world"] == "2x2" and out["search"]["free"] == ["tp"]
    assert ultractl.main(["plan", "--job", str(TINY), "--world", "2x2", "--explain"]) == 0
    assert "layout search on 2x2" in capsys.readouterr().out
    assert ultractl.main(["plan", "--job", str(TINY)]) == 2
    assert "--job needs --world" in capsys.readouterr().err
    # No valid layout: exit 1, with the reason.
    assert ultractl.main(["plan", "--job", str(TINY), "--world", "2x2",
                          "--set", "parallel.tp=3"]) == 1
    assert "parallel.tp must divide the devices per node" in capsys.readouterr().out
    assert ultractl.main(["plan", "--job", str(TINY), "--world", "2x2",
                          "--set", "parallel.tp=many"]) == 2
    assert "parallel.tp" in capsys.readouterr().err


def test_a_job_files_search_is_over_its_replan_dimensions_and_lists_ep(capsys) -> None:
    """examples/mixtral_8x7b.toml lets the daemon re-plan ep (and more): `plan --job` on 8x8
    searches them as for the live job, and its layouts carry ep."""
    mixtral = TINY.parent / "mixtral_8x7b.toml"
    assert ultractl.main(["plan", "--job", str(mixtral), "--world", "8x8", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "free: ep, tp, pp, zero, recompute, micro_batch" in out
    ranked = [line for line in out.splitlines() if line.startswith(("best:", "  #"))]
    assert len(ranked) >= 3 and any(" ep8 " in line for line in ranked), out
    # --free still overrides the file's list (ep 1, tp 1, pp 1: nothing fits 80 GB, exit 1).
    assert ultractl.main(["plan", "--job", str(mixtral), "--world", "8x8", "--free", "zero"]) == 1
    assert "free: zero" in capsys.readouterr().out
