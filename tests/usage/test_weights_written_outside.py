"""Master weights follow weights written outside the step, and keep their low bits where a write leaves the value as
it was (``nn.Embedding(max_norm=...)`` renormalises its rows in place on every forward pass)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp import MPPlugin


class Embedder(LightningModule):
    def __init__(self, max_norm=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16, max_norm=max_norm)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        idx, y = batch
        return nn.functional.mse_loss(self.head(self.emb(idx)).float().squeeze(-1), y.float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 32, (96,), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(idx, torch.randn(96, generator=g)),
                                           batch_size=8)


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
@pytest.mark.parametrize("mode", ["bf16-true", "fp16-true"])
def test_a_renormalisation_that_changes_nothing_keeps_the_masters(mode, kind):
    plain, renormed = Embedder(), Embedder(max_norm=1e6)  # the norm never reaches 1e6: the same computation
    plugins = [MPPlugin(mode, master_weights=kind), MPPlugin(mode, master_weights=kind)]
    make_trainer(plugins[0], max_steps=24).fit(plain)
    make_trainer(plugins[1], max_steps=24).fit(renormed)
    assert torch.equal(plain.emb.weight, renormed.emb.weight)
    held = [p.masters._entries[id(m.emb.weight)].held for p, m in zip(plugins, (plain, renormed))]
    assert torch.equal(*held)  # the fp32 masters, or the Kahan compensation
    assert held[0].abs().sum() > 0


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_a_write_of_the_same_values_keeps_the_low_bits(kind):
    """``copy_`` of a weight's own values (a version-counter bump, nothing changed), through ``.data`` or not, between
    steps: the run is bit-identical to one without the writes."""
    from lightning.pytorch import Callback

    class Rewrite(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with torch.no_grad():
                pl_module.emb.weight.copy_(pl_module.emb.weight.clone())
            pl_module.head.weight.data.copy_(pl_module.head.weight.data.clone())

    plain, rewritten = Embedder(), Embedder()
    plugins = [MPPlugin("bf16-true", master_weights=kind), MPPlugin("bf16-true", master_weights=kind)]
    make_trainer(plugins[0], max_steps=12).fit(plain)
    make_trainer(plugins[1], max_steps=12, callbacks=[Rewrite()]).fit(rewritten)
    for a, b in zip(plain.parameters(), rewritten.parameters()):
        assert torch.equal(a, b)


def test_a_write_that_changes_the_weight_still_moves_the_master():
    model = Embedder()
    plugin = MPPlugin("bf16-true")
    make_trainer(plugin, max_steps=4).fit(model)
    with torch.no_grad():
        model.emb.weight[3].fill_(0.5)
    master = plugin.masters.master_of(model.emb.weight)
    assert torch.equal(master[3], torch.full((16,), 0.5))
    assert torch.equal(master.to(torch.bfloat16), model.emb.weight)


def test_ema_weights_survive_a_resume_in_another_mode(tmp_path):
    """bf16-true with fp32 masters and Lightning's EMAWeightAveraging: the average is put into the model when fit ends
    and saved; fine-tuning that checkpoint in 'bf16' starts from the saved (EMA) weights, not from the masters."""
    import lightning.pytorch.callbacks as callbacks

    EMAWeightAveraging = getattr(callbacks, "EMAWeightAveraging", None)
    if EMAWeightAveraging is None:
        pytest.skip("Lightning's EMAWeightAveraging came in Lightning 2.6")

    model = Embedder()
    trainer = make_trainer(MPPlugin("bf16-true"), max_steps=12, callbacks=[EMAWeightAveraging(decay=0.5)])
    trainer.fit(model)
    path = tmp_path / "ema.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]

    started = {}

    class Start(__import__("lightning.pytorch").pytorch.Callback):
        def on_train_start(self, trainer, pl_module):
            started.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    resumed = Embedder()
    make_trainer(MPPlugin("bf16"), max_steps=13, callbacks=[Start()]).fit(resumed, ckpt_path=path)
    for name, value in saved.items():
        assert torch.equal(started[name], value.float()), name
