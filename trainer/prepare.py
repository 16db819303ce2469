"""Turn text files into a token file: `python -m trainer.prepare OUT.bin FILE_OR_DIR... [--tokenizer tokenizer.json]`.

The built-in tokenizer is byte-level (vocab 256, UTF-8 bytes). A Hugging Face `tokenizer.json`
is used when given and the `tokenizers` package is installed. The built-in corpus
`python-stdlib` is this interpreter's own standard library source, found offline everywhere.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from trainer.tokens import TokenFileHeader, open_tokens, write_token_file

BUILTIN_SOURCES = ("python-stdlib",)
# Enough text for thousands of distinct 128-token samples, small enough to prepare in a second.
STDLIB_BYTES = 8 * 2**20


def _text_files(inputs: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for p in inputs:
        files.extend(sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p])
    return files


def encode_bytes(texts: Iterable[bytes]) -> np.ndarray:
    return np.frombuffer(b"\n\n".join(texts), dtype=np.uint8).astype(np.uint16)


def encode_hf(texts: Iterable[bytes], tokenizer_file: Path) -> tuple[np.ndarray, int]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit(
            "a tokenizer.json needs the `tokenizers` package: pip install tokenizers"
        ) from None
    tok = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text.decode("utf-8", errors="replace")).ids)
    return np.asarray(ids, dtype=np.int64), tok.get_vocab_size()


def prepare(
    out: Path, inputs: list[Path], tokenizer: Path | None = None, source: str = ""
) -> TokenFileHeader:
    texts = [f.read_bytes() for f in _text_files(inputs)]
    if not texts:
        raise SystemExit(f"no input files found in {', '.join(map(str, inputs))}")
    if tokenizer is None:
        tokens, vocab, name = encode_bytes(texts), 256, "bytes"
    else:
        tokens, vocab = encode_hf(texts, tokenizer)
        name = str(tokenizer)
    return write_token_file(
        out, tokens, vocab_size=vocab, source=source or ",".join(map(str, inputs)), tokenizer=name
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.prepare", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "out", type=Path, help="output token file (.bin); a .json sidecar is written beside it"
    )
    ap.add_argument("inputs", type=Path, nargs="+", help="text files or directories")
    ap.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer.json (default: bytes)")
    args = ap.parse_args(argv)
    header = prepare(args.out, args.inputs, args.tokenizer)
    print(
        f"{args.out}: {header.num_tokens} {header.dtype} tokens, vocab {header.vocab_size}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
