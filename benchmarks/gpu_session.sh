#!/usr/bin/env bash
# One visit to the GPU machine: the CUDA tests, then the step-overhead and buffer-snapshot benchmarks.
# Usage (repository root, on the GPU machine): bash benchmarks/gpu_session.sh [tests|bench|all] OUTDIR
set -u
what=${1:-all}
out=${2:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
if [ -f .te/te_install.sh ]; then source .te/te_install.sh >/dev/null 2>&1 || true; fi
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python -m pytest -q -m gpu -p no:cacheprovider -p no:logging --tb=short ${TESTS:-tests/gpu} 2>&1 | grep -v "^DEBUG" > "$out/gpu_tests.txt"; tail -40 "$out/gpu_tests.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 330 python benchmarks/bench_overhead.py --steps 12 --sync-steps 2 \
    --modes plain-bf16,lightning-bf16-mixed,mp-bf16,lightning-16-mixed,mp-fp16,lightning-bf16-true,mp-bf16-true \
    --json "$out/bench_overhead.json" 2>&1 | tail -30 | tee "$out/bench_overhead.txt"
  timeout 200 python benchmarks/bench_buffers.py --json "$out/bench_buffers.json" 2>&1 | tail -12 | tee "$out/bench_buffers.txt"
fi
