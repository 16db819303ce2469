"""Build a small byte-level BPE `tokenizer.json` from local text, offline (no hub).

    python -m examples.make_tokenizer OUT/tokenizer.json [TEXT_FILES_OR_DIRS...] [--vocab-size 4096]

Without inputs it learns from this interpreter's standard library source, which every install
has. The result is a real Hugging Face tokenizer file (the `tokenizers` package): what
`ultrascale-prepare --tokenizer` takes, with `<|endoftext|>` as its end-of-document token.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

EOS = "<|endoftext|>"


def _texts(files: Iterable[Path]) -> Iterator[str]:
    for f in files:
        yield f.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.make_tokenizer", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="where to write tokenizer.json")
    ap.add_argument("inputs", type=Path, nargs="*", help="text files or directories to learn from")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args(argv)
    from trainer.prepare import input_files, stdlib_files

    files = input_files(args.inputs) if args.inputs else stdlib_files()
    build_tokenizer(_texts(files), args.vocab_size, args.out)
    print(f"{args.out}: byte-level BPE, vocab {args.vocab_size}, EOS {EOS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
