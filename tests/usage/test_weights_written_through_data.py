"""Weights written through ``.data`` (or any other way that leaves a parameter's version counter alone) reach the
next step, in every mode and with every kind of master weights.

``param.data`` is an alias with a version counter of its own: WGAN weight clipping (``p.data.clamp_``), weight
constraints (``w.data.renorm_``), shrinkage, VQ-VAE dead-code resets (``weight.data[rows] = ...``) and weights put
into the model between two ``fit`` calls all write that way. A user expects the next step to start from what they
wrote, as it does under Lightning's own plugins (where the weights are all there is).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import Callback, LightningModule
from torch import nn

from lightning_mp import MPPlugin

#: (mode, master_weights) pairs: every mode, the true-half ones with each kind of masters
MODES = [
    ("fp32", None), ("bf16", None), ("fp16", None),
    ("bf16-true", "fp32"), ("bf16-true", "kahan"), ("bf16-true", "stochastic"), ("bf16-true", "none"),
    ("fp16-true", "fp32"), ("fp16-true", "kahan"),
]
IDS = [m if k is None else f"{m}-{k}" for m, k in MODES]


def plugin_for(mode: str, kind) -> MPPlugin:
    kwargs = {} if kind is None else {"master_weights": kind}
    if mode.startswith("fp16"):
        kwargs["init_scale"] = 2.0**8
    return MPPlugin(mode, **kwargs)


class Net(LightningModule):
    def __init__(self, lr: float = 0.0, manual_write=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 1)
        self.lr = lr
        self.manual_write = manual_write
        if manual_write is not None:
            self.automatic_optimization = False

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x.to(self.l1.weight.dtype)).float(), y.float())
        if self.manual_write is None:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.manual_write(self)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class WriteAfterStep(Callback):
    """Calls ``write(module)`` after every training batch (and, with ``before=True``, before every one).

    With ``lr=0`` a step changes nothing: ``undone`` lists the steps after which a weight was not what the write
    before it left."""

    def __init__(self, write, before: bool = False) -> None:
        self.write, self.before = write, before
        self.written = None
        self.undone = []

    def _write(self, pl_module):
        self.write(pl_module)
        self.written = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.written is not None:
            for n, p in pl_module.named_parameters():
                if not torch.equal(p, self.written[n]):
                    self.undone.append((batch_idx, n))
        if not self.before:
            self._write(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.before:
            self._write(pl_module)


def clamp_all(module, c=0.01):
    for p in module.parameters():
        p.data.clamp_(-c, c)


def renorm_rows(module):
    module.l1.weight.data.renorm_(2, 0, 0.05)


def reset_rows(module):
    module.l1.weight.data[2:5] = 0.125


def fill_bias(module):
    module.l1.bias.data.fill_(-0.375)


def copy_into(module):
    module.l2.weight.data.copy_(torch.full_like(module.l2.weight, 0.75))


WRITES = {"clamp": clamp_all, "renorm": renorm_rows, "reset_rows": reset_rows, "fill": fill_bias,
          "copy": copy_into}


@pytest.mark.parametrize(("mode", "kind"), MODES, ids=IDS)
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_data_write_after_each_step_is_what_the_next_step_starts_from(mode, kind, write):
    """lr 0: a step changes nothing, so after the run the weights are exactly what the last write left."""
    model = Net(lr=0.0)
    writer = WriteAfterStep(WRITES[write])
    make_trainer(plugin_for(mode, kind), max_steps=4, callbacks=[writer]).fit(model)
    assert writer.undone == []


@pytest.mark.parametrize(("mode", "kind"), MODES, ids=IDS)
def test_weight_clipping_holds_while_training(mode, kind):
    """WGAN-style clipping with a learning rate that moves the weights far less than the clip: after each step the
    weights sit within the clip plus one update, never back at their unclipped size."""
    c = 0.01
    seen = []

    class Watch(Callback):  # (runs before the clipping callback: sees what the step left)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(max(p.detach().float().abs().max().item() for p in pl_module.parameters()))

    model = Net(lr=1e-4)
    make_trainer(plugin_for(mode, kind), max_steps=6, callbacks=[Watch(), WriteAfterStep(clamp_all)]).fit(model)
    assert max(seen[1:]) <= c * 1.05, seen


@pytest.mark.parametrize(("mode", "kind"), MODES, ids=IDS)
def test_shrinkage_compounds(mode, kind):
    """``p.data.mul_(0.5)`` after each of 4 steps at lr 0: every weight is 1/16 of its start (exact in every dtype)."""
    model = Net(lr=0.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def shrink(module):
        for p in module.parameters():
            p.data.mul_(0.5)

    plugin = plugin_for(mode, kind)
    make_trainer(plugin, max_steps=4, callbacks=[WriteAfterStep(shrink)]).fit(model)
    for name, p in model.named_parameters():
        want = start[name].to(p.dtype) / 16  # (the half cast of the start, halved four times: exact)
        assert torch.equal(p, want), name


@pytest.mark.parametrize(("mode", "kind"), MODES, ids=IDS)
def test_a_data_write_before_the_forward_pass(mode, kind):
    """Written in ``on_train_batch_start`` (the batch's forward pass already uses it): kept by the step."""
    model = Net(lr=0.0)
    writer = WriteAfterStep(reset_rows, before=True)
    make_trainer(plugin_for(mode, kind), max_steps=3, callbacks=[writer]).fit(model)
    assert writer.undone == []
    assert torch.equal(model.l1.weight[2:5], torch.full_like(model.l1.weight[2:5], 0.125))


@pytest.mark.parametrize(("mode", "kind"), MODES, ids=IDS)
def test_a_data_write_in_manual_optimization(mode, kind):
    """Manual optimization: the write right after ``opt.step()`` inside ``training_step``."""
    model = Net(lr=0.0, manual_write=reset_rows)
    make_trainer(plugin_for(mode, kind), max_steps=3).fit(model)
    assert torch.equal(model.l1.weight[2:5], torch.full_like(model.l1.weight[2:5], 0.125))


@pytest.mark.parametrize(("mode", "kind"), MODES, ids=IDS)
def test_weights_written_between_two_fits(mode, kind):
    """Weights put into the model between two ``fit`` calls of one Trainer and plugin (an average, a reset) are where
    the continued run starts: with lr 0 they are still there when it ends."""
    model = Net(lr=0.0)
    plugin = plugin_for(mode, kind)
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(model)
    model.l1.weight.data.fill_(0.0625)
    model.l2.bias.data.copy_(torch.tensor([-0.5]))
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model)
    assert torch.equal(model.l1.weight, torch.full_like(model.l1.weight, 0.0625))
    assert torch.equal(model.l2.bias, torch.tensor([-0.5], dtype=model.l2.bias.dtype))


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_a_data_write_reaches_the_masters_and_a_checkpoint(kind, tmp_path):
    """The masters a checkpoint carries after a ``.data`` write are the written weights (a resume starts there)."""
    model = Net(lr=0.0)
    plugin = plugin_for("bf16-true", kind)
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(model)
    model.l1.weight.data.fill_(0.0625)
    path = tmp_path / "w.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)
    assert torch.equal(state["state_dict"]["l1.weight"].float(), torch.full((16, 8), 0.0625))
    resumed = Net(lr=0.0)
    make_trainer(plugin_for("bf16-true", kind), max_steps=3).fit(resumed, ckpt_path=path)
    assert torch.equal(resumed.l1.weight, torch.full_like(resumed.l1.weight, 0.0625))
