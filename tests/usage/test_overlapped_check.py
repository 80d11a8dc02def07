"""The inf/NaN check of a large model taken during backward (``lightning_mp.overlap``), from the user's side.

On the GPU the maxima are taken on a side stream for models of 2**27 elements and more; here the same logic runs in
line on the CPU, for a tiny model (the size limit and the device list are lowered for these tests). Whatever the
user's code does to gradients after backward, the step applies only gradients that were checked as they are.
"""

from __future__ import annotations

import math

import pytest
import torch
from .conftest import opt_trainer
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp import overlap

MODES = ("fp32", "bf16", "bf16-true")  # (bf16-true: the half gradients' figures, fp32 master weights)


@pytest.fixture
def small_models_overlap(monkeypatch, check_passes):
    monkeypatch.setattr(overlap, "MIN_NUMEL", 0)
    monkeypatch.setattr(overlap, "MIN_NUMEL_PER_GRAD", 0)
    monkeypatch.setattr(overlap, "DEVICE_TYPES", ("cuda", "cpu"))
    verdicts = []
    original = overlap.OverlappedCheck.verdict

    def spy(self, optimizer):
        out = original(self, optimizer)
        verdicts.append(out is not None)
        return out

    monkeypatch.setattr(overlap.OverlappedCheck, "verdict", spy)
    return verdicts, check_passes


class Net(LightningModule):
    def __init__(self, poison_step=None, poison_in_hook=None, unused_last=False, accumulate=1):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.side = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(8, 1)
        self.poison_step, self.poison_in_hook, self.unused_last = poison_step, poison_in_hook, unused_last
        self.accumulate = accumulate
        self.seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.b(torch.relu(self.a(x)))
        last = (batch_idx + 1) % self.accumulate == 0
        if not (self.unused_last and last):
            out = out + self.side(x)
            if self.poison_step is not None and batch_idx == self.poison_step:
                out = out + self.side(x) * math.inf  # inf/NaN gradients
        return nn.functional.mse_loss(out.float(), y.float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)


class HookNet(Net):
    def on_before_optimizer_step(self, optimizer):
        if self.poison_in_hook is not None and self.trainer.global_step == self.poison_in_hook:
            self.b.weight.grad[0, 0] = math.nan


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_clean_steps_take_the_verdict_from_backward_and_train_as_without_it(mode, small_models_overlap):
    verdicts, passes = small_models_overlap
    model = Net()
    opt_trainer(MPPlugin(mode), max_steps=4).fit(model)
    assert verdicts == [True] * 4 and passes == []  # no second pass over the gradients
    reference = Net()
    overlap.MIN_NUMEL = 1 << 40  # (monkeypatched: restored after the test) the usual pass
    opt_trainer(MPPlugin(mode), max_steps=4).fit(reference)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("mode", MODES)
def test_an_inf_gradient_from_backward_is_skipped_with_every_parameter_unchanged(mode, small_models_overlap):
    verdicts, _ = small_models_overlap

    class Snap(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                self.before = _params(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.after = _params(pl_module)

    snap, plugin, model = Snap(), MPPlugin(mode), Net(poison_step=2)
    opt_trainer(plugin, max_steps=4, callbacks=[snap]).fit(model)
    assert verdicts[2] is True and plugin.stats.skipped_steps == 1
    for name, value in snap.before.items():
        assert torch.equal(value, snap.after[name]), name


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_that_writes_a_nan_after_backward_is_still_caught(mode, small_models_overlap):
    _, passes = small_models_overlap
    plugin = MPPlugin(mode)
    opt_trainer(plugin, max_steps=4).fit(HookNet(poison_in_hook=1))
    assert plugin.stats.skipped_steps == 1 and len(passes) == 4  # a writing hook: the gradients are read again


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_where_the_last_micro_batch_leaves_a_parameter_out_is_checked_in_full(mode, small_models_overlap):
    """``side`` gets its gradient (an inf) in the first micro-batch only: its maximum was not taken in the last
    backward, so the step is checked by the usual pass, and skipped."""
    verdicts, passes = small_models_overlap
    plugin = MPPlugin(mode)
    opt_trainer(plugin, max_steps=2, accumulate_grad_batches=2).fit(Net(poison_step=0, unused_last=True, accumulate=2))
    if mode == "bf16-true":  # the fp32 sums of the micro-batches: the masters' gather checks what the step applies
        assert verdicts == [] and plugin.stats.skipped_steps == 1
        return
    assert verdicts == [False, False] and len(passes) == 2
    assert plugin.stats.skipped_steps == 1


def test_hooks_are_removed_when_training_ends(small_models_overlap):
    model = Net()
    opt_trainer(MPPlugin("bf16"), max_steps=2).fit(model)
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def test_small_models_and_scaling_modes_get_no_hooks(monkeypatch, check_passes):
    monkeypatch.setattr(overlap, "DEVICE_TYPES", ("cuda", "cpu"))
    installed = []
    original = overlap.OverlappedCheck.install
    monkeypatch.setattr(
        overlap.OverlappedCheck, "install", lambda self, opts, **kw: installed.append(original(self, opts, **kw))
    )
    for mode in ("bf16", "fp16", "bf16-true"):
        opt_trainer(MPPlugin(mode), max_steps=1).fit(Net())
    assert installed == [False, False]  # bf16 and bf16-true asked (too small); fp16 unscales anyway


def test_with_the_spike_guard_the_gradient_norm_taken_during_backward_is_the_check(small_models_overlap):
    """The spike guard's figure (the total L2 norm) is inf/NaN when a gradient is: taken during backward, it is both
    the inf/NaN check and the guard's gradient norm (no pass after backward), and a spike is still skipped."""
    verdicts, passes = small_models_overlap
    plugin = MPPlugin("bf16", spike_sigma=6.0, spike_window=8)
    opt_trainer(plugin, max_steps=8).fit(Net(poison_step=6))
    assert verdicts == [True] * 8 and passes == []
    assert plugin.stats.skipped_steps == 1 and plugin.stats.spike_skips == 0  # an inf: the check's, not a spike


def test_several_processes_keep_the_check_after_backward(small_models_overlap, monkeypatch):
    """Under DDP the gradients are reduced (and maybe compressed by a communication hook) after the hooks would take
    their maxima: the check runs after backward on what the step applies."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert overlap.OverlappedCheck().install([torch.optim.SGD(Net().parameters(), lr=0.1)]) is False


def test_many_small_gradients_get_no_hooks_even_in_a_large_model(monkeypatch) -> None:
    """A model above the size for the overlapped check whose gradients are small on average (a LitGPT 12 x 768: 1.1 M
    elements a gradient) is launch-bound: a hook per gradient would cost host time the GPU cannot hide."""
    monkeypatch.setattr(overlap, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(overlap, "MIN_NUMEL", 1 << 12)  # (the sizes scaled down 2^15: the rule, not the memory)
    monkeypatch.setattr(overlap, "MIN_NUMEL_PER_GRAD", 1 << 7)
    many_small = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(80)])  # 5760 elements, 36 a gradient
    few_large = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    for model, expected in ((many_small, False), (few_large, True)):
        check = overlap.OverlappedCheck()
        assert check.install([torch.optim.SGD(model.parameters(), lr=0.1)]) is expected
        check.remove()
