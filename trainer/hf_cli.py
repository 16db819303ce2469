"""`ultrascale-hf`: Hugging Face weights out of and into our durable checkpoints.

    ultrascale-hf export CHECKPOINT_DIR OUT_DIR [--step N] [--dtype bf16|fp32] [--job JOB.toml]
    ultrascale-hf import HF_DIR CHECKPOINT_DIR [--job JOB.toml]

`export` reads a durable checkpoint of any layout (DCP reshards on read) in one process, one
of our tensors at a time (a MoE layer's stacked experts become one file tensor each), and
writes config.json, generation_config.json and model.safetensors (or shards and
model.safetensors.index.json above 5 GB). The model's fields come from the
checkpoint's manifest (written by every run since `models/` exists), else from `--job`.

`import` writes the Hugging Face model as a step-0 durable checkpoint (model, fresh AdamW state,
layout dp=1), which any layout then restores. It holds the whole model in this process; a job
that starts from the same directory with `[init] hf` reads only each rank's shards instead. The
optimizer's hyperparameters are saved with it, so pass the job that will train it as `--job`.

Exit codes: 0 done, 1 failure, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch

from parallel.cli_common import Parser, add_version
from parallel.job import MAX_STEPS, ConfigError, JobConfig, ModelConfig, from_dict, load, loads

EXIT_USAGE = 2
MODEL_PREFIX = "state.model."


def _job(path: Path | None, hf: Path | None = None) -> JobConfig:
    overrides = [f"init.hf={json.dumps(str(hf))}"] if hf is not None else []
    if path is not None:
        return load(path, overrides)
    return loads('[data]\nsource = "python-stdlib"\n', overrides)


def _model_of(extra: dict, job: Path | None, where: Path) -> ModelConfig:
    if job is not None:
        return _job(job).model
    if "model" not in extra:
        raise ConfigError(f"{where}/manifest.json does not record the model's fields (a "
                          "checkpoint from before models/ existed): pass --job JOB.toml")
    return from_dict({"model": extra["model"], "data": {"source": "python-stdlib"}}).model


def _checkpoint(root: Path, step: int | None) -> Path:
    from checkpoint.manifest import MANIFEST_NAME, checkpoint_dir, list_checkpoints

    if (root / MANIFEST_NAME).exists() and step is None:
        return root  # a step directory itself
    if step is not None:
        return checkpoint_dir(root, step)
    found = list_checkpoints(root)
    if not found:
        raise ConfigError(f"no checkpoint under {root}")
    return found[-1][1]


def export(args: argparse.Namespace) -> int:
    from checkpoint.durable import load_offline, open_offline
    from models import get_spec
    from models.safetensors_out import MAX_SHARD_BYTES, Planned, write_safetensors

    ckpt = _checkpoint(args.checkpoint_dir, args.step)
    manifest, metadata = open_offline(ckpt)
    model = _model_of(manifest.extra, args.job, ckpt)
    spec = get_spec(model.family)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    stored = metadata.state_dict_metadata
    tensors = {t.hf: t for t in spec.hf.tensors(model)}
    planned = []
    for t in tensors.values():
        key = MODEL_PREFIX + t.ours
        if key not in stored:
            raise ConfigError(f"{ckpt}: no tensor {key} (the model says {t.hf} exists)")
        size = tuple(stored[key].size)  # type: ignore[union-attr]
        planned.append(Planned(t.hf, size if t.index is None else size[1:], dtype))
    # One of our tensors at a time: a stacked one is read once for all its consecutive slices.
    held: dict[str, torch.Tensor] = {}

    def read(p: Planned) -> torch.Tensor:
        t = tensors[p.name]
        key = MODEL_PREFIX + t.ours
        if key not in held:
            held.clear()
            props = stored[key].properties  # type: ignore[union-attr]
            held[key] = torch.empty(tuple(stored[key].size), dtype=props.dtype)  # type: ignore[union-attr]
            load_offline(ckpt, manifest, {key: held[key]})
        return held[key] if t.index is None else held[key][t.index]

    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = write_safetensors(args.out_dir, planned, read, args.max_shard_bytes or MAX_SHARD_BYTES)
    config = spec.hf.config_to_hf(model) | {
        "torch_dtype": "bfloat16" if args.dtype == "bf16" else "float32"}
    (args.out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (args.out_dir / "generation_config.json").write_text(
        json.dumps({"_from_model_config": True}, indent=2) + "\n")
    print(json.dumps({"checkpoint": str(ckpt), "step": manifest.step, "out": str(args.out_dir),
                      "files": [f.name for f in files], "dtype": args.dtype}))
    return 0


def import_(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from checkpoint.durable import CheckpointManager
    from checkpoint.state import Progress, TrainState
    from models import get_spec
    from parallel.layout import Layout
    from trainer.loop import build_optimizer
    from trainer.pretrained import load_pretrained

    job = _job(args.job, args.hf_dir)
    spec = get_spec(job.model.family)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = spec.build(job.model)
        model.to_empty(device="cpu")
        spec.init_weights(model, job.train.seed)  # every parameter is overwritten next
        load_pretrained(model, args.hf_dir)
        state = TrainState(model, build_optimizer(model, job.train), Progress())
        manager = CheckpointManager(args.checkpoint_dir, keep=1 << 30,
                                    layout=Layout().to_dict(), timeout=timedelta(minutes=30),
                                    extra={"model": dataclasses.asdict(job.model)})
        manager.save_async(state)
        manager.wait()
        path = manager.commits[-1][1]
    finally:
        dist.destroy_process_group()
    print(json.dumps({"hf": str(args.hf_dir), "checkpoint": str(path), "step": 0}))
    return 0


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if not 0 <= step <= MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected a step in [0, {MAX_STEPS}] (got {text!r})")
    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(prog="ultrascale-hf", description=__doc__)
    add_version(ap, "ultrascale-hf")
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="a durable checkpoint -> a Hugging Face directory")
    ex.add_argument("checkpoint_dir", type=Path, help="checkpoint.dir (or one step_* in it)")
    ex.add_argument("out_dir", type=Path, help="the Hugging Face directory to write")
    ex.add_argument("--step", type=_step, help="the checkpoint of this step (default: newest)")
    ex.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32",
                    help="dtype of the written weights")
    ex.add_argument("--job", type=Path, help="the job's TOML, for checkpoints that do not "
                                             "record the model")
    ex.add_argument("--max-shard-bytes", type=int, default=0, help=argparse.SUPPRESS)
    im = sub.add_parser("import", help="a Hugging Face directory -> a step-0 durable checkpoint")
    im.add_argument("hf_dir", type=Path)
    im.add_argument("checkpoint_dir", type=Path)
    im.add_argument("--job", type=Path, help="the job that will train it (its [train] "
                                             "optimizer settings are saved)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # DCP warns that it loads "in a single process" when there is no process group: we mean to.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        return export(args) if args.command == "export" else import_(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"ultrascale-hf: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"ultrascale-hf {args.command} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
