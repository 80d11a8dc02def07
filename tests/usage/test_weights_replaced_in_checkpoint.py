"""Fine-tuning from a checkpoint of a true-half run whose weights were replaced after its master weights were saved.

The ways a user gets there, each through the real ``Trainer`` (``trainer.fit(model, ckpt_path=...)``):

* Lightning's ``EMAWeightAveraging`` callback: its checkpoints hold the average in ``state_dict`` (fp32: it averages
  an fp32 copy of the module made before the cast) and the trained weights aside; fine-tuning from such a
  checkpoint without the callback starts from the average;
* a callback of the user's that writes averages of its own into ``checkpoint["state_dict"]`` (kept in bf16 here);
* the checkpoint file edited (``torch.load``, other weights put in, ``torch.save``);
* the module's ``on_load_checkpoint`` replacing weights before Lightning loads them;
* a layer left out of the checkpoint and loaded with ``strict_loading = False``: the model's own (fresh) weights;
* weights loaded with ``model.load_state_dict`` after a run and saved with ``trainer.save_checkpoint`` (the masters
  follow them when saved);
* Lightning Fabric: ``fabric.load`` of a checkpoint whose model weights were edited.

What the user expects: the checkpoint's weights are where fine-tuning starts. Parameter by parameter, where a
weight is what its saved master rounds to (an ordinary resume) the exact fp32 master goes on; everywhere else the
master is the checkpoint's weight, at the precision the checkpoint holds it (an fp32 average counts in full, not
rounded to bf16: Lightning restores the weights into the fp32 module before the plugin casts it). Read from the plugin's
``state_dict()`` when training starts and from the weights after fine-tuning. A plain ``bf16`` mixed resume keeps
the checkpoint's fp32 weights the same way. An ordinary resume (the EMA callback present again, which puts the
trained weights back) still goes on bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
import lightning.pytorch.callbacks as pl_callbacks
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp.master import fp32_values
from tests.usage.conftest import opt_trainer

#: Lightning's EMA callback (Lightning 2.6 on; the tests that use it are skipped before)
EMAWeightAveraging = getattr(pl_callbacks, "EMAWeightAveraging", None)
needs_ema = pytest.mark.skipif(EMAWeightAveraging is None, reason="Lightning's EMAWeightAveraging came in 2.6")
CW_HALF = torch.bfloat16
CW_SAVED_AT = 6  # the checkpoint's step
CW_KINDS = ("fp32", "kahan")


class CwNet(LightningModule):
    """Two Linear layers, Adam; ``replace_on_load``: weights its ``on_load_checkpoint`` writes into the checkpoint."""

    def __init__(self, seed: int = 0, replace_on_load: Optional[dict] = None, strict: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(8, 32)
        self.l2 = nn.Linear(32, 1)
        self.replace_on_load = replace_on_load
        self.strict_loading = strict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, 2 * x[:, :1]), batch_size=8)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.replace_on_load is not None:
            checkpoint["state_dict"].update(self.replace_on_load)


def cw_other_weights(names: Optional[set] = None) -> dict[str, torch.Tensor]:
    """Another model's fp32 weights (none of them a bf16 value: checked), those named in ``names`` (all: None)."""
    other = {n: p.detach().clone() for n, p in CwNet(seed=1).named_parameters() if names is None or n in names}
    for name, value in other.items():
        assert not bool(value.eq(value.to(CW_HALF).float()).any()), f"{name}: a bf16 value by chance"
    return other


class CwHalfEMA(Callback):
    """A user's EMA kept in bf16, written into the checkpoint's ``state_dict`` (the trained weights aside)."""

    def __init__(self) -> None:
        self.average: Optional[dict] = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        now = {n: p.detach().to(CW_HALF) for n, p in pl_module.named_parameters()}
        if self.average is None:
            self.average = {n: v.clone() for n, v in now.items()}
        for name, value in now.items():
            self.average[name].lerp_(value, 0.5)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        assert self.average is not None
        checkpoint["current_model_state"] = dict(checkpoint["state_dict"])
        checkpoint["state_dict"].update({n: v.clone() for n, v in self.average.items()})


