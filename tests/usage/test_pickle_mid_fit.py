"""Anything the plugin attaches during ``fit`` survives pickling and copying.

Weight-averaging callbacks and checkpointing code copy the LightningModule while it trains: ``torch.save(pl_module)``
in a callback, ``copy.deepcopy(pl_module)`` (EMA, Lightning's ``StochasticWeightAveraging`` and ``WeightAveraging``).
With a step-interval LR scheduler (held after a skipped step), FP32 guards (a LayerNorm and a BatchNorm: the
defaults guard both) and a poisoned batch (a NaN input: a skipped step, the scheduler held), in every mode:

* the module, its optimizer and its scheduler pickle and deep-copy mid-fit; the pickled module loads with
  ``torch.load(weights_only=False)`` and runs forward as the module did when it was saved;
* a copy is the user's module, not the plugin's run: its ``lr_scheduler_step`` is its own (not held, run on the
  copy), during the fit and after it, and the copy trains under Lightning's own plugin;
* the copies change nothing about the run (bit-identical to the run without them; the hold still holds);
* after ``fit`` the module and its class are plain again.
"""

from __future__ import annotations

import copy
import inspect
import io
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
import lightning.pytorch.callbacks as pl_callbacks
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp.guards import fp32_guard_of

from .conftest import OPT_MODES, opt_assert_nested_equal, opt_plugin, opt_trainer

#: Lightning's WeightAveraging came in Lightning 2.6
WeightAveraging = getattr(pl_callbacks, "WeightAveraging", None)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers",
    "ignore:The number of training batches",
    "ignore:SWA is currently only supported every epoch",
    "ignore:Swapping scheduler",
)

PM_LR, PM_GAMMA = 0.1, 0.5
PM_BATCHES, PM_BATCH_SIZE = 6, 4
PM_POISONED = 1  # the batch whose step is skipped (and whose scheduler step is held)


class PmModel(LightningModule):
    """Linear, LayerNorm, BatchNorm, Linear; SGD with momentum and a step-interval StepLR (halves the LR a step)."""

    def __init__(self, poisoned: tuple[int, ...] = (PM_POISONED,)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.bn, self.out = nn.Linear(4, 8), nn.LayerNorm(8), nn.BatchNorm1d(8), nn.Linear(8, 1)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(PM_BATCHES * PM_BATCH_SIZE, 4, generator=g)
        for batch in poisoned:
            self.x[batch * PM_BATCH_SIZE] = float("nan")

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.norm(self.inp(x)))))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=PM_LR, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=PM_GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x), batch_size=PM_BATCH_SIZE)


class PmCountingModel(PmModel):
    """The user's own ``lr_scheduler_step``: it counts its calls on the module it is called on."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scheduler_calls = 0

    def lr_scheduler_step(self, scheduler, metric) -> None:
        self.scheduler_calls += 1
        scheduler.step()


def pm_probe(module: nn.Module) -> torch.optim.lr_scheduler.StepLR:
    """A scheduler of the module's own (not the run's): stepping it halves its LR from 1."""
    return torch.optim.lr_scheduler.StepLR(torch.optim.SGD(module.parameters(), lr=1.0), step_size=1, gamma=0.5)


def pm_lr(scheduler) -> float:
    return scheduler.optimizer.param_groups[0]["lr"]


def pm_input(module: nn.Module) -> torch.Tensor:
    """Inputs in the dtype of the module's first layer (half after a true-half run)."""
    return torch.randn(PM_BATCH_SIZE, 4, generator=torch.Generator().manual_seed(2)).to(module.inp.weight.dtype)


