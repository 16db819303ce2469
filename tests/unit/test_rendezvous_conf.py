"""`--rdzv-endpoint`, `--rdzv-id` and `--rdzv-conf` of `torchrun --rdzv-backend ultrascale`:
every bad value is refused with one line that names it (daemon/rendezvous/conf.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.rendezvous.conf import RendezvousConfError, parse
from tests.pki import make_ca

pytestmark = pytest.mark.unit

ENDPOINT = "127.0.0.1:2379"


def refusal(endpoint: str = ENDPOINT, run_id: str = "run", **conf: str) -> str:
    with pytest.raises(RendezvousConfError) as info:
        parse(endpoint, run_id, conf)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_and_torch_options() -> None:
    conf = parse(ENDPOINT, "run", {"timeout": "900", "join_timeout": "60",
                                   "keep_alive_interval": "1", "etcd_timeout": "2.5"})
    assert conf.endpoints == ENDPOINT and conf.run_id == "run" and not conf.tls
    assert conf.etcd_timeout == 2.5
    assert dict(conf.torch_options) == {"timeout": 900, "join_timeout": 60,
                                        "keep_alive_interval": 1}


@pytest.mark.parametrize(("conf", "named"), [
    ({"cacrt": "/x"}, "--rdzv-conf cacrt: unknown option"),
    ({"store_type": "file"}, "--rdzv-conf store_type: unknown option"),
    ({"cert": "/x"}, "cert= and key= go together"),
    ({"key": "/x"}, "cert= and key= go together"),
    ({"user": "u"}, "--rdzv-conf password_file: user= and password_file= go together"),
    ({"password_file": "/x"}, "--rdzv-conf user: user= and password_file= go together"),
    ({"cacert": "/nonexistent.pem"}, "--rdzv-conf cacert=/nonexistent.pem: No such file"),
    ({"join_timeout": "soon"}, "--rdzv-conf join_timeout=soon: expected a whole number > 0"),
    ({"keep_alive_max_attempt": "0"}, "--rdzv-conf keep_alive_max_attempt=0: expected"),
    ({"etcd_timeout": "-1"}, "--rdzv-conf etcd_timeout=-1: expected seconds > 0"),
])
def test_bad_options_are_named(conf: dict[str, str], named: str) -> None:
    assert named in refusal(**conf)


def test_bad_endpoints_and_run_ids_are_named() -> None:
    assert refusal(endpoint="").startswith("--rdzv-endpoint:")
    assert refusal(endpoint="ftp://h:1").startswith("--rdzv-endpoint ftp://h:1: expected")
    assert "mixes http:// and https://" in refusal(endpoint="http://a:1,https://b:2")
    assert refusal(run_id="../x").startswith("--rdzv-id must match")


def test_files_are_checked(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    assert f"--rdzv-conf cacert={not_pem}: not a PEM file" in refusal(cacert=str(not_pem))
    password = tmp_path / "password"
    password.write_text("secret\n")
    password.chmod(0o644)
    message = refusal(user="ultrad", password_file=str(password))
    assert message.startswith(f"--rdzv-conf password_file={password} is accessible by group")
    password.chmod(0o600)
    assert parse(ENDPOINT, "run", {"user": "ultrad", "password_file": str(password)}
                 ).security.password() == "secret"


def test_tls_follows_the_files_and_the_scheme(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "rdzv")
    pair = ca.issue("client")
    files = {"cacert": str(ca.cert), "cert": str(pair.cert), "key": str(pair.key)}
    assert parse(ENDPOINT, "run", files).tls
    assert parse("https://127.0.0.1:2379", "run", {}).tls
    assert "http:// with --rdzv-conf cacert/cert/key" in refusal(endpoint="http://h:1", **files)
