#!/usr/bin/env bash
# One short GPU check for whoever gets a GPU (< 4 minutes on one H200):
#   1. the GPU-marked tests (pytest -m gpu: CUDA training with AMP, iRPE fp32/fp16 vs the
#      reference), 2. the GPU rows of tools/benchmark.py: one attention layer at 25x38
#      and the L sweep (peak memory from the CUDA allocator), DETR-R50 plain vs iRPE
#      training step and inference at the COCO size 2 x 800x1216.
# Results: $OUT (default outputs/benchmark_gpu): results.json, results.md, op_sweep.png,
# gpu.txt, pytest_gpu.txt, benchmark.txt. See docs/benchmarks.md.
#
#   bash tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/benchmark_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
status=0
timeout 120 "$PY" -m pytest -q -m gpu 2>&1 | tee "$OUT/pytest_gpu.txt" || status=1
timeout 150 "$PY" tools/benchmark.py --device cuda --only op,model --op-repeats 20 \
    --sweep-repeats 5 --naive-max-length 2048 --model-size 800x1216 --model-repeats 5 \
    --model-warmup 2 --output-dir "$OUT" 2>&1 | tee "$OUT/benchmark.txt" || status=1
exit $status
