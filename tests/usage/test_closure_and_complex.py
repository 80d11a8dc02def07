"""Optimizers that evaluate the closure themselves (SAM and its kin) in automatic optimization, and complex-valued
parameters (spectral/FFT models): they train under MPPlugin as under Lightning's own plugin of the same mode, and a
step with an inf/NaN still changes nothing."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mp import MPPlugin

LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "bf16-true": "bf16-true"}


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as Lightning users write it for automatic optimization: the closure gives the
    gradient at the weights, the weights move up it by ``rho``, the closure runs again there, the base optimizer
    steps from the original weights with that second gradient."""

    def __init__(self, params, base=torch.optim.SGD, rho: float = 0.05, **kwargs) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.evaluations = 0

    @torch.no_grad()
    def step(self, closure):  # the closure is required
        with torch.enable_grad():
            closure()
        self.evaluations += 1
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        moved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    e = (p.grad * (group["rho"] / (norm + 1e-12))).to(p.dtype)
                    p.add_(e)
                    moved.append((p, e))
        with torch.enable_grad():
            closure()
        self.evaluations += 1
        for p, e in moved:
            p.sub_(e)
        self.base_optimizer.step()


class SamNet(LightningModule):
    def __init__(self, poison_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.poison_step, self.calls = poison_step, 0
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        # poison the second evaluation (at the perturbed point) of one step: only a check inside step() sees it
        if self.poison_step is not None and self.calls == 2 * self.poison_step + 2:
            loss = loss * math.nan
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return SAM(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(model: LightningModule, mode: str, lightning: bool = False, steps: int = 6):
    trainer = make_trainer(None if lightning else MPPlugin(mode), max_steps=steps,
                           **({"precision": LIGHTNING[mode]} if lightning else {}))
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-true"])
def test_sam_in_automatic_optimization_trains_as_under_lightning(mode):
    ours, theirs = SamNet(), SamNet()
    _fit(ours, mode)
    _fit(theirs, mode, lightning=True)
    assert ours.trainer.optimizers[0].evaluations == 12  # the optimizer evaluated the closure, twice a step
    first, last = sum(ours.losses[:4]), sum(ours.losses[-4:])
    assert last < first
    if mode == "fp32":  # the same computation: bit-identical
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b)
    else:  # (bf16-true: ours keeps fp32 masters, Lightning none)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-true"])
def test_sam_step_poisoned_at_its_second_evaluation_changes_nothing(mode):
    model = SamNet(poison_step=3)
    snapshots = {}

    class Watch(__import__("lightning.pytorch").pytorch.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx in (3, 4):
                opt = trainer.optimizers[0]
                snapshots[batch_idx] = (
                    [p.detach().clone() for p in pl_module.parameters()],
                    {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.base_optimizer.state.items()},
                )

    plugin = MPPlugin(mode)
    make_trainer(plugin, max_steps=6, callbacks=[Watch()]).fit(model)
    (before, state_before), (after, state_after) = snapshots[3], snapshots[4]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert state_before.keys() == state_after.keys()
    for key, saved in state_before.items():  # the base optimizer's momentum held too
        for name, value in saved.items():
            assert torch.equal(value, state_after[key][name]), name
    assert plugin.stats.skipped_steps == 1
    assert all(math.isfinite(v) for p in model.parameters() for v in p.detach().float().flatten().tolist())


def test_sam_with_a_loss_scale_is_refused_with_the_reason():
    with pytest.raises(MisconfigurationException, match="SAM evaluates its closure inside step"):
        make_trainer(MPPlugin("fp16"), max_steps=2).fit(SamNet())


class Spectral(LightningModule):
    """A complex-valued spectral filter (FFT, multiply, inverse FFT) before a real head."""

    def __init__(self, poison_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.filter = nn.Parameter(torch.randn(8, dtype=torch.complex64) * 0.3)
        self.head = nn.Linear(8, 1)
        self.poison_step = poison_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        spectrum = torch.fft.fft(x.float()) * self.filter
        if self.poison_step is not None and self.global_step == self.poison_step:
            spectrum = spectrum * torch.tensor(complex(math.inf, 0.0))
        h = torch.fft.ifft(spectrum).real
        return nn.functional.mse_loss(self.head(h).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=8)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "tf32"])
def test_complex_parameters_train(mode):
    ours = Spectral()
    make_trainer(MPPlugin(mode, **({"init_scale": 2.0**8} if mode == "fp16" else {})), max_steps=8).fit(ours)
    assert ours.filter.dtype is torch.complex64
    if mode in ("fp32", "tf32"):  # (no TF32 on the CPU) the same computation as Lightning's 32-true: bit-identical
        theirs = Spectral()
        make_trainer(None, max_steps=8, precision="32-true").fit(theirs)
        assert torch.equal(ours.filter, theirs.filter) and torch.equal(ours.head.weight, theirs.head.weight)
    else:
        assert not torch.equal(ours.filter, Spectral().filter)  # it trained


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_complex_gradient_with_an_inf_skips_the_step(mode):
    model = Spectral(poison_step=2)
    seen = {}

    class Watch(__import__("lightning.pytorch").pytorch.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx in (2, 3):
                opt = trainer.optimizers[0]
                seen[batch_idx] = ([p.detach().clone() for p in pl_module.parameters()],
                                   [int(s["step"]) for s in opt.state.values()])

    plugin = MPPlugin(mode, **({"init_scale": 2.0**8} if mode == "fp16" else {}))
    make_trainer(plugin, max_steps=5, callbacks=[Watch()]).fit(model)
    (before, steps_before), (after, steps_after) = seen[2], seen[3]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert steps_before == steps_after  # Adam's step count held
    assert plugin.stats.skipped_steps == 1
