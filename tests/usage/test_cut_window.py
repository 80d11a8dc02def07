"""An accumulation window cut short (``on_train_batch_start`` returning -1 mid-window) never steps: Lightning drops its
gradients at the next window's ``zero_grad``, and nothing of it (fp32 gradient sums, the spike guard's loss sum)
reaches the next step, in every mode."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp import MPPlugin


class Net(LightningModule):
    def __init__(self, cut_at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.cut_at = cut_at

    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == self.cut_at:
            return -1  # the rest of this epoch is skipped

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(96, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-true", "fp16-true"])
@pytest.mark.parametrize("master_weights", [None, "kahan"])
def test_a_cut_window_leaves_nothing_behind(mode, master_weights):
    if master_weights and "true" not in mode:
        pytest.skip("master weights are a true-half option")
    kwargs = {"master_weights": master_weights} if master_weights else {}
    if "fp16" in mode:
        kwargs["init_scale"] = 2.0**8
    runs = []
    for cut_at in (4, 6):  # at a window's start (nothing accumulated) and two micro-batches into it
        model = Net(cut_at)
        make_trainer(MPPlugin(mode, **kwargs), max_epochs=2, max_steps=-1, accumulate_grad_batches=4).fit(model)
        runs.append(model)
    # (BatchNorm's running statistics differ: the cut window's forward passes ran, as under Lightning's plugins)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
        assert torch.equal(a, b), name
