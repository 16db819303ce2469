"""The preparer: documents end with EOS (or are separated by a blank line in bytes), the index
says where each starts, inputs of any size are cut without changing the tokens, and errors
name the file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from examples.make_tokenizer import EOS, build_tokenizer
from trainer import prepare as prep
from trainer.tokens import index_path, open_documents, open_tokens

pytestmark = pytest.mark.unit
tokenizers = pytest.importorskip("tokenizers")

DOCS = [
    "The quick brown fox.\nIt jumps over the lazy dog.",
    "Ünïcödé text: naïve café, 日本語.",
    "def f(x):\n    return x + 1\n\n\nprint(f(2))\n",
    "one more",
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return build_tokenizer(DOCS * 20, 300, out)


def _documents(out: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    tokens, header = open_tokens(out)
    starts = open_documents(out, header)
    assert starts is not None and len(starts) == header.num_documents
    ends = [*starts[1:].tolist(), header.num_tokens]
    return tokens, [np.asarray(tokens[s:e]) for s, e in zip(starts.tolist(), ends, strict=True)]


def _write_inputs(root: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    (root / "a.jsonl").write_text(
        "\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS[:2])) + "\n\n"
    )
    pq.write_table(pa.table({"body": [DOCS[2], None, ""]}), root / "b.parquet")
    (root / "c.txt").write_text(DOCS[3])
    return [root / "a.jsonl", root / "b.parquet", root / "c.txt"]


def test_tokenizer_documents_end_with_eos_and_the_index_finds_them(tmp_path, tokenizer_json):
    out = tmp_path / "out" / "corpus.bin"
    header = prep.prepare(out, _write_inputs(tmp_path / "in"), tokenizer_json, text_key="body")
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id(EOS)
    assert header.eos_token_id == eos and header.num_documents == len(DOCS)
    assert header.dtype == "uint16" and header.vocab_size == tok.get_vocab_size()
    _, docs = _documents(out)
    for doc, text in zip(docs, DOCS, strict=True):  # empty and null rows are no documents
        assert doc.tolist() == tok.encode(text, add_special_tokens=False).ids + [eos]
    copy = out.with_suffix(".tokenizer.json")
    assert copy.read_bytes() == tokenizer_json.read_bytes()
    assert header.tokenizer == copy.name


def test_bytes_separate_documents_by_a_blank_line(tmp_path):
    out = tmp_path / "corpus.bin"
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n")
    header = prep.prepare(out, [tmp_path / "a.jsonl"])
    tokens, docs = _documents(out)
    assert bytes(np.asarray(tokens, dtype=np.uint8)) == "\n\n".join(DOCS).encode()
    assert [bytes(d.astype(np.uint8)) for d in docs] == [
        d.encode() + (b"\n\n" if i < len(DOCS) - 1 else b"") for i, d in enumerate(DOCS)
    ]
    assert header.eos_token_id is None and header.tokenizer == "bytes"


def test_cutting_a_large_document_keeps_its_tokens(tmp_path, tokenizer_json, monkeypatch):
    """Chunks and tokenizer pieces cut only after a line end before text: a text file many
    chunks long is still one document with the tokens of the whole."""
    text = "".join(f"{DOCS[i % 4]}\n" for i in range(400))
    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)
    monkeypatch.setattr(prep, "PIECE_CHARS", 300)
    assert "".join(prep.split_document(text)) == text and len(prep.split_document(text)) > 10
    (tmp_path / "big.txt").write_text(text)
    out = tmp_path / "corpus.bin"
    prep.prepare(out, [tmp_path / "big.txt"], tokenizer_json)
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    _, docs = _documents(out)
    assert len(docs) == 1
    assert docs[0].tolist() == tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id(EOS)]


def test_a_vocabulary_past_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w3")
    header = prep.prepare(tmp_path / "c.bin", [tmp_path / "a.txt"], tmp_path / "tokenizer.json")
    tokens, _ = open_tokens(tmp_path / "c.bin")
    assert header.dtype == "uint32" and header.eos_token_id == 70_001
    assert tokens.tolist() == [1, 69_999, 3, 70_001]


def test_a_missing_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    assert prep.main([str(tmp_path / "o.bin"), str(tmp_path / "a.txt"), str(tmp_path / "gone.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err == f"ultrascale-prepare: {tmp_path / 'gone.jsonl'}: no such file or directory\n"
    assert not (tmp_path / "o.bin").exists()


def test_a_bad_record_names_its_line_and_leaves_nothing_behind(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    assert prep.main([str(tmp_path / "o.bin"), str(tmp_path / "a.jsonl")]) == 1
    assert capsys.readouterr().err.strip().endswith("a.jsonl:2: no string field 'text' (set --text-key)")
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]  # temporary files removed too


def test_an_unknown_eos_token_is_a_usage_error(tmp_path, tokenizer_json, capsys):
    (tmp_path / "a.txt").write_text("x")
    argv = [str(tmp_path / "o.bin"), str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer_json)]
    assert prep.main([*argv, "--eos-token", "<nope>"]) == 2
    assert "--eos-token '<nope>' is not a token of" in capsys.readouterr().err


def test_progress_is_plain_lines_when_piped_and_one_line_on_a_terminal(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    assert prep.main([str(tmp_path / "o.bin"), str(tmp_path / "a.txt"), "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and captured.err.endswith("MB/s  done\n")
    summary = json.loads(captured.out)
    assert summary["documents"] == 1 and summary["tokens"] == 5
    assert summary["peak_rss_bytes"]["main"] > 0 and index_path(tmp_path / "o.bin").exists()

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    progress = prep.Progress(10, term)
    progress.update(1, 3, 5)
    progress.done()
    assert term.getvalue().startswith("\r1 documents  3 tokens") and term.getvalue().endswith("\033[K\n")
