"""A hook that drops a gradient (``p.grad = None`` in ``on_before_optimizer_step``, e.g. to freeze a layer for a
step) with gradient clipping on: that parameter is not updated, in every mode, as under Lightning's plugins."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp import MPPlugin


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def on_before_optimizer_step(self, optimizer):
        self.body.weight.grad = None  # this step does not move the body's weight

    def training_step(self, batch, batch_idx):
        return self.head(torch.tanh(self.body(batch[0]))).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_dropped_gradient_leaves_its_parameter(mode, algorithm):
    model = Net()
    before = model.body.weight.detach().clone()
    head = model.head.weight.detach().clone()
    plugin = MPPlugin(mode, **({"init_scale": 2.0**8} if "fp16" in mode else {}))
    make_trainer(plugin, max_steps=3, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm).fit(model)
    assert torch.equal(model.body.weight.float(), before.to(model.body.weight.dtype).float())
    assert not torch.equal(model.head.weight.float(), head.to(model.head.weight.dtype).float())
    assert plugin.stats.skipped_steps == 0
