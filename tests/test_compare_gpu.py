"""`python -m lightning_mp compare` on a CUDA GPU: the device-sized default, launch-bound detection, CUDA timing and
per-mode CUDA memory. Skipped without CUDA. Run on the GPU machine from the repository root::

    PYTHONPATH=.:tests python -m pytest -q -m gpu tests/test_compare_gpu.py

Imports only torch, lightning and lightning_mp (no jsonargparse needed).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from lightning_mp.tools.compare import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

SMALL = ["--model.width", "64", "--model.layers", "1", "--model.heads", "2", "--model.seq_len", "32",
         "--model.batch_size", "8"]


def _run(tmp_path, *argv):
    out = tmp_path / "compare.json"
    started = time.perf_counter()
    code = main([*argv, "--no-progress", "--json", str(out)])
    return code, json.loads(out.read_text()), time.perf_counter() - started


def test_default_run_is_sized_to_a_large_gpu_and_a_tensor_core_mode_wins(tmp_path, capsys):
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("the large default is for GPUs with 40 GB or more")
    code, data, seconds = _run(tmp_path)
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0
    assert "width=2048" in data["meta"]["model_call"]
    assert seconds < 120, f"the default run took {seconds:.0f} s"
    rows = {r["mode"]: r for r in data["results"]}
    assert all(r["memory_kind"] == "cuda" for r in rows.values() if r["peak_mem_mib"])
    assert rows["bf16"]["speedup"] > 2 and rows["bf16"]["speedup_lo"] > 1.5  # large GEMMs: bf16 clearly wins
    assert rows["bf16-true"]["peak_mem_mib"] < rows["fp32"]["peak_mem_mib"]
    assert rows["fp32"]["host_ms"] is not None  # CUDA events time the device, the host side is kept too
    assert data["decision"]["mode"] not in ("fp32", "tf32") and data["decision"]["confidence"] == "high"
    assert data["probe"] is not None and data["probe"]["overhead_bound"] is False


def test_a_small_model_is_called_launch_bound_not_an_fp32_win(tmp_path, capsys):
    code, data, _ = _run(tmp_path, *SMALL, "--modes", "fp32", "bf16", "--steps", "24")
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert data["probe"]["overhead_bound"] is True
    assert "Size: launch-bound" in printed and "too small for precision to matter" in printed
    assert "The step is mostly fixed overhead" in printed or data["decision"]["mode"] != "fp32"


def test_cuda_memory_is_per_mode_whatever_the_order(tmp_path):
    peaks = []
    for order in (["fp32", "bf16-true"], ["bf16-true", "fp32"]):
        medium = ["--model.width", "512", "--model.layers", "2", "--model.heads", "8", "--model.seq_len", "256",
                  "--model.batch_size", "16"]  # activations well above the process's first allocations
        code, data, _ = _run(tmp_path, *medium, "--modes", *order, "--steps", "8", "--no-batch-probe")
        assert code == 0
        peaks.append({r["mode"]: r["peak_mem_mib"] for r in data["results"]})
    # a mode's own tensors plus what its turns allocate; the process's first CUDA work (library workspaces, ~16-100
    # MiB on an H100) is not charged to whichever mode ran first: at most a few MiB of it remain
    for mode in ("fp32", "bf16-true"):
        assert peaks[0][mode] == pytest.approx(peaks[1][mode], rel=0.05, abs=24)
    assert peaks[0]["bf16-true"] < peaks[0]["fp32"] and peaks[1]["bf16-true"] < peaks[1]["fp32"]
