"""A skipped step puts back every buffer its forward passes changed, however they changed it: in place (BatchNorm's
running statistics), or re-assigned (``self.ema = 0.9 * self.ema + 0.1 * h.mean(0)``, ``self.calls = self.calls + 1``,
the common way in EMA codebooks, custom norms and monitors), persistent or not, in every mode.

The poisoned batch holds one NaN input: the forward pass makes the statistics NaN, the gradients NaN, the step is
skipped, and the statistics must be what they were before that batch (a NaN left in them would poison every later
step).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch import Callback, LightningModule
from torch import nn

from lightning_mp import MPPlugin

MODES = ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"]
POISONED = 2  # the batch with a NaN input


def plugin_for(mode: str, **kwargs) -> MPPlugin:
    if mode.startswith("fp16"):
        kwargs.setdefault("init_scale", 2.0**8)
    return MPPlugin(mode, **kwargs)


class Tracker(nn.Module):
    """A module without parameters whose buffers its forward pass re-assigns."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("peak", torch.zeros(()), persistent=False)

    def forward(self, h):
        stat = h.detach().float()
        self.ema = 0.9 * self.ema + 0.1 * stat.mean(0)
        self.calls = self.calls + 1
        self.peak = torch.maximum(self.peak, stat.abs().max())
        return h


