#!/usr/bin/env bash
# The checks only a GPU can run, as one script for a lent GPU machine (docs: README, "Benchmarks").
# Run from the repository root on a machine whose python3 has a CUDA torch. Wheels of packages
# its image lacks may sit in .whl/ (crc32c, and a protobuf as new as proto/'s generated code).
# Each part has its own time limit, so one that hangs does not cost the rest.
set -u
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ultrascale-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/ultrascale-site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
part() { echo; echo "=== $1 (limit $2 s)"; shift 2; local t0=$SECONDS; timeout "$@"; echo "=== rc=$? in $((SECONDS - t0)) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
part "snapshot staging on the GPU (unit tests)" 110 110 python3 -m pytest -q -p no:cacheprovider \
  tests/unit/test_snapshot_staging.py tests/unit/test_snapshot_fastpath.py
part "nccl/CUDA trainer against the CPU reference" 140 140 python3 -m bench.gpu_parity
part "snapshot blocking against a device-to-host copy" 100 100 python3 -m bench.snapshot \
  --device cuda --runs 3 --size-mb 256 1024
part "MFU 350m bf16, steps 4-5 traced" 100 100 python3 -m bench.mfu --size 350m --steps 15 --profile
part "MFU 1b bf16" 90 90 python3 -m bench.mfu --size 1b --steps 10
