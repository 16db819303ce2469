"""ultractl's command line: global flags in either position, environment fallbacks, precedence,
the config verbs, exit codes, and the completion scripts (checked by real bash, zsh and fish)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from daemon.cli import ctlconfig, ultractl
from daemon.cli.ctlconnect import Target, TargetError, TLSFiles, resolve_target
from daemon.procutil import free_port

pytestmark = pytest.mark.unit

# Every global flag, a value for it, and the attribute it sets.
GLOBAL_FLAGS = [
    ("--endpoint", "10.0.0.1:7400,10.0.0.2:7400", "endpoint", "10.0.0.1:7400,10.0.0.2:7400"),
    ("--token-file", "/run/token", "token_file", "/run/token"),
    ("--tls-ca", "/etc/ca.pem", "tls_ca", "/etc/ca.pem"),
    ("--tls-cert", "/etc/op.pem", "tls_cert", "/etc/op.pem"),
    ("--tls-key", "/etc/op.key", "tls_key", "/etc/op.key"),
    ("--context", "prod", "context", "prod"),
    ("--config", "/tmp/other-config", "config", "/tmp/other-config"),
    ("-o", "json", "output", "json"),
    ("--output", "yaml", "output", "yaml"),
    ("--timeout", "2.5", "timeout", 2.5),
]
# A command line of each shape: top level, nested, with positionals and own flags.
COMMANDS = [["status"], ["nodes"], ["plan", "--explain"], ["job", "submit", "job.toml"],
            ["drain", "n1"], ["events", "-f"], ["checkpoint"], ["config", "get-contexts"],
            ["config", "use-context", "x"], ["completion", "bash"]]


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    return ultractl._parser(env or {"HOME": "/nonexistent"}).parse_args(argv)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("flag", "value", "dest", "expected"), GLOBAL_FLAGS,
                         ids=[f[0] for f in GLOBAL_FLAGS])
def test_global_flag_before_or_after_the_command(command: list[str], flag: str, value: str,
                                                 dest: str, expected: object) -> None:
    default = getattr(parse(command), dest)
    assert default != expected
    before = parse([flag, value, *command])
    after = parse([*command, flag, value])
    assert getattr(before, dest) == getattr(after, dest) == expected
    # The command's own arguments are untouched by where the flag went.
    assert {k: v for k, v in vars(before).items() if k != dest} == \
           {k: v for k, v in vars(after).items() if k != dest}


def test_a_flag_after_the_command_overrides_one_before_it() -> None:
    assert parse(["-o", "json", "nodes", "-o", "yaml"]).output == "yaml"


def test_environment_fallbacks_and_flags_over_them() -> None:
    env = {"ULTRA_ENDPOINT": "e:1", "ULTRA_TOKEN_FILE": "/t", "ULTRA_TLS_CA": "/ca",
           "ULTRA_CONTEXT": "c", "ULTRACTL_CONFIG": "/cfg", "ULTRA_OUTPUT": "yaml",
           "ULTRA_TIMEOUT": "4"}
    args = parse(["status"], env)
    assert (args.endpoint, args.token_file, args.tls_ca, args.context, args.config,
            args.output, args.timeout) == ("e:1", "/t", "/ca", "c", "/cfg", "yaml", 4.0)
    args = parse(["status", "--endpoint", "f:2", "-o", "json", "--timeout", "1"], env)
    assert (args.endpoint, args.output, args.timeout) == ("f:2", "json", 1.0)
    assert parse(["status"], {"XDG_CONFIG_HOME": "/x"}).config == "/x/ultrascale/config"


@pytest.mark.parametrize(("env", "named"), [({"ULTRA_OUTPUT": "xml"}, "ULTRA_OUTPUT"),
                                            ({"ULTRA_TIMEOUT": "soon"}, "ULTRA_TIMEOUT"),
                                            ({"ULTRA_TIMEOUT": "-1"}, "ULTRA_TIMEOUT")])
def test_bad_environment_is_a_usage_error_naming_the_variable(env, named, capsys) -> None:
    assert ultractl.main(["status"], env) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    (["status", "--timeout", "0"], "--timeout"), (["nodes", "-o", "xml"], "--output"),
    (["drain"], "node"), (["bogus"], "COMMAND"), (["completion", "tcsh"], "shell"),
    (["config", "set-context", "x", "--endpoint", "no-port"], "--endpoint"),
])
def test_usage_errors_exit_2_naming_the_argument(argv, named, tmp_path, capsys) -> None:
    assert ultractl.main(argv, {"ULTRACTL_CONFIG": str(tmp_path / "config")}) == 2
    assert named in capsys.readouterr().err


# --- where the endpoints and credentials come from: flag/env > context ---

@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "ultrascale" / "config"
    for name, secret in (("ctx-token", "ctx-secret"), ("flag-token", "flag-secret")):
        (tmp_path / name).write_text(secret + "\n")
        (tmp_path / name).chmod(0o600)  # ultractl refuses a token others can read
    ctlconfig.set_context(path, "prod", {"endpoint": "10.0.0.1:7400",
                                         "token-file": str(tmp_path / "ctx-token")})
    ctlconfig.use_context(path, "prod")
    return path


def test_the_flag_or_environment_wins_over_the_context_per_field(config: Path) -> None:
    token = str(config.parent.parent / "flag-token")
    # Clear text to 10.x: the operator said --insecure (without it, see the next test).
    assert resolve_target(None, None, TLSFiles(), "", config, insecure=True) == Target(
        ("10.0.0.1:7400",), "ctx-secret", None, "prod", config)
    # An endpoint from the flag: the context's token still applies, and nothing is discovered
    # into a context the endpoints did not come from.
    assert resolve_target("10.9.9.9:1", None, TLSFiles(), "", config, insecure=True) == Target(
        ("10.9.9.9:1",), "ctx-secret", None, "", config)
    assert resolve_target(None, token, TLSFiles(), "", config,
                          insecure=True).token == "flag-secret"
    with pytest.raises(TargetError, match="--context: no context 'staging'"):
        resolve_target("10.9.9.9:1", token, TLSFiles(), "staging", config)
    with pytest.raises(TargetError, match="--token-file /nope"):
        resolve_target("10.9.9.9:1", "/nope", TLSFiles(), "", config)
    with pytest.raises(TargetError, match="no endpoint"):
        resolve_target(None, None, TLSFiles(), "", config.parent / "missing")


def test_clear_text_beyond_loopback_needs_insecure(config: Path) -> None:
    with pytest.raises(TargetError, match="10.0.0.1:7400 is not a loopback .*--insecure"):
        resolve_target(None, None, TLSFiles(), "", config)
    assert resolve_target("127.0.0.1:1,[::1]:2,localhost:3", None, TLSFiles(), "",
                          config).endpoints == ("127.0.0.1:1", "[::1]:2", "localhost:3")


def test_a_context_offers_its_seeds_then_the_discovered_members(config: Path) -> None:
    assert ctlconfig.save_discovered(config, "prod", ["10.0.0.2:7400", "10.0.0.1:7400",
                                                      "127.0.0.1:7402"])
    assert not ctlconfig.save_discovered(config, "prod", ["10.0.0.1:7400", "10.0.0.2:7400",
                                                          "127.0.0.1:7402"])
    ca = config.parent.parent / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot read here\n-----END CERTIFICATE-----\n")
    target = resolve_target(None, None, TLSFiles(str(ca)), "", config)
    assert target.endpoints == ("10.0.0.1:7400", "10.0.0.2:7400", "127.0.0.1:7402")
    # Without TLS, a discovered member on another host is never offered the token, even
    # under --insecure (a node record is not the operator's word); loopback ones are.
    target = resolve_target(None, None, TLSFiles(), "", config, insecure=True)
    assert target.endpoints == ("10.0.0.1:7400", "127.0.0.1:7402")
    # A new endpoint means another cluster: what was discovered through the old one goes.
    ctlconfig.set_context(config, "prod", {"endpoint": "10.1.0.1:7400"})
    assert ctlconfig.load_context(config).discovered == ()


# --- ultractl config ---

def ctl(config: Path, *argv: str) -> int:
    return ultractl.main(list(argv), {"ULTRACTL_CONFIG": str(config)})


def test_config_verbs_kubectl_style(tmp_path: Path, capsys) -> None:
    path = tmp_path / "cfg" / "config"
    assert ctl(path, "config", "current-context") == 1
    assert "current-context is not set" in capsys.readouterr().err
    assert ctl(path, "config", "set-context", "a", "--token-file", "/t") == 2
    assert "a new context needs --endpoint" in capsys.readouterr().err
    assert ctl(path, "config", "set-context", "a", "--endpoint", "h1:1,h2:2",
               "--token-file", "/t") == 0
    assert ctl(path, "config", "set-context", "b", "--endpoint", "[::1]:7400",
               "--tls-ca", "/ca") == 0
    assert capsys.readouterr().out.splitlines() == ['context "a" created', 'context "b" created']
    assert ctl(path, "config", "use-context", "b") == 0
    assert ctl(path, "config", "current-context") == 0
    assert capsys.readouterr().out.splitlines() == ['switched to context "b"', "b"]
    # Only the given field changes; an empty value removes one.
    assert ctl(path, "config", "set-context", "b", "--token-file", "/tb", "--tls-ca", "") == 0
    assert capsys.readouterr().out == 'context "b" modified\n'
    assert ctl(path, "config", "get-contexts") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["CURRENT", "NAME", "ENDPOINT", "DISCOVERED", "TOKEN-FILE",
                                "TLS-CA"]
    assert table[1].split() == ["a", "h1:1,h2:2", "0", "/t"]
    assert table[2].split() == ["*", "b", "[::1]:7400", "0", "/tb"]
    assert ctl(path, "config", "get-contexts", "-o", "json") == 0
    assert json.loads(capsys.readouterr().out) == [
        {"name": "a", "current": False, "endpoint": "h1:1,h2:2", "token-file": "/t"},
        {"name": "b", "current": True, "endpoint": "[::1]:7400", "token-file": "/tb"}]
    assert ctl(path, "-o", "yaml", "config", "get-contexts") == 0
    assert [c["name"] for c in yaml.safe_load(capsys.readouterr().out)] == ["a", "b"]
    assert ctl(path, "config", "use-context", "nope") == 2
    err = capsys.readouterr().err
    assert "no context 'nope'" in err and "known: a, b" in err
    assert ctl(path, "config", "delete-context", "b") == 0
    assert ctl(path, "config", "current-context") == 1
    assert ctl(path, "config", "delete-context", "b") == 2


def test_config_file_is_private_atomic_and_keeps_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump({"contexts": {"a": {"endpoint": "h:1", "tls-cert": "/c"}},
                                    "preferences": {"colour": False}}))
    ctlconfig.set_context(path, "a", {"token-file": "/t"})
    ctlconfig.save_context(path, ctlconfig.Context("local", "127.0.0.1:1", "/l"))
    raw = yaml.safe_load(path.read_text())
    # Fields a newer ultractl wrote survive an older one's rewrite.
    assert raw["contexts"]["a"] == {"endpoint": "h:1", "tls-cert": "/c", "token-file": "/t"}
    assert raw["preferences"] == {"colour": False} and raw["current-context"] == "local"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config"]  # no temporary left


@pytest.mark.parametrize(("text", "named"), [("contexts: [1, 2]\n", "contexts"),
                                             ("contexts: {a: 3}\n", "contexts.a"),
                                             ("a: [\n", "not valid YAML"),
                                             ("contexts: {a: {endpoint: 'h:1', discovered: 5}}\n"
                                              "current-context: a\n", "contexts.a.discovered")])
def test_a_broken_config_file_is_a_usage_error_naming_the_field(tmp_path, capsys, text,
                                                                named) -> None:
    path = tmp_path / "config"
    path.write_text(text)
    assert ctl(path, "status") == 2
    err = capsys.readouterr().err
    assert str(path) in err and named in err


# --- exit 3: no agent reachable, nothing sent ---

@pytest.fixture
def closed_port() -> int:
    return free_port()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP and never speaks gRPC, like a stopped agent."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [["status"], ["drain", "n1"], ["events"]], ids=" ".join)
def test_no_agent_reachable_exits_3(closed_port, silent_port, command, tmp_path,
                                    capsys) -> None:
    env = {"ULTRACTL_CONFIG": str(tmp_path / "config")}
    endpoints = f"127.0.0.1:{closed_port},localhost:{closed_port}"
    assert ultractl.main([*command, "--endpoint", endpoints], env) == 3
    assert "cannot reach any agent" in capsys.readouterr().err
    # A silent agent never becomes ready: the connect deadline ends the wait.
    assert ultractl.main([*command, "--endpoint", f"127.0.0.1:{silent_port},{endpoints}",
                          "--timeout", "0.5"], env) == 3
    assert "none ready within 0.5s" in capsys.readouterr().err


# --- completion ---

def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*path, name)
                yield from commands(child, (*path, name))


def script(shell: str, capsys) -> str:
    assert ultractl.main(["completion", shell]) == 0
    return capsys.readouterr().out


def test_completion_names_every_command_and_flag(capsys) -> None:
    all_commands = list(commands(ultractl._parser()))
    assert ("config", "set-context") in all_commands and ("job", "submit") in all_commands
    assert ("job", "cancel") in all_commands and ("wait",) in all_commands
    for shell in ("bash", "zsh", "fish"):
        text = script(shell, capsys)
        for path in all_commands:
            key = f"case '{' '.join(path)}'" if shell == "fish" else f'"{" ".join(path)}")'
            assert key in text, (shell, path)
            assert path[-1] in text
        for flag, *_ in GLOBAL_FLAGS:
            assert flag in text


BASH_CASES = [
    ("ultractl no", ["nodes"]),
    ("ultractl c", ["checkpoint", "completion", "config", "cordon"]),
    ("ultractl config use", ["use-context"]),
    ("ultractl -o json --endpoint h:1 config s", ["set-context"]),
    ("ultractl nodes -o j", ["json"]),
    ("ultractl --output y", ["yaml"]),
    ("ultractl job submit --re", ["--replace"]),
    ("ultractl config set-context x --tok", ["--token-file"]),
    ("ultractl completion z", ["zsh"]),
    ("ultractl job ca", ["cancel"]),
    ("ultractl job g", ["get"]),
    ("ultractl job cancel --j", ["--job"]),
    ("ultractl logs n --f", ["--follow"]),
    ("ultractl wa", ["wait"]),
    ("ultractl job get -o t", ["toml"]),
    ("ultractl wait --for state=c", ["state=cancelled"]),
]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_accepts_the_script_and_completes(capsys, tmp_path: Path) -> None:
    path = tmp_path / "ultractl.bash"
    path.write_text(script("bash", capsys))
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for line, expected in BASH_CASES:
        words = line.split()
        program = (f"source {path}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
                   "_ultractl; printf '%s\\n' \"${COMPREPLY[@]}\"")
        out = subprocess.run(["bash", "-c", program], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert sorted(out.stdout.split()) == expected, line
    # An option's value without choices completes as a file name.
    (tmp_path / "token-abc").write_text("x")
    program = (f"source {path}; cd {tmp_path}; COMP_WORDS=(ultractl status --token-file tok); "
               "COMP_CWORD=3; _ultractl; printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True)
    assert out.stdout.split() == ["token-abc"], out.stderr


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_accepts_the_script_and_completes(capsys, tmp_path: Path) -> None:
    path = tmp_path / "_ultractl"
    path.write_text(script("zsh", capsys))
    check = subprocess.run(["zsh", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for line, expected in BASH_CASES:
        # Outside a completion widget compadd does not exist: this one records the candidates
        # and filters them by the prefix, as the completion system would.
        program = (f"source {path}; compadd() {{ shift; reply+=(\"$@\") }}; reply=(); "
                   f"words=({line}); CURRENT=${{#words}}; _ultractl; "
                   "for w in $reply; do [[ $w == ${words[CURRENT]}* ]] && print -- $w; done; true")
        out = subprocess.run(["zsh", "-f", "-c", program], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert sorted(out.stdout.split()) == expected, line


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_accepts_the_script_and_completes(capsys, tmp_path: Path) -> None:
    path = tmp_path / "ultractl.fish"
    path.write_text(script("fish", capsys))
    check = subprocess.run(["fish", "--no-execute", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "XDG_DATA_HOME": str(tmp_path / "data")}
    for line, expected in [*BASH_CASES, ("ultractl completion f", ["fish"])]:
        # `complete -C` asks fish's own completion machinery, as a keypress would.
        out = subprocess.run(["fish", "--no-config", "-c", f"source {path}; complete -C'{line}'"],
                             capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        words = [w.split("\t")[0] for w in out.stdout.splitlines()]
        assert sorted(words) == expected, line
    (tmp_path / "token-abc").write_text("x")
    out = subprocess.run(["fish", "--no-config", "-c", f"source {path}; cd {tmp_path}; "
                          "complete -C'ultractl status --token-file tok'"],
                         capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["token-abc"], out.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["job", "get", "-o", "xml"], "job get -o: expected one of toml, yaml, json (got 'xml')"),
    (["wait", "--for=state=done"], "wait --for: expected state=STATE, STATE one of finished, "
                                   "cancelled, failed, running, pending (got 'state=done')"),
    (["wait", "--for", "phase=running"], "wait --for: expected state=STATE"),
    (["wait", "--timeout", "0"], "wait --timeout: expected seconds > 0 (got '0')"),
    (["wait", "--timeout", "soon"], "wait --timeout: expected seconds > 0 (got 'soon')"),
])
def test_lifecycle_usage_errors_are_one_line_and_exit_2(argv, message, tmp_path, capsys) -> None:
    """Checked before any agent is asked: no endpoint is needed to get the usage error."""
    assert ultractl.main(argv, {"ULTRACTL_CONFIG": str(tmp_path / "config")}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ultractl: " + message), err


def test_wait_documents_its_exit_codes_in_its_help(capsys) -> None:
    assert ultractl.main(["wait", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit codes: 0 the job reached STATE; 1 it reached another state it cannot leave " \
           "(finished, failed, cancelled); 2 usage" in text and "4 --timeout passed first" in text