class CwStart(Callback):
    """The weights and the plugin's state when training starts (after the checkpoint was loaded)."""

    def __init__(self) -> None:
        self.params: dict = {}
        self.plugin_state: dict = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.plugin_state = copy.deepcopy(trainer.precision_plugin.state_dict())

    def values(self) -> dict[str, torch.Tensor]:
        """Where training starts from, in fp32: the master weights (true-half) or the fp32 weights (mixed)."""
        masters = self.plugin_state.get("master_weights")
        if masters is None or all(p.dtype == torch.float32 for p in self.params.values()):
            return {n: p.float() for n, p in self.params.items()}
        values = fp32_values(masters, self.params)
        assert values.keys() == self.params.keys()
        return values


def cw_first_run(kind: str, tmp_path: Path, callbacks: tuple = (), max_steps: int = CW_SAVED_AT + 2) -> tuple:
    """A bf16-true run with ``kind`` masters, checkpointed at step :data:`CW_SAVED_AT` by ``ModelCheckpoint``;
    returns (the checkpoint's path, the run's model)."""
    saver = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=CW_SAVED_AT, save_top_k=1)
    model = CwNet()
    opt_trainer(MPPlugin("bf16-true", master_weights=kind), max_steps=max_steps, callbacks=[*callbacks, saver],
                enable_checkpointing=True).fit(model)  # fmt: skip
    return tmp_path / "mid.ckpt", model


