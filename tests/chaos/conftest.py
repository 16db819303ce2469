"""Chaos suite plumbing: opt-in, the `chaos` fixture, the report and its table.

Chaos scenarios (marker `chaos`) are deselected unless `ULTRA_CHAOS=1` is set or `--chaos` is
given (`--chaos` is only known when tests/chaos is on the command line, since pytest reads
options from the conftest files it starts with). `test_random_sequence_short` is not marked
`chaos` and runs in the default suite.

Every scenario appends rows to a JSON lines report: `ULTRA_CHAOS_REPORT`, else
`<pytest basetemp>/chaos_report.jsonl`; the table is printed at the end of the session.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.runner import ChaosRun

REPORT_KEY = pytest.StashKey[Path]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--chaos", action="store_true", default=False,
                     help="run the chaos scenarios (tests/chaos); same as ULTRA_CHAOS=1")


def chaos_enabled(config: pytest.Config) -> bool:
    if os.environ.get("ULTRA_CHAOS", "") not in ("", "0"):
        return True
    try:
        return bool(config.getoption("--chaos"))
    except ValueError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ULTRA_CHAOS=1 / --chaos the scenarios are deselected (not run, not reported as
    skipped): they belong to `make chaos`, not to the default suite."""
    if chaos_enabled(config):
        return
    here = Path(__file__).parent
    chosen, dropped = [], []
    for item in items:
        is_chaos = item.get_closest_marker("chaos") and here in Path(str(item.fspath)).parents
        (dropped if is_chaos else chosen).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = chosen


@pytest.fixture(scope="session")
def chaos_report(tmp_path_factory: pytest.TempPathFactory,
                 pytestconfig: pytest.Config) -> Path:
    env = os.environ.get("ULTRA_CHAOS_REPORT")
    path = Path(env) if env else tmp_path_factory.getbasetemp() / "chaos_report.jsonl"
    pytestconfig.stash[REPORT_KEY] = path
    return path


@pytest.fixture(scope="session")
def replay_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("ULTRA_CHAOS_REPLAY_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("replay-cache")


@pytest.fixture
def chaos(tmp_path: Path, token_file: Path, chaos_report: Path, replay_cache: Path,
          request: pytest.FixtureRequest) -> Iterator[Any]:
    """`chaos(**options)` -> a started ChaosRun (see runner.ChaosRun), stopped at the end."""
    made: list[ChaosRun] = []

    def make(scenario: str | None = None, **options: Any) -> ChaosRun:
        run = ChaosRun(tmp_path / f"run{len(made)}", token_file,
                       scenario or request.node.name.removeprefix("test_"),
                       report=chaos_report, replay_cache=replay_cache, **options)
        made.append(run)
        run.start()
        return run

    try:
        yield make
    finally:
        for run in made:
            try:
                if not run.recorded:
                    run.outcome.error = run.outcome.error or "the scenario did not get to the end"
                    try:
                        run.measure()
                    finally:
                        run.record()
            finally:
                run.stop()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    path = config.stash.get(REPORT_KEY, None)
    if path is None or not path.exists():
        return
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not rows:
        return
    head = ["scenario", "fault", "stall s", "steps re-run", "exact", "max rel diff", "ok"]
    table = [head] + [[
        r["scenario"], r["fault"], _fmt(r["stall_s"]), _fmt(r["steps_rerun"]),
        _fmt(r["exact"]), "-" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}",
        _fmt(r["ok"])] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    terminalreporter.write_sep("=", f"chaos report ({path})")
    for i, row in enumerate(table):
        terminalreporter.write_line("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            terminalreporter.write_line("  ".join("-" * w for w in widths))
    for r in rows:
        if not r["ok"] and r.get("error"):
            terminalreporter.write_line(f"{r['scenario']}: {r['error'][:300]}")
