"""What every command-line tool of the distribution shares.

- Its version, from one source: `version` in pyproject.toml. A source tree (an editable
  install, or a checkout on PYTHONPATH) reads the pyproject.toml beside its packages, so a bump
  shows at once; an installed wheel has none there and reads its own metadata instead.
- A parser whose usage errors are one line (`PROG: error: ... (see PROG --help)`, exit 2) and
  whose help shows each option's default.

Pure and cheap (no torch): `ultractl --version` must not wait for an import.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DISTRIBUTION = "ultrascale"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
EXIT_USAGE = 2


def version_from_pyproject(path: Path) -> str | None:
    """`project.version` of the pyproject.toml at `path` if it is this distribution's."""
    try:
        project = tomllib.loads(path.read_text()).get("project", {})
    except (OSError, ValueError):
        return None
    if project.get("name") != DISTRIBUTION or not isinstance(project.get("version"), str):
        return None
    return str(project["version"])


@functools.cache
def version() -> str:
    """This distribution's version; "unknown" when neither source has it."""
    found = version_from_pyproject(PYPROJECT)
    if found is not None:
        return found
    import importlib.metadata  # slow to import: only where there is no pyproject.toml

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def version_line(prog: str) -> str:
    return f"{prog} {version()}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; `(default: X)` after an option's help when it has one.

    None, False and "" are no default worth showing (a required value, an off switch, unset).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default:" in text or default is argparse.SUPPRESS
                or default is None or default is False or default == "" or default == []
                or not action.option_strings or action.help is argparse.SUPPRESS):
            return action.help
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with one-line usage errors and defaults in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_version(parser: argparse.ArgumentParser, prog: str) -> None:
    """`--version`: print `PROG VERSION` and exit 0."""
    parser.add_argument("--version", action="version", version=version_line(prog),
                        help="print the version and exit")
