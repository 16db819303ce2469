"""The Grafana dashboards and Prometheus rules of deploy/, and the metric names their queries use.

Tests parse the names out of the files, so a check of "every metric exists" follows the
dashboards and rules as they change rather than a list kept beside them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS = REPO / "deploy" / "prometheus"
RULE_FILES = sorted(PROMETHEUS.glob("*.rules.yml"))

# PromQL words that look like metric names: aggregation modifiers, set and bool operators.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.$:])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:]|\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (Grafana's $variables are not names)."""
    text = re.sub(r"\$\{?\w+\}?", "", expr)
    text = _STRING.sub("", text)
    text = re.sub(r"\{[^}]*\}", "", text)      # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)     # range and subquery durations
    text = _CLAUSE.sub("", text)               # label lists of by/without/on/ignoring
    return {n for n in _NAME.findall(text) if n.lower() not in _KEYWORDS}


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs() -> dict[str, list[str]]:
    """uid -> every PromQL expression of the dashboard (panel targets and query variables)."""
    out: dict[str, list[str]] = {}
    for path in DASHBOARDS:
        d = load_dashboard(path)
        exprs = [t["expr"] for p in panels(d) for t in p.get("targets", [])]
        for var in d.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                query = var["query"]
                query = query["query"] if isinstance(query, dict) else query
                # label_values(metric, label): the metric is the selector inside.
                m = re.fullmatch(r"label_values\((.*),\s*\w+\)", query.strip())
                exprs.append(m.group(1) if m else query)
        out[d["uid"]] = exprs
    return out


def rules() -> list[dict[str, Any]]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def names_used() -> dict[str, set[str]]:
    """Metric name -> the dashboards (uids) and alerts/records that use it."""
    used: dict[str, set[str]] = {}
    for uid, exprs in dashboard_exprs().items():
        for expr in exprs:
            for name in metric_names(expr):
                used.setdefault(name, set()).add(uid)
    for rule in rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(rule.get("alert") or rule["record"])
    return used
