#!/usr/bin/env bash
# The convergence benchmark on one GPU within a 10-minute command: nine processes share the GPU (the runs are bound
# by host work at this size, and the machine has 16 cores), each taking one seed and a third of the modes (the third: the bf16 optimizer-state modes beside
# their counterparts); every
# process resumes what an earlier visit finished. Usage, from the repository root (Transformer Engine set up first
# where fp8 should run):  bash benchmarks/convergence_gpu.sh [MAX_MINUTES] [OUT]  (LIMIT: seconds a process may run, default 560)
set -u
MAX=${1:-6.5}
OUT_DIR=${2:-benchmarks/results/convergence}
mkdir -p "$OUT_DIR"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
A=fp32,bf16,bf16-true,bf16-true:stochastic,fp16-true,fp8:bf16-weights
B=tf32,fp16,bf16-true:kahan,bf16-true:none,fp8
C=bf16-true:bf16-states,fp8:bf16-states,bf16:bf16-states
pids=()
for seed in 0 1 2; do
  for modes in $A $B $C; do
    timeout "${LIMIT:-560}" python benchmarks/convergence.py --seeds "$seed" --modes "$modes" --threads 2 --concurrent 9 \
      --max-minutes "$MAX" --out "$OUT_DIR" >"$OUT_DIR.log.$seed.${modes%%,*}" 2>&1 &
    pids+=($!)
  done
done
wait "${pids[@]}"
grep -h "seed\|Error\|error" "$OUT_DIR".log.* | grep -v "^GPT-mini" | tail -40
python benchmarks/convergence.py --report --out "$OUT_DIR" | tail -25
