#!/usr/bin/env bash
# The FP8 recipes' convergence (issue: a default recipe chosen on evidence) on one GPU within one 10-minute command:
# bf16 as the reference and every FP8 layout and recipe, seeds 0, 1, 2, one process per (mode, seed), all sharing the
# GPU (GPT-mini is bound by host work; the machine has 16 cores). Transformer Engine set up first
# (`source .te/te_install.sh`), torchao installed for its modes. Usage, from the repository root:
#   bash benchmarks/convergence_fp8_gpu.sh [STEPS] [OUT]     (STEPS: a multiple of 200; LOGS: where the logs go)
set -u
STEPS=${1:-2000}
OUT_DIR=${2:-benchmarks/results/convergence_fp8}
LOGS=${LOGS:-$OUT_DIR.logs}
mkdir -p "$OUT_DIR" "$LOGS"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
pids=()
for seed in 0 1 2; do
  for mode in bf16 fp8 fp8:current fp8:torchao-tensorwise fp8:torchao-rowwise; do
    timeout "${LIMIT:-480}" python benchmarks/convergence.py --seeds "$seed" --modes "$mode" --threads 1 \
      --concurrent 15 --steps "$STEPS" --out "$OUT_DIR" >"$LOGS/$seed.${mode//:/_}" 2>&1 &
    pids+=($!)
  done
done
wait "${pids[@]}"
grep -h "Error\|error" "$LOGS"/* | tail -10
python benchmarks/convergence.py --report --out "$OUT_DIR" | tail -20
