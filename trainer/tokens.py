"""The token file: raw little-endian uint16/uint32 tokens, a JSON sidecar, and a document index.

`corpus.bin` holds the tokens back to back (Megatron/nanoGPT style, so it memory-maps),
`corpus.json` names the dtype, vocabulary size, token count, where the tokens came from and the
end-of-document token, and `corpus.idx` (when the sidecar's `num_documents` > 0) holds where each
document starts: `num_documents` little-endian uint64 token offsets, ascending, the first 0.
Document d is tokens `[idx[d], idx[d+1])` (the last one runs to the end); with an
`eos_token_id` it ends with that token, with the byte-level default documents are separated by a
blank line instead (docs/data.md).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

# 2: eos_token_id, num_documents and tokenizer_sha256; version 1 files read with their defaults.
FORMAT_VERSION = 2
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
INDEX_DTYPE = np.dtype("<u8")


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
    eos_token_id: int | None = None
    num_documents: int = 0  # 0: no index, document boundaries unknown
    tokenizer_sha256: str = ""  # of the tokenizer.json copied beside the tokens; "" for bytes


def sidecar_path(path: Path) -> Path:
    return path.with_suffix(".json")


def index_path(path: Path) -> Path:
    return path.with_suffix(".idx")


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def replace_atomically(target: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TokenFileWriter:
    """Streams tokens and document starts into temporary files beside `path`.

    `commit()` renames them into place, the sidecar last, so a reader never sees a half-written
    token file and concurrent preparers of the same file are safe; leaving the `with` block on
    an exception removes them.
    """

    def __init__(
        self,
        path: Path,
        *,
        vocab_size: int,
        source: str,
        tokenizer: str,
        tokenizer_sha256: str = "",
        eos_token_id: int | None = None,
        documents: bool = True,
    ) -> None:
        self.path = path
        self.vocab_size, self.source, self.tokenizer = vocab_size, source, tokenizer
        self.tokenizer_sha256, self.eos_token_id = tokenizer_sha256, eos_token_id
        self.dtype = dtype_for_vocab(vocab_size)
        self.num_tokens = 0
        self.num_documents = 0
        self.documents = documents
        path.parent.mkdir(parents=True, exist_ok=True)
        self._files: dict[Path, tuple[str, BinaryIO]] = {}
        for target in (path, index_path(path)) if documents else (path,):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{target.name}.")
            self._files[target] = (tmp, os.fdopen(fd, "wb"))

    def append(self, tokens: np.ndarray, starts: np.ndarray | None = None) -> None:
        """Tokens in order; `starts`: where documents begin, as offsets into `tokens`."""
        tokens = np.asarray(tokens)
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise TokenFileError(f"token id {int(tokens.max())} >= vocab_size {self.vocab_size}")
        if starts is not None and len(starts):
            if not self.documents:
                raise TokenFileError(f"{self.path}: opened without a document index")
            absolute = np.asarray(starts, dtype=np.int64) + self.num_tokens
            self._files[index_path(self.path)][1].write(absolute.astype(INDEX_DTYPE).tobytes())
            self.num_documents += len(absolute)
        self._files[self.path][1].write(tokens.astype(DTYPES[self.dtype], copy=False).tobytes())
        self.num_tokens += int(tokens.size)

    def commit(self) -> TokenFileHeader:
        header = TokenFileHeader(
            self.dtype,
            self.vocab_size,
            self.num_tokens,
            self.source,
            self.tokenizer,
            eos_token_id=self.eos_token_id,
            num_documents=self.num_documents,
            tokenizer_sha256=self.tokenizer_sha256,
        )
        for target, (tmp, f) in self._files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, target)
        self._files = {}
        if not self.documents:
            index_path(self.path).unlink(missing_ok=True)  # a stale index would lie
        replace_atomically(sidecar_path(self.path), json.dumps(asdict(header), indent=2).encode())
        return header

    def abort(self) -> None:
        for tmp, f in self._files.values():
            f.close()
            Path(tmp).unlink(missing_ok=True)
        self._files = {}

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


def write_token_file(
    path: Path,
    tokens: np.ndarray,
    *,
    vocab_size: int,
    source: str,
    tokenizer: str,
    doc_starts: np.ndarray | None = None,
    eos_token_id: int | None = None,
) -> TokenFileHeader:
    """Write tokens (and, given `doc_starts`, the document index) in one go."""
    with TokenFileWriter(
        path,
        vocab_size=vocab_size,
        source=source,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        documents=doc_starts is not None,
    ) as writer:
        writer.append(tokens, doc_starts)
        return writer.commit()


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
    if header.num_documents:
        idx = index_path(path)
        expected = header.num_documents * INDEX_DTYPE.itemsize
        actual = idx.stat().st_size if idx.exists() else -1
        if actual != expected:
            raise TokenFileError(
                f"{idx}: size {actual} bytes, header says {header.num_documents} documents ({expected} bytes)"
            )
    return header


def open_tokens(path: Path) -> tuple[np.ndarray, TokenFileHeader]:
    header = read_header(path)
    return np.memmap(path, dtype=DTYPES[header.dtype], mode="r"), header


def open_documents(path: Path, header: TokenFileHeader) -> np.ndarray | None:
    """Token offsets where the documents of `path` start (memory-mapped), None without an index."""
    if not header.num_documents:
        return None
    return np.memmap(index_path(path), dtype=INDEX_DTYPE, mode="r")
