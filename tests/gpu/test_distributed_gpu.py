"""DDP and FSDP on two GPUs with an overflow injected on one rank (runs benchmarks/bench_distributed.py small).

Checked for MPPlugin bf16 and fp16 under DDP and FSDP: every rank skips exactly the injected steps, every rank ends
with the same full weights, and the global loss curve equals the one-GPU run's within 2 %.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(tmp_path, runs: list[str]) -> dict:
    """bench_distributed.py at toy size over ``runs``, overflow on the last rank at steps 5 and 11; rows by name."""
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "bench_distributed.py"),
        "--vocab", "512", "--hidden", "256", "--layers", "2", "--heads", "4", "--seq", "128",
        "--global-batch", "8", "--steps", "16", "--warmup", "4", "--poison-steps", "5", "11", "--lr", "1e-3",
        "--out", str(tmp_path), "--tag", "test", "--runs", *runs,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["run"]: r for r in json.loads((tmp_path / "bench_distributed_test.json").read_text())["rows"]}


def test_ddp_and_fsdp_skip_together_and_match_one_gpu(tmp_path):
    runs = ["1gpu mp-bf16", "1gpu mp-fp16", "ddp mp-bf16", "ddp mp-fp16", "fsdp mp-bf16", "fsdp mp-fp16"]
    rows = run_bench(tmp_path, runs)
    assert set(rows) == set(runs)
    for name in runs:
        row = rows[name]
        assert "error" not in row, row.get("error")
        assert row["skipped_per_rank"] == [[5, 11]] * row["devices"], name
        assert row["same_weights_all_ranks"] and row["same_stats_all_ranks"], name
        assert row["stats"]["skipped_steps"] == 2 and row["stats"]["steps"] == 16
        if row["devices"] == 2:
            assert row["loss_max_rel_diff"] <= 0.02, (name, row["loss_max_rel_diff"])
        assert row["losses"][-1] < row["losses"][0], name  # it learns


def test_true_half_under_ddp_and_fsdp_matches_one_gpu(tmp_path):
    """bf16-true with fp32 masters: DDP (masters per rank) and FSDP (the fp32 shards are the masters, LayerNorms
    wrapped apart in fp32) against one GPU, with an overflow on one rank."""
    runs = ["1gpu mp-bf16-true", "ddp mp-bf16-true", "fsdp mp-bf16-true"]
    rows = run_bench(tmp_path, runs)
    for name in runs:
        row = rows[name]
        assert "error" not in row, row.get("error")
        assert row["skipped_per_rank"] == [[5, 11]] * row["devices"], name
        assert row["same_weights_all_ranks"], name
        if row["devices"] == 2:
            assert row["loss_max_rel_diff"] <= 0.02, (name, row["loss_max_rel_diff"])
