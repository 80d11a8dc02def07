"""The loss-spike guard on CUDA: the window and the decision on the device, a skipped spike leaves weights, BatchNorm
statistics, optimizer state and the LR bit-identical, and each optimizer of a GAN is judged against its own window.

Skipped without CUDA. Run on the GPU machine from the repository root::

    PYTHONPATH=.:tests python -m pytest -q -m gpu tests/gpu/test_spike_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from usage.conftest import opt_trainer
from usage.test_spike_guard import GAN, Boring, Net, Snapshot, plugin, skipped_per_optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

GPU = {"accelerator": "gpu", "devices": 1}


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true", "fp32"])
def test_a_spike_is_skipped_on_the_gpu_with_everything_bit_identical(mode):
    snap, p = Snapshot(at=40), plugin(mode)
    factor = 30.0 if mode.startswith("fp16") else 1e3
    opt_trainer(p, max_steps=44, callbacks=[snap], **GPU).fit(Net(spike_at=[40], factor=factor))
    assert p.stats.spike_skips == 1 and p.stats.skipped_steps == 1
    assert p._spike._values.device.type == "cuda"  # the window lives on the device
    for name, value in snap.before.items():
        assert value.device.type == "cuda" or name == "lr" or name.endswith(".step")  # (Adam's count: on the host)
        assert torch.equal(value, snap.after[name]), name
    if mode.startswith("fp16"):
        assert p.stats.loss_scale == 2.0**8


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_a_smooth_gpu_run_skips_nothing(mode):
    p = plugin(mode)
    opt_trainer(p, max_steps=300, **GPU).fit(Net())
    assert p.stats.spike_skips == 0 and p.stats.skipped_steps == 0


def test_each_optimizer_has_its_own_window_on_the_gpu():
    p = plugin("bf16")
    opt_trainer(p, max_steps=-1, max_epochs=1, **GPU).fit(GAN(spike_at=100))
    assert p.stats.spike_skips == 1 and skipped_per_optimizer(p) == [1, 0]
    assert tuple(p._spike._values.shape) == (2, 2, 32)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_a_converged_model_is_not_locked_out_on_the_gpu(mode):
    p = plugin(mode, spike_window=32)
    opt_trainer(p, max_steps=300, **GPU).fit(Boring())
    assert p.stats.spike_skips == 0 and p.stats.skipped_steps == 0


class FP8Net(Net):
    """Net with layers Transformer Engine runs in FP8 (dimensions multiples of 16), BatchNorm kept."""

    def __init__(self, spike_at=(), factor=1e3):
        super().__init__(spike_at=spike_at, factor=factor)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 1))  # fmt: skip


def _fp8_ready():
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not (torch.cuda.is_available() and _fp8_ready()), reason="needs Transformer Engine and sm >= 8.9")
def test_fp8_a_spike_is_skipped_and_a_smooth_run_is_not():
    fp8 = {"size_rule": "off"}
    smooth = plugin("fp8", fp8=fp8)
    opt_trainer(smooth, max_steps=300, **GPU).fit(FP8Net())
    assert smooth._fp8 is not None and smooth.stats.spike_skips == 0 and smooth.stats.skipped_steps == 0

    snap, p = Snapshot(at=40), plugin("fp8", fp8=fp8)
    opt_trainer(p, max_steps=44, callbacks=[snap], **GPU).fit(FP8Net(spike_at=[40]))
    assert p.stats.spike_skips == 1 and p.stats.skipped_steps == 1
    for name, value in snap.before.items():
        assert torch.equal(value, snap.after[name]), name
