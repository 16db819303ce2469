"""ultractl's config file: named contexts (agent endpoints + credentials), kubectl style.

`--config FILE`, else `$ULTRACTL_CONFIG`, else `$XDG_CONFIG_HOME/ultrascale/config` (default
`~/.config/ultrascale/config`), YAML:

    current-context: local
    contexts:
      local:
        endpoint: 127.0.0.1:7400,127.0.0.1:7401   # what the operator set (seeds)
        token-file: /tmp/ultrad-local/token
        discovered: [127.0.0.1:7400, 127.0.0.1:7401, 127.0.0.1:7402]   # written by ultractl

`discovered` is the member list an agent last reported, so a context keeps working when the
agents it was set up with are gone; `endpoint` is never rewritten by discovery. Keys this
module does not know are kept as they are when the file is rewritten, so a newer ultractl can
add fields to a context without an older one dropping them. The file is written atomically
(temporary file, fsync, rename) with mode 0600, since it names credentials.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Mapping
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
    discovered: tuple[str, ...] = ()
    tls_cert: str = ""  # a client certificate, for agents that require one (mTLS)
    tls_key: str = ""

    def endpoints(self) -> tuple[str, ...]:
        """The seeds first, then the discovered members, each once."""
        return tuple(dict.fromkeys([*split_endpoints(self.endpoint), *self.discovered]))


@dataclass(frozen=True)
class ContextRow:
    """One context as `config get-contexts` shows it: every key of its entry, unknown ones too."""
    name: str
    current: bool
    entry: Mapping[str, Any]


_ENDPOINT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}")


def split_endpoints(text: str, what: str = "--endpoint") -> tuple[str, ...]:
    """`host:port[,host:port...]` as a tuple; `what` names the flag or field in errors."""
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if not _ENDPOINT.fullmatch(p)]
    if bad or not parts:
        raise ContextError(f"{what}: expected HOST:PORT[,HOST:PORT...] (got {text!r})")
    return parts


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("ULTRACTL_CONFIG"):
        return Path(env["ULTRACTL_CONFIG"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "ultrascale" / "config"


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"contexts": {}}
    except OSError as exc:
        raise ContextError(f"{path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ContextError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ContextError(f"{path}: expected a mapping at the top level")
    contexts = raw.setdefault("contexts", {})
    if not isinstance(contexts, dict):
        raise ContextError(f"{path}: contexts: expected a mapping of name to context")
    for name, entry in contexts.items():
        if not isinstance(entry, dict):
            raise ContextError(f"{path}: contexts.{name}: expected a mapping")
    return raw


def _write(path: Path, raw: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # A unique temporary name: two ultractl processes may rewrite the file at once.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(dict(raw), f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _context(path: Path, name: str, entry: Mapping[str, Any]) -> Context:
    discovered = entry.get("discovered") or []
    if not isinstance(discovered, list) or not all(isinstance(e, str) for e in discovered):
        raise ContextError(f"{path}: contexts.{name}.discovered: expected a list of HOST:PORT")
    return Context(name, str(entry["endpoint"]), str(entry.get("token-file") or ""),
                   str(entry.get("tls-ca") or ""), tuple(discovered),
                   str(entry.get("tls-cert") or ""), str(entry.get("tls-key") or ""))


def load_context(path: Path, name: str = "") -> Context | None:
    """The context `name`, else the current one; None when neither is set."""
    raw = _read(path)
    name = name or str(raw.get("current-context") or "")
    if not name:
        return None
    contexts = raw["contexts"]
    entry = contexts.get(name)
    if entry is None or not entry.get("endpoint"):
        known = ", ".join(sorted(contexts)) or "none"
        raise ContextError(f"--context: no context {name!r} with an endpoint in {path} "
                           f"(known: {known})")
    return _context(path, name, entry)


def list_contexts(path: Path) -> tuple[str, tuple[ContextRow, ...]]:
    """The current context's name and every context, sorted by name."""
    raw = _read(path)
    current = str(raw.get("current-context") or "")
    return current, tuple(ContextRow(name, name == current, dict(entry))
                          for name, entry in sorted(raw["contexts"].items()))


def save_context(path: Path, context: Context, make_current: bool = True) -> None:
    """Add or replace one context, keeping the others (and the entry's unknown keys)."""
    raw = _read(path)
    entry = raw["contexts"].setdefault(context.name, {})
    if entry.get("endpoint") != context.endpoint:
        # Members discovered through other endpoints belong to another cluster.
        entry.pop("discovered", None)
    entry.update({"endpoint": context.endpoint, "token-file": context.token_file})
    for key, value in (("tls-ca", context.tls_ca), ("tls-cert", context.tls_cert),
                       ("tls-key", context.tls_key)):
        if value:
            entry[key] = value
        else:
            entry.pop(key, None)
    if make_current:
        raw["current-context"] = context.name
    _write(path, raw)


def set_context(path: Path, name: str, fields: Mapping[str, str | None]) -> bool:
    """Create or modify `name`: only the given fields change (an empty value removes one).

    `fields` maps file keys (`endpoint`, `token-file`, `tls-ca`, `tls-cert`, `tls-key`) to values, None = not given.
    Returns True when the context is new.
    """
    raw = _read(path)
    contexts = raw["contexts"]
    created = name not in contexts
    given = {k: v for k, v in fields.items() if v is not None}
    if "endpoint" in given:
        split_endpoints(given["endpoint"])
    if created and not given.get("endpoint"):
        raise ContextError(f"set-context {name}: a new context needs --endpoint")
    entry = contexts.setdefault(name, {})
    if "endpoint" in given and given["endpoint"] != entry.get("endpoint"):
        entry.pop("discovered", None)
    for key, value in given.items():
        if value:
            entry[key] = value
        elif key == "endpoint":
            raise ContextError(f"set-context {name}: --endpoint cannot be empty")
        else:
            entry.pop(key, None)
    _write(path, raw)
    return created


def use_context(path: Path, name: str) -> None:
    raw = _read(path)
    if name not in raw["contexts"]:
        known = ", ".join(sorted(raw["contexts"])) or "none"
        raise ContextError(f"use-context: no context {name!r} in {path} (known: {known})")
    raw["current-context"] = name
    _write(path, raw)


def delete_context(path: Path, name: str) -> None:
    raw = _read(path)
    if name not in raw["contexts"]:
        known = ", ".join(sorted(raw["contexts"])) or "none"
        raise ContextError(f"delete-context: no context {name!r} in {path} (known: {known})")
    del raw["contexts"][name]
    if raw.get("current-context") == name:
        raw.pop("current-context")
    _write(path, raw)


def save_discovered(path: Path, name: str, endpoints: Iterable[str]) -> bool:
    """Record the members an agent reported; False (and no write) when nothing changed."""
    raw = _read(path)
    entry = raw["contexts"].get(name)
    found = sorted(set(endpoints))
    if entry is None or not found or entry.get("discovered") == found:
        return False
    entry["discovered"] = found
    _write(path, raw)
    return True
