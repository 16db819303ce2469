"""Where a job's files are, and the check that keeps them under the directories an agent allows.

Workers run as the agent's user (root under a plain systemd unit) and create, write, prune and
read what the spec's path fields name, so whoever can submit a job must not be able to point them
anywhere. Every field typed `JobPath` is checked: resolved the way the workers resolve it (`~`,
then a relative checkpoint.dir under job.output_dir, any other relative path under the working
directory), then with `..` and symlinks resolved, it must lie under one of the roots. A field
left at its default is the deployment's choice, not the submitter's, and is not checked.

The driver finds its directories through `job_path` too, so the check and the use cannot drift.
The agents run it when a job is submitted (SubmitJob, --job-file) and again before their workers
take a generation of it (a spec written into etcd directly); README, "Job files".
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Sequence
from pathlib import Path

from parallel.job import ConfigError, JobConfig, JobPath


@functools.cache
def _path_fields(cls: type) -> tuple[tuple[str, str], ...]:
    """(key, default) of every JobPath field of the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, f.default) for f in dataclasses.fields(cls) if hints[f.name] is JobPath)


@functools.cache
def _nested_fields(cls: type) -> tuple[str, ...]:
    """Fields of `cls` that hold a tuple of dataclasses (`[[data.sources]]`)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is tuple and args and dataclasses.is_dataclass(args[0]):
            out.append(f.name)
    return tuple(out)


def _set_values(prefix: str, obj: object) -> list[tuple[str, str]]:
    """(name, value) of the JobPath fields of `obj` (and of its nested tables) that differ from
    their defaults."""
    out = [(f"{prefix}.{key}", getattr(obj, key)) for key, default in _path_fields(type(obj))
           if getattr(obj, key) != default]
    for key in _nested_fields(type(obj)):
        for i, item in enumerate(getattr(obj, key)):
            out += _set_values(f"{prefix}.{key}[{i}]", item)
    return out


def _field_values(job: JobConfig) -> dict[str, str]:
    out: dict[str, str] = {}
    for section in dataclasses.fields(JobConfig):
        out.update(_set_values(section.name, getattr(job, section.name)))
    return out


def job_path(job: JobConfig, name: str) -> Path | None:
    """The path field `name` (`section.key`, or `data.sources[i].path`) as the workers use it,
    unresolved; None if unset."""
    value = _field_values(job).get(name)
    if not value:
        return None
    path = Path(value).expanduser()
    out = job_path(job, "job.output_dir") if name == "checkpoint.dir" else None
    return path if path.is_absolute() or out is None else out / path


def set_paths(job: JobConfig) -> list[str]:
    """The path fields `job` sets to something other than their defaults."""
    return list(_field_values(job))


def check_paths(job: JobConfig, roots: Sequence[Path], cwd: Path | None = None) -> None:
    """ConfigError naming the first set path field that resolves outside every root.

    `cwd` is the workers' working directory (default: this process's, which they inherit)."""
    base = cwd or Path.cwd()
    allowed = [(base / root).resolve() for root in roots]
    shown = ", ".join(str(root) for root in allowed) or "none"
    for name in set_paths(job):
        path = job_path(job, name)
        assert path is not None
        try:
            resolved = (base / path).resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
            raise ConfigError(f"{name}: cannot resolve {path}: {exc}") from None
        if not any(resolved.is_relative_to(root) for root in allowed):
            raise ConfigError(
                f"{name} = {_field_values(job)[name]!r} resolves to {resolved}, "
                f"outside the directories job paths may use on this node ({shown}; the "
                f"agent's allowed_paths)")
