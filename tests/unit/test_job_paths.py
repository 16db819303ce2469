"""parallel.job_paths: a job's paths resolved as the workers resolve them, checked against the
agent's allowed roots; and how `ultrad` reads those roots."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.cli.ultrad import UsageError, _parser, build_config, resolve_options
from parallel.job import ConfigError, loads
from parallel.job_paths import check_paths, job_path, set_paths

pytestmark = pytest.mark.unit

SOURCE = '[data]\nsource = "python-stdlib"\n'


def _job(*overrides: str):
    return loads(SOURCE, list(overrides))


def test_relative_paths_resolve_as_the_driver_uses_them(tmp_path: Path) -> None:
    job = _job(f'job.output_dir="{tmp_path}/out"', 'checkpoint.dir="ckpt"')
    assert job_path(job, "checkpoint.dir") == tmp_path / "out" / "ckpt"
    assert job_path(_job('checkpoint.dir="ckpt"'), "checkpoint.dir") == Path("ckpt")
    assert job_path(_job(), "checkpoint.dir") is None
    check_paths(job, [tmp_path])  # a relative checkpoint.dir under an allowed output dir
    # without an output dir, a relative path is under the workers' working directory
    check_paths(_job('checkpoint.dir="ckpt"'), [tmp_path], cwd=tmp_path)
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        check_paths(_job('checkpoint.dir="ckpt"'), [tmp_path / "x"], cwd=tmp_path)


def test_defaults_are_not_checked() -> None:
    assert set_paths(_job()) == []
    check_paths(_job(), [])
    assert set_paths(_job('data.cache_dir="/x"')) == ["data.cache_dir"]


@pytest.mark.parametrize("field", ["job.output_dir", "checkpoint.dir", "data.cache_dir"])
def test_escapes_are_refused_naming_the_field_and_the_roots(tmp_path: Path, field: str) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(tmp_path / "outside")
    (allowed / "loop").symlink_to(allowed / "loop")
    for value in ("/etc/x", f"{allowed}/a/../../outside", f"{allowed}/link/a",
                  f"{allowed}/loop/a", "~root/x"):
        with pytest.raises(ConfigError) as err:
            check_paths(_job(f'{field}="{value}"'), [allowed])
        assert str(err.value).startswith(field) and str(allowed) in str(err.value), value
    check_paths(_job(f'{field}="{allowed}/a/../b"'), [allowed])


def test_a_token_file_may_be_a_root_itself(tmp_path: Path) -> None:
    token = tmp_path / "tokens.bin"
    job = loads(f'[data]\npath = "{token}"\n')
    check_paths(job, [token])
    with pytest.raises(ConfigError, match="data.path"):
        check_paths(job, [tmp_path / "other"])


def test_every_source_of_a_blend_is_checked(tmp_path: Path) -> None:
    inside, outside = tmp_path / "allowed" / "a.bin", tmp_path / "b.bin"
    job = loads(f'[[data.sources]]\npath = "{inside}"\n[[data.sources]]\npath = "{outside}"\n'
                'weight = 2.0\n')
    assert set_paths(job) == ["data.sources[0].path", "data.sources[1].path"]
    with pytest.raises(ConfigError, match=r"^data\.sources\[1\]\.path"):
        check_paths(job, [tmp_path / "allowed"])
    check_paths(job, [tmp_path])


def _config(tmp_path: Path, text: str, *flags: str):
    path = tmp_path / "agent.toml"
    path.write_text(f'etcd = "h:1"\ndevices = 1\nstate_dir = "{tmp_path}/state"\n' + text)
    return build_config(resolve_options(_parser().parse_args(["--config", str(path), *flags]),
                                        {}))


def test_ultrad_reads_allowed_paths_from_config_flag_and_env(tmp_path: Path) -> None:
    assert _config(tmp_path, "").job_roots == (tmp_path / "state",)
    cfg = _config(tmp_path, 'allowed_paths = ["/a", "/b"]\n')
    assert cfg.allowed_paths == (Path("/a"), Path("/b")) and cfg.job_roots == cfg.allowed_paths
    assert _config(tmp_path, "", "--allowed-paths", "/c:/d").allowed_paths == (Path("/c"),
                                                                                Path("/d"))
    with pytest.raises(UsageError, match="agent.toml: allowed_paths must be a list"):
        _config(tmp_path, "allowed_paths = 5\n")


@pytest.mark.parametrize(("flag", "value"), [("--etcd-outage", "nan"), ("--etcd-outage", "inf"),
                                             ("--ttl", "100000")])
def test_agent_numbers_are_finite_and_bounded(tmp_path: Path, flag: str, value: str) -> None:
    with pytest.raises(UsageError, match=flag):
        _config(tmp_path, "", flag, value)
