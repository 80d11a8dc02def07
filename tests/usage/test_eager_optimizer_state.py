"""Optimizers that make their state in the constructor from the parameters (Adagrad's ``sum``) get fp32 state with
master weights, as every other optimizer does: in fp16 an eps-sized accumulator underflows and 0/0 gives NaN."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp import MPPlugin


class AdagradNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16-true", "fp16-true"])
@pytest.mark.parametrize("master_weights", ["fp32", "kahan", "stochastic"])
def test_adagrad_with_masters_keeps_fp32_state_and_trains(mode, master_weights):
    ours = AdagradNet()
    trainer = make_trainer(MPPlugin(mode, master_weights=master_weights, **({"init_scale": 2.0**8} if mode ==
                                                                             "fp16-true" else {})), max_steps=8)
    trainer.fit(ours)
    assert {v["sum"].dtype for v in trainer.optimizers[0].state.values()} == {torch.float32}
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    reference = AdagradNet()
    make_trainer(None, max_steps=8, precision="32-true").fit(reference)
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a.float(), b, atol=0.03, rtol=0.03)
