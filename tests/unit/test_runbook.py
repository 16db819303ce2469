"""docs/runbook.md against deploy/prometheus/alerts.rules.yml: every alert's runbook_url names
its own section, every section says what the alert means, what to check and what to do, and
no section outlives its alert."""

from __future__ import annotations

import re

import pytest

from tests.deploy_files import REPO, rules

pytestmark = pytest.mark.unit

RUNBOOK = REPO / "docs" / "runbook.md"


def sections() -> dict[str, str]:
    """`## Title` -> the text up to the next such heading."""
    parts = re.split(r"^## (.+)$", RUNBOOK.read_text(), flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def anchor(title: str) -> str:
    """The anchor Markdown renderers give a heading (lower case, spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_every_alert_links_its_own_runbook_section() -> None:
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert {"UltraAgentDown", "UltraAllAgentsDown", "UltraAgentsAbsent"} <= set(alerts)
    found = sections()
    for name, rule in alerts.items():
        url = rule["annotations"].get("runbook_url")
        assert url == f"docs/runbook.md#{anchor(name)}", (name, url)
        assert name in found, f"docs/runbook.md has no section for {name}"
    assert set(found) == set(alerts), f"sections without an alert: {set(found) - set(alerts)}"


def test_every_section_says_what_it_means_what_to_check_and_what_to_do() -> None:
    for title, body in sections().items():
        for part in ("**Means**:", "**Check**:", "**Do**:"):
            assert part in body, f"{title}: no {part}"
