"""ultractl's config file: named contexts (endpoint + token file), kubectl style.

`$XDG_CONFIG_HOME/ultrascale/config` (default `~/.config/ultrascale/config`), YAML:

    current-context: local
    contexts:
      local: {endpoint: 127.0.0.1:7400, token-file: /tmp/ultrad-local/token}
      prod: {endpoint: 10.0.0.1:7400, token-file: ~/.ultra/token, tls-ca: ~/.ultra/ca.pem,
             tls-cert: ~/.ultra/operator.pem, tls-key: ~/.ultra/operator.key}
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ContextError(ValueError):
    pass


@dataclass(frozen=True)
class Context:
    name: str
    endpoint: str
    token_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""  # a client certificate, for agents that require one (mTLS)
    tls_key: str = ""


def config_path(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "ultrascale" / "config"


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ContextError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ContextError(f"{path}: expected a mapping at the top level")
    return raw


def load_context(path: Path, name: str = "") -> Context | None:
    raw = _read(path)
    name = name or str(raw.get("current-context", ""))
    if not name:
        return None
    contexts = raw.get("contexts") or {}
    entry = contexts.get(name) if isinstance(contexts, dict) else None
    if not isinstance(entry, dict) or not entry.get("endpoint"):
        known = ", ".join(sorted(contexts)) if isinstance(contexts, dict) else ""
        raise ContextError(f"--context: no context {name!r} with an endpoint in {path} "
                           f"(known: {known or 'none'})")
    return Context(name, str(entry["endpoint"]), str(entry.get("token-file", "")),
                   str(entry.get("tls-ca", "")), str(entry.get("tls-cert", "")),
                   str(entry.get("tls-key", "")))


def save_context(path: Path, context: Context, make_current: bool = True) -> None:
    """Add or replace one context, keeping the others; written atomically, 0600."""
    raw = _read(path)
    contexts = raw.get("contexts") if isinstance(raw.get("contexts"), dict) else {}
    entry = {"endpoint": context.endpoint, "token-file": context.token_file}
    for field, value in (("tls-ca", context.tls_ca), ("tls-cert", context.tls_cert),
                         ("tls-key", context.tls_key)):
        if value:
            entry[field] = value
    contexts[context.name] = entry
    raw["contexts"] = contexts
    if make_current:
        raw["current-context"] = context.name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=True)
    tmp.replace(path)
