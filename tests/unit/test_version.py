"""One version source (pyproject.toml's `version`), `--version` on every command, help texts
that show defaults."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import daemon
from daemon.cli import versioncmd
from parallel import bounded_toml, cli_common
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.unit.test_structure import repository_files

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = bounded_toml.loads((REPO / "pyproject.toml").read_text(), "pyproject.toml")
VERSION = PYPROJECT["project"]["version"]
# Module and the name it prints, for every console script.
COMMANDS = {"daemon.cli.ultrad": "ultrad", "daemon.cli.ultractl": "ultractl",
            "trainer.prepare": "ultrascale-prepare", "trainer.hf_cli": "ultrascale-hf",
            "trainer": "ultrascale trainer"}


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ULTRA", "PYTHON"))}
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**base, "PYTHONPATH": str(REPO),
                                                       **(env or {})})


def test_the_version_is_pyprojects() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", VERSION)
    assert cli_common.version() == VERSION
    assert daemon.__version__ == VERSION  # what agents put in their node record and /metrics


def test_another_projects_pyproject_is_not_read(tmp_path: Path) -> None:
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "other"\nversion = "9.9.9"\n')
    assert cli_common.version_from_pyproject(other) is None
    assert cli_common.version_from_pyproject(tmp_path / "missing.toml") is None
    other.write_text('[project]\nname = "ultrascale"\nversion = "9.9.9"\n')
    assert cli_common.version_from_pyproject(other) == "9.9.9"


def test_an_installed_copy_reads_its_metadata(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    # A wheel has no pyproject.toml beside its packages.
    monkeypatch.setattr(cli_common, "PYPROJECT", tmp_path / "pyproject.toml")
    cli_common.version.cache_clear()
    try:
        assert cli_common.version() == importlib.metadata.version("ultrascale")
    finally:
        cli_common.version.cache_clear()


def test_no_other_file_spells_the_version() -> None:
    """A release changes pyproject.toml; the Kubernetes image tag must equal it (kustomize
    cannot read Python), and the changelog names released versions in its headings."""
    spelled = re.compile(r"(?<![\w.])" + re.escape(VERSION) + r"(?![\w.])")
    allowed = {
        "pyproject.toml": re.compile(r'version = "' + re.escape(VERSION) + '"'),
        "deploy/k8s/kustomization.yaml": re.compile(r'\s*newTag: "' + re.escape(VERSION) + '".*'),
        "CHANGELOG.md": re.compile(r"## \[" + re.escape(VERSION) + r"\].*|\[" + re.escape(VERSION)
                                   + r"\]: .*"),
    }
    hits = []
    for path in repository_files():
        name = str(path.relative_to(REPO))
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if spelled.search(line) and not (name in allowed and allowed[name].fullmatch(line)):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, "the version spelled outside pyproject.toml:\n" + "\n".join(hits)
    kustomization = (REPO / "deploy/k8s/kustomization.yaml").read_text()
    assert f'newTag: "{VERSION}"' in kustomization, "the image tag must be the version"


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_every_command_answers_version(module: str) -> None:
    done = _run(module, "--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{COMMANDS[module]} {VERSION}\n", "")


def test_ultrad_local_answers_version() -> None:
    done = _run("daemon.cli.ultrad", "local", "--version")
    assert (done.returncode, done.stdout) == (0, f"ultrad {VERSION}\n")


def test_ultractl_version_client_only(tmp_path: Path) -> None:
    env = {"ULTRACTL_CONFIG": str(tmp_path / "config")}
    done = _run("daemon.cli.ultractl", "version", "--client", "-o", "json", env=env)
    assert done.returncode == 0 and json.loads(done.stdout) == {"client": VERSION}
    # Without a cluster to ask: the client's version, then the usage error (exit 2).
    done = _run("daemon.cli.ultractl", "version", env=env)
    assert done.returncode == 2 and done.stdout.splitlines()[1].split() == ["ultractl", VERSION]
    assert done.stderr.count("\n") == 1 and "--endpoint" in done.stderr


def test_ultractl_version_lists_each_agents() -> None:
    reply = pb.ListNodesResponse(nodes=[pb.Node(node="b", version="0.0.1"), pb.Node(node="a")])
    asked: list[Any] = []

    class Agents:
        def ListNodes(self, request: Any, timeout: float, metadata: Any) -> Any:  # noqa: N802
            asked.append((request, timeout, metadata))
            return reply

    out: list[tuple[Any, list[str]]] = []
    args = SimpleNamespace(client=False, timeout=3.0, output="table")
    assert versioncmd.run(args, lambda: (Agents(), ("md",)),
                          lambda data, _, table: out.append((data, list(table(data))))) == 0
    assert asked == [(pb.ListNodesRequest(), 3.0, ("md",))]
    data, lines = out[0]
    assert data == {"client": VERSION, "agents": {"a": "unknown", "b": "0.0.1"}}
    assert [line.split() for line in lines] == [["COMPONENT", "VERSION"], ["ultractl", VERSION],
                                                ["ultrad", "a", "unknown"], ["ultrad", "b", "0.0.1"]]


def test_ultractl_version_prints_the_client_before_an_unreachable_cluster() -> None:
    out: list[Any] = []

    def unreachable() -> Any:
        raise ConnectionError("no agent")

    args = SimpleNamespace(client=False, timeout=3.0, output="json")
    with pytest.raises(ConnectionError):
        versioncmd.run(args, unreachable, lambda data, *_: out.append(data))
    assert out == [{"client": VERSION}]


@pytest.mark.parametrize(("argv", "shown"), [
    (["daemon.cli.ultrad"], ["--listen LISTEN", "(default: 127.0.0.1:7400)", "(default: 5)"]),
    (["daemon.cli.ultrad", "local"], ["(default: 3)"]),
    (["daemon.cli.ultractl"], ["(default: table)", "(default: 10.0)"]),
    (["trainer.prepare"], ["(default: text)"]),
    (["trainer.hf_cli", "export"], ["(default: fp32)"]),
])
def test_help_shows_defaults(argv: list[str], shown: list[str]) -> None:
    done = _run(*argv, "--help")
    text = " ".join(done.stdout.split())  # argparse wraps lines
    assert done.returncode == 0 and all(s in text for s in shown), done.stdout
    assert "(default: None)" not in text