def cw_saved_masters(checkpoint: dict, weights_then: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's master weights as fp32 values (``weights_then``: the weights they were saved with)."""
    values = fp32_values(checkpoint["MPPlugin"]["master_weights"], weights_then)
    assert values.keys() == weights_then.keys()
    return values


def cw_resume(resume: str, kind: str, path: Any, model: Optional[CwNet] = None, steps: int = 4) -> tuple:
    """Fine-tune from ``path`` for ``steps`` steps; returns (where it started, the model)."""
    start = CwStart()
    model = model if model is not None else CwNet(seed=2)  # (its own weights are replaced by the checkpoint's)
    plugin = MPPlugin(resume, master_weights=kind) if resume == "bf16-true" else MPPlugin(resume)
    opt_trainer(plugin, max_steps=CW_SAVED_AT + steps, callbacks=[start]).fit(model, ckpt_path=path)
    return start, model


def cw_assert_starts_from(start: dict, weights: dict, masters: dict, kind: str, what: str) -> None:
    """Parameter by parameter: where the checkpoint's weight is what its saved master rounds to, every element (an
    ordinary resume), the saved master, exactly; elsewhere the checkpoint's weight at its own precision (an element an
    average left where it was is the average's too): exactly with fp32 masters and in a mixed resume, and for a Kahan
    compensation to what it holds (bf16 rounding drops up to 2**-9 of a weight, the compensation keeps what it
    dropped to about 2**-17: the test allows 2**-15)."""
    for name, weight in weights.items():
        weight, got, master = weight.float(), start[name], masters[name]
        if bool(weight.eq(master.to(CW_HALF).float()).all()):
            diff = (got - master).abs().max().item()
            assert diff == 0.0, f"{what}: {name} starts {diff:.3g} away from its saved master (an ordinary resume)"
        elif kind == "fp32":
            diff = (got - weight).abs().max().item()
            assert diff == 0.0, f"{what}: {name} starts {diff:.3g} away from the checkpoint's weights"
        else:
            assert torch.equal(got.to(CW_HALF), weight.to(CW_HALF)), f"{what}: {name} does not round to the weights"
            worst = ((got - weight).abs() / weight.abs().clamp_min(1e-30)).max().item()
            assert worst < 2.0**-15, f"{what}: {name} starts {worst:.3g} (relative) away from the checkpoint's weights"


# ================================================================================================================
# Lightning's EMA callback: fine-tuning from its checkpoint starts from the average
# ================================================================================================================
@needs_ema
@pytest.mark.parametrize("resume", ["bf16-true", "bf16"])
@pytest.mark.parametrize("kind", CW_KINDS)
def test_fine_tuning_from_an_ema_checkpoint_starts_from_the_average(kind, resume, tmp_path):
    path, _ = cw_first_run(kind, tmp_path, callbacks=(EMAWeightAveraging(decay=0.5),))
    checkpoint = torch.load(path, weights_only=False)
    average = checkpoint["state_dict"]
    assert all(v.dtype == torch.float32 for v in average.values())  # (the callback averages in fp32)
    masters = cw_saved_masters(checkpoint, checkpoint["current_model_state"])
    start, _ = cw_resume(resume, kind, path)
    cw_assert_starts_from(start.values(), average, masters, kind, f"{kind} -> {resume}")


@needs_ema
@pytest.mark.parametrize("kind", ["fp32", "kahan", "stochastic"])
def test_a_resume_with_the_ema_callback_starts_from_the_exact_masters(kind, tmp_path):
    """The callback present again puts the trained weights back before the cast: an ordinary resume, which starts
    from the saved masters exactly (and the trained weights)."""
    path, _ = cw_first_run(kind, tmp_path, callbacks=(EMAWeightAveraging(decay=0.5),))
    checkpoint = torch.load(path, weights_only=False)
    trained = checkpoint["current_model_state"]
    start = CwStart()
    opt_trainer(MPPlugin("bf16-true", master_weights=kind), max_steps=CW_SAVED_AT + 2,
                callbacks=[EMAWeightAveraging(decay=0.5), start]).fit(CwNet(seed=2), ckpt_path=path)  # fmt: skip
    for name, weight in trained.items():
        assert torch.equal(start.params[name], weight), f"{kind}: {name} is not the trained weight"
    if kind != "stochastic":
        masters = cw_saved_masters(checkpoint, trained)
        for name, value in start.values().items():
            assert torch.equal(value, masters[name]), f"{kind}: {name} does not start from its saved master"


# ================================================================================================================
# a callback of the user's writes bf16 averages into the checkpoint
# ================================================================================================================
@pytest.mark.parametrize("resume", ["bf16-true", "bf16"])
@pytest.mark.parametrize("kind", CW_KINDS)
def test_fine_tuning_from_half_averages_written_into_the_checkpoint(kind, resume, tmp_path):
    path, _ = cw_first_run(kind, tmp_path, callbacks=(CwHalfEMA(),))
    checkpoint = torch.load(path, weights_only=False)
    masters = cw_saved_masters(checkpoint, checkpoint["current_model_state"])
    start, _ = cw_resume(resume, kind, path)
    cw_assert_starts_from(start.values(), checkpoint["state_dict"], masters, kind, f"{kind} -> {resume}")


# ================================================================================================================
# other weights put into the checkpoint: edited, by on_load_checkpoint, or a layer left out
# ================================================================================================================
HOWS = ("edited", "on_load_checkpoint", "layer_left_out")


def cw_replace(how: str, path: Path, tmp_path: Path) -> tuple[Any, CwNet, dict, dict]:
    """The checkpoint at ``path`` with weights replaced ``how``; returns (the path to resume from, the model to resume,
    the weights training must start from, the weights the masters were saved with)."""
    checkpoint = torch.load(path, weights_only=True)
    saved_with = dict(checkpoint["state_dict"])
    if how == "edited":
        checkpoint["state_dict"].update(cw_other_weights())
        path = tmp_path / "edited.ckpt"
        torch.save(checkpoint, path)
        return path, CwNet(seed=2), dict(checkpoint["state_dict"]), saved_with
    if how == "on_load_checkpoint":
        other = cw_other_weights({"l1.weight", "l2.bias"})
        return path, CwNet(seed=2, replace_on_load=other), {**saved_with, **other}, saved_with
    # the head left out of the checkpoint (to train it afresh): the model's own fp32 head
    for name in ("l2.weight", "l2.bias"):
        del checkpoint["state_dict"][name]
    path = tmp_path / "headless.ckpt"
    torch.save(checkpoint, path)
    model = CwNet(seed=1, strict=False)
    own = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("l2.")}
    cw_other_weights(set(own))  # (checks they are no bf16 values)
    return path, model, {**checkpoint["state_dict"], **own}, saved_with


@pytest.mark.parametrize("resume", ["bf16-true", "bf16"])
@pytest.mark.parametrize("kind", CW_KINDS)
@pytest.mark.parametrize("how", HOWS)
def test_fine_tuning_starts_from_the_weights_put_into_the_checkpoint(how, kind, resume, tmp_path):
    path, _ = cw_first_run(kind, tmp_path)
    resume_from, model, weights, saved_with = cw_replace(how, path, tmp_path)
    masters = cw_saved_masters(torch.load(path, weights_only=True), saved_with)
    start, _ = cw_resume(resume, kind, resume_from, model=model)
    cw_assert_starts_from(start.values(), weights, masters, kind, f"{how}: {kind} -> {resume}")


