"""LR schedulers people configure, with inf/NaN steps skipped by MPPlugin: ``OneCycleLR(total_steps=N)`` over N
steps, ``CosineAnnealingWarmRestarts``, ``LambdaLR`` with ``frequency`` 2, ``ReduceLROnPlateau`` on a logged metric
(step and epoch interval), under ``hold_schedulers_on_skip=True`` and ``False``.

Lightning steps a step-interval scheduler after every optimizer step. With the hold (the default) the plugin leaves
out the scheduler call right after a skipped step: the run goes as one whose data leaves the poisoned batches out.
Without it the schedule is Lightning's: as a run in which those batches' gradients are zero (plain SGD: a step that
changes nothing), under Lightning's own plugin of the mode where the arithmetic is the same. A gradient is poisoned
in ``on_after_backward`` (the logged loss stays finite, as a user's metric would be).
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from .conftest import OPT_MODES, MwMLP, mw_params, mw_regression_data, opt_assert_nested_equal, opt_plugin, opt_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers", "ignore:The number of training batches", "ignore:.*LeafSpec",
)

SS_LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                "fp16-true": "16-true"}  # fmt: skip
SS_POISONED = (2, 5)
SS_BATCHES = 8


class SsNet(MwMLP):
    """MwMLP (plain SGD) on 8 batches with a scheduler of ``kind``; the first weight's gradient is ``inf``
    (``poison="inf"``) or zero (``"zero"``) at the batches in ``poisoned``; ``drop`` leaves batches out of the data.
    Records the learning rate after every batch."""

    def __init__(self, kind: str, *, poisoned=(), poison: str = "inf", drop=(), total_steps: int = SS_BATCHES,
                 frequency: int = 1, interval: str = "step", **kwargs) -> None:  # fmt: skip
        kwargs.setdefault("n", 64)
        super().__init__(**kwargs)
        self.kind, self.total_steps, self.frequency, self.interval = kind, total_steps, frequency, interval
        self.poisoned, self.poison, self.drop = set(poisoned), poison, set(drop)
        self.lrs: list = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.epoch_loop.total_batch_idx in self.poisoned:
            grad = self.layer.weight.grad
            if self.poison == "zero":
                for p in self.parameters():
                    p.grad.zero_()
            else:
                grad[0, 0] = math.inf

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        config = {"interval": self.interval, "frequency": self.frequency}
        if self.kind == "onecycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total_steps)
        elif self.kind == "warm_restarts":
            scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=3)
        elif self.kind == "lambda":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5**k)
        else:
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
            config["monitor"] = "train_loss_step" if self.interval == "step" else "train_loss_epoch"
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, **config}}

    def train_dataloader(self):
        x, y = mw_regression_data(self.n, self.features)
        keep = [i for i in range(self.n) if i // self.batch_size not in self.drop]
        return DataLoader(TensorDataset(x[keep], y[keep]), batch_size=self.batch_size)


def ss_fit(mode: str, kind: str, *, hold: Optional[bool] = None, lightning: bool = False,
           max_steps: int = -1, max_epochs: int = 1, **model_kwargs):  # fmt: skip
    """Fit an SsNet with MPPlugin(mode, hold_schedulers_on_skip=hold) (true-half: no master weights, Lightning's
    arithmetic) or Lightning's own plugin; returns (model, plugin or None)."""
    torch.manual_seed(0)
    model = SsNet(kind, lr=0.01, **model_kwargs)
    plugin = None
    if not lightning:
        options = {} if hold is None else {"hold_schedulers_on_skip": hold}
        if mode.endswith("-true"):
            options["master_weights"] = "none"
        plugin = opt_plugin(mode, **options)
    precision = SS_LIGHTNING[mode] if lightning else None
    opt_trainer(plugin, max_steps=max_steps, precision=precision, max_epochs=max_epochs).fit(model)
    return model, plugin


def ss_assert_equal(actual: dict, expected: dict, what: str) -> None:
    opt_assert_nested_equal(actual, expected, what)


# ================================================================================================================
# OneCycleLR over exactly its total steps
# ================================================================================================================
@pytest.mark.parametrize("hold", [True, False], ids=["hold", "no-hold"])
@pytest.mark.parametrize("mode", OPT_MODES)
def test_one_cycle_over_its_total_steps_with_skipped_steps(mode, hold):
    """``OneCycleLR(total_steps=8)`` over 8 steps, 2 of them skipped: no "Tried to step 9 times" error either way.
    Without the hold the learning rates are Lightning's run with nothing skipped, step for step; with it the schedule
    is 2 steps behind (the run of the 6 clean batches), and 2 more steps (``max_steps=10``) end it exactly where
    Lightning's run of 8 steps ends, still without the error."""
    model, plugin = ss_fit(mode, "onecycle", hold=hold, poisoned=SS_POISONED)
    assert plugin.stats.steps == SS_BATCHES and plugin.stats.skipped_steps == len(SS_POISONED)
    clean, _ = ss_fit(mode, "onecycle", lightning=mode != "fp16", hold=hold)
    if not hold:
        assert model.lrs == clean.lrs
        return
    dropped, _ = ss_fit(mode, "onecycle", hold=hold, drop=SS_POISONED)
    assert [lr for i, lr in enumerate(model.lrs) if i not in SS_POISONED] == dropped.lrs
    ss_assert_equal(mw_params(model), mw_params(dropped), "skipped steps against the data without them")
    longer, longer_plugin = ss_fit(mode, "onecycle", hold=hold, poisoned=SS_POISONED, max_steps=10, max_epochs=2)
    assert longer_plugin.stats.steps == 10 and longer.lrs[-1] == clean.lrs[-1]


