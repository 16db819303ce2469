"""Job spec parsing and validation: every error names its field; the CLI exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parallel.job import ConfigError, FaultConfig, from_dict, load, loads, process_group_timeout
from parallel.layout import resolve
from tests.conftest import REPO, small_job_text

pytestmark = pytest.mark.unit

MINIMAL = '[data]\nsource = "python-stdlib"\n'


def test_defaults_and_overrides():
    cfg = loads(MINIMAL, ["parallel.zero=2", "train.lr=1", 'job.name="x"'])
    assert cfg.parallel.zero == 2 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.job.name == "x" and cfg.parallel.dp == "auto"


@pytest.mark.parametrize(
    ("text", "overrides", "field"),
    [
        (MINIMAL + "[model]\nhidden_sise = 64\n", [], "model.hidden_sise"),
        (MINIMAL + "[modle]\n", [], "[modle]"),
        (MINIMAL + '[train]\nsteps = "ten"\n', [], "train.steps"),
        (MINIMAL + "[train]\nsteps = 1.5\n", [], "train.steps"),
        (MINIMAL + "[parallel]\nzero = 4\n", [], "parallel.zero"),
        (MINIMAL + '[parallel]\ndp = "many"\n', [], "parallel.dp"),
        (MINIMAL + "[parallel]\nsequence_parallel = 1\n", [], "parallel.sequence_parallel"),
        (
            MINIMAL + "[model]\nhidden_size = 100\nnum_attention_heads = 8\n",
            [],
            "model.num_attention_heads",
        ),
        (MINIMAL + "[model]\nnum_key_value_heads = 3\n", [], "model.num_key_value_heads"),
        (MINIMAL + "[train]\nglobal_batch = 0\n", [], "train.global_batch"),
        (MINIMAL + "[train]\nseq_len = 4096\n", [], "train.seq_len"),
        (MINIMAL + "[parallel]\nmicro_batch = 32\n", [], "parallel.micro_batch"),
        (
            MINIMAL
            + "[parallel]\ndp = 4\nmicro_batch = 4\npad_uneven = false\n[train]\nglobal_batch = 8\n",
            [],
            "train.global_batch must be a multiple of parallel.dp x parallel.micro_batch",
        ),
        ("[data]\n", [], "data"),
        (MINIMAL + "[checkpoint]\nevery = 5\n", [], "checkpoint.dir"),
        (MINIMAL + '[checkpoint]\nstorage = "local"\n', [], "checkpoint.storage must be one of"),
        (MINIMAL, ["checkpoint.storage=1"], "checkpoint.storage"),
        (MINIMAL, ["parallel.bogus=1"], "parallel.bogus"),
        (MINIMAL, ["nosection.key=1"], "nosection.key"),
        (MINIMAL, ["novalue"], "key.path=value"),
        (MINIMAL + "[fault]\nhang_floor_s = 0\n", [], "fault.hang_floor_s must be > 0"),
        (MINIMAL + "[fault]\nhang_step_factor = -1\n", [], "fault.hang_step_factor"),
        (MINIMAL + "[fault]\njoin_timeout_s = 0.0\n", [], "fault.join_timeout_s"),
        (MINIMAL + "[fault]\nrestore_timeout_s = -5\n", [], "fault.restore_timeout_s"),
        (MINIMAL + "[fault]\nfirst_step_timeout_s = 0\n", [], "fault.first_step_timeout_s"),
        (MINIMAL + "[fault]\nheartbeat_timeout_s = 0\n", [], "fault.heartbeat_timeout_s"),
        (MINIMAL + "[fault]\nmax_failures = 0\n", [], "fault.max_failures must be >= 1"),
        (MINIMAL + "[fault]\nmax_failures = 2.5\n", [], "fault.max_failures must be int"),
        (MINIMAL + "[fault]\nbackoff_s = 0\n", [], "fault.backoff_s"),
        (MINIMAL + "[fault]\nbackoff_max_s = 0.5\n", [], "fault.backoff_max_s must be >="),
        (MINIMAL + "[fault]\nheartbeat_timeout = 5\n", [], "fault.heartbeat_timeout"),
        (MINIMAL, ["fault.join_timeout_s=-1"], "fault.join_timeout_s"),
        ("[data\n", [], "not valid TOML"),
    ],
)
def test_bad_spec_names_the_field(text, overrides, field):
    with pytest.raises(ConfigError, match=None) as err:
        loads(text, overrides)
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("world", "parallel", "field"),
    [
        (8, {"dp": 3}, "parallel.dp x tp x pp x cp"),
        (4, {"tp": 3}, "parallel.tp"),
        (20, {"dp": 20}, "parallel.dp must be <= train.global_batch"),
        (3, {"cp": 3}, "train.seq_len must be a multiple of 2 x parallel.cp"),
    ],
)
def test_layout_checks_against_the_world(world, parallel, field):
    body = MINIMAL + "[parallel]\n" + "".join(f"{k} = {v}\n" for k, v in parallel.items())
    with pytest.raises(ConfigError) as err:
        resolve(loads(body), world)
    assert field in str(err.value)


def test_checkpoint_storage_is_shared_unless_set_to_node():
    assert loads(MINIMAL).checkpoint.storage == "shared"
    cfg = loads(MINIMAL + '[checkpoint]\ndir = "ckpt"\nstorage = "node"\n')
    assert cfg.checkpoint.storage == "node"
    assert from_dict(cfg.to_dict()) == cfg
    assert loads(MINIMAL, ['checkpoint.storage="node"']).checkpoint.storage == "node"


def test_fault_defaults_apply_without_a_section():
    cfg = load(REPO / "examples" / "tiny.toml")
    assert cfg.fault == FaultConfig()
    assert (cfg.fault.hang_floor_s, cfg.fault.hang_step_factor) == (10.0, 5.0)
    assert (cfg.fault.join_timeout_s, cfg.fault.restore_timeout_s) == (60.0, 120.0)
    assert (cfg.fault.first_step_timeout_s, cfg.fault.heartbeat_timeout_s) == (120.0, 5.0)
    assert (cfg.fault.max_failures, cfg.fault.backoff_s, cfg.fault.backoff_max_s) == (3, 1.0, 30.0)


def test_fault_section_parses_and_round_trips():
    cfg = loads(MINIMAL + "[fault]\nhang_floor_s = 2\nmax_failures = 5\n", ["fault.backoff_s=0.25"])
    assert cfg.fault.hang_floor_s == 2.0 and isinstance(cfg.fault.hang_floor_s, float)
    assert cfg.fault.max_failures == 5 and cfg.fault.backoff_s == 0.25
    assert from_dict(cfg.to_dict()) == cfg
    assert from_dict(load(REPO / "examples" / "tiny.toml").to_dict()).fault == FaultConfig()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, 120.0),  # restore and first step are the longest default deadlines
        ({"join_timeout_s": 300.0}, 300.0),
        ({"first_step_timeout_s": 400.0}, 400.0),
        (
            {
                "join_timeout_s": 1.0,
                "restore_timeout_s": 2.0,
                "first_step_timeout_s": 3.0,
                "hang_floor_s": 4.0,
            },
            4.0,
        ),
    ],
)
def test_process_group_timeout_is_the_longest_phase_deadline(fields, expected):
    assert process_group_timeout(FaultConfig(**fields)) == expected


def test_uneven_batch_resolves_with_padding():
    layout = resolve(
        loads(MINIMAL + "[train]\nglobal_batch = 10\n[parallel]\nmicro_batch = 2\n"), 3
    )
    assert (layout.dp, layout.grad_accum, layout.samples_per_step) == (3, 2, 12)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("sections", "extra", "field"),
    [
        ({"model": {"num_attention_heads": 5}}, [], "model.num_attention_heads"),
        ({"train": {"bogus": 1}}, [], "train.bogus"),
        ({}, ["--set", "parallel.zeroo=2"], "parallel.zeroo"),
        ({"parallel": {"dp": 4, "micro_batch": 4, "pad_uneven": False}}, [], "parallel.pad_uneven"),
        ({}, ["--steps", "99"], "--steps"),
    ],
)
def test_cli_exits_2_naming_the_field(tmp_path, token_file, sections, extra, field):
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file, **sections))
    proc = _cli("--config", str(job), *extra)
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and proc.stdout == ""


def test_cli_missing_file_exits_2(tmp_path):
    proc = _cli("--config", str(tmp_path / "nope.toml"))
    assert proc.returncode == 2 and "nope.toml" in proc.stderr
