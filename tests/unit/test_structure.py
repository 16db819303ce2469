"""The code base's shape: no import cycle among its modules or its packages, the daemon's
layers importing only downwards and a bottom that imports nothing above it, and a repository
that stands alone (no references to documents outside it). Files are cut by concept, not by a
line count."""

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
# Every package of the repository's own code.
PACKAGES = ("bench", "checkpoint", "daemon", "models", "ops", "parallel", "proto", "tools",
            "trainer")
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
def module_graph(packages: tuple[str, ...]) -> dict[str, frozenset[str]]:
    """Module → the modules of `packages` it imports (resolved to modules that exist).

    A module's own enclosing packages are left out: importing `a.b.c` runs `a/b/__init__.py`
    first whatever `c` needs, so that edge says nothing about the design (a family's
    `__init__` that imports its torch modules inside functions is not a cycle)."""
    files = {module_name(p): p for pkg in packages for p in python_files(REPO / pkg)}
    graph: dict[str, frozenset[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        for name in imported_modules(path):
            if not any(is_under(name, pkg) for pkg in packages):
                continue
            while name not in files and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in files and name != module and not is_under(module, name):
                targets.add(name)
        graph[module] = frozenset(targets)
    return graph


def daemon_graph() -> dict[str, frozenset[str]]:
    return module_graph(("daemon",))


def package_graph() -> dict[str, frozenset[str]]:
    """Top-level package → the other top-level packages its modules import."""
    graph: dict[str, set[str]] = {pkg: set() for pkg in PACKAGES}
    for module, targets in module_graph(PACKAGES).items():
        source = module.split(".")[0]
        graph[source] |= {t.split(".")[0] for t in targets} - {source}
    return {pkg: frozenset(targets) for pkg, targets in graph.items()}


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


def test_the_import_graph_sees_the_whole_repository() -> None:
    graph = module_graph(PACKAGES)
    assert "models.model_config" in graph["parallel.job"]
    assert "models" in package_graph()["parallel"]
    # the edge to a module's own package is left out, the one to a sibling is not
    assert "models.moe" not in graph["models.moe.model"]
    assert "models.moe.dispatch" in graph["models.moe.model"]


def test_no_import_cycle_among_the_repositorys_modules() -> None:
    cycle = find_cycle(module_graph(PACKAGES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_no_import_cycle_among_the_repositorys_packages() -> None:
    # models sits below parallel: the model families import nothing of parallel/, which asks
    # a family's spec for its plans (models/spec.py)
    cycle = find_cycle(package_graph())
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or ())


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
