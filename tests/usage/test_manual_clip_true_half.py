"""Manual optimization with ``self.clip_gradients(opt, ...)`` before ``opt.step()`` in the true-half modes (a case
that once raised ``found_inf must be a float tensor`` in fp16-true), for plain, foreach and fused optimizers and
both clipping algorithms; and fp32 weights loaded between two fits reach the masters exactly when the model is
made fp32 first (``model.float()``), as a fresh model's do."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp import MPPlugin

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adam-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}


class Manual(LightningModule):
    def __init__(self, optimizer: str = "sgd", algorithm: str = "norm") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
        self.automatic_optimization = False
        self.optimizer, self.algorithm = optimizer, algorithm

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.net(batch[0]).float().pow(2).mean()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm=self.algorithm)
        opt.step()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp16-true", "bf16-true", "fp16"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_clip_before_step(mode, optimizer, algorithm):
    model = Manual(optimizer, algorithm)
    before = [p.detach().float().clone() for p in model.parameters()]
    plugin = MPPlugin(mode, **({"init_scale": 2.0**8} if "fp16" in mode else {}))
    make_trainer(plugin, max_steps=3).fit(model)
    assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    assert any(not torch.equal(a, p.detach().float()) for a, p in zip(before, model.parameters()))


def test_fp32_weights_loaded_between_fits_after_float_reach_the_masters_exactly():
    class Auto(Manual):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = True

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).float().pow(2).mean()

    model = Auto()
    make_trainer(MPPlugin("bf16-true"), max_steps=2).fit(model)
    torch.manual_seed(5)
    exact = {k: torch.randn_like(v, dtype=torch.float32) for k, v in model.state_dict().items()}
    model.float()  # the half weights become fp32 again: load_state_dict keeps every bit
    model.load_state_dict(exact)
    plugin = MPPlugin("bf16-true")
    seen = {}

    class Start(__import__("lightning.pytorch").pytorch.Callback):
        def on_train_start(self, trainer, pl_module):
            masters = trainer.precision_plugin.masters
            seen.update({n: masters.master_of(p).detach().clone() for n, p in pl_module.named_parameters()
                         if masters.master_of(p) is not None})

    make_trainer(plugin, max_steps=1, callbacks=[Start()]).fit(model)
    assert seen and all(torch.equal(seen[n], exact[n]) for n in seen)
