"""A checkpoint written with MPPlugin("fp16") resumes under Lightning's own fp16 plugin with its loss scale."""

from __future__ import annotations

import math

import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_mp import MPPlugin


class Net(LightningModule):
    def __init__(self, poison=(1, 2)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.poison = poison

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).float().pow(2).mean()
        return loss * math.inf if self.global_step in self.poison and self.trainer.max_steps <= 4 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)


def test_lightning_16_mixed_resumes_our_fp16_scale(tmp_path):
    plugin = MPPlugin("fp16", init_scale=2.0**10)
    trainer = make_trainer(plugin, max_steps=4)
    trainer.fit(Net())
    scale = plugin.scaler.get_scale()
    assert scale < 2.0**10  # backed off on the poisoned steps
    path = tmp_path / "ours.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["MixedPrecision"]["scale"] == scale

    theirs = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    resumed = make_trainer(theirs, max_steps=5)
    resumed.fit(Net(), ckpt_path=path)
    assert theirs.scaler.get_scale() == scale  # one clean step since: no growth yet (interval 2000)


def test_bf16_checkpoints_carry_no_lightning_scaler_entry(tmp_path):
    trainer = make_trainer(MPPlugin("bf16"), max_steps=2)
    trainer.fit(Net(poison=()))
    trainer.save_checkpoint(tmp_path / "b.ckpt")
    assert "MixedPrecision" not in torch.load(tmp_path / "b.ckpt", weights_only=True)


def test_spike_guard_runs_without_get_total_norm(monkeypatch):
    """torch 2.4/2.5 (declared before 0.2; the minimum is now 2.11) have no torch.nn.utils.get_total_norm."""
    import lightning_mp.spike as spike

    monkeypatch.delattr(torch.nn.utils, "get_total_norm")
    norms = []
    original = spike._l2_norm
    monkeypatch.setattr(spike, "_l2_norm", lambda tensors: norms.append(original(tensors)) or norms[-1])
    plugin = MPPlugin("bf16", spike_sigma=6.0, spike_window=8)
    make_trainer(plugin, max_steps=12).fit(Net(poison=()))
    assert plugin.stats.steps == 12 and plugin.stats.skipped_steps == 0
    assert len(norms) == 12 and all(math.isfinite(float(n)) for n in norms)
