"""The step counters and the loss scale describe the whole run: they live as long as the plugin, as the loss scale of
Lightning's own ``MixedPrecision`` does (its scaler is an attribute of the plugin object: evaluations, a continued
``fit`` and another ``Trainer`` given the same plugin keep it; a checkpoint restores it, also into ``validate``).

Every way a user reaches a Trainer entry point after training: ``validate``/``test``/``predict`` after ``fit``, a
continued ``fit`` of the same Trainer, a second ``Trainer`` given the same plugin, ``trainer.save_checkpoint`` after
an evaluation, and a fresh plugin resumed from that checkpoint (``fit`` and ``validate`` with ``ckpt_path=``). Skipped
steps come from poisoned batches (a NaN input); the expected figures from the batches the run trained on (an oracle
callback), the loss scale from ``torch.amp.GradScaler``'s rule applied to them, and in fp16 from Lightning's own
``MixedPrecision`` taken through the same entry points.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin

from .conftest import OPT_MODES, OPT_SCALING_MODES, opt_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers",
    "ignore:The number of training batches",
    "ignore:.*`ModelCheckpoint` callback",
)

RC_INIT_SCALE = 2.0**8
RC_GROWTH_INTERVAL = 3  # small: the growth tracker decides when the scale grows within these few steps
RC_BATCHES = 8
RC_BATCH_SIZE = 2


class RcModel(LightningModule):
    """A linear regression on ``RC_BATCHES`` fixed batches; the batches in ``poisoned`` hold a NaN input (their step
    is skipped). Evaluation runs on clean data."""

    def __init__(self, poisoned: tuple[int, ...] = (1, 2)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(RC_BATCHES * RC_BATCH_SIZE, 4, generator=g)
        self.clean = self.x.clone()
        for batch in poisoned:
            self.x[batch * RC_BATCH_SIZE] = float("nan")

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).float().pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self(batch[0]).float().pow(2).mean())

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x), batch_size=RC_BATCH_SIZE)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.clean), batch_size=RC_BATCH_SIZE)

    test_dataloader = predict_dataloader = val_dataloader


class RcTrained(Callback):
    """The oracle: whether each training batch the run stepped on was poisoned, in order, over every entry point
    (one optimizer, no accumulation: one step a batch; a poisoned batch's step is skipped)."""

    def __init__(self) -> None:
        self.poisoned: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.poisoned.append(bool(torch.isnan(batch[0]).any()))

    def counts(self) -> dict[str, int]:
        trailing = 0
        for skipped in reversed(self.poisoned):
            if not skipped:
                break
            trailing += 1
        return {"steps": len(self.poisoned), "skipped_steps": sum(self.poisoned), "consecutive_skips": trailing}

    def scale(self) -> tuple[float, int]:
        """The loss scale and growth tracker ``torch.amp.GradScaler`` reaches over these steps."""
        scale, tracker = RC_INIT_SCALE, 0
        for skipped in self.poisoned:
            if skipped:
                scale, tracker = scale * 0.5, 0
            else:
                tracker += 1
                if tracker == RC_GROWTH_INTERVAL:
                    scale, tracker = scale * 2.0, 0
        return scale, tracker


def rc_plugin(mode: str) -> MPPlugin:
    if mode in OPT_SCALING_MODES:
        return MPPlugin(mode, init_scale=RC_INIT_SCALE, growth_interval=RC_GROWTH_INTERVAL)
    return MPPlugin(mode)


def rc_trainer(plugin: Any, oracle: RcTrained, max_steps: int = 3, **kwargs: Any) -> Trainer:
    kwargs.setdefault("limit_val_batches", 2)
    return opt_trainer(plugin, max_steps, [oracle], **kwargs)


def rc_figures(plugin: MPPlugin) -> dict[str, Any]:
    """What the plugin reports: the totals, the one optimizer's own counters and the scaler's state (fp16)."""
    stats = plugin.stats
    figures: dict[str, Any] = {
        "steps": stats.steps, "skipped_steps": stats.skipped_steps, "consecutive_skips": stats.consecutive_skips,
        "per_optimizer": [s.state_dict() for s in stats.per_optimizer], "loss_scale": stats.loss_scale,
    }  # fmt: skip
    scaler = plugin.scaler
    if scaler is not None:
        state = scaler.state_dict()
        figures["scaler"] = {k: state[k] for k in ("scale", "_growth_tracker")}
    return figures


def rc_expect_counts(plugin: MPPlugin, oracle: RcTrained, mode: str) -> None:
    expected = oracle.counts()
    stats = plugin.stats
    assert (stats.steps, stats.skipped_steps, stats.consecutive_skips) == tuple(expected.values()), (
        f"{mode}: the plugin counts {stats!r}, the run trained {expected}"
    )
    assert [s.state_dict() for s in stats.per_optimizer] == [expected]
    assert stats.skipped is (expected["consecutive_skips"] > 0)
    if mode in OPT_SCALING_MODES:
        scale, tracker = oracle.scale()
        assert stats.loss_scale == scale
        assert plugin.scaler.state_dict()["_growth_tracker"] == tracker
    else:
        assert stats.loss_scale is None


# ---------------------------------------------------------------------------------------------- evaluation after fit
@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
@pytest.mark.parametrize("mode", OPT_MODES)
def test_evaluation_after_fit_keeps_the_counters_and_the_scale(mode, entry):
    plugin, oracle, model = rc_plugin(mode), RcTrained(), RcModel()
    trainer = rc_trainer(plugin, oracle)
    trainer.fit(model)  # steps: clean, poisoned, poisoned (two skips in a row at the end)
    rc_expect_counts(plugin, oracle, mode)
    assert plugin.stats.consecutive_skips == 2
    after_fit = rc_figures(plugin)

    getattr(trainer, entry)(model, **({} if entry == "predict" else {"verbose": False}))
    assert rc_figures(plugin) == after_fit
    assert plugin.state_dict()["optimizers"] == [oracle.counts()]


@pytest.mark.parametrize("mode", OPT_MODES)
def test_continued_fit_counts_on(mode):
    plugin, oracle, model = rc_plugin(mode), RcTrained(), RcModel()
    trainer = rc_trainer(plugin, oracle)
    trainer.fit(model)
    trainer.validate(model, verbose=False)
    trainer.fit_loop.epoch_loop.max_steps = 6  # (Lightning 2.6: the fit loop's max_steps has no setter)
    trainer.fit(model)
    assert trainer.global_step == 6
    assert oracle.counts()["skipped_steps"] >= 2
    rc_expect_counts(plugin, oracle, mode)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_another_trainer_with_the_same_plugin_counts_on(mode):
    plugin, oracle = rc_plugin(mode), RcTrained()
    rc_trainer(plugin, oracle).fit(RcModel())
    first = oracle.counts()
    rc_trainer(plugin, oracle, max_steps=5).fit(RcModel())  # a new model too: the plugin's figures are the run's
    assert oracle.counts()["steps"] == first["steps"] + 5
    rc_expect_counts(plugin, oracle, mode)


def test_the_loss_scale_follows_lightnings_mixed_precision_across_entry_points():
    """Lightning's MixedPrecision object keeps its scaler through evaluations, a continued fit and another Trainer:
    the plugin's scale and growth tracker follow it at every point, and its counters run alongside."""
    ours, oracle = rc_plugin("fp16"), RcTrained()
    scaler = torch.amp.GradScaler("cpu", init_scale=RC_INIT_SCALE, growth_interval=RC_GROWTH_INTERVAL)
    lightning = MixedPrecision("16-mixed", "cpu", scaler=scaler)

    def scales() -> tuple[dict, dict]:
        state = ours.scaler.state_dict()
        return {k: state[k] for k in ("scale", "_growth_tracker")}, {
            k: scaler.state_dict()[k] for k in ("scale", "_growth_tracker")
        }

    runs = [(ours, RcModel(), oracle), (lightning, RcModel(), RcTrained())]
    trainers = [rc_trainer(plugin, seen) for plugin, _, seen in runs]
    for trainer, (_, model, _) in zip(trainers, runs):
        trainer.fit(model)
    assert scales()[0] == scales()[1]
    for trainer, (_, model, _) in zip(trainers, runs):
        trainer.validate(model, verbose=False)
        trainer.predict(model)
    assert scales()[0] == scales()[1]
    for trainer, (_, model, _) in zip(trainers, runs):
        trainer.fit_loop.epoch_loop.max_steps = 6
        trainer.fit(model)
    assert scales()[0] == scales()[1]
    for plugin, model, seen in runs:
        rc_trainer(plugin, seen, max_steps=5).fit(model)
    assert scales()[0] == scales()[1]
    rc_expect_counts(ours, oracle, "fp16")


# ---------------------------------------------------------------------------------------------- checkpoints
def rc_saved_after_validate(mode: str, path: str) -> tuple[MPPlugin, RcTrained]:
    plugin, oracle, model = rc_plugin(mode), RcTrained(), RcModel(poisoned=(1,))
    trainer = rc_trainer(plugin, oracle)
    trainer.fit(model)
    trainer.validate(model, verbose=False)
    trainer.save_checkpoint(path)
    return plugin, oracle


@pytest.mark.parametrize("mode", OPT_MODES)
def test_checkpoint_saved_after_validate_holds_the_counters(mode, tmp_path):
    path = str(tmp_path / "after_validate.ckpt")
    plugin, oracle = rc_saved_after_validate(mode, path)
    entry = torch.load(path, weights_only=True)["MPPlugin"]
    assert entry["optimizers"] == [oracle.counts()] == [{"steps": 3, "skipped_steps": 1, "consecutive_skips": 0}]
    if mode in OPT_SCALING_MODES:
        scale, tracker = oracle.scale()
        assert (entry["scaler"]["scale"], entry["scaler"]["_growth_tracker"]) == (scale, tracker)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_fit_resumed_from_a_checkpoint_saved_after_validate_counts_on(mode, tmp_path):
    path = str(tmp_path / "after_validate.ckpt")
    _, oracle = rc_saved_after_validate(mode, path)
    fresh = rc_plugin(mode)
    rc_trainer(fresh, oracle, max_steps=6).fit(RcModel(poisoned=(1, 4)), ckpt_path=path)
    assert oracle.counts()["steps"] == 6  # three before the checkpoint, three after
    assert oracle.counts()["skipped_steps"] == 2  # batch 1 before, batch 4 after
    rc_expect_counts(fresh, oracle, mode)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_validate_from_a_checkpoint_restores_the_counters(mode, tmp_path):
    """As Lightning's MixedPrecision restores its scaler in ``validate(ckpt_path=...)``."""
    path = str(tmp_path / "after_validate.ckpt")
    trained, oracle = rc_saved_after_validate(mode, path)
    fresh, model = rc_plugin(mode), RcModel(poisoned=(1,))
    trainer = rc_trainer(fresh, RcTrained())
    trainer.validate(model, ckpt_path=path, verbose=False)
    rc_expect_counts(fresh, oracle, mode)
    assert rc_figures(fresh) == rc_figures(trained)
    saved_again = str(tmp_path / "again.ckpt")
    trainer.save_checkpoint(saved_again)
    assert torch.load(saved_again, weights_only=True)["MPPlugin"]["optimizers"] == [oracle.counts()]


def test_lightnings_mixed_precision_restores_its_scale_in_validate(tmp_path):
    """The behaviour followed above: Lightning's own plugin takes the checkpoint's scale in ``validate``."""
    path = str(tmp_path / "lightning.ckpt")
    scaler = torch.amp.GradScaler("cpu", init_scale=RC_INIT_SCALE, growth_interval=RC_GROWTH_INTERVAL)
    trainer = rc_trainer(MixedPrecision("16-mixed", "cpu", scaler=scaler), RcTrained())
    trainer.fit(RcModel(poisoned=(1,)))
    trainer.save_checkpoint(path)
    fresh = torch.amp.GradScaler("cpu", init_scale=RC_INIT_SCALE, growth_interval=RC_GROWTH_INTERVAL)
    rc_trainer(MixedPrecision("16-mixed", "cpu", scaler=fresh), RcTrained()).validate(
        RcModel(), ckpt_path=path, verbose=False
    )
    assert fresh.get_scale() == scaler.get_scale() == RC_INIT_SCALE / 2
