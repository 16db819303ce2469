"""Reading secrets from files (admin token, etcd password) that only their owner may read.

A secret in a group- or world-accessible file is refused, not warned about: by the time
anyone reads a warning, the secret has leaked, and the fix (`chmod 600`) is one command.
"""

from __future__ import annotations

import stat
from pathlib import Path


class SecretFileError(ValueError):
    pass


def check_private(path: Path, flag: str) -> None:
    """Refuse `path` unless only its owner can read or write it (mode 0600 or 0400)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise SecretFileError(f"{flag} {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise SecretFileError(
            f"{flag} {path} is accessible by group or others (mode {mode:04o}); "
            f"it holds a secret: run `chmod 600 {path}`")


def read_secret(path: Path, flag: str) -> str:
    """The stripped contents of a private, non-empty secret file; errors name `flag` and path."""
    check_private(path, flag)
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise SecretFileError(f"{flag} {path}: {exc.strerror}") from None
    if not secret:
        raise SecretFileError(f"{flag} {path} is empty")
    return secret
