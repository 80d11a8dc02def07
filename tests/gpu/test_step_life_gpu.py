"""The step's life under Fabric on CUDA, at the default loss scale (2**16, above fp16's range): a step clipped and
left out with its gradients kept, a gradient two optimizers share, and the clipped gradients the loop reads.

Skipped without CUDA. Run on the GPU machine from the repository root::

    PYTHONPATH=.:tests python -m pytest -q -m gpu tests/gpu/test_step_life_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mp import MPFabricPrecision

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
]

CASES = [("fp16", {}), ("fp16-true", {}), ("fp16-true", {"master_weights": "none"}), ("bf16-true", {}), ("bf16", {})]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def _data(n: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 16, generator=g) for _ in range(n)]


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize(("mode", "kw"), CASES)
def test_left_out_step_keeps_its_gradients_at_the_default_scale(mode, kw):
    """Clipped, left out by the loop's rule, gradients kept: the next step equals the program that never clipped."""
    def run(clip_left_out: bool) -> tuple[torch.Tensor, int]:
        plugin = MPFabricPrecision(mode, **kw)
        fabric = Fabric(accelerator="cuda", devices=1, plugins=[plugin])
        raw = _model()
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.05))
        for i, x in enumerate(_data()):
            fabric.backward(model(x.cuda()).float().pow(2).mean())
            if i == 2:
                if clip_left_out:
                    fabric.clip_gradients(model, opt, max_norm=1e6)
                continue
            opt.step()
            opt.zero_grad()
        return _weights(model), plugin.stats.skipped_steps

    got, skipped = run(True)
    want, want_skipped = run(False)
    assert skipped == want_skipped == 0
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize(("mode", "kw"), CASES)
def test_read_after_clipping_is_clipped(mode, kw):
    plugin = MPFabricPrecision(mode, **({"init_scale": 2.0**8} if mode.startswith("fp16") else {}), **kw)
    fabric = Fabric(accelerator="cuda", devices=1, plugins=[plugin])
    raw = _model()
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.05))
    fabric.backward(model(_data()[0].cuda()).float().pow(2).mean() * 100)
    fabric.clip_gradients(model, opt, max_norm=0.01)
    total = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    assert float(total) == pytest.approx(0.01, rel=2e-2)
    opt.step()
    assert plugin.stats.skipped_steps == 0


@pytest.mark.parametrize(("mode", "kw"), CASES)
def test_shared_weight_both_backward_first(mode, kw):
    """Two optimizers hold the first layer; both backward calls run before both steps: as the fp32 run."""
    def run(plugin: MPFabricPrecision) -> torch.Tensor:
        fabric = Fabric(accelerator="cuda", devices=1, plugins=[plugin])
        raw = _model()
        opt1 = torch.optim.SGD([*raw[0].parameters()], lr=0.05)
        opt2 = torch.optim.SGD([*raw[0].parameters(), *raw[2].parameters()], lr=0.05)
        model, opt1, opt2 = fabric.setup(raw, opt1, opt2)
        for x in _data():
            fabric.backward(model(x.cuda()).float().pow(2).mean())
            opt1.step()
            opt2.step()
            opt1.zero_grad()
            opt2.zero_grad()
        return _weights(model)

    got, want = run(MPFabricPrecision(mode, **kw)), run(MPFabricPrecision("fp32"))
    assert float((got - want).abs().max()) < 0.03