@pytest.mark.parametrize("resume", ["bf16-true", "bf16"])
@pytest.mark.parametrize("kind", CW_KINDS)
def test_fine_tuning_from_other_weights_trains_as_from_them(kind, resume, tmp_path):
    """Other fp32 weights put into the checkpoint (none of them what a saved master rounds to): fine-tuning ends
    where it ends from the same checkpoint without its master weights (which starts from the weights, exactly)."""
    path, _ = cw_first_run(kind, tmp_path)
    edited, _, _, _ = cw_replace("edited", path, tmp_path)
    checkpoint = torch.load(edited, weights_only=True)
    del checkpoint["MPPlugin"]["master_weights"]
    without = tmp_path / "without_masters.ckpt"
    torch.save(checkpoint, without)
    _, ours = cw_resume(resume, kind, edited)
    expect_warning = resume == "bf16-true"
    with pytest.warns(UserWarning, match="no master weights") if expect_warning else contextlib.nullcontext():
        _, reference = cw_resume(resume, kind, without)
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        diff = (a.float() - b.float()).abs().max().item()
        assert diff == 0.0, f"{kind} -> {resume}: {name} ends {diff:.3g} away from the run from the weights"


# ================================================================================================================
# weights loaded after a run and saved: the masters follow them (a guard: this worked before)
# ================================================================================================================
def test_weights_loaded_after_a_run_and_saved_are_where_the_resume_starts(tmp_path):
    """The masters follow the weights when saved, element by element (a master that still rounds to its weight keeps
    its low bits), and the resume is an ordinary one. (fp32 masters: a Kahan compensation kept while the weights are
    followed is dropped only where it no longer rounds away against its weight, so a weight written over keeps one
    that still does: the weight is right, its low bits up to half an ulp off; the checkpoint is not where that
    happens.)"""
    model = CwNet()
    trainer = opt_trainer(MPPlugin("bf16-true", master_weights="fp32"), max_steps=CW_SAVED_AT)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "before.ckpt")
    model.load_state_dict(cw_other_weights({"l1.weight"}), strict=False)  # (into the bf16 module: rounded)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    before = torch.load(tmp_path / "before.ckpt", weights_only=True)
    masters = cw_saved_masters(before, before["state_dict"])
    weights = torch.load(tmp_path / "after.ckpt", weights_only=True)["state_dict"]
    start, _ = cw_resume("bf16-true", "fp32", tmp_path / "after.ckpt")
    for name, value in start.values().items():
        weight, master = weights[name].float(), masters[name]
        expected = torch.where(weight.eq(master.to(CW_HALF).float()), master, weight)
        diff = (value - expected).abs().max().item()
        assert diff == 0.0, f"{name} starts {diff:.3g} away from the weights loaded after the run"


# ================================================================================================================
# Fabric: fabric.load of a checkpoint whose model weights were edited
# ================================================================================================================
@pytest.mark.parametrize("kind", CW_KINDS)
def test_fabric_fine_tuning_from_edited_weights_starts_from_them(kind, tmp_path):
    from lightning.fabric import Fabric

    from lightning_mp import MPFabricPrecision

    def run() -> tuple:
        plugin = MPFabricPrecision("bf16-true", master_weights=kind)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = CwNet()
        model, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
        plugin.setup_optimizers(opt)
        return fabric, plugin, net, model, opt

    fabric, plugin, net, model, opt = run()
    for x, y in list(net.train_dataloader())[:CW_SAVED_AT]:
        fabric.backward(F.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "precision": plugin})
    checkpoint = torch.load(tmp_path / "f.ckpt", weights_only=True)
    masters = cw_saved_masters({"MPPlugin": checkpoint["precision"]}, checkpoint["model"])
    # half values of other weights (the module is bf16 when fabric.load runs: it holds them at bf16 precision)
    other = {n: v.to(CW_HALF) for n, v in cw_other_weights({"l1.weight"}).items()}
    checkpoint["model"].update(other)
    torch.save(checkpoint, tmp_path / "f.ckpt")

    fabric, plugin, net, model, opt = run()
    fabric.load(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "precision": plugin})
    for group in opt.param_groups:
        group["lr"] = 0.0  # (the masters are applied at the next step; this one moves nothing)
    x, y = next(iter(net.train_dataloader()))
    fabric.backward(F.mse_loss(model(x).float(), y))
    opt.step()
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    start = fp32_values(copy.deepcopy(plugin.state_dict()["master_weights"]), params)
    cw_assert_starts_from(start, checkpoint["model"], masters, kind, f"Fabric {kind}")
