"""`ultrascale-prepare` as users run it: 2 worker processes write the same token file as 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, worker_env
from trainer.prepare import CHUNK_BYTES

pytestmark = pytest.mark.integration
pytest.importorskip("tokenizers")


def _prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.prepare", *args, "-o", "json"],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300,
    )


def test_two_workers_write_what_one_writes(tmp_path):
    from examples.make_tokenizer import build_tokenizer

    words = ["alpha", "beta", "gamma", "délta", "über", "zeta", "the", "of", "\n"]
    docs = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(i % 300)) for i in range(3000)]
    tok = build_tokenizer(docs[:200], 400, tmp_path / "tokenizer.json")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert data.stat().st_size > 2 * CHUNK_BYTES  # the workers share the work
    (tmp_path / "notes.txt").write_text("\n".join(docs[:50]))
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}" / "corpus.bin"
        done = _prepare(str(out), str(data), str(tmp_path / "notes.txt"),
                        "--tokenizer", str(tok), "--workers", str(workers))
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["workers"] == workers
        assert summary["documents"] == sum(map(bool, docs)) + 1  # empty records are no documents
        outs[workers] = out
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        assert outs[1].with_suffix(suffix).read_bytes() == outs[2].with_suffix(suffix).read_bytes()
    one, two = (json.loads(outs[w].with_suffix(".json").read_text()) for w in (1, 2))
    assert one == two


def test_a_missing_input_exits_2_naming_it(tmp_path):
    done = _prepare(str(tmp_path / "o.bin"), str(tmp_path / "missing.jsonl"), "--workers", "2")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"ultrascale-prepare: {tmp_path / 'missing.jsonl'}: no such file or directory\n"
