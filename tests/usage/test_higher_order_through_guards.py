"""Gradient penalties (double backward: WGAN-GP, R1) and torch.func transforms (per-sample gradients with
vmap(grad(...))) through a guarded LayerNorm, in every mode: they train as under Lightning's own plugins."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp.guards import _layer_norm_fp32, _UpcastLayerNorm

MODES = ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"]


class Critic(LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x = batch[0].to(next(self.parameters()).dtype).requires_grad_(True)
        out = self.net(x)
        if self.kind == "penalty":  # WGAN-GP: the norm of d critic / d input, differentiated again
            (g,) = torch.autograd.grad(out.float().sum(), x, create_graph=True)
            loss = out.float().mean() + 10 * ((g.float().norm(dim=1) - 1) ** 2).mean()
        else:  # per-sample gradient norms with torch.func, as a regulariser
            from torch.func import functional_call, grad, vmap

            params = {k: v.detach() for k, v in self.net.named_parameters()}

            def one(p, xi):
                return functional_call(self.net, p, (xi.unsqueeze(0),)).float().sum()

            per_sample = vmap(grad(one), in_dims=(None, 0))(params, x.detach())
            norms = sum(v.float().pow(2).flatten(1).sum(1) for v in per_sample.values())
            loss = out.float().pow(2).mean() + 1e-3 * norms.mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g)),
                                           batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["penalty", "per-sample"])
def test_trains_through_the_guards(mode, kind):
    model = Critic(kind)
    plugin = MPPlugin(mode, **({"init_scale": 2.0**8} if "fp16" in mode else {}))
    make_trainer(plugin, max_steps=6).fit(model)
    assert len(model.losses) == 6 and all(torch.isfinite(torch.tensor(model.losses)))
    assert plugin.stats.skipped_steps == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_guarded_layer_norm_differentiates_twice_as_the_plain_ops(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 16).to(dtype).requires_grad_(True)
    weight = torch.randn(16, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    results = []
    for fn in (_UpcastLayerNorm.apply, _layer_norm_fp32):
        y = fn(x, weight, bias, 1e-5, (16,))
        (gx,) = torch.autograd.grad(y.float().pow(2).sum(), x, create_graph=True)
        results.append(torch.autograd.grad(gx.float().pow(2).sum(), (x, weight, bias)))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
