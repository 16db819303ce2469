"""Throw-away certificate authorities for TLS tests, made with the `openssl` CLI.

EC P-256 keys (fast to generate). Every leaf certificate is valid for both server and client
auth, for 127.0.0.1 and localhost, so one certificate serves an agent's listener and its
client side towards peers, as in production. Keys are written 0600.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def require_openssl() -> str:
    path = shutil.which("openssl")
    if path is None:
        pytest.skip("the openssl CLI is not installed (Debian package `openssl`); "
                    "TLS tests generate their certificates with it")
    return path


def _run(*args: str) -> None:
    subprocess.run([require_openssl(), *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class CA:
    name: str
    cert: Path
    key: Path
    root: Path

    def issue(self, name: str, san: str = "IP:127.0.0.1,DNS:localhost") -> Pair:
        """A leaf certificate and key, signed by this CA."""
        pair = Pair(self.root / f"{name}.pem", self.root / f"{name}.key")
        csr = self.root / f"{name}.csr"
        ext = self.root / f"{name}.ext"
        ext.write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n")
        _run("req", "-new", *_EC, "-keyout", str(pair.key), "-out", str(csr),
             "-subj", f"/CN={name}")
        _run("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
             "-CAcreateserial", "-days", "2", "-out", str(pair.cert), "-extfile", str(ext))
        pair.key.chmod(0o600)
        return pair


def make_ca(root: Path, name: str) -> CA:
    root.mkdir(parents=True, exist_ok=True)
    ca = CA(name, root / f"{name}-ca.pem", root / f"{name}-ca.key", root)
    _run("req", "-x509", *_EC, "-keyout", str(ca.key), "-out", str(ca.cert), "-days", "2",
         "-subj", f"/CN={name} test CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return ca
