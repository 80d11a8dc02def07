"""Trainer flags and module helpers people use every day, under MPPlugin in every mode: ``fast_dev_run``,
``overfit_batches``, ``max_time``, ``LightningModule.freeze()`` / ``unfreeze()``, ``DeviceStatsMonitor``.

Each is compared with Lightning's own plugin of the mode: the same steps, the same weights where the arithmetic is
the same (``fp32`` and ``32-true``, ``bf16`` and ``bf16-mixed``, true-half modes with ``master_weights="none"``
and Lightning's ``bf16-true`` / ``16-true``; on a CPU Lightning runs ``16-mixed`` as bf16), no warnings Lightning's
plugin does not give, no errors; with master weights, the masters survive what happens between two fits.
"""

from __future__ import annotations

import csv
import datetime
import importlib.util
import math
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from .conftest import (
    assert_tensors_equal, OPT_MODES, MwMLP, mw_params, mw_regression_data,
    opt_assert_nested_equal, opt_plugin, opt_trainer,
)

FLAGS_LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                   "fp16-true": "16-true"}  # fmt: skip
#: modes whose arithmetic is Lightning's own (with master_weights="none" in true-half modes)
FLAGS_EXACT = ("fp32", "bf16", "bf16-true", "fp16-true")


class FlagsNet(MwMLP):
    """MwMLP (SGD) with hyperparameters saved, predictions, and a validation set."""

    def __init__(self, lr: float = 0.05, **kwargs) -> None:
        super().__init__(lr, **kwargs)
        self.save_hyperparameters()

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def predict_dataloader(self):
        x, _ = mw_regression_data(self.n, self.features)
        return DataLoader(TensorDataset(x), batch_size=8)


def flags_plugin(mode: str, same_as_lightning: bool = False):
    """MPPlugin(mode); ``same_as_lightning``: in true-half modes without master weights, Lightning's arithmetic."""
    if same_as_lightning and mode.endswith("-true"):
        return opt_plugin(mode, master_weights="none")
    return opt_plugin(mode)


def flags_warnings(caught) -> set[str]:
    return {
        str(w.message) for w in caught
        if w.category.__name__ != "PerformanceWarning" and "LeafSpec" not in str(w.message)
    }  # fmt: skip


