"""Every command given bad input answers in one line naming the flag, field or file, with the
documented exit code (2: usage, config or input files), never a traceback.

Each case runs the command as a user would (a subprocess), so argparse's own errors, the
environment fallbacks and the top-level exception handling are all part of what is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# No --devices here: a --config case gives it in the file (a flag would override the file).
AGENT = ("daemon.cli.ultrad", "--etcd", "127.0.0.1:1", "--no-workers", "--state-dir",
         "{tmp}/state")
ULTRAD = (*AGENT, "--devices", "1")
LOCAL = ("daemon.cli.ultrad", "local")
CTL = ("daemon.cli.ultractl",)
PREPARE = ("trainer.prepare",)
HF = ("trainer.hf_cli",)
JOB = '[data]\nsource = "python-stdlib"\n'


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    names: str  # what the error line must name
    files: dict[str, str] = field(default_factory=dict)  # name -> text, made in {tmp}
    env: dict[str, str] = field(default_factory=dict)
    code: int = 2


def agent_toml(text: str, names: str) -> Case:
    text = text if text.startswith("devices") else f"devices = 1\n{text}"
    return Case((*AGENT, "--config", "{tmp}/agent.toml"), names, {"agent.toml": text})


CASES = {
    # ultrad: flags, ULTRA_* variables and --config (as strict as a job file)
    "ultrad --log-level loud": Case((*ULTRAD, "--log-level", "loud"), "--log-level"),
    "ultrad --devices 8.5": Case((*ULTRAD, "--devices", "8.5"), "--devices must be int"),
    "ultrad --devices 1_0": Case((*ULTRAD, "--devices", "1_0"), "--devices must be int"),
    "ultrad --devices 99999": Case((*ULTRAD, "--devices", "99999"), "--devices must be in"),
    "ultrad --device-memory 1e9": Case((*ULTRAD, "--device-memory", "1e9"), "--device-memory"),
    "ultrad --listen port 99999": Case((*ULTRAD, "--listen", "127.0.0.1:99999"), "--listen"),
    "ultrad --metrics-listen port 99999": Case((*ULTRAD, "--metrics-listen", "127.0.0.1:99999"),
                                               "--metrics-listen"),
    "ultrad --health-listen port 70000": Case((*ULTRAD, "--health-listen", "127.0.0.1:70000"),
                                              "--health-listen"),
    "ultrad --state-dir a file": Case((*ULTRAD, "--state-dir", "{tmp}/file"), "--state-dir",
                                      {"file": "x"}),
    "ultrad --state-dir under a file": Case((*ULTRAD, "--state-dir", "{tmp}/file/sub"),
                                            "--state-dir", {"file": "x"}),
    "ultrad --snapshot-dir a file": Case((*ULTRAD, "--snapshot-dir", "{tmp}/file"),
                                         "--snapshot-dir", {"file": "x"}),
    "ultrad unknown flag": Case((*ULTRAD, "--colour", "red"), "--colour"),
    "ultrad ULTRA_TTL=true": Case(ULTRAD, "ULTRA_TTL must be int", env={"ULTRA_TTL": "true"}),
    "ultrad ULTRA_INSECURE=maybe": Case(ULTRAD, "ULTRA_INSECURE",
                                        env={"ULTRA_INSECURE": "maybe"}),
    "ultrad ULTRA_LOG_LEVEL=loud": Case(ULTRAD, "--log-level",
                                        env={"ULTRA_LOG_LEVEL": "loud"}),
    "agent.toml devices = 8.5": agent_toml("devices = 8.5\n", "agent.toml: devices must be int"),
    "agent.toml ttl = true": agent_toml("ttl = true\n", "agent.toml: ttl must be int"),
    "agent.toml etcd_outage = true": agent_toml("etcd_outage = true\n",
                                                "agent.toml: etcd_outage must be float"),
    "agent.toml listen = 7400": agent_toml("listen = 7400\n", "agent.toml: listen must be str"),
    "agent.toml insecure = 'yes'": agent_toml('insecure = "yes"\n',
                                              "agent.toml: insecure must be bool"),
    "agent.toml allowed_paths a string": agent_toml('allowed_paths = "/a"\n',
                                                    "agent.toml: allowed_paths must be a list"),
    "agent.toml allowed_paths = [1]": agent_toml("allowed_paths = [1]\n",
                                                 "agent.toml: allowed_paths[0] must be str"),
    "agent.toml ttl = 1": agent_toml("ttl = 1\n", "--ttl must be in [2, 3600]"),
    "agent.toml devices = -1": agent_toml("devices = -1\n", "--devices must be in"),
    "agent.toml unknown key": agent_toml("colour = 1\n", "agent.toml: unknown key(s) colour"),
    "agent.toml a table": agent_toml("[tls]\ncert = 1\n", "agent.toml: unknown key(s) tls"),
    "agent.toml etcd a table": agent_toml("[etcd]\nhost = 1\n", "agent.toml: etcd must be str"),
    "agent.toml bad TOML": agent_toml("devices = [\n", "agent.toml: not valid TOML"),
    "agent.toml too deep": agent_toml("devices = " + "[" * 40 + "]" * 40 + "\n",
                                      "agent.toml: nested deeper"),
    "agent.toml missing": Case((*ULTRAD, "--config", "{tmp}/missing.toml"), "missing.toml"),
    "agent.toml a directory": Case((*ULTRAD, "--config", "{tmp}"), "--config"),
    "ultrad --job-file missing": Case((*ULTRAD, "--job-file", "{tmp}/job.toml"), "job.toml"),
    "ultrad --job-file bad TOML": Case((*ULTRAD, "--job-file", "{tmp}/job.toml"),
                                       "job.toml", {"job.toml": "[model\n"}),
    # ultrad local
    "local missing job": Case((*LOCAL, "{tmp}/job.toml"), "job.toml"),
    "local bad job": Case((*LOCAL, "{tmp}/job.toml"), "train.steps",
                          {"job.toml": JOB + "[train]\nsteps = 1.5\n"}),
    "local --ttl 1": Case((*LOCAL, "{tmp}/job.toml", "--ttl", "1"), "--ttl", {"job.toml": JOB}),
    "local --nodes x": Case((*LOCAL, "{tmp}/job.toml", "--nodes", "x"), "--nodes",
                            {"job.toml": JOB}),
    "local --nodes 0": Case((*LOCAL, "{tmp}/job.toml", "--nodes", "0"), "--nodes",
                            {"job.toml": JOB}),
    "local --state-dir a file": Case((*LOCAL, "{tmp}/job.toml", "--state-dir", "{tmp}/file"),
                                     "--state-dir", {"job.toml": JOB, "file": "x"}),
    "local --set without =": Case((*LOCAL, "{tmp}/job.toml", "--set", "train.steps"), "--set",
                                  {"job.toml": JOB}),
    # ultrascale-prepare
    "prepare missing input": Case((*PREPARE, "{tmp}/o.bin", "{tmp}/missing.txt"), "missing.txt"),
    "prepare OUT a directory": Case((*PREPARE, "{tmp}", "{tmp}/in.txt"), "is a directory",
                                    {"in.txt": "hello\n"}),
    "prepare --workers 0": Case((*PREPARE, "{tmp}/o.bin", "{tmp}/in.txt", "--workers", "0"),
                                "--workers", {"in.txt": "hello\n"}),
    "prepare --workers x": Case((*PREPARE, "{tmp}/o.bin", "{tmp}/in.txt", "--workers", "x"),
                                "--workers", {"in.txt": "hello\n"}),
    "prepare ULTRA_PREPARE_WORKERS=x": Case((*PREPARE, "{tmp}/o.bin", "{tmp}/in.txt"),
                                            "ULTRA_PREPARE_WORKERS", {"in.txt": "hello\n"},
                                            env={"ULTRA_PREPARE_WORKERS": "x"}),
    "prepare --tokenizer missing": Case((*PREPARE, "{tmp}/o.bin", "{tmp}/in.txt", "--tokenizer",
                                         "{tmp}/tok.json"), "tok.json", {"in.txt": "hello\n"}),
    "prepare bad jsonl record": Case((*PREPARE, "{tmp}/o.bin", "{tmp}/in.jsonl"), "in.jsonl:2",
                                     {"in.jsonl": '{"text": "a"}\nnot json\n'}, code=1),
    # ultrascale-hf
    "hf export --step x": Case((*HF, "export", "{tmp}", "{tmp}/out", "--step", "x"), "--step"),
    "hf export no checkpoint": Case((*HF, "export", "{tmp}/none", "{tmp}/out"), "none"),
    "hf import --job missing": Case((*HF, "import", "{tmp}", "{tmp}/ck", "--job",
                                     "{tmp}/job.toml"), "job.toml"),
    "hf import no model": Case((*HF, "import", "{tmp}", "{tmp}/ck"), "config.json"),
    # python -m trainer (under torchrun or alone)
    "trainer missing job": Case(("trainer", "--config", "{tmp}/job.toml"), "job.toml"),
    "trainer --steps x": Case(("trainer", "--config", "{tmp}/job.toml", "--steps", "x"),
                              "--steps", {"job.toml": JOB}),
    "trainer --steps 0": Case(("trainer", "--config", "{tmp}/job.toml", "--steps", "0"),
                              "--steps", {"job.toml": JOB}),
    # ultractl
    "ultractl plan bad job": Case((*CTL, "plan", "--job", "{tmp}/job.toml", "--world", "2x2"),
                                  "job.toml: not valid TOML", {"job.toml": "[model\n"}),
    "ultractl plan missing job": Case((*CTL, "plan", "--job", "{tmp}/job.toml", "--world", "2x2"),
                                      "job.toml"),
    "ultractl plan --memory 1e400": Case((*CTL, "plan", "--job", "{tmp}/job.toml", "--world",
                                          "2x2", "--memory", "1e400"), "--memory",
                                         {"job.toml": JOB}),
    "ultractl plan --world huge": Case((*CTL, "plan", "--job", "{tmp}/job.toml", "--world",
                                        "99999999x99999999"), "--world", {"job.toml": JOB}),
    "ultractl --timeout -1": Case((*CTL, "--timeout", "-1", "status"), "--timeout"),
    "ultractl unknown flag": Case((*CTL, "status", "--colour"), "--colour"),
    "ultractl ULTRA_OUTPUT=xml": Case((*CTL, "status"), "ULTRA_OUTPUT",
                                      env={"ULTRA_OUTPUT": "xml"}),
    "ultractl job submit missing": Case((*CTL, "--endpoint", "127.0.0.1:1", "job", "submit",
                                         "{tmp}/job.toml"), "job.toml"),
    "ultractl --config a directory": Case((*CTL, "--config", "{tmp}", "status"), "{tmp}"),
    "ultractl bad --endpoint": Case((*CTL, "--endpoint", "nohost", "status"), "--endpoint"),
}


def run_case(case: Case, tmp: Path) -> subprocess.CompletedProcess[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in case.files.items():
        (tmp / name).write_text(text)
    argv = [a.replace("{tmp}", str(tmp)) for a in case.argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ULTRA", "PYTHON"))}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp), XDG_CONFIG_HOME=str(tmp / "config"),
               **case.env)
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=90, env=env)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Every case, run a few at a time: most of a case is a Python start-up."""
    root = tmp_path_factory.mktemp("cli_edges")
    dirs = {name: root / f"case{i}" for i, name in enumerate(sorted(CASES))}
    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(dirs, pool.map(lambda n: run_case(CASES[n], dirs[n]), dirs), strict=True))
    return {name: (dirs[name], done[name]) for name in dirs}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_and_its_exit_code(
        name: str, results: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    case = CASES[name]
    tmp, done = results[name]
    names = case.names.replace("{tmp}", str(tmp))
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == case.code, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert names in lines[0], lines[0]


def test_ultrad_local_exits_2_when_its_agents_refuse_their_configuration(tmp_path: Path) -> None:
    """A bad ULTRA_* variable reaches only the agents `ultrad local` starts: their usage error
    is its own, exit 2 with the agent's line (before this, exit 1 and 'see the log')."""
    (tmp_path / "job.toml").write_text(JOB)
    case = Case((*LOCAL, "{tmp}/job.toml", "--nodes", "1", "--state-dir", "{tmp}/state"),
                "", env={"ULTRA_DEVICE_MEMORY": "lots"})
    done = run_case(case, tmp_path)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    # Its first line says where the state is; the last is the agent's own.
    last = done.stderr.splitlines()[-1]
    assert last.startswith("ultrad local: agent node-0: ultrad: ULTRA_DEVICE_MEMORY must be int")
