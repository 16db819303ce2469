"""Regenerate the Python modules of the gRPC API from `proto/ultrascale/v1/*.proto`.

`make proto` runs `python -m proto.generate`; the output is committed, and a unit test
regenerates into a temporary directory and fails on any difference. protoc writes absolute
imports (`from ultrascale.v1 import agent_pb2`), which only resolve with `proto/` on sys.path,
so the generated `*_grpc.py` imports are rewritten to package-relative ones.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("ultrascale") / "v1"
_ABSOLUTE_IMPORT = re.compile(r"^from ultrascale\.v1 import (\w+)", re.MULTILINE)


def generate(out_root: Path = PROTO_ROOT) -> list[Path]:
    """Write `<out_root>/ultrascale/v1/*_pb2{,_grpc}.py{,i}`; returns the files written."""
    from grpc_tools import protoc  # dev dependency, only needed to regenerate

    sources = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(s.relative_to(PROTO_ROOT)) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for source in sources:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = out_root / PACKAGE_DIR / f"{source.stem}{suffix}"
            text = _ABSOLUTE_IMPORT.sub(r"from . import \1", path.read_text())
            # Generated code follows protoc's style, not ours.
            path.write_text("# ruff: noqa\n" + text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="root to write ultrascale/v1/ under (default: proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
