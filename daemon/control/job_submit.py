"""Turning a job file into the `spec` record and writing it: what SubmitJob and
`ultrad --job-file` share.

`--job-file` exists for deployments that ship the job with the agents (a Kubernetes ConfigMap
mounted into every pod): each agent offers the job when it starts, etcd takes the first offer
and only if no job is stored yet, so agents restarting or rolling out never replace a running
job; replacing it stays an explicit `ultractl job submit --replace`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.keys import Keys
from daemon.control.records import JobSpec
from daemon.tasks import Backoff
from parallel import job as jobmod
from parallel.job_paths import check_paths
from parallel.layout import resolve

log = logging.getLogger(__name__)

# etcd refuses requests over --max-request-bytes (1.5 MiB by default); keep room for the
# transaction around the value.
MAX_SPEC_BYTES = 1024 * 1024


def prepare_spec(toml: str, overrides: Sequence[str], source: str,
                 roots: Sequence[Path]) -> JobSpec:
    """The validated job as stored in etcd; jobmod.ConfigError names the offending field.

    Its paths must lie under `roots` (the agent's allowed_paths, parallel.job_paths)."""
    job = jobmod.loads(toml, list(overrides), source=source)
    check_paths(job, roots)
    p = job.parallel
    # Check the layout on the smallest world it could run on, so an unsupported or
    # inconsistent parallelism is refused now rather than when nodes are planned. With dp
    # "auto", the smallest dp is ep (expert parallelism takes its ranks from dp).
    resolve(job, (p.dp if isinstance(p.dp, int) else p.ep) * p.tp * p.pp * p.cp)
    spec = JobSpec(config=job.to_dict(), toml=toml, overrides=tuple(overrides),
                   submitted_at=time.time())
    size = len(spec.to_json())
    if size > MAX_SPEC_BYTES:
        raise jobmod.ConfigError(
            f"{source}: the stored job is {size} bytes, over the {MAX_SPEC_BYTES} byte limit "
            f"(etcd refuses requests over --max-request-bytes, 1.5 MiB by default)")
    return spec


async def write_spec(etcd: Etcd, keys: Keys, spec: JobSpec, replace: bool,
                     ended_revision: int = 0) -> int | None:
    """Store `spec`; the revision, or None when a job exists and `replace` is false.

    `ended_revision`: the stored job's revision, known to have ended (finished, failed,
    cancelled); it is replaced without `replace` unless it changed meanwhile."""
    if replace:
        compare = []
    elif ended_revision:
        compare = [etcd.tx.mod(keys.spec) == ended_revision]
    else:
        compare = [etcd.tx.version(keys.spec) == 0]
    # A new job starts from nothing: the previous job's progress and orders go with it.
    ok, responses = await etcd.txn(
        compare,
        [etcd.tx.put(keys.spec, spec.to_json()), etcd.tx.delete(keys.progress),
         etcd.tx.delete(keys.checkpoint), etcd.tx.delete(keys.directive)],
    )
    return int(responses[0].response_put.header.revision) if ok else None


def read_job_file(path: Path, roots: Sequence[Path]) -> JobSpec:
    """`--job-file`, validated; ValueError names the flag and the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--job-file {path}: {exc.strerror}") from None
    source = f"--job-file {path}"
    try:
        return prepare_spec(text, (), source=source, roots=roots)
    except jobmod.ConfigError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(source) else f"{source}: {message}"
                         ) from None


async def offer_job_file(etcd: Etcd, keys: Keys, path: Path, ttl: float,
                         roots: Sequence[Path]) -> None:
    """Store the job of `path` unless a job is already stored; retried until etcd answers."""
    spec = read_job_file(path, roots)
    backoff = Backoff(initial=0.1, maximum=ttl / 2)
    while True:
        try:
            revision = await write_spec(etcd, keys, spec, replace=False)
        except ETCD_ERRORS as exc:
            log.debug("--job-file %s not offered yet: %s", path, exc)
            await backoff.sleep()
            continue
        if revision is None:
            log.info("--job-file %s: a job is already stored; keeping it", path)
        else:
            log.info("--job-file %s: submitted (revision %d)", path, revision)
        return