def flags_fit(mode: str, who: str, tmp_path, model=None, **trainer_kwargs):
    """Fit a FlagsNet with MPPlugin (``who`` "ours", or "ours-none": true-half without masters) or Lightning's own
    plugin (``who`` "lightning"); returns (model, trainer, plugin or None, the warnings seen)."""
    model = model if model is not None else FlagsNet(n=32)
    plugin = None if who == "lightning" else flags_plugin(mode, same_as_lightning=who == "ours-none")
    precision = FLAGS_LIGHTNING[mode] if who == "lightning" else None
    trainer_kwargs.setdefault("max_steps", -1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = opt_trainer(plugin, precision=precision, default_root_dir=tmp_path, **trainer_kwargs)
        trainer.fit(model)
    return model, trainer, plugin, flags_warnings(caught)




# ================================================================================================================
# fast_dev_run, overfit_batches
# ================================================================================================================
FLAGS_RUNS = {
    "fast_dev_run": dict(fast_dev_run=True),
    "fast_dev_run=3": dict(fast_dev_run=3),
    "overfit_batches=2": dict(overfit_batches=2, max_epochs=4),
}
FLAGS_STEPS = {"fast_dev_run": 1, "fast_dev_run=3": 3, "overfit_batches=2": 8}


@pytest.mark.parametrize("flag", list(FLAGS_RUNS))
@pytest.mark.parametrize("mode", OPT_MODES)
def test_debug_flags_run_the_steps_lightnings_plugin_runs(mode, flag, tmp_path):
    ours, trainer, plugin, warned = flags_fit(mode, "ours", tmp_path, **FLAGS_RUNS[flag])
    theirs, their_trainer, _, their_warned = flags_fit(mode, "lightning", tmp_path, **FLAGS_RUNS[flag])
    steps = FLAGS_STEPS[flag]
    assert trainer.global_step == their_trainer.global_step == steps
    assert plugin.stats.steps == steps and plugin.stats.skipped_steps == 0
    assert len(ours.losses) == steps and all(math.isfinite(loss) for loss in ours.losses)
    assert warned <= their_warned, f"warnings Lightning's own plugin does not give: {warned - their_warned}"
    if flag.startswith("fast_dev_run"):
        # Lightning's fast_dev_run writes nothing: no checkpoint, no logs
        assert not list(tmp_path.rglob("*.ckpt")) and trainer.logger is None or not trainer.loggers
    else:  # the same two batches every epoch: the loss goes down
        assert ours.losses[-1] < ours.losses[0] and ours.losses[-2] < ours.losses[1]
    if mode in FLAGS_EXACT:
        same = flags_fit(mode, "ours-none", tmp_path, **FLAGS_RUNS[flag])[0] if mode.endswith("-true") else ours
        assert_tensors_equal(mw_params(same), mw_params(theirs), f"{flag}: weights against Lightning's {mode}")
        assert same.losses == theirs.losses


# ================================================================================================================
# max_time
# ================================================================================================================
@pytest.mark.parametrize("mode", OPT_MODES)
def test_max_time_stops_between_whole_steps(mode, tmp_path):
    """Lightning's Timer stops at the end of a batch: every step counted, none half-done, the next fit goes on."""
    limit = datetime.timedelta(seconds=0.3)
    model, trainer, plugin, warned = flags_fit(mode, "ours", tmp_path, max_time=limit, max_epochs=10_000)
    assert 0 < trainer.global_step < 10_000 * 4, "max_time did not stop the run"
    assert plugin.stats.steps == trainer.global_step == len(model.losses) and plugin.stats.skipped_steps == 0
    assert all(math.isfinite(loss) for loss in model.losses)
    if len(model.losses) >= 8:  # two epochs of the same 4 batches (fp16 on a busy CPU may take fewer in 0.3 s)
        assert sum(model.losses[-4:]) < sum(model.losses[:4])
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    _, _, _, their_warned = flags_fit(mode, "lightning", tmp_path, max_time=limit, max_epochs=10_000)
    assert warned <= their_warned, f"warnings Lightning's own plugin does not give: {warned - their_warned}"
    steps = trainer.global_step
    trainer.fit_loop.max_epochs = 10_001  # room for one more epoch: the time is spent, the Timer stops again
    trainer.fit(model)
    assert plugin.stats.steps == trainer.global_step >= steps


# ================================================================================================================
# freeze() / unfreeze()
# ================================================================================================================
FLAGS_KIND_RUNS = [*[(mode, None) for mode in OPT_MODES], ("bf16-true", "kahan"), ("bf16-true", "stochastic"),
                   ("bf16-true", "none")]
FLAGS_KIND_IDS = [m if k is None else f"{m}-{k}" for m, k in FLAGS_KIND_RUNS]


@pytest.mark.parametrize("mode, kind", FLAGS_KIND_RUNS, ids=FLAGS_KIND_IDS)
def test_freeze_predict_unfreeze_between_fits_changes_nothing(mode, kind, tmp_path):
    """``fit``; ``freeze()``, predictions from a second Trainer with the same plugin object; ``unfreeze()``; the
    first Trainer fits on. The weights end exactly as without the pause: the masters of the trained model are
    kept while the plugin runs a loop with no optimizer (a bug before: they were dropped, so a checkpoint saved
    then held none and the second fit started from the half weights)."""
    options = {} if kind is None else {"master_weights": kind}
    results = {}
    for pause in (False, True):
        model = FlagsNet(n=32)
        plugin = opt_plugin(mode, **options)
        trainer = opt_trainer(plugin, max_steps=4)
        trainer.fit(model)
        if pause:
            trainer.save_checkpoint(tmp_path / "before.ckpt")
            model.freeze()
            assert not model.training and not any(p.requires_grad for p in model.parameters())
            predictions = opt_trainer(plugin).predict(model)
            theirs = opt_trainer(precision=FLAGS_LIGHTNING[mode]).predict(model) if mode != "fp16" else predictions
            assert all(torch.equal(a, b) for a, b in zip(predictions, theirs)), "predictions differ from Lightning's"
            assert not model.training and not any(p.requires_grad for p in model.parameters())
            model.unfreeze()
            assert model.training and all(p.requires_grad for p in model.parameters())
            trainer.save_checkpoint(tmp_path / "after.ckpt")  # the checkpoint still holds the masters
            before, after = (torch.load(tmp_path / f"{when}.ckpt", weights_only=True).get("MPPlugin", {})
                             .get("master_weights") for when in ("before", "after"))  # fmt: skip
            assert (before is None) == (after is None)
            if before is not None:
                opt_assert_nested_equal(after, before, "master weights")
        trainer.fit_loop.epoch_loop.max_steps = 8
        trainer.fit(model)
        assert plugin.stats.steps == 8
        results[pause] = mw_params(model)
    assert_tensors_equal(results[True], results[False], "fit, freeze/predict/unfreeze, fit against fit, fit")


@pytest.mark.parametrize("mode", OPT_MODES)
def test_frozen_module_predicts_as_with_lightnings_plugin(mode):
    """After ``freeze()`` a frozen model predicts in the mode's dtype, as under Lightning's plugin of the mode
    (``fp16`` on a CPU: Lightning's runs bf16; compared with itself through a second Trainer)."""
    model = FlagsNet(n=32)
    opt_trainer(flags_plugin(mode, same_as_lightning=True), max_steps=2).fit(model)
    model.freeze()
    ours = torch.cat(opt_trainer(flags_plugin(mode)).predict(model))
    reference = FLAGS_LIGHTNING[mode] if mode != "fp16" else None
    theirs = torch.cat(opt_trainer(flags_plugin(mode) if reference is None else None, precision=reference)
                       .predict(model))  # fmt: skip
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert bool(torch.isfinite(ours).all())


# ================================================================================================================
# DeviceStatsMonitor
# ================================================================================================================
def flags_logged_columns(logger: CSVLogger) -> set[str]:
    logger.finalize("success")
    with open(f"{logger.log_dir}/metrics.csv") as handle:
        return set(next(csv.reader(handle)))


@pytest.mark.parametrize("mode", OPT_MODES)
def test_device_stats_monitor_logs_what_it_logs_with_lightnings_plugin(mode, tmp_path):
    pytest.importorskip("psutil")  # (DeviceStatsMonitor's CPU statistics)
    columns = {}
    for who in ("ours", "lightning"):
        logger = CSVLogger(tmp_path, name=who)
        model, trainer, plugin, warned = flags_fit(mode, who, tmp_path, max_steps=4, logger=logger,
                                                   log_every_n_steps=1, callbacks=[DeviceStatsMonitor()])  # fmt: skip
        assert trainer.global_step == 4 and all(math.isfinite(loss) for loss in model.losses)
        columns[who] = (flags_logged_columns(logger), warned)
    assert any("cpu_percent" in c for c in columns["ours"][0]), columns["ours"][0]
    assert columns["ours"][0] == columns["lightning"][0]
    ours_warned, their_warned = columns["ours"][1], columns["lightning"][1]
    assert ours_warned <= their_warned, f"warnings Lightning's own plugin does not give: {ours_warned - their_warned}"


@pytest.mark.parametrize("mode, kind", FLAGS_KIND_RUNS, ids=FLAGS_KIND_IDS)
def test_frozen_backbone_with_a_trainable_head_trains_the_head_alone(mode, kind):
    """The fine-tuning pattern: ``freeze()``, then the head ``requires_grad_(True)``; the optimizer is given every
    parameter. The frozen weights stay bit for bit (masters or not), the head trains as under Lightning's plugin
    (the same weights where the arithmetic is the same); Lightning keeps the frozen module in eval mode and says so
    with its own warning, the same here."""
    results = {}
    for who in ("ours", "lightning"):
        model = FlagsNet(n=32)
        model.freeze()
        model.out.requires_grad_(True)
        start = mw_params(model)
        if who == "ours":
            options = {"master_weights": kind} if kind is not None else {}
            plugin, precision = opt_plugin(mode, **options), None
        else:
            plugin, precision = None, FLAGS_LIGHTNING[mode]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt_trainer(plugin, precision=precision, max_steps=4).fit(model)
        after = mw_params(model)
        for name in ("layer.weight", "layer.bias"):
            assert torch.equal(after[name], start[name].to(after[name].dtype)), f"{who}: frozen {name} changed"
        assert not torch.equal(after["out.weight"], start["out.weight"].to(after["out.weight"].dtype))
        assert not model.training
        results[who] = (after, flags_warnings(caught), plugin)
    (ours, warned, plugin), (theirs, their_warned, _) = results["ours"], results["lightning"]
    assert warned <= their_warned, f"warnings Lightning's own plugin does not give: {warned - their_warned}"
    assert plugin.stats.steps == 4 and plugin.stats.skipped_steps == 0
    if mode in FLAGS_EXACT and (kind == "none" or not mode.endswith("-true")):
        assert_tensors_equal(ours, theirs, "the head trained against Lightning's")


@pytest.mark.parametrize(
    "device_stats",
    [False, pytest.param(True, marks=pytest.mark.skipif(importlib.util.find_spec("psutil") is None,
                                                        reason="DeviceStatsMonitor's CPU statistics need psutil"))],
    ids=["lr-precision", "lr-devicestats-precision"],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["bf16", "bf16-true"])
def test_fast_dev_run_with_monitors_warns_nothing(mode, device_stats, tmp_path):
    """``fast_dev_run`` suppresses logging (Lightning says so once): Lightning's ``LearningRateMonitor`` and
    ``DeviceStatsMonitor`` log nothing and say nothing; ``PrecisionMonitor(plot=...)`` draws nothing and says
    nothing either (it warned that no logging step ran, advising a smaller ``log_every_n_steps``)."""
    pytest.importorskip("matplotlib")
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lightning_mp import PrecisionMonitor

    plot = tmp_path / "precision.png"
    callbacks = [
        LearningRateMonitor(),
        *([DeviceStatsMonitor()] if device_stats else []),
        PrecisionMonitor(plot=str(plot)),
    ]
    model, trainer, plugin, warned = flags_fit(mode, "ours", tmp_path, fast_dev_run=2, callbacks=callbacks,
                                               logger=CSVLogger(tmp_path))  # fmt: skip
    assert trainer.global_step == 2 and plugin.stats.steps == 2
    assert not warned, warned
    assert not plot.exists()
