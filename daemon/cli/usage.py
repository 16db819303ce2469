"""Checks `ultrad` and `ultrad local` share: a usage error (exit 2) names the flag."""

from __future__ import annotations

from pathlib import Path

MAX_DEVICES = 1024  # per node


class UsageError(ValueError):
    pass


def check_directory(flag: str, path: Path) -> None:
    """UsageError unless `path` is a directory or could be made one (its first existing
    ancestor is a directory); permissions are checked where it is used."""
    for here in (path, *path.parents):
        try:
            exists, is_dir = here.exists(), here.is_dir()
        except OSError:  # not searchable: reported where the path is used
            return
        if exists:
            if not is_dir:
                where = "" if here == path else f" ({here} is a file)"
                raise UsageError(f"{flag} {path}: not a directory{where}")
            return
