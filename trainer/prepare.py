"""Turn text, JSON Lines and Parquet files into a token file (docs/data.md, "Prepare your data").

    ultrascale-prepare OUT.bin INPUT... [--tokenizer tokenizer.json] [--text-key text] [--workers N]

Every input is a stream of documents: a text file is one document, a `.jsonl` line is one (its
`--text-key` field), a `.parquet` row is one (its `--text-key` column). The main process cuts the
inputs into chunks of about CHUNK_BYTES at line ends and hands them to `--workers` processes,
at most two chunks per worker in flight, and writes the tokens back in input order: memory stays
bounded by the chunks in flight and the longest line, whatever the input's size, and the output
does not depend on the number of workers.

With a Hugging Face `tokenizer.json` (the `tokenizers` package) every document is followed by
the end-of-document token, and the tokenizer file is copied beside the tokens. Without one the
tokenizer is byte-level (vocab 256: UTF-8 bytes), which has no spare id for an EOS: documents
are separated by a blank line instead. Either way `OUT.idx` records where each document starts.
The built-in corpus `python-stdlib` is this interpreter's own standard library source, found
offline everywhere.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import os
import re
import resource
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from parallel.cli_common import Parser, add_version
from trainer.tokens import (
    DTYPES,
    TokenFileHeader,
    TokenFileWriter,
    dtype_for_vocab,
    open_tokens,
    replace_atomically,
)

BUILTIN_SOURCES = ("python-stdlib",)
# Enough text for thousands of distinct 128-token samples, small enough to prepare in a second.
STDLIB_BYTES = 8 * 2**20
# Big enough that handing a chunk to a worker costs little next to tokenizing it, small enough
# that 2 x workers of them in flight stay a few MB each.
CHUNK_BYTES = 2**20
# A tokenizer's working memory is many times its input (offsets, alignments, token strings per
# byte): documents are fed to it in pieces of at most this many characters, cut where a line
# ends before a non-blank character, a boundary no common pre-tokenizer merges across.
PIECE_CHARS = 2**16
_SAFE_CUT = re.compile(r"\n(?=\S)")
BYTE_SEPARATOR = (10, 10)  # "\n\n" between documents when there is no EOS token
# Tried in order when neither --eos-token nor a tokenizer_config.json beside the file names one.
KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
EXIT_FAILURE, EXIT_USAGE = 1, 2


class PrepareError(Exception):
    """A problem with the command line or the environment: one line, exit 2."""

    exit_code = EXIT_USAGE


class BadInput(PrepareError):
    """A record that cannot be read (names the file and line): exit 1."""

    exit_code = EXIT_FAILURE


@dataclass(frozen=True)
class Chunk:
    """A piece of one input file, in input order."""

    file: str
    kind: str  # "text": a piece of one document; "jsonl": whole lines; "rows": Parquet texts
    payload: bytes | list[str]
    first_line: int  # jsonl: 1-based line number of the payload's first line
    input_bytes: int
    starts_document: bool = True  # text: this piece begins its file's document
    ends_document: bool = True  # text: this piece ends it


@dataclass(frozen=True)
class Encoder:
    """What a worker needs to tokenize a chunk; small, so it travels with every chunk."""

    tokenizer: str  # path of a tokenizer.json, "" for bytes
    vocab_size: int
    eos_token_id: int | None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(DTYPES[dtype_for_vocab(self.vocab_size)])

    @property
    def separator(self) -> tuple[int, ...]:
        return () if self.eos_token_id is not None else BYTE_SEPARATOR


@dataclass(frozen=True)
class Encoded:
    tokens: np.ndarray
    starts: np.ndarray  # offsets into tokens where documents begin (after their separator)
    input_bytes: int


@functools.lru_cache(maxsize=2)
def _load_tokenizer(path: str) -> Any:
    # Parallelism comes from --workers: a tokenizer that also spread over every core would
    # oversubscribe them. An explicit TOKENIZERS_PARALLELISM wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrepareError(
            "a tokenizer.json needs the `tokenizers` package: pip install 'ultrascale[prepare]'"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises a bare Exception for a bad file
        raise PrepareError(f"{path}: not a Hugging Face tokenizer.json: {exc}") from None


def _documents(chunk: Chunk, text_key: str) -> list[str | bytes]:
    if chunk.kind == "text":
        return [chunk.payload] if chunk.payload else []  # type: ignore[list-item]
    if chunk.kind == "rows":
        return [t for t in chunk.payload if t]  # type: ignore[union-attr]
    docs: list[str | bytes] = []
    for n, line in enumerate(chunk.payload.split(b"\n"), start=chunk.first_line):  # type: ignore[union-attr]
        if not line.strip():
            continue
        where = f"{chunk.file}:{n}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise BadInput(f"{where}: not valid JSON: {exc}") from None
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise BadInput(f"{where}: no string field {text_key!r} (set --text-key)")
        if text:
            docs.append(text)
    return docs


def split_document(text: str, limit: int | None = None) -> list[str]:
    """`text` in pieces of at least `limit` (PIECE_CHARS) characters, the last may be shorter,
    each cut after the first line end past the limit that a non-blank character follows."""
    limit = PIECE_CHARS if limit is None else limit
    pieces, pos = [], 0
    while len(text) - pos > limit and (cut := _SAFE_CUT.search(text, pos + limit)):
        pieces.append(text[pos : cut.end()])
        pos = cut.end()
    pieces.append(text[pos:])
    return pieces


def _encode_hf(path: str, docs: list[str | bytes], dtype: np.dtype) -> list[np.ndarray]:
    tok = _load_tokenizer(path)
    # The fast variant skips the offsets nobody here reads (tokenizers >= 0.21).
    encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    owners, pieces = [], []
    for n, doc in enumerate(docs):
        text = doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
        for piece in split_document(text):
            owners.append(n)
            pieces.append(piece)
    ids: list[list[np.ndarray]] = [[] for _ in docs]
    start = 0
    while start < len(pieces):
        # Batches of about PIECE_CHARS too, so the tokenizer's memory stays small.
        end, size = start, 0
        while end < len(pieces) and (end == start or size + len(pieces[end]) <= PIECE_CHARS):
            size += len(pieces[end])
            end += 1
        encodings = encode_batch(pieces[start:end], add_special_tokens=False)
        for n, e in zip(owners[start:end], encodings, strict=True):
            ids[n].append(np.asarray(e.ids, dtype=dtype))
        start = end
    return [np.concatenate(parts) if parts else np.empty(0, dtype) for parts in ids]


def encode_chunk(enc: Encoder, chunk: Chunk, text_key: str) -> Encoded:
    """Tokens of a chunk: each document preceded by the separator (bytes) or followed by EOS."""
    docs = _documents(chunk, text_key)
    if enc.tokenizer:
        ids = _encode_hf(enc.tokenizer, docs, enc.dtype)
    else:
        ids = [
            np.frombuffer(d if isinstance(d, bytes) else d.encode("utf-8"), dtype=np.uint8)
            for d in docs
        ]
    begins = chunk.kind != "text" or chunk.starts_document
    ends = chunk.kind != "text" or chunk.ends_document
    sep = np.asarray(enc.separator, dtype=enc.dtype)
    eos = np.asarray([] if enc.eos_token_id is None else [enc.eos_token_id], dtype=enc.dtype)
    pieces, starts, n = [], [], 0
    for doc in ids:
        if begins:
            pieces.append(sep)
            starts.append(n + len(sep))
        pieces.append(doc)
        if ends:
            pieces.append(eos)
        n += (len(sep) if begins else 0) + len(doc) + (len(eos) if ends else 0)
    tokens = np.concatenate(pieces).astype(enc.dtype) if pieces else np.empty(0, enc.dtype)
    return Encoded(tokens, np.asarray(starts, dtype=np.int64), chunk.input_bytes)


def input_files(inputs: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*") if q.is_file()))
        elif p.is_file():
            files.append(p)
        else:
            raise PrepareError(f"{p}: no such file or directory")
    if not files:
        raise PrepareError(f"no input files found in {', '.join(map(str, inputs))}")
    return files


def _last_cut(data: bytes, before_text: bool) -> int:
    """Just past the last line end of `data` (that a non-blank byte follows, if `before_text`)."""
    cut = data.rfind(b"\n")
    if before_text:
        while cut != -1 and (cut + 1 >= len(data) or data[cut + 1 : cut + 2].isspace()):
            cut = data.rfind(b"\n", 0, cut)
    return cut + 1


def _line_blocks(path: Path, before_text: bool = False) -> Iterator[bytes]:
    """The file in blocks of about CHUNK_BYTES, each cut at a line end (the last may not end one)."""
    with open(path, "rb") as f:
        carry = b""
        while block := f.read(CHUNK_BYTES):
            data = carry + block
            cut = _last_cut(data, before_text)
            if cut == 0:  # no line end yet: keep reading until there is one
                carry = data
                continue
            carry = data[cut:]
            yield data[:cut]
        if carry:
            yield carry


def _jsonl_chunks(path: Path) -> Iterator[Chunk]:
    line = 1
    for block in _line_blocks(path):
        yield Chunk(str(path), "jsonl", block, line, len(block))
        line += block.count(b"\n")


def _text_chunks(path: Path) -> Iterator[Chunk]:
    # Cut where the tokenizer's pieces are cut (split_document), so neither changes the tokens.
    blocks = _line_blocks(path, before_text=True)
    current = next(blocks, b"")
    first = True
    for following in blocks:
        yield Chunk(str(path), "text", current, 0, len(current), first, False)
        current, first = following, False
    yield Chunk(str(path), "text", current, 0, len(current), first, True)


def _parquet_chunks(path: Path, text_key: str) -> Iterator[Chunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(
            f"{path}: reading Parquet needs pyarrow: pip install 'ultrascale[parquet]'"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's ArrowInvalid and friends
        raise BadInput(f"{path}: not a Parquet file: {exc}") from None
    if text_key not in pf.schema_arrow.names:
        raise BadInput(f"{path}: no column {text_key!r} (set --text-key)")
    rows_total = max(1, pf.metadata.num_rows)
    size = path.stat().st_size
    texts: list[str] = []
    text_bytes = rows = reported = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[text_key]):
        column = batch.column(0)
        values = column.to_pylist()
        if any(v is not None and not isinstance(v, str) for v in values):
            raise BadInput(f"{path}: column {text_key!r} must hold strings (got {column.type})")
        texts.extend(v for v in values if v)
        text_bytes += sum(len(v) for v in values if v)
        rows += len(values)
        if text_bytes >= CHUNK_BYTES:
            # Progress counts the file's bytes in proportion to the rows read.
            done = size * rows // rows_total
            yield Chunk(str(path), "rows", texts, 0, done - reported)
            texts, text_bytes, reported = [], 0, done
    yield Chunk(str(path), "rows", texts, 0, size - reported)


def read_chunks(files: Iterable[Path], text_key: str) -> Iterator[Chunk]:
    for f in files:
        name = f.name.lower()
        if name.endswith(JSONL_SUFFIXES):
            yield from _jsonl_chunks(f)
        elif name.endswith(PARQUET_SUFFIXES):
            yield from _parquet_chunks(f, text_key)
        else:
            yield from _text_chunks(f)


def _encode_in_order(
    enc: Encoder, chunks: Iterator[Chunk], text_key: str, workers: int, sink: Callable[[Encoded], None]
) -> None:
    if workers <= 1:
        for chunk in chunks:
            sink(encode_chunk(enc, chunk, text_key))
        return
    # spawn, not fork: a forked tokenizer's thread pool can deadlock the child.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    pending: deque[Future[Encoded]] = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(encode_chunk, enc, chunk, text_key))
            if len(pending) >= 2 * workers:
                sink(pending.popleft().result())
        while pending:
            sink(pending.popleft().result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _eos_token_id(tok: Any, path: Path, eos_token: str | None) -> int:
    names: list[str] = []
    if eos_token:
        names = [eos_token]
    else:
        config = path.parent / "tokenizer_config.json"
        try:
            named = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            named = None
        if isinstance(named, dict):
            named = named.get("content")
        names = ([named] if isinstance(named, str) else []) + list(KNOWN_EOS)
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    if eos_token:
        raise PrepareError(f"--eos-token {eos_token!r} is not a token of {path}")
    raise PrepareError(
        f"{path}: no end-of-document token found (tried {', '.join(names)}); name it with --eos-token"
    )


class Progress:
    """Documents, tokens, MB/s and ETA: one updating line on a terminal, plain lines when piped."""

    def __init__(self, total_bytes: int, stream: TextIO | None = None) -> None:
        self.total_bytes = total_bytes
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.interval = 0.2 if self.tty else 5.0
        self.started = self.last = time.perf_counter()
        self.documents = self.tokens = self.input_bytes = 0

    def update(self, documents: int, tokens: int, input_bytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.input_bytes += input_bytes
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self._show(now, final=False)

    def done(self) -> None:
        self._show(time.perf_counter(), final=True)

    @property
    def seconds(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)

    def _show(self, now: float, final: bool) -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = self.input_bytes / elapsed
        left = max(self.total_bytes - self.input_bytes, 0)
        eta = "done" if final else (f"eta {left / rate:.0f}s" if rate else "eta ?")
        line = (
            f"{self.documents:,} documents  {self.tokens:,} tokens  "
            f"{self.input_bytes / 1e6:,.1f}/{self.total_bytes / 1e6:,.1f} MB  "
            f"{rate / 1e6:.1f} MB/s  {eta}"
        )
        if self.tty:
            self.stream.write("\r" + line + "\033[K" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def prepare(
    out: Path,
    inputs: list[Path],
    tokenizer: Path | None = None,
    source: str = "",
    *,
    text_key: str = "text",
    workers: int = 1,
    eos_token: str | None = None,
    progress: Progress | None = None,
) -> TokenFileHeader:
    """Tokenize `inputs` into `out` (+ .json, .idx and, with a tokenizer, .tokenizer.json)."""
    files = input_files(inputs)
    if tokenizer is None:
        enc, name, sha = Encoder("", 256, None), "bytes", ""
    else:
        tok = _load_tokenizer(str(tokenizer))
        enc = Encoder(
            str(tokenizer.resolve()),
            tok.get_vocab_size(with_added_tokens=True),
            _eos_token_id(tok, tokenizer, eos_token),
        )
        raw = tokenizer.read_bytes()
        copy = out.with_suffix(".tokenizer.json")
        name, sha = copy.name, hashlib.sha256(raw).hexdigest()
    first_document = True

    with TokenFileWriter(
        out,
        vocab_size=enc.vocab_size,
        source=source or ",".join(map(str, inputs)),
        tokenizer=name,
        tokenizer_sha256=sha,
        eos_token_id=enc.eos_token_id,
    ) as writer:

        def sink(encoded: Encoded) -> None:
            nonlocal first_document
            tokens, starts = encoded.tokens, encoded.starts
            if first_document and len(starts):
                # The separator goes between documents, not before the first one.
                skip = len(enc.separator)
                tokens, starts = tokens[skip:], starts - skip
                first_document = False
            writer.append(tokens, starts)
            if progress is not None:
                progress.update(len(starts), len(tokens), encoded.input_bytes)

        _encode_in_order(enc, read_chunks(files, text_key), text_key, workers, sink)
        if tokenizer is not None:
            replace_atomically(out.with_suffix(".tokenizer.json"), raw)
        return writer.commit()


def peak_rss_bytes() -> tuple[int, int]:
    """Peak resident memory of this process and of its largest finished child process."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale,
    )


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    picked, total = [], 0
    for f in files:
        picked.append(f)
        total += f.stat().st_size
        if total >= STDLIB_BYTES:
            break
    return picked


