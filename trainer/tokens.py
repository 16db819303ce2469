"""The token file: raw little-endian uint16/uint32 tokens plus a JSON sidecar.

`corpus.bin` holds the tokens back to back (Megatron/nanoGPT style, so it memory-maps), and
`corpus.json` names the dtype, vocabulary size, token count and where the tokens came from.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenFileError(ValueError):
    pass


@dataclass(frozen=True)
class TokenFileHeader:
    dtype: str
    vocab_size: int
    num_tokens: int
    source: str
    tokenizer: str
    version: int = FORMAT_VERSION


def sidecar_path(path: Path) -> Path:
    return path.with_suffix(".json")


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def write_token_file(
    path: Path, tokens: np.ndarray, *, vocab_size: int, source: str, tokenizer: str
) -> TokenFileHeader:
    """Write tokens and sidecar atomically (temp + rename), so concurrent preparers are safe."""
    dtype = dtype_for_vocab(vocab_size)
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise TokenFileError(f"token id {int(tokens.max())} >= vocab_size {vocab_size}")
    header = TokenFileHeader(dtype, vocab_size, int(tokens.size), source, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, payload in (
        (path, tokens.astype(DTYPES[dtype]).tobytes()),
        (sidecar_path(path), json.dumps(asdict(header), indent=2).encode()),
    ):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{target.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    return header


def read_header(path: Path) -> TokenFileHeader:
    side = sidecar_path(path)
    try:
        raw = json.loads(side.read_text())
    except OSError as exc:
        raise TokenFileError(f"{side}: cannot read token file sidecar: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise TokenFileError(f"{side}: not valid JSON: {exc}") from None
    try:
        header = TokenFileHeader(**raw)
    except TypeError as exc:
        raise TokenFileError(f"{side}: bad header fields: {exc}") from None
    if header.dtype not in DTYPES:
        raise TokenFileError(f"{side}: dtype must be one of {list(DTYPES)} (got {header.dtype!r})")
    expected = header.num_tokens * np.dtype(DTYPES[header.dtype]).itemsize
    actual = path.stat().st_size if path.exists() else -1
    if actual != expected:
        raise TokenFileError(
            f"{path}: size {actual} bytes, header says {header.num_tokens} {header.dtype} tokens ({expected} bytes)"
        )
    return header


def open_tokens(path: Path) -> tuple[np.ndarray, TokenFileHeader]:
    header = read_header(path)
    return np.memmap(path, dtype=DTYPES[header.dtype], mode="r"), header