def pm_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def pm_loaded(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class PmSnapshot(Callback):
    """At the end of batch ``at`` (the poisoned batch: its scheduler step is held next): the module, its optimizer and
    its scheduler pickled and deep-copied, the module's state and the output of an eval copy kept."""

    def __init__(self, at: int = PM_POISONED) -> None:
        self.at = at
        self.taken = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.at or self.taken:
            return
        self.taken = True
        optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
        self.module_bytes = pm_saved(pl_module)
        self.copy = copy.deepcopy(pl_module)
        self.state = copy.deepcopy(pl_module.state_dict())
        self.optimizer_bytes, self.optimizer_copy = pm_saved(optimizer), copy.deepcopy(optimizer)
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())
        self.scheduler_bytes, self.scheduler_copy = pm_saved(scheduler), copy.deepcopy(scheduler)
        self.scheduler_state = copy.deepcopy(scheduler.state_dict())
        with torch.no_grad():
            self.output = copy.deepcopy(pl_module).eval()(pm_input(pl_module))
        self.probe = pm_probe(self.copy)  # the copy's lr_scheduler_step while the original's is held
        self.copy.lr_scheduler_step(self.probe, None)
        self.probe_lr_during_fit = pm_lr(self.probe)


def pm_fit(mode: str, model: PmModel, callbacks=(), **kwargs: Any):
    kwargs.setdefault("max_steps", 5)
    trainer = opt_trainer(opt_plugin(mode), kwargs.pop("max_steps"), callbacks, **kwargs)
    trainer.fit(model)
    return trainer


def pm_assert_plain(module: PmModel) -> None:
    """Nothing of the plugin's run on the module or its class."""
    assert "lr_scheduler_step" not in vars(module)
    own = vars(type(module)).get("lr_scheduler_step")  # (the hold's route lives on the class while fit runs)
    assert own is None or inspect.isfunction(own), own
    for name, sub in module.named_modules():
        assert fp32_guard_of(sub) is None, name
        assert "forward" not in vars(sub), name


# ---------------------------------------------------------------------------------------------- torch.save mid-fit
@pytest.mark.parametrize("mode", OPT_MODES)
def test_module_saved_mid_fit_loads_and_runs(mode):
    snapshot = PmSnapshot()
    model = PmModel()
    trainer = pm_fit(mode, model, [snapshot])
    assert snapshot.taken and trainer.precision_plugin.stats.skipped_steps == 1

    loaded = pm_loaded(snapshot.module_bytes)
    assert type(loaded) is PmModel
    opt_assert_nested_equal(loaded.state_dict(), snapshot.state, "loaded")
    loaded.eval()
    with torch.no_grad():
        output = loaded(pm_input(loaded))
    opt_assert_nested_equal(output, snapshot.output, "output")
    assert "lr_scheduler_step" not in vars(loaded)
    probe = pm_probe(loaded)
    loaded.lr_scheduler_step(probe, None)
    assert pm_lr(probe) == 0.5
    pm_assert_plain(model)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_optimizer_and_scheduler_pickle_and_copy_mid_fit(mode):
    snapshot = PmSnapshot()
    pm_fit(mode, PmModel(), [snapshot])
    for name, data, duplicate, state in (
        ("optimizer", snapshot.optimizer_bytes, snapshot.optimizer_copy, snapshot.optimizer_state),
        ("scheduler", snapshot.scheduler_bytes, snapshot.scheduler_copy, snapshot.scheduler_state),
    ):
        opt_assert_nested_equal(pm_loaded(data).state_dict(), state, f"loaded {name}")
        opt_assert_nested_equal(duplicate.state_dict(), state, f"copied {name}")
    # the scheduler's state at the poisoned batch's end: two steps so far, one scheduler step (the first)
    assert snapshot.scheduler_state["last_epoch"] == 1
    assert snapshot.optimizer_state["param_groups"][0]["lr"] == PM_LR * PM_GAMMA


