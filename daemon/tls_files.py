"""gRPC TLS credentials from PEM files, with errors that name the flag of a file that fails."""

from __future__ import annotations

from pathlib import Path

import grpc


class TLSFileError(ValueError):
    pass


def read_pem(path: Path, flag: str) -> bytes:
    try:
        data = path.expanduser().read_bytes()
    except OSError as exc:
        raise TLSFileError(f"{flag} {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise TLSFileError(f"{flag} {path}: not a PEM file")
    return data


def client_credentials(ca: Path | None, cert: Path | None, key: Path | None, *,
                       flags: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key"),
                       ) -> grpc.ChannelCredentials:
    """Credentials that verify the server against `ca` (None: the system's roots) and, with
    `cert` and `key`, present a client certificate (mutual TLS)."""
    ca_flag, cert_flag, key_flag = flags
    if (cert is None) != (key is None):
        raise TLSFileError(f"{cert_flag} and {key_flag} go together")
    return grpc.ssl_channel_credentials(
        read_pem(ca, ca_flag) if ca else None,
        read_pem(key, key_flag) if key else None,
        read_pem(cert, cert_flag) if cert else None)
