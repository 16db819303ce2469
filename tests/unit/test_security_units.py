"""Security rules that need no process: private secret files, the etcd endpoint/TLS rules,
the listen policy for /metrics, and ultractl's client-certificate settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.api.auth import AuthError, load_or_create_token
from daemon.cli import ultractl
from daemon.cli.ctlconfig import Context, load_context, save_context
from daemon.cli.ultrad import UsageError, _parser, build_config, resolve_options
from daemon.control.etcd_security import EtcdSecurity, EtcdSecurityError

pytestmark = pytest.mark.unit

PEM = "-----BEGIN CERTIFICATE-----\nnot checked before use\n-----END CERTIFICATE-----\n"


def _secret(path: Path, mode: int, text: str = "s3cret\n") -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _config(tmp_path: Path, *flags: str) -> object:
    args = _parser().parse_args(["--etcd", "127.0.0.1:2379", "--devices", "1",
                                 "--state-dir", str(tmp_path / "state"), *flags])
    return build_config(resolve_options(args, {}))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_token_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    token = _secret(tmp_path / "token", mode)
    with pytest.raises(AuthError, match=rf"--token-file {token} .*mode 0{mode:o}.*chmod 600"):
        load_or_create_token(token, tmp_path / "state")


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_private_token_file_is_accepted(tmp_path: Path, mode: int) -> None:
    assert load_or_create_token(_secret(tmp_path / "t", mode), tmp_path)[0] == "s3cret"


def test_generated_token_loosened_later_is_refused(tmp_path: Path) -> None:
    _, path = load_or_create_token(None, tmp_path / "state")
    path.chmod(0o644)
    with pytest.raises(AuthError, match="mode 0644"):
        load_or_create_token(None, tmp_path / "state")


def test_ultractl_refuses_a_readable_token_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    token = _secret(tmp_path / "token", 0o644)
    code = ultractl.main(["--endpoint", "127.0.0.1:1", "--token-file", str(token), "status"])
    assert code == 2 and f"--token-file {token}" in capsys.readouterr().err


def test_ultractl_names_a_missing_client_key(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    token = _secret(tmp_path / "token", 0o600)
    code = ultractl.main(["--endpoint", "127.0.0.1:1", "--token-file", str(token),
                          "--tls-cert", str(tmp_path / "c.pem"), "--tls-key",
                          str(tmp_path / "missing.key"), "status"])
    err = capsys.readouterr().err
    assert code == 2 and "--tls-key" in err and "missing.key" in err, err


def test_context_keeps_client_certificate(tmp_path: Path) -> None:
    path = tmp_path / "config"
    ctx = Context("prod", "10.0.0.1:7400", "/t", "/ca.pem", tls_cert="/op.pem", tls_key="/op.key")
    save_context(path, ctx)
    assert load_context(path) == ctx


def test_metrics_may_listen_beyond_loopback_while_grpc_keeps_tls(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text(PEM)
    tls = ["--tls-cert", str(cert), "--tls-key", str(cert)]
    cfg = _config(tmp_path, "--listen", "0.0.0.0:7400", "--metrics-listen", "0.0.0.0:9400",
                  *tls)
    assert cfg.metrics_listen == "0.0.0.0:9400" and cfg.tls is not None  # type: ignore[attr-defined]
    assert not cfg.insecure  # type: ignore[attr-defined]
    # The gRPC rule is unchanged: beyond loopback it needs TLS or an explicit --insecure.
    with pytest.raises(UsageError, match="--listen 0.0.0.0:7400 .*--insecure"):
        _config(tmp_path, "--listen", "0.0.0.0:7400", "--metrics-listen", "0.0.0.0:9400")
    with pytest.raises(UsageError, match="--metrics-listen: expected host:port"):
        _config(tmp_path, "--metrics-listen", "0.0.0.0")


def test_tls_files_are_checked_at_start(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--tls-cert .*missing.pem"):
        _config(tmp_path, "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key",
                str(tmp_path / "k"))
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    with pytest.raises(UsageError, match="--etcd-ca .*not a PEM file"):
        _config(tmp_path, "--etcd-ca", str(not_pem))


@pytest.mark.parametrize("endpoints,tls_files,expected", [
    ("https://a:1,https://b:2", False, True),   # https without files: system roots, still TLS
    ("https://a:1,b:2", False, True),           # no scheme follows the others
    ("a:1,b:2", True, True),                    # etcdctl habit: TLS files mean TLS
    ("a:1", False, False),
    ("http://a:1", False, False),
])
def test_endpoint_scheme_decides_tls(tmp_path: Path, endpoints: str, tls_files: bool,
                                     expected: bool) -> None:
    security = EtcdSecurity(ca=tmp_path / "ca.pem") if tls_files else EtcdSecurity()
    assert security.uses_tls(endpoints) is expected


def test_ambiguous_etcd_endpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EtcdSecurityError, match="mixes http:// and https://"):
        EtcdSecurity().uses_tls("https://a:1,http://b:2")
    with pytest.raises(EtcdSecurityError, match="endpoints are http://"):
        EtcdSecurity(ca=tmp_path / "ca.pem").uses_tls("http://a:1")
    with pytest.raises(UsageError, match="mixes http:// and https://"):
        _config(tmp_path, "--etcd", "https://a:1,http://b:2")


def test_etcd_credentials_go_in_pairs(tmp_path: Path) -> None:
    with pytest.raises(EtcdSecurityError, match="--etcd-cert and --etcd-key"):
        EtcdSecurity(cert=tmp_path / "c.pem")
    with pytest.raises(UsageError, match="--etcd-user and --etcd-password-file"):
        _config(tmp_path, "--etcd-user", "ultrad")


def test_etcd_password_file_must_be_private(tmp_path: Path) -> None:
    loose = _secret(tmp_path / "pw", 0o644)
    with pytest.raises(UsageError, match=rf"--etcd-password-file {loose} .*mode 0644"):
        _config(tmp_path, "--etcd-user", "ultrad", "--etcd-password-file", str(loose))
    tight = _secret(tmp_path / "pw2", 0o600)
    cfg = _config(tmp_path, "--etcd-user", "ultrad", "--etcd-password-file", str(tight))
    assert cfg.etcd_security.password() == "s3cret"  # type: ignore[attr-defined]


def test_etcd_password_never_crosses_the_network_in_clear(tmp_path: Path) -> None:
    pw = ["--etcd-user", "ultrad", "--etcd-password-file", str(_secret(tmp_path / "pw", 0o600))]
    with pytest.raises(UsageError, match="clear text to 10.0.0.5"):
        _config(tmp_path, "--etcd", "http://10.0.0.5:2379", *pw)
    assert _config(tmp_path, "--etcd", "http://10.0.0.5:2379", "--insecure", *pw)
    ca = tmp_path / "ca.pem"
    ca.write_text(PEM)
    assert _config(tmp_path, "--etcd", "https://10.0.0.5:2379", "--etcd-ca", str(ca), *pw)