@pytest.mark.parametrize("mode", OPT_MODES)
def test_copies_mid_fit_change_nothing_about_the_run(mode):
    """Bit-identical to the run without the copies; the scheduler was held once (the skipped step)."""
    runs = []
    for callbacks in ([PmSnapshot()], []):
        model = PmModel()
        trainer = pm_fit(mode, model, callbacks)
        runs.append((model.state_dict(), trainer.optimizers[0].state_dict(), trainer.precision_plugin.stats.as_dict()))
    opt_assert_nested_equal(runs[0], runs[1], mode)
    stats = runs[0][2]
    assert (stats["steps"], stats["skipped_steps"]) == (5, 1)
    assert runs[0][1]["param_groups"][0]["lr"] == PM_LR * PM_GAMMA**4  # five steps, one held


# ---------------------------------------------------------------------------------------------- copy.deepcopy mid-fit
@pytest.mark.parametrize("mode", OPT_MODES)
def test_module_copied_mid_fit_is_the_users_module(mode):
    """The copy's ``lr_scheduler_step`` is its own: not held (the original's was, at that step), run on the copy,
    during the fit and after it; the copy trains under Lightning's own plugin, its scheduler stepped every step."""
    snapshot = PmSnapshot()
    model = PmCountingModel()
    trainer = pm_fit(mode, model, [snapshot])
    duplicate = snapshot.copy
    assert snapshot.probe_lr_during_fit == 0.5  # stepped while the original's scheduler was held
    assert model.scheduler_calls == 4  # five steps, one held: the user's override, through the hold
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4
    assert duplicate.scheduler_calls == 2  # one in the fit before the copy, one the probe's (on the copy)

    assert "lr_scheduler_step" not in vars(duplicate)
    probe = pm_probe(duplicate)
    duplicate.lr_scheduler_step(probe, None)
    assert pm_lr(probe) == 0.5 and duplicate.scheduler_calls == 3 and model.scheduler_calls == 4
    opt_assert_nested_equal(duplicate.state_dict(), snapshot.state, "copy")

    duplicate.float()
    again = opt_trainer(None, 3, precision="32-true")
    again.fit(duplicate)
    assert duplicate.scheduler_calls == 6  # every step's scheduler step (clean data for these three)
    assert again.optimizers[0].param_groups[0]["lr"] == pytest.approx(PM_LR * PM_GAMMA**3)
    pm_assert_plain(model)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_an_instance_lr_scheduler_step_is_held_and_kept(mode):
    """An ``lr_scheduler_step`` the user set on the instance is held as a method is, and stays after fit."""
    model = PmModel()
    calls: list[int] = []

    def lr_scheduler_step(scheduler, metric) -> None:
        calls.append(scheduler.last_epoch)
        scheduler.step()

    model.lr_scheduler_step = lr_scheduler_step
    trainer = pm_fit(mode, model)
    assert calls == [0, 1, 2, 3]  # five steps, one held
    assert trainer.optimizers[0].param_groups[0]["lr"] == PM_LR * PM_GAMMA**4
    assert vars(model)["lr_scheduler_step"] is lr_scheduler_step
    assert "lr_scheduler_step" not in vars(PmModel)


# ---------------------------------------------------------------------------------------------- weight averaging
class PmEpochPoisonModel(PmModel):
    """The poisoned batch poisons only the epochs in ``epochs`` (SWA's extra epoch, which runs the data through the
    BatchNorm again for its statistics, sees clean data: a NaN there would reach them under any precision)."""

    def __init__(self, epochs: tuple[int, ...]) -> None:
        super().__init__(poisoned=())
        self.epochs = epochs

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if batch_idx == PM_POISONED and self.current_epoch in self.epochs:
            x = x.clone()
            x[0] = float("nan")
        return self(x).float().pow(2).mean()


