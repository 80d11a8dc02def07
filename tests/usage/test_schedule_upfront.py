"""PrecisionSchedule entries that training cannot switch to are refused before the first step, not at their step."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import Callback, LightningModule
from torch import nn

from lightning_mp import MPPlugin, PrecisionSchedule


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)


class Steps(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args):
        self.batches += 1


@pytest.mark.parametrize(
    ("start", "target", "where"),
    [("bf16", "bf16-true", "schedule"), ("fp16", "fp16-true", "schedule"), ("bf16-true", "bf16", "schedule"),
     ("fp32", "bf16-true", "schedule"), ("auto", "bf16-true", "schedule"), ("fp16", "bf16-true", "fallback"),
     ("bf16-true", "fp16-true", "schedule")],
)
def test_an_entry_that_cannot_be_switched_to_fails_before_training(start, target, where):
    steps = Steps()
    schedule = PrecisionSchedule({8: target}) if where == "schedule" else PrecisionSchedule(fallback={start: target})
    with pytest.raises(ValueError, match=f"cannot switch from precision=.* to '{target}'"):
        make_trainer(MPPlugin(start), max_steps=12, callbacks=[schedule, steps]).fit(Net())
    assert steps.batches == 0


@pytest.mark.parametrize(("start", "target"), [("fp32", "bf16"), ("bf16", "fp16"), ("fp16", "fp32"),
                                               ("bf16-true", "bf16-true")])
def test_switchable_entries_still_run(start, target):
    schedule = PrecisionSchedule({2: target})
    plugin = MPPlugin(start)
    make_trainer(plugin, max_steps=4, callbacks=[schedule]).fit(Net())
    assert plugin.mode.name == target
