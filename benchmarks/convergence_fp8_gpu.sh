#!/usr/bin/env bash
# The FP8 recipes' convergence (issue: a default recipe chosen on evidence) on one GPU within one 10-minute command:
# bf16 as the reference and every FP8 layout and recipe, seeds 0, 1, 2, one process per (mode, seed), all sharing the
# GPU (GPT-mini is bound by host work; the machine has 16 cores). Transformer Engine set up first
# (`source .te/te_install.sh`), torchao installed for its modes. Usage, from the repository root:
#   bash benchmarks/convergence_fp8_gpu.sh [STEPS] [OUT]     (STEPS: a multiple of 200; LOGS: where the logs go)
#
# The second command attributes torchao rowwise's gap (1,600 steps, 3 seeds: 0.076 nats/byte above tensorwise and
# bf16 on every seed): seed 0 only, 800 steps, four processes sharing the GPU: fp8:torchao-rowwise beside
# plain-torchao-rowwise (the same recipe through torchao's own convert_to_float8_training under Lightning's
# precision="bf16-mixed", no lightning_mp), fp8:torchao-rowwise-gw-hp (torchao's rowwise_with_gw_hp) and
# fp8:torchao-tensorwise. Same gap in the plain run: the recipe's; none there: lightning_mp's. torchao only
# (no Transformer Engine needed). Estimated 2-3 minutes on one H200 (each process: ~10 s start-up, ~30-60 s compiling
# its FP8 layers, 800 steps at ~40-60 ms with four sharing the GPU); each process is cut at LIMIT (default 300 s):
#   bash benchmarks/convergence_fp8_gpu.sh attribution [STEPS] [OUT]   (default 800, convergence_fp8_attribution)
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1

# run_modes OUT STEPS LIMIT "SEEDS" "MODES": one process per (mode, seed), all at once, then the table
run_modes() {
  local out=$1 steps=$2 limit=$3 seeds=$4 modes=$5 logs=${LOGS:-$1.logs} pids=() n=0 seed mode
  mkdir -p "$out" "$logs"
  for seed in $seeds; do for mode in $modes; do n=$((n + 1)); done; done
  for seed in $seeds; do
    for mode in $modes; do
      timeout "$limit" python benchmarks/convergence.py --seeds "$seed" --modes "$mode" --threads 1 \
        --concurrent "$n" --steps "$steps" --out "$out" >"$logs/$seed.${mode//:/_}" 2>&1 &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
  grep -h "Error\|error" "$logs"/* | tail -10
  python benchmarks/convergence.py --report --out "$out" | tail -20
}

if [ "${1:-}" = attribution ]; then
  run_modes "${3:-benchmarks/results/convergence_fp8_attribution}" "${2:-800}" "${LIMIT:-300}" "0" \
    "fp8:torchao-rowwise plain-torchao-rowwise fp8:torchao-rowwise-gw-hp fp8:torchao-tensorwise"
else
  run_modes "${2:-benchmarks/results/convergence_fp8}" "${1:-2000}" "${LIMIT:-480}" "0 1 2" \
    "bf16 fp8 fp8:current fp8:torchao-tensorwise fp8:torchao-rowwise"
fi