def builtin_corpus(name: str, cache_dir: Path) -> Path:
    """The token file of a built-in corpus, prepared into the cache on first use."""
    if name not in BUILTIN_SOURCES:
        raise ValueError(f"data.source must be one of {BUILTIN_SOURCES} (got {name!r})")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = cache_dir.expanduser() / "data" / f"{name}-{version}-bytes.bin"
    try:
        open_tokens(out)
        return out
    except (OSError, ValueError):
        pass
    prepare(out, stdlib_files(), source=f"{name} {version}")
    return out


MAX_WORKERS = 1024


def _workers(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_WORKERS}] (got {value!r})")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = Parser(
        prog="ultrascale-prepare",
        description="Tokenize text, .jsonl and .parquet files into a token file (docs/data.md).",
    )
    add_version(ap, "ultrascale-prepare")
    ap.add_argument("out", type=Path, help="output token file (.bin); .json and .idx go beside it")
    ap.add_argument("inputs", type=Path, nargs="+", help="files or directories (read recursively)")
    ap.add_argument(
        "--tokenizer", type=Path, help="a Hugging Face tokenizer.json (default: UTF-8 bytes)"
    )
    ap.add_argument("--text-key", default="text", help="the text field of .jsonl/.parquet records")
    ap.add_argument(
        "--workers",
        type=_workers,
        default=None,
        help="tokenizer processes (env ULTRA_PREPARE_WORKERS; default 1)",
    )
    ap.add_argument("--eos-token", help="the end-of-document token (default: from the tokenizer)")
    ap.add_argument("-o", "--output", choices=("text", "json"), default="text",
                    help="format of the summary on stdout")
    args = ap.parse_args(argv)
    if args.workers is None:
        try:
            args.workers = _workers(os.environ.get("ULTRA_PREPARE_WORKERS") or "1")
        except argparse.ArgumentTypeError as exc:
            ap.error(f"ULTRA_PREPARE_WORKERS: {exc}")
    try:
        if args.out.is_dir():
            raise PrepareError(f"{args.out}: is a directory (OUT is the token file to write)")
        total = sum(f.stat().st_size for f in input_files(args.inputs))
        progress = Progress(total)
        header = prepare(
            args.out,
            args.inputs,
            args.tokenizer,
            text_key=args.text_key,
            workers=args.workers,
            eos_token=args.eos_token,
            progress=progress,
        )
    except PrepareError as exc:
        print(f"ultrascale-prepare: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"ultrascale-prepare: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILURE
    progress.done()
    main_rss, worker_rss = peak_rss_bytes()
    summary = {
        "out": str(args.out),
        "documents": header.num_documents,
        "tokens": header.num_tokens,
        "dtype": header.dtype,
        "vocab_size": header.vocab_size,
        "eos_token_id": header.eos_token_id,
        "input_bytes": progress.input_bytes,
        "seconds": round(progress.seconds, 3),
        "workers": args.workers,
        "peak_rss_bytes": {"main": main_rss, "largest_worker": worker_rss if args.workers > 1 else 0},
    }
    if args.output == "json":
        print(json.dumps(summary))
    else:
        print(
            f"{args.out}: {header.num_documents:,} documents, {header.num_tokens:,} {header.dtype} "
            f"tokens, vocab {header.vocab_size}; {progress.input_bytes / 1e6:,.1f} MB in "
            f"{progress.seconds:.1f}s ({progress.input_bytes / 1e6 / progress.seconds:.1f} MB/s, "
            f"{header.num_documents / progress.seconds:,.0f} docs/s); peak RSS "
            f"{main_rss / 2**20:.0f} MiB main"
            + (f", {worker_rss / 2**20:.0f} MiB largest worker" if args.workers > 1 else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
