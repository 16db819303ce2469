"""Write this interpreter's standard library as JSON Lines, one document per module.

    python -m examples.sample_jsonl OUT.jsonl

A corpus every install has, offline, in the format most published datasets use
(`{"text": ...}` per line): input for `ultrascale-prepare` in the README's "Prepare your data".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.prepare import stdlib_files


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m examples.sample_jsonl OUT.jsonl", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    with open(out, "w") as f:
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            f.write(json.dumps({"text": text, "module": path.stem}) + "\n")
    print(f"{out}: {len(files)} documents", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
