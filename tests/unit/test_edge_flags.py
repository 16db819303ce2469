"""Bad input at the agent's edges: a TLS flag that would silently mean plain text, and secret
files that another user owns."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.api.auth import AuthError, load_or_create_token
from daemon.cli import ultrad
from daemon.cli.ctlconnect import TLSFiles, resolve_target
from daemon.cli.ultrad import UsageError, _parser, build_config, resolve_options

pytestmark = pytest.mark.unit

PEM = "-----BEGIN CERTIFICATE-----\nnot checked before use\n-----END CERTIFICATE-----\n"
NOBODY = 65534


def _argv(tmp_path: Path, *flags: str) -> list[str]:
    return ["--etcd", "127.0.0.1:2379", "--devices", "1", "--state-dir",
            str(tmp_path / "state"), *flags]


def _config(tmp_path: Path, *flags: str) -> object:
    return build_config(resolve_options(_parser().parse_args(_argv(tmp_path, *flags)), {}))


def test_tls_ca_without_a_certificate_is_a_usage_error(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text(PEM)
    # Without --tls-cert/--tls-key the listener would serve plain text, and the operator who
    # gave a CA to require client certificates would never know.
    with pytest.raises(UsageError, match="--tls-ca .*--tls-cert"):
        _config(tmp_path, "--tls-ca", str(ca))
    assert ultrad.main(_argv(tmp_path, "--tls-ca", str(ca))) == 2
    assert "--tls-ca" in capsys.readouterr().err
    # With a certificate it is mutual TLS, as before.
    cfg = _config(tmp_path, "--tls-cert", str(ca), "--tls-key", str(ca), "--tls-ca", str(ca))
    assert cfg.tls is not None and cfg.tls.ca == ca  # type: ignore[attr-defined]


def test_ultractl_tls_ca_alone_verifies_the_agents(tmp_path: Path) -> None:
    # ultractl's --tls-ca alone is server-verified TLS (no client certificate), never plain.
    ca = tmp_path / "ca.pem"
    ca.write_text(PEM)
    target = resolve_target("10.0.0.1:7400", None, TLSFiles(str(ca)), "", tmp_path / "config")
    assert target.credentials is not None


def _owned_by_nobody(path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path.write_text("s3cret\n")
    path.chmod(0o600)
    os.chown(path, NOBODY, NOBODY)
    return path


def test_token_file_owned_by_another_user_is_refused(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    token = _owned_by_nobody(tmp_path / "token")
    with pytest.raises(AuthError, match=rf"--token-file {token} is owned by uid {NOBODY}"):
        load_or_create_token(token, tmp_path / "state")
    assert ultrad.main(_argv(tmp_path, "--token-file", str(token))) == 2
    assert f"--token-file {token}" in capsys.readouterr().err


def test_generated_token_given_to_another_user_is_refused(tmp_path: Path) -> None:
    _, path = load_or_create_token(None, tmp_path / "state")
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(AuthError, match=f"{path} is owned by uid {NOBODY}"):
        load_or_create_token(None, tmp_path / "state")


def test_etcd_password_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    pw = _owned_by_nobody(tmp_path / "pw")
    with pytest.raises(UsageError, match=rf"--etcd-password-file {pw} is owned by uid"):
        _config(tmp_path, "--etcd-user", "ultrad", "--etcd-password-file", str(pw))