class CodebookNorm(nn.Module):
    """A custom norm with a weight, whose running scale is re-assigned (it belongs to the optimizer of its weight)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.register_buffer("running_scale", torch.ones(features))

    def forward(self, h):
        if self.training:
            self.running_scale = 0.8 * self.running_scale + 0.2 * h.detach().float().abs().mean(0)
        return h / self.running_scale.to(h.dtype).clamp_min(1e-3) * self.weight


class Net(LightningModule):
    def __init__(self, manual: bool = False, accumulate: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.track = Tracker(16)
        self.norm = CodebookNorm(16)
        self.l2 = nn.Linear(16, 1)
        self.manual = manual
        self.accumulate = accumulate
        if manual:
            self.automatic_optimization = False

    def forward(self, x):
        return self.l2(self.norm(self.track(self.bn(torch.relu(self.l1(x))))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x.to(self.l1.weight.dtype)).float(), y.float())
        if not self.manual:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            opt.step()
            opt.zero_grad()
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Poison(Callback):
    """Puts a NaN into the inputs of the batches ``batches`` and keeps the buffers before each window and after it."""

    def __init__(self, batches, window: int = 1) -> None:
        self.batches, self.window = set(batches), window
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.window == 0:
            self.before[batch_idx // self.window] = buffers_of(pl_module)
        if batch_idx in self.batches:
            batch[0][0, 0] = math.nan

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.window == 0:
            self.after[batch_idx // self.window] = buffers_of(pl_module)


def buffers_of(module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{where}: buffer {name} {a[name]} != {b[name]}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_skipped_step_puts_back_reassigned_buffers(mode, manual):
    poison = Poison([POISONED])
    model = Net(manual=manual)
    plugin = plugin_for(mode)
    make_trainer(plugin, max_steps=5, callbacks=[poison]).fit(model)
    assert plugin.stats.skipped_steps == 1
    assert_same(poison.before[POISONED], poison.after[POISONED], "the skipped step")
    for name, b in model.named_buffers():
        if b.is_floating_point():
            assert torch.isfinite(b).all(), f"{name} kept the poisoned step's NaN"
    # the counter counts the forward passes of the steps taken: 5 batches, one skipped
    assert int(model.track.calls) == 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_accumulation_window_puts_back_reassigned_buffers(mode):
    poison = Poison([POISONED * 2 + 1], window=2)  # the second micro-batch of the window
    model = Net()
    plugin = plugin_for(mode)
    make_trainer(plugin, max_steps=4, accumulate_grad_batches=2, callbacks=[poison]).fit(model)
    assert plugin.stats.skipped_steps == 1
    assert_same(poison.before[POISONED], poison.after[POISONED], "the skipped window")
    assert int(model.track.calls) == 6


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_step_changes_nothing_against_a_run_without_it(mode):
    """The run with the poisoned batch ends with the buffers of the run that never saw it: re-assigned buffers, the
    BatchNorm statistics and counter, every parameter and the optimizer state (the oracle's data skips the batch)."""
    class SkipBatch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == POISONED:
                return -1  # (Lightning skips the rest of the epoch on -1: used below only as a marker)

    poisoned, clean = Net(), Net()
    runs = [plugin_for(mode), plugin_for(mode)]
    make_trainer(runs[0], max_steps=5, callbacks=[Poison([POISONED])]).fit(poisoned)

    class Without(torch.utils.data.Dataset):
        def __init__(self, base):
            self.items = [base[i] for i in range(len(base)) if i // 8 != POISONED]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    base = clean.train_dataloader().dataset
    clean.train_dataloader = lambda: torch.utils.data.DataLoader(Without(base), batch_size=8)
    make_trainer(runs[1], max_steps=4).fit(clean)
    assert_same(buffers_of(poisoned), buffers_of(clean), "final")
    for (name, a), b in zip(poisoned.named_parameters(), clean.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", MODES)
def test_buffers_reassigned_to_another_dtype_or_device_object_are_put_back(mode):
    """A forward that re-assigns a buffer with a tensor of another shape (a growing history) or replaces it by a new
    object each step: after the skip the slot holds the old value, shape included."""
    class History(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(0))

        def forward(self, h):
            self.seen = torch.cat([self.seen, h.detach().float().mean().reshape(1)])
            return h

    class WithHistory(Net):
        def __init__(self):
            super().__init__()
            self.hist = History()

        def forward(self, x):
            return self.hist(super().forward(x))

    poison = Poison([POISONED])
    model = WithHistory()
    make_trainer(plugin_for(mode), max_steps=5, callbacks=[poison]).fit(model)
    assert_same(poison.before[POISONED], poison.after[POISONED], "the skipped step")
    assert model.hist.seen.shape == (4,)
    assert torch.isfinite(model.hist.seen).all()


class LateNet(Net):
    """Buffers and a submodule that appear during training: a buffer registered at the first training step (lazy
    statistics), and at the second a tracker module added (``self.late = Tracker(16)``), both updated every step."""

    def forward(self, x):
        h = self.bn(torch.relu(self.l1(x)))
        if not hasattr(self, "seen"):
            self.register_buffer("seen", torch.zeros(16))
        self.seen = self.seen + h.detach().float().abs().mean(0)
        if self.global_step >= 1 and not hasattr(self, "late"):
            self.late = Tracker(16).to(h.device)
        if hasattr(self, "late"):
            h = self.late(h)
        return self.l2(self.norm(self.track(h)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_buffers_and_submodules_that_appear_during_training_are_put_back_too(mode, manual):
    poison = Poison([POISONED])
    plugin = plugin_for(mode)
    make_trainer(plugin, max_steps=4, callbacks=[poison]).fit(LateNet(manual=manual))
    assert plugin.stats.skipped_steps == 1
    before, after = poison.before[POISONED], poison.after[POISONED]
    assert {"seen", "late.ema", "late.calls"} <= set(before)  # (registered before the poisoned batch)
    assert_same(before, after, f"{mode} skipped batch")


def test_the_watch_on_registrations_ends_with_the_run():
    """The global buffer and module registration hooks the snapshot counts with are torch's: gone after fit."""
    from lightning_mp.buffers import _Registrations
    from torch.nn.modules import module as torch_module

    import gc

    gc.collect()  # (snapshots of earlier runs that never tore down stop watching when collected)
    hooks = (len(torch_module._global_buffer_registration_hooks), len(torch_module._global_module_registration_hooks))
    watchers = _Registrations.watchers
    plugin = plugin_for("bf16")
    make_trainer(plugin, max_steps=3, callbacks=[Poison([POISONED])]).fit(LateNet())
    assert _Registrations.watchers == watchers and plugin._steps.buffers._unwatch is None
    assert (len(torch_module._global_buffer_registration_hooks),
            len(torch_module._global_module_registration_hooks)) == hooks
    if watchers == 0:  # (alone in the process: nothing of ours is left on torch)
        assert not _Registrations.handles
