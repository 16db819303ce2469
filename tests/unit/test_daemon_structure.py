"""The daemon's shape: no import cycles, layers that only import downwards, a bottom that
imports nothing above it, and a repository that stands alone (no references to documents
outside it). Files are cut by concept, not by a line count."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DAEMON = REPO / "daemon"
# Packages below the daemon: they must run (and be tested) without it.
LIBRARIES = ("trainer", "parallel", "checkpoint", "ops")
# What each daemon layer must not import (a prefix matches the module and everything below it).
FORBIDDEN = {
    "daemon.control": ("daemon.node", "daemon.api", "daemon.cli", "daemon.agent"),
    "daemon.node": ("daemon.api", "daemon.cli", "daemon.agent"),
    # torchrun's rendezvous backend: etcd and the key schema only, no agent
    "daemon.rendezvous": ("daemon.node", "daemon.api", "daemon.cli", "daemon.agent"),
}
# Modules every layer may import (metrics, and the records they observe): they import nothing
# of the daemon but each other and the package itself (its version).
BOTTOM = ("daemon.metrics", "daemon.expert_metrics", "daemon.control.records",
          "daemon.recovery_phases")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path) -> Iterator[str]:
    """Every module `path` imports, anywhere in the file (TYPE_CHECKING and functions too).

    `from a.b import c` yields `a.b.c` and `a.b`: the caller keeps what names a module.
    """
    is_package = path.name == "__init__.py"
    package = module_name(path).split(".")
    if not is_package:
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            yield full
            yield from (f"{full}.{alias.name}" for alias in node.names)


def is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@functools.cache
def daemon_graph() -> dict[str, frozenset[str]]:
    """Module → the daemon modules it imports (resolved to modules that exist)."""
    files = {module_name(p): p for p in python_files(DAEMON)}
    graph: dict[str, frozenset[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        for name in imported_modules(path):
            if not is_under(name, "daemon"):
                continue
            while name not in files and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in files and name != module:
                targets.add(name)
        graph[module] = frozenset(targets)
    return graph


def find_cycle(graph: Mapping[str, Set[str]]) -> list[str] | None:
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = grey
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if color.get(nxt, black) == grey:
                return stack[stack.index(nxt):] + [nxt]
            if color.get(nxt) == white:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = black
        return None

    for node in sorted(graph):
        if color[node] == white:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_import_graph_sees_the_daemon() -> None:
    graph = daemon_graph()
    assert "daemon.control.records" in graph["daemon.control.decide"]
    assert "daemon.control.decide" in graph["daemon.control.leader"]


def test_no_import_cycle_among_daemon_modules() -> None:
    cycle = find_cycle(daemon_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_daemon_layers_only_import_downwards() -> None:
    violations = sorted(
        f"{src} -> {dst}"
        for src, targets in daemon_graph().items()
        for layer, banned in FORBIDDEN.items() if is_under(src, layer)
        for dst in targets if any(is_under(dst, b) for b in banned))
    assert not violations, "layer violations:\n" + "\n".join(violations)


def test_the_bottom_imports_nothing_above_it() -> None:
    graph = daemon_graph()
    assert "daemon.control.records" in graph["daemon.metrics"]  # the graph sees it
    above = sorted(f"{src} -> {dst}" for src in BOTTOM for dst in graph[src]
                   if dst not in {*BOTTOM, "daemon"})
    assert not above, "the bottom imports upwards:\n" + "\n".join(above)
    assert not graph["daemon"], graph["daemon"]


def test_libraries_do_not_import_the_daemon() -> None:
    violations = sorted(
        f"{path.relative_to(REPO)} imports {name}"
        for lib in LIBRARIES for path in python_files(REPO / lib)
        for name in set(imported_modules(path)) if is_under(name, "daemon"))
    assert not violations, "\n".join(violations)


# The design brief and the measured notes live outside the repository; the names are split so
# this file does not itself read as a pointer to them.
_BRIEF, _NOTES = "ARCHITECTURE" + r"\.md", "notes" + "/"
OUTSIDE_REFERENCE = re.compile(_BRIEF + r"|(?<![\w.-])(?:\.\./|~/|/)?(?:\w+/)*" + _NOTES)


def repository_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True, timeout=30).stdout.decode()
    return [REPO / name for name in sorted(set(listed.split("\0"))) if name]


def test_the_reference_pattern() -> None:
    brief, notes = "ARCHITECTURE" + ".md", "notes" + "/"
    for text in (f"see {brief}", f"(shared/{notes}x.md)", f"../{notes}a.md", f"{notes}b.md"):
        assert OUTSIDE_REFERENCE.search(text), text
    for text in ("docs/architecture.md", "release-notes/x", "footnotes/ here", "keynotes/"):
        assert not OUTSIDE_REFERENCE.search(text), text


def test_the_repository_stands_alone() -> None:
    this = Path(__file__).resolve()
    hits: list[str] = []
    for path in repository_files():
        if path.resolve() == this or not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for number, line in enumerate(text.splitlines(), start=1):
            if OUTSIDE_REFERENCE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, "references to documents outside the repository:\n" + "\n".join(hits)
