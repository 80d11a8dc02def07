"""PrecisionMonitor with no plugin that can skip a step (Lightning's bf16-mixed or 32-true, no loss scaler): when the
loss or the weights turn inf/NaN it says so, once, instead of logging skip_rate 0 beside a model that no longer
trains. Where a plugin skips (MPPlugin, a loss scaler) the step never reaches the weights and nothing is said."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import TinyRegressor, make_trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mp import MPPlugin
from lightning_mp.callbacks import PrecisionMonitor

WARNING = "PrecisionMonitor: the loss or the weights hold inf/NaN at step"


def fit(tmp_path, plugin=None, model=None, **kwargs):
    monitor = PrecisionMonitor(log_every_n_steps=2)
    trainer = make_trainer(plugin, max_steps=8, callbacks=[monitor], logger=CSVLogger(tmp_path), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model or TinyRegressor())
    return trainer, monitor, [str(w.message) for w in caught if str(w.message).startswith(WARNING)]


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_alone_it_warns_once_when_the_weights_turn_non_finite(tmp_path, precision):
    poisoned = TinyRegressor(poison_grad=(2,), poison_value=math.nan)  # the third step writes NaN into the weights
    trainer, monitor, said = fit(tmp_path, precision=precision, model=poisoned)
    assert not torch.isfinite(poisoned.net1.weight).all()  # nothing skipped it
    assert len(said) == 1, said  # logging steps 4, 6 and 8 all see it: said once
    assert said[0].startswith(f"{WARNING} 4, and no precision plugin skips such steps here (")
    assert "precision/skip_rate stays 0" in said[0] and "MPPlugin skips inf/NaN steps" in said[0]
    assert monitor.last["precision/skip_rate"] == 0.0 and trainer.global_step == 8


def test_alone_it_warns_when_the_loss_turns_non_finite(tmp_path):
    poisoned = TinyRegressor(poison_loss=(3,), poison_value=math.inf)  # logging step 4: an inf loss
    _, _, said = fit(tmp_path, precision="bf16-mixed", model=poisoned)
    assert len(said) == 1 and said[0].startswith(f"{WARNING} 4,")


@pytest.mark.parametrize(
    "plugin",
    [
        lambda: MPPlugin("bf16"),
        lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0)),
    ],
    ids=["MPPlugin", "a loss scaler"],
)
def test_where_a_plugin_skips_the_step_nothing_is_said(tmp_path, plugin):
    poisoned = TinyRegressor(poison_grad=(2,), poison_value=math.nan)
    _, monitor, said = fit(tmp_path, plugin(), model=poisoned)
    assert not said and torch.isfinite(poisoned.net1.weight).all()
    assert monitor.last["precision/skipped_steps"] == 1


def test_a_clean_run_alone_says_nothing(tmp_path):
    _, _, said = fit(tmp_path, precision="bf16-mixed")
    assert not said
