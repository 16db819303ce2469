"""Reading secrets from files (admin token, etcd password) that only their owner may read.

A secret in a group- or world-accessible file is refused, not warned about: by the time
anyone reads a warning, the secret has leaked, and the fix (`chmod 600`) is one command.
The agent also insists that it owns the file: whoever owns it can read it whatever its mode,
and can replace the secret with one of their choosing.
"""

from __future__ import annotations

import stat
from pathlib import Path


class SecretFileError(ValueError):
    pass


def check_private(path: Path, flag: str, owner: int | None = None) -> None:
    """Refuse `path` unless only its owner can read or write it (mode 0600 or 0400) and, with
    `owner`, unless that uid owns it."""
    try:
        st = path.stat()
    except OSError as exc:
        raise SecretFileError(f"{flag} {path}: {exc.strerror}") from None
    if owner is not None and st.st_uid != owner:
        raise SecretFileError(
            f"{flag} {path} is owned by uid {st.st_uid}, not by this process's user (uid "
            f"{owner}); it holds a secret: run `chown {owner} {path}` or use a file of its own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SecretFileError(
            f"{flag} {path} is accessible by group or others (mode {mode:04o}); "
            f"it holds a secret: run `chmod 600 {path}`")


def read_secret(path: Path, flag: str, owner: int | None = None) -> str:
    """The stripped contents of a private, non-empty secret file (owned by `owner`, when
    given); errors name `flag` and path."""
    check_private(path, flag, owner)
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise SecretFileError(f"{flag} {path}: {exc.strerror}") from None
    if not secret:
        raise SecretFileError(f"{flag} {path} is empty")
    return secret