@pytest.mark.slow
@pytest.mark.parametrize("mode", OPT_MODES)
def test_stochastic_weight_averaging_with_copies_mid_fit(mode):
    """Lightning's SWA (its copy of the module, its SWALR swapped in at its start) with a step-interval scheduler,
    the guards, a skipped step and the module pickled and copied mid-fit in every epoch."""
    runs = []
    for snapshots in ([PmSnapshot(at=PM_POISONED), PmSnapshot(at=PM_BATCHES - 1)], []):
        model = PmEpochPoisonModel(epochs=(0, 1))  # before SWA starts, and in its first epoch
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
        trainer = pm_fit(mode, model, [swa, *snapshots], max_steps=-1, max_epochs=3)
        runs.append((model.state_dict(), trainer.precision_plugin.stats.as_dict()))
        for snapshot in snapshots:
            loaded = pm_loaded(snapshot.module_bytes).eval()
            with torch.no_grad():
                assert torch.isfinite(loaded(pm_input(loaded))).all()
        pm_assert_plain(model)
    opt_assert_nested_equal(runs[0], runs[1], mode)
    assert runs[0][1]["skipped_steps"] == 2  # the poisoned batch of the first two epochs
    assert all(torch.isfinite(t).all() for t in runs[0][0].values() if t.is_floating_point())


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(
            m,
            marks=pytest.mark.skip(
                reason="WeightAveraging's fp32 copy cannot average fp16 weights: Lightning's precision='16-true' fails"
                " alike (torch's foreach grouping allows bf16 beside fp32, not fp16)"
            ),
        )
        if m == "fp16-true"
        else pytest.param(m, marks=pytest.mark.skipif(WeightAveraging is None, reason="WeightAveraging: Lightning 2.6"))
        for m in OPT_MODES
    ],
)
def test_weight_averaging_with_copies_mid_fit(mode):
    runs = []
    for snapshots in ([PmSnapshot()], []):
        model = PmModel()
        trainer = pm_fit(mode, model, [WeightAveraging(), *snapshots])
        runs.append((model.state_dict(), trainer.precision_plugin.stats.as_dict()))
        pm_assert_plain(model)
    opt_assert_nested_equal(runs[0], runs[1], mode)


class PmFailingModel(PmModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise ValueError("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_the_class_is_plain_after_fit_ends_with_an_exception(mode):
    model = PmFailingModel()
    with pytest.raises(ValueError, match="boom"):
        pm_fit(mode, model, [PmSnapshot()])
    pm_assert_plain(model)
    assert "lr_scheduler_step" not in vars(PmModel)


# ---------------------------------------------------------------------------------------------- the plugin mid-fit
class PmPluginSnapshot(Callback):
    """At the poisoned batch's end: the precision plugin pickled (``torch.save``) and deep-copied, as a checkpointing
    or experiment-tracking callback may do with the Trainer's parts, and its counters kept."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == PM_POISONED:
            plugin = trainer.precision_plugin
            self.data, self.copy = pm_saved(plugin), copy.deepcopy(plugin)
            self.stats, self.scale = plugin.stats.as_dict(), plugin.scaler.get_scale() if plugin.scaler else None


@pytest.mark.parametrize("mode", OPT_MODES)
def test_the_plugin_pickles_and_copies_mid_fit_and_the_copies_train_a_new_run(mode):
    """The copies keep the counters and the loss scale of the moment, hold nothing of the run (the run goes on
    bit-identical, its teardown leaves the module plain), and train a run of their own."""
    snapshot = PmPluginSnapshot()
    model, reference = PmModel(), PmModel()
    trainer = pm_fit(mode, model, [snapshot])
    pm_fit(mode, reference)
    opt_assert_nested_equal(model.state_dict(), reference.state_dict(), "the run beside its copies")
    pm_assert_plain(model)
    loaded = pm_loaded(snapshot.data)
    for copied in (loaded, snapshot.copy):
        assert copied.stats.as_dict() == snapshot.stats and copied.stats.skipped_steps == 1
        if snapshot.scale is not None:
            assert copied.scaler.get_scale() == snapshot.scale
        fresh = PmModel(poisoned=())
        again = opt_trainer(copied, 2, [])
        again.fit(fresh)
        assert copied.stats.steps == snapshot.stats["steps"] + 2  # (the plugin's counters go on across runs)
        pm_assert_plain(fresh)
    assert trainer.precision_plugin.stats.steps == 5
