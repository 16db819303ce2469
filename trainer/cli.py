"""`torchrun --standalone --nproc-per-node N -m trainer --config FILE [...]`.

Without torchrun (no RANK in the environment) it runs as a world of one. Rank 0 writes
results to stdout (one JSON object per step with --log-format json); everything else goes to
stderr. Exit codes: 0 done, 1 failure, 2 bad usage or bad config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from parallel.cli_common import Parser, add_version
from parallel.job import ConfigError, JobConfig, load
from trainer.telemetry import finite_or_none, step_record

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(prog="python -m trainer", description="Train a Llama on the job's layout.")
    add_version(ap, "ultrascale trainer")
    ap.add_argument("--config", required=True, type=Path, help="job TOML file")
    ap.add_argument(
        "--steps",
        type=int,
        help="stop after this step (default: train.steps); a resumed run stops at the same step",
    )
    ap.add_argument("--checkpoint-dir", type=Path, help="overrides checkpoint.dir")
    ap.add_argument("--checkpoint-every", type=int, help="overrides checkpoint.every")
    ap.add_argument(
        "--resume", action="store_true", help="continue from the newest valid checkpoint"
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set parallel.zero=2 (repeatable)",
    )
    ap.add_argument("--log-format", choices=("json", "text"), default="text",
                    help="rank 0's step lines on stdout")
    return ap.parse_args(argv)


def load_config(args: argparse.Namespace) -> JobConfig:
    overrides = list(args.overrides)
    if args.checkpoint_dir is not None:
        # A path typed on the command line means the working directory's, not job.output_dir's.
        overrides.append(f"checkpoint.dir={json.dumps(str(args.checkpoint_dir.absolute()))}")
    if args.checkpoint_every is not None:
        overrides.append(f"checkpoint.every={args.checkpoint_every}")
    cfg = load(args.config, overrides)
    if args.steps is not None and not 1 <= args.steps <= cfg.train.steps:
        raise ConfigError(
            f"--steps must be in [1, train.steps={cfg.train.steps}] (got {args.steps})"
        )
    return cfg


class ProgressPrinter:
    """JSON lines, or one updating line with step, loss, tokens/s and ETA on a terminal."""

    def __init__(self, fmt: str, stop_at: int) -> None:
        self.fmt, self.stop_at = fmt, stop_at
        self.tty = sys.stdout.isatty()
        self.started = time.perf_counter()
        self.first_step: int | None = None

    def step(self, r, dp: int) -> None:  # r: trainer.loop.StepResult
        if self.fmt == "json":
            record = {
                "step": r.step,
                "loss": finite_or_none(r.loss),
                "consumed_samples": r.consumed_samples,
                "tokens": r.tokens,
                "dp": dp,
                "step_seconds": round(r.step_seconds, 6),
                "recompute_seconds": round(r.recompute_seconds, 6),
                "recompute_ratio": round(r.recompute_ratio, 6),
                **step_record(r),
            }
            if r.memory is not None:  # this rank's (rank 0's) bytes by kind
                record["memory_bytes"] = {
                    k: v for k, v in dataclasses.asdict(r.memory).items() if v is not None
                }
            if r.bubble_ratio_measured is not None:
                record["bubble_ratio_measured"] = round(r.bubble_ratio_measured, 6)
                record["bubble_ratio_predicted"] = round(r.bubble_ratio_predicted, 6)
                record["bubble_ratio_pp_ranks"] = [round(x, 6) for x in r.bubble_ratio_pp_ranks]
            print(json.dumps(record), flush=True)
            return
        if self.first_step is None:
            self.first_step, self.started = r.step, time.perf_counter() - r.step_seconds
        elapsed = time.perf_counter() - self.started
        done = r.step - self.first_step + 1
        eta = elapsed / done * (self.stop_at - r.step)
        mfu = f"  mfu {r.mfu:.1%}" if r.mfu is not None else ""
        skipped = f"  skipped ({r.skipped})" if r.skipped else ""
        evaluated = f"  eval {r.eval_loss:.4f}" if r.eval_loss is not None else ""
        line = (
            f"step {r.step}/{self.stop_at}  loss {r.loss:.4f}{evaluated}  lr {r.lr:.2e}"
            f"  {r.tokens / r.step_seconds:,.0f} tok/s{mfu}  eta {eta:.0f}s{skipped}"
        )
        end = "" if self.tty and r.step < self.stop_at else "\n"
        print(
            ("\r" if self.tty else "") + line + ("\033[K" if self.tty else ""), end=end, flush=True
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # Imported after validation so a bad config fails fast, without a torch import.
    from trainer.nonfinite import NonFiniteSteps
    from trainer.run import run

    try:
        return run(
            cfg,
            stop_at=args.steps or cfg.train.steps,
            resume=args.resume,
            printer=ProgressPrinter(args.log_format, args.steps or cfg.train.steps),
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NonFiniteSteps as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
