"""ultrascale-prepare with 1 and 2 workers: docs/s, MB/s and peak memory on a synthetic jsonl.

    python -m bench.prepare [--mb 200] [--runs 3] [--workers 1 2]

Writes a seeded jsonl of about --mb MB (documents of 20 to 2,000 words drawn from a Zipf-like
vocabulary), learns a byte-level BPE tokenizer.json (vocab 8,192) from its first documents, then
runs `python -m trainer.prepare` as a user would, --runs times per worker count, and prints the
medians. Peak RSS is the preparer's own report: the main process and its largest worker (the
whole job stays under main + workers x worker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from examples.make_tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parent.parent


def synthetic_jsonl(path: Path, megabytes: float, seed: int = 0) -> list[str]:
    """Write the corpus; returns its first documents, to learn the tokenizer from."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = np.array(["".join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(20_000)])
    weights = 1 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    target, written, first = megabytes * 1e6, 0, []
    with open(path, "w") as f:
        while written < target:
            n = int(rng.integers(20, 2_000))
            text = " ".join(words[rng.choice(len(words), size=n, p=weights)].tolist())
            if rng.random() < 0.3:
                text = text.replace(" e ", "\n", 3)
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
            if len(first) < 500:
                first.append(text)
    return first


def run_once(data: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "trainer.prepare", str(out), str(data), "--tokenizer",
         str(tokenizer), "--workers", str(workers), "-o", "json"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"prepare failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="size of the synthetic jsonl")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        root = Path(tmp)
        data = root / "corpus.jsonl"
        first = synthetic_jsonl(data, args.mb)
        tokenizer = build_tokenizer(first, 8192, root / "tokenizer.json")
        mb = data.stat().st_size / 1e6
        print(f"input: {mb:,.1f} MB jsonl; tokenizer: byte-level BPE, vocab 8192; "
              f"median of {args.runs} runs", file=sys.stderr)
        rows = []
        for workers in args.workers:
            runs = [run_once(data, tokenizer, root / f"out{workers}.bin", workers)
                    for _ in range(args.runs)]
            seconds = statistics.median(r["seconds"] for r in runs)
            main_rss = max(r["peak_rss_bytes"]["main"] for r in runs)
            worker_rss = max(r["peak_rss_bytes"]["largest_worker"] for r in runs)
            rows.append((workers, runs[0]["documents"], runs[0]["tokens"], seconds, main_rss,
                         worker_rss))
    base = rows[0][3]
    print(f"{'workers':>7} {'seconds':>8} {'docs/s':>9} {'MB/s':>6} {'tokens/s':>10} "
          f"{'x vs ' + str(rows[0][0]):>7} {'RSS main':>9} {'RSS worker':>10} {'RSS all':>8}")
    for workers, docs, tokens, seconds, main_rss, worker_rss in rows:
        total = main_rss + (workers * worker_rss if workers > 1 else 0)
        print(f"{workers:>7} {seconds:>8.1f} {docs / seconds:>9,.0f} {mb / seconds:>6.1f} "
              f"{tokens / seconds:>10,.0f} {base / seconds:>7.2f} {main_rss / 2**20:>6.0f} MiB "
              f"{worker_rss / 2**20:>6.0f} MiB {total / 2**20:>4.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