# ================================================================================================================
# other schedulers, step and epoch interval
# ================================================================================================================
SS_SCHEDULERS = {
    "warm_restarts": dict(),
    "lambda-frequency-2": dict(frequency=2),
    "plateau-step": dict(interval="step"),
    "plateau-epoch": dict(interval="epoch", max_epochs=2),
}
SS_MODES = ("fp32", "fp16", "bf16-true")


def ss_kind(name: str) -> str:
    return name.split("-")[0]


@pytest.mark.parametrize("name", list(SS_SCHEDULERS))
@pytest.mark.parametrize("mode", SS_MODES)
def test_schedulers_without_the_hold_step_as_lightning(mode, name):
    """``hold_schedulers_on_skip=False``: every scheduler steps as under Lightning, a skipped step counting as a
    step: the learning rates and weights are those of a run whose poisoned batches have zero gradients (plain SGD:
    a step that changes nothing), under Lightning's own plugin of the mode (fp16: MPPlugin's)."""
    options = SS_SCHEDULERS[name]
    model, plugin = ss_fit(mode, ss_kind(name), hold=False, poisoned=SS_POISONED, **options)
    assert plugin.stats.skipped_steps == len(SS_POISONED)  # (global batch indices: in the first epoch)
    zeroed, _ = ss_fit(mode, ss_kind(name), hold=False, lightning=mode != "fp16", poisoned=SS_POISONED,
                       poison="zero", **options)  # fmt: skip
    assert model.lrs == zeroed.lrs
    ss_assert_equal(mw_params(model), mw_params(zeroed), "skipped steps against zero gradients")


@pytest.mark.parametrize("name", ["warm_restarts", "plateau-step"])
@pytest.mark.parametrize("mode", SS_MODES)
def test_held_schedulers_follow_the_clean_steps(mode, name):
    """With the hold, a step-interval scheduler is not stepped after a skipped step: the learning rates of the clean
    batches and the weights are those of a run whose data leaves the poisoned batches out (``ReduceLROnPlateau``
    reads the same logged losses there)."""
    options = SS_SCHEDULERS[name]
    model, plugin = ss_fit(mode, ss_kind(name), hold=True, poisoned=SS_POISONED, **options)
    assert plugin.stats.skipped_steps == len(SS_POISONED)
    dropped, _ = ss_fit(mode, ss_kind(name), hold=True, drop=SS_POISONED, **options)
    assert [lr for i, lr in enumerate(model.lrs) if i not in SS_POISONED] == dropped.lrs
    ss_assert_equal(mw_params(model), mw_params(dropped), "skipped steps against the data without them")


@pytest.mark.parametrize("mode", SS_MODES)
def test_held_scheduler_with_frequency_and_epoch_plateau(mode):
    """With the hold: ``LambdaLR`` at ``frequency=2`` is called by Lightning after batches 2, 4, 6, 8; the call
    right after a skipped step (batch 6, the 5th skipped) is left out, the one after batch 4 (batch 3 skipped, 4
    clean) is not: 3 of 4 halvings. An epoch-interval ``ReduceLROnPlateau`` is never held: it steps at each epoch's
    end as Lightning's does (the epoch's logged mean holds the finite losses of the skipped batches)."""
    model, _ = ss_fit(mode, "lambda", hold=True, poisoned=SS_POISONED, frequency=2)
    assert model.lrs[-1] == 0.01 * 0.5**3
    epochs, _ = ss_fit(mode, "plateau", hold=True, poisoned=SS_POISONED, **SS_SCHEDULERS["plateau-epoch"])
    unheld, _ = ss_fit(mode, "plateau", hold=False, poisoned=SS_POISONED, **SS_SCHEDULERS["plateau-epoch"])
    assert epochs.lrs == unheld.lrs and len(epochs.lrs) == 2 * SS_BATCHES


class SsNone(SsNet):
    """SsNet whose ``training_step`` returns ``None`` at the batches in ``none_at``."""

    def __init__(self, kind: str, *, none_at=(), **kwargs) -> None:
        super().__init__(kind, **kwargs)
        self.none_at = set(none_at)

    def training_step(self, batch, batch_idx):
        if self.trainer.fit_loop.epoch_loop.total_batch_idx in self.none_at:
            return None
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_a_batch_returning_none_is_not_held(mode):
    """A batch whose ``training_step`` returns ``None`` is no skipped step: Lightning steps the scheduler after it
    and the hold does not hold it; a user's ``lr_scheduler_step`` override is held after a skipped step alone."""
    calls: list = []

    class Overridden(SsNone):
        def lr_scheduler_step(self, scheduler, metric):
            calls.append(metric)
            scheduler.step()

    torch.manual_seed(0)
    model = Overridden("lambda", lr=0.01, none_at=(3,), poisoned=(5,))
    plugin = opt_plugin(mode, **({"master_weights": "none"} if mode.endswith("-true") else {}))
    opt_trainer(plugin, max_steps=-1, max_epochs=1).fit(model)
    assert plugin.stats.steps == SS_BATCHES and plugin.stats.skipped_steps == 1 and len(calls) == SS_BATCHES - 1
    torch.manual_seed(0)
    theirs = SsNone("lambda", lr=0.01, none_at=(3,))
    opt_trainer(None, max_steps=-1, max_epochs=1, precision="32-true").fit(theirs)
    assert model.lrs[:5] == theirs.lrs[:5] and model.lrs[5:] == theirs.lrs[4:-1]
