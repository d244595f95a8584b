#!/usr/bin/env bash
# The checks that need a CUDA device, for a lent GPU machine, in under 8 minutes: every test
# marked `cuda` (skipped on CPU machines), then the stall benchmark with the state on the GPU.
#
# Needs torch with CUDA and tiercheck's dependencies importable there (`pip install -e
# '.[test]'` where an index can be reached; otherwise wheels put on PYTHONPATH first). Writes
# its logs and figures to $OUT when set (the device tool's folder), else bench/results/gpu/.
#
#   bash bench/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
# The CUDA tests: staging from device memory (pinned buffers, non_blocking copies, the fence),
# the codec's device paths.
timeout 240 python -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$out/cuda-tests.log"
# The stall and the in-place restore with the state in GPU memory, against the copy floors.
timeout 200 python bench/stall.py --device cuda --tensors 16 3000 --mb 500 --repeats 5 \
    --json "$out/stall-cuda.json" --png "$out/stall-cuda.png" | tee "$out/stall-cuda.md"
