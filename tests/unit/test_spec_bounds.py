"""Bad numbers, sizes and nesting in a job spec or an agent config are refused naming the field
or the file, never a crash (NaN/inf deadlines, 10**30 sizes, RecursionError)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from daemon.cli.ultrad import UsageError, _parser, resolve_options
from parallel import job as jobmod
from parallel.job import ConfigError, load, loads

pytestmark = pytest.mark.unit

MINIMAL = '[data]\nsource = "python-stdlib"\n'
DEEP = 10_000


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        (MINIMAL + "[fault]\njoin_timeout_s = inf\n", [],
         "fault.join_timeout_s must be a finite number (got inf)"),
        (MINIMAL + "[fault]\njoin_timeout_s = nan\n", [],
         "fault.join_timeout_s must be a finite number (got nan)"),
        (MINIMAL, ["fault.join_timeout_s=-inf"], "fault.join_timeout_s must be a finite number"),
        (MINIMAL + "[fault]\nrestore_timeout_s = -1.5\n", [], "fault.restore_timeout_s must be > 0"),
        (MINIMAL + "[fault]\nfirst_step_timeout_s = 1e9\n", [],
         "fault.first_step_timeout_s must be <= 86400"),
        (MINIMAL + "[fault]\nmax_failures = 100000000000\n", [], "fault.max_failures must be <="),
        (MINIMAL + "[train]\nlr = nan\n", [], "train.lr must be a finite number"),
        (MINIMAL + "[train]\ngrad_clip = inf\n", [], "train.grad_clip must be a finite number"),
        (MINIMAL + "[model]\nrope_theta = inf\n", [], "model.rope_theta must be a finite number"),
        (MINIMAL + f"[train]\nsteps = {10**30}\n", [], "train.steps must be a 64-bit integer"),
        (MINIMAL + f"[train]\nsteps = {2**40}\n", [], "train.steps must be <="),
        (MINIMAL + f"[train]\nglobal_batch = {2**40}\n", [], "train.global_batch must be <="),
        (MINIMAL + "[train]\nseed = -1\n", [], "train.seed must be >= 0"),
        (MINIMAL + f"[parallel]\ndp = {10**30}\n", [], "parallel.dp"),
        (MINIMAL + f"[parallel]\ntp = {2**20}\n", [], "parallel.tp must be <="),
        (MINIMAL + f"[model]\nhidden_size = {2**30}\n", [], "model.hidden_size must be <="),
        (MINIMAL + f"[checkpoint]\nkeep = {10**6}\n", [], "checkpoint.keep must be <="),
        (MINIMAL + f'[job]\nname = "{"x" * 5000}"\n', [], "job.name must be at most"),
        (MINIMAL + "[parallel]\nreplan = [" + '"tp", ' * 1000 + "]\n", [],
         "parallel.replan must have at most"),
    ],
)
def test_numbers_and_sizes_are_bounded_naming_the_field(text, overrides, message):
    with pytest.raises(ConfigError) as err:
        loads(text, overrides)
    assert message in str(err.value)


def test_the_defaults_and_the_example_are_within_the_bounds():
    loads(MINIMAL)
    loads(MINIMAL + "[fault]\njoin_timeout_s = 86400\n[train]\nseed = 0\n")


def _numeric_fields() -> list[str]:
    out = []
    for section in dataclasses.fields(jobmod.JobConfig):
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            tp = hints[f.name]
            options = typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,)
            if int in options or float in options:
                out.append(f"{section.name}.{f.name}")
    return out


def test_every_numeric_field_has_an_upper_bound():
    """A new int or float field must say how large it may be (parallel.job.MAX)."""
    missing = [name for name in _numeric_fields() if name not in jobmod.MAX]
    assert not missing, f"no upper bound in parallel.job.MAX for {missing}"
    assert not set(jobmod.MAX) - set(_numeric_fields())


def test_path_fields_are_typed_as_job_paths():
    """A field naming a file or directory is a JobPath, so agents check it (parallel.job_paths)."""
    for section in dataclasses.fields(jobmod.JobConfig):
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            if f.name.endswith(("dir", "path", "_file")) or f.name == "output_dir":
                assert hints[f.name] is jobmod.JobPath, f"{section.name}.{f.name}"


@pytest.mark.parametrize(
    "body",
    [
        "a = " + "[" * DEEP + "]" * DEEP,
        "a = " + "{b = " * DEEP + "1" + "}" * DEEP,
        "[train]\nsteps" + ".a" * DEEP + " = 1",
        "[" + ".".join(["train"] * DEEP) + "]\nx = 1",
    ],
    ids=["arrays", "inline-tables", "dotted-key", "table-header"],
)
def test_deeply_nested_job_file_is_a_config_error_naming_the_file(tmp_path, body):
    path = tmp_path / "deep.toml"
    path.write_text(MINIMAL + body + "\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(path) in str(err.value) and "nested deeper than" in str(err.value)


def test_deeply_nested_override_is_a_config_error():
    with pytest.raises(ConfigError, match="nested deeper than"):
        loads(MINIMAL, ["train.steps=" + "[" * DEEP + "]" * DEEP])


def test_brackets_inside_strings_and_comments_do_not_count():
    text = (MINIMAL + '[job]\nname = "' + "[" * 40 + '"  # ' + "{" * 40 + "\n"
            + "[parallel]\nreplan = [\'\'\'" + "[" * 40 + "\'\'\', \"\"\"a]]]\"\"\"\"]\n")
    with pytest.raises(ConfigError) as err:  # parsed fine; refused only for the bogus replan
        loads(text)
    assert "parallel.replan must list distinct dimensions" in str(err.value)


def test_deeply_nested_agent_config_is_a_usage_error_naming_the_file(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text("devices = 1\nx = " + "[" * DEEP + "]" * DEEP + "\n")
    with pytest.raises(UsageError) as err:
        resolve_options(_parser().parse_args(["--config", str(path), "--etcd", "h:1"]), {})
    assert str(path) in str(err.value) and "nested deeper than" in str(err.value)
