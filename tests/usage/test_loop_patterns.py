"""Training-loop patterns people write every day, under MPPlugin in every mode, each compared with Lightning's own
plugin of the mode (``fp32`` and ``32-true``, ``bf16`` and ``bf16-mixed``, true-half modes with
``master_weights="none"`` and Lightning's ``bf16-true`` / ``16-true``; on a CPU Lightning runs ``16-mixed`` as bf16,
so ``fp16`` is compared with itself or with the run it must equal):

- ``training_step`` returning ``None`` for some batches (Lightning takes no backward for them and says nothing of a
  skip) or a dict ``{"loss": ..., "other": ...}``; a ``None`` inside an accumulation window;
- the last accumulation window of an epoch that ``accumulate_grad_batches`` does not divide;
- ``val_check_interval=0.5`` and ``num_sanity_val_steps=2`` with master weights;
- ``on_before_optimizer_step`` logging ``grad_norm``, a conditional ``configure_gradient_clipping`` override,
  ``on_after_backward`` reading ``.grad``;
- a mid-epoch ``ModelCheckpoint(every_n_train_steps=k)`` resumed with ``fit(ckpt_path=...)``;
- several training dataloaders (a dict of loaders, ``CombinedLoader``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import CombinedLoader, grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .conftest import (
    OPT_MODES, MwMLP, assert_tensors_equal, mw_params, mw_regression_data, opt_assert_nested_equal, opt_plugin,
    opt_trainer,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers", "ignore:The number of training batches", "ignore:.*LeafSpec",
)

LOOP_LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                  "fp16-true": "16-true"}  # fmt: skip
#: (mode, master weights): every mode with its default, and the other kinds of master weights in true-half modes
LOOP_RUNS = [*[(mode, None) for mode in OPT_MODES], ("bf16-true", "kahan"), ("bf16-true", "stochastic"),
             ("fp16-true", "none")]  # fmt: skip
LOOP_IDS = [m if k is None else f"{m}-{k}" for m, k in LOOP_RUNS]


def loop_plugin(mode: str, kind: Optional[str] = None, **kwargs: Any):
    """MPPlugin(mode): fp16 modes from a modest scale growing every 2 clean steps (the scale shows what counted)."""
    if mode.startswith("fp16"):
        kwargs.setdefault("growth_interval", 2)
    if kind is not None:
        kwargs["master_weights"] = kind
    return opt_plugin(mode, **kwargs)


def loop_same_as_lightning(mode: str) -> Optional[dict]:
    """The MPPlugin options under which ``mode`` is Lightning's own arithmetic; ``None`` for fp16 (no reference)."""
    if mode == "fp16":
        return None
    return {"master_weights": "none"} if mode.endswith("-true") else {}




def loop_scale(plugin) -> Optional[float]:
    return getattr(getattr(plugin, "stats", None), "loss_scale", None)


class LoopNet(MwMLP):
    """MwMLP on 8 batches of 8 whose ``training_step`` returns ``None`` at the batches in ``none_at``, a loss times
    zero at ``zero_at``, a dict ``{"loss", "other"}`` where ``as_dict``; ``drop`` leaves those batches out of the
    data. Records the loss scale after every batch. fp16-true without master weights trains with SGD (Adam's moments
    in fp16 overflow, under Lightning's 16-true too)."""

    def __init__(self, none_at=(), zero_at=(), drop=(), as_dict=False, **kwargs) -> None:
        kwargs.setdefault("n", 64)
        super().__init__(**kwargs)
        self.none_at, self.zero_at, self.drop, self.as_dict = set(none_at), set(zero_at), set(drop), as_dict
        self.scales: list = []

    @property
    def batch_index(self) -> int:
        return self.trainer.fit_loop.epoch_loop.total_batch_idx

    def training_step(self, batch, batch_idx):
        if self.batch_index in self.none_at:
            return None
        loss = super().training_step(batch, batch_idx)
        if self.batch_index in self.zero_at:
            loss = loss * 0.0
        return {"loss": loss, "other": loss.detach() * 2} if self.as_dict else loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.scales.append(loop_scale(getattr(self.trainer, "precision_plugin", None)))

    def train_dataloader(self):
        x, y = mw_regression_data(self.n, self.features)
        keep = [i for i in range(self.n) if i // self.batch_size not in self.drop]
        return DataLoader(TensorDataset(x[keep], y[keep]), batch_size=self.batch_size)


def loop_optimizer(mode: str, kind: Optional[str]) -> str:
    return "sgd" if mode == "fp16-true" and kind == "none" else "adam"


def loop_fit(mode, kind=None, *, lightning=False, model_cls=LoopNet, plugin_kwargs=None, model_kwargs=None,
             **trainer_kwargs):  # fmt: skip
    """Fit a ``model_cls`` with MPPlugin(mode, master_weights=kind) or (``lightning``) Lightning's own plugin;
    returns (model, trainer, plugin or None)."""
    model_kwargs = dict(model_kwargs or {})
    model_kwargs.setdefault("optimizer", loop_optimizer(mode, kind))
    model_kwargs.setdefault("lr", 0.01)
    torch.manual_seed(0)
    model = model_cls(**model_kwargs)
    plugin = None if lightning else loop_plugin(mode, kind, **(plugin_kwargs or {}))
    trainer_kwargs.setdefault("max_epochs", 1)
    precision = LOOP_LIGHTNING[mode] if lightning else None
    trainer = opt_trainer(plugin, max_steps=trainer_kwargs.pop("max_steps", -1), precision=precision,
                          **trainer_kwargs)  # fmt: skip
    trainer.fit(model)
    return model, trainer, plugin


# ================================================================================================================
# training_step returning None or a dict
# ================================================================================================================
@pytest.mark.parametrize("mode, kind", LOOP_RUNS, ids=LOOP_IDS)
def test_training_step_returning_none_is_no_skip_and_leaves_the_scale(mode, kind):
    """Batches whose ``training_step`` returns ``None`` (the others a dict): Lightning runs no backward and moves
    nothing; its optimizer step still counts in ``global_step`` and the plugin's ``stats.steps``, not as a skipped
    step. The weights, the master weights and the loss scale end as in a run whose data leaves those batches out
    (torch's GradScaler, which Lightning's 16-mixed does not call for such a batch, does not move; a bug before: the
    scale counted them as clean steps and grew too early). A whole accumulation window of ``None`` is the same."""
    model, trainer, plugin = loop_fit(mode, kind, model_kwargs=dict(none_at=(1, 4), as_dict=True))
    dropped, _, dropped_plugin = loop_fit(mode, kind, model_kwargs=dict(drop=(1, 4), as_dict=True))
    assert trainer.global_step == plugin.stats.steps == 8
    assert plugin.stats.skipped_steps == dropped_plugin.stats.skipped_steps == 0
    assert len(model.losses) == 6 and all(math.isfinite(loss) for loss in model.losses)
    assert_tensors_equal(mw_params(model), mw_params(dropped), "None batches against the data without them")
    masters = plugin.state_dict().get("master_weights")
    if masters is not None:  # fp32 masters, Kahan compensations, the rounding noise's generators
        opt_assert_nested_equal(masters, dropped_plugin.state_dict()["master_weights"], "master weights")
    if mode.startswith("fp16"):
        kept = [s for i, s in enumerate(model.scales) if i not in (1, 4)]
        assert kept == dropped.scales and loop_scale(plugin) == loop_scale(dropped_plugin) == 2.0**8 * 2**3
    reference = loop_same_as_lightning(mode)
    if reference is not None and kind in (None, "none"):
        same = "none" if mode.endswith("-true") else None
        ours, our_trainer, _ = loop_fit(mode, same, model_kwargs=dict(none_at=(1, 4), as_dict=True))
        theirs, their_trainer, _ = loop_fit(mode, same, lightning=True, model_kwargs=dict(none_at=(1, 4), as_dict=True))
        assert our_trainer.global_step == their_trainer.global_step
        assert_tensors_equal(mw_params(ours), mw_params(theirs), f"against Lightning's {LOOP_LIGHTNING[mode]}")
    if mode.startswith("fp16"):  # a whole window of None (accumulate_grad_batches=2): no scale update either
        windowed, _, windowed_plugin = loop_fit(mode, kind, model_kwargs=dict(none_at=(2, 3)),
                                                accumulate_grad_batches=2)  # fmt: skip
        assert windowed_plugin.stats.skipped_steps == 0 and loop_scale(windowed_plugin) == 2.0**8 * 2


@pytest.mark.parametrize("mode, kind", LOOP_RUNS, ids=LOOP_IDS)
def test_none_inside_an_accumulation_window_adds_nothing(mode, kind):
    """``accumulate_grad_batches=3``: ``None`` at the last batch of the first window and inside the second. The
    window steps with what its other batches accumulated, as Lightning's own plugins of fp32, bf16 and the true-half
    modes do, and its ``16-mixed`` on a CPU (run as bf16-mixed). (Lightning's ``16-mixed`` on a GPU instead drops a
    window whose last batch is ``None``: no ``GradScaler.step``, the gradients zeroed next; an oddity of Lightning's
    that the plugin does not copy in fp16.) Exactly as a run whose ``None`` batches add a zero loss: the fp32 gradient
    sums of the master weights, the scale and the counters alike."""
    model, trainer, plugin = loop_fit(mode, kind, model_kwargs=dict(none_at=(2, 4)), accumulate_grad_batches=3)
    zeroed, _, zeroed_plugin = loop_fit(mode, kind, model_kwargs=dict(zero_at=(2, 4)), accumulate_grad_batches=3)
    assert trainer.global_step == plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    assert_tensors_equal(mw_params(model), mw_params(zeroed), "None batches against zero losses")
    assert model.scales == zeroed.scales
    masters = plugin.state_dict().get("master_weights")
    if masters is not None:
        opt_assert_nested_equal(masters, zeroed_plugin.state_dict()["master_weights"], "master weights")
    reference = loop_same_as_lightning(mode)
    if reference is not None and kind in (None, "none"):
        same = "none" if mode.endswith("-true") else None
        ours, _, _ = loop_fit(mode, same, model_kwargs=dict(none_at=(2, 4)), accumulate_grad_batches=3)
        theirs, _, _ = loop_fit(mode, same, lightning=True, model_kwargs=dict(none_at=(2, 4)),
                                accumulate_grad_batches=3)  # fmt: skip
        assert_tensors_equal(mw_params(ours), mw_params(theirs), f"against Lightning's {LOOP_LIGHTNING[mode]}")


# ================================================================================================================
# the last accumulation window of an epoch
# ================================================================================================================
@pytest.mark.parametrize("mode, kind", LOOP_RUNS, ids=LOOP_IDS)
def test_short_last_accumulation_window_steps_as_lightning(mode, kind):
    """``accumulate_grad_batches=3`` over 8 batches, two epochs: windows of 3, 3 and 2 batches (Lightning steps at
    the epoch's last batch; the loss is still divided by 3), the next epoch's first window starting afresh. The
    steps and weights are Lightning's own (in fp16 and with master weights: within rounding of Lightning's fp32)."""
    model, trainer, plugin = loop_fit(mode, kind, accumulate_grad_batches=3, max_epochs=2)
    assert trainer.global_step == plugin.stats.steps == 6 and plugin.stats.skipped_steps == 0
    reference = loop_same_as_lightning(mode)
    if reference is not None and kind == ("none" if mode.endswith("-true") else None):
        theirs, their_trainer, _ = loop_fit(mode, kind, lightning=True, accumulate_grad_batches=3, max_epochs=2)
        assert their_trainer.global_step == 6
        assert_tensors_equal(mw_params(model), mw_params(theirs), f"against Lightning's {LOOP_LIGHTNING[mode]}")
        return
    fp32, _, _ = loop_fit("fp32", lightning=True, model_kwargs=dict(optimizer=loop_optimizer(mode, kind)),
                          accumulate_grad_batches=3, max_epochs=2)  # fmt: skip
    expected = mw_params(fp32)
    for name, value in mw_params(model).items():
        torch.testing.assert_close(value.float(), expected[name], rtol=0.05, atol=0.02, msg=name)
    # the short window is a step of its own: one epoch of 8 batches is 3 steps, as Lightning's
    one_epoch, one_trainer, one_plugin = loop_fit(mode, kind, accumulate_grad_batches=3)
    assert one_trainer.global_step == one_plugin.stats.steps == 3


# ================================================================================================================
# mid-epoch validation, the sanity check
# ================================================================================================================
class LoopValidated(LoopNet):
    """LoopNet with a validation set (the first two training batches) and the outputs' dtype and loss recorded."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.validated: list = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out.float(), y.float())
        self.validated.append((out.dtype, float(loss)))
        self.log("val_loss", loss)

    def val_dataloader(self):
        return self.train_dataloader()


LOOP_VALIDATION = dict(val_check_interval=0.5, num_sanity_val_steps=2, limit_val_batches=2)


@pytest.mark.parametrize("mode, kind", LOOP_RUNS, ids=LOOP_IDS)
def test_mid_epoch_validation_leaves_training_untouched(mode, kind):
    """``val_check_interval=0.5`` and ``num_sanity_val_steps=2``: validation runs on the model's weights in the
    mode's dtype (the half weights in true-half modes, as Lightning's), the sanity check before any step gives
    Lightning's numbers, and training goes on bit-identically to a run without validation: the weights, the master
    weights (their compensation, their rounding noise) and the loss scale."""
    model, trainer, plugin = loop_fit(mode, kind, model_cls=LoopValidated, max_epochs=2, **LOOP_VALIDATION)
    plain, _, plain_plugin = loop_fit(mode, kind, model_cls=LoopValidated, max_epochs=2)
    assert len(model.validated) == 2 + 4 * 2 and not plain.validated
    assert_tensors_equal(mw_params(model), mw_params(plain), "with validation against without")
    assert model.losses == plain.losses and model.scales == plain.scales
    masters = plugin.state_dict().get("master_weights")
    if masters is not None:
        opt_assert_nested_equal(masters, plain_plugin.state_dict()["master_weights"], "master weights")
    dtype = next(model.parameters()).dtype if mode.endswith("-true") else {"fp32": torch.float32,
                                                                           "bf16": torch.bfloat16,
                                                                           "fp16": torch.float16}[mode]  # fmt: skip
    assert all(d == dtype for d, _ in model.validated)
    if mode != "fp16":  # the sanity check: the same initial weights, Lightning's numbers
        theirs, _, _ = loop_fit(mode, kind, lightning=True, model_cls=LoopValidated, max_steps=0, **LOOP_VALIDATION)
        assert model.validated[:2] == theirs.validated[:2]


# ================================================================================================================
# hooks that read the gradients; a conditional clipping override
# ================================================================================================================
class LoopHooked(LoopNet):
    """Logs ``grad_norm(self, norm_type=2)`` with ``log_dict`` in ``on_before_optimizer_step``, reads ``.grad`` in
    ``on_after_backward``, and clips by norm only from the third step on (``configure_gradient_clipping``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.norms: list = []
        self.after_backward: list = []

    def on_after_backward(self) -> None:
        self.after_backward.append(self.layer.weight.grad.detach().float().clone())

    def on_before_optimizer_step(self, optimizer) -> None:
        norms = grad_norm(self, norm_type=2)
        self.norms.append({name: float(value) for name, value in norms.items()})
        self.log_dict(norms)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.trainer.global_step >= 2:
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("mode", OPT_MODES)
def test_grad_norm_logged_before_the_step_is_lightnings(mode):
    """``grad_norm`` logged in ``on_before_optimizer_step`` and a conditional ``clip_gradients``: the logged norms,
    the ``.grad`` read in ``on_after_backward`` and the weights are Lightning's own plugin's (true-half without
    master weights). In fp16 the norms are of the unscaled gradients, as Lightning unscales before this hook: the
    same whatever the loss scale, and within rounding of fp32's; ``on_after_backward`` sees the scaled ones, as
    under Lightning's 16-mixed. With master weights the hook reads the true gradients too (the first step's
    norms are Lightning's)."""
    options = dict(model_cls=LoopHooked, model_kwargs=dict(optimizer="sgd"), max_steps=6)
    if mode == "fp16":
        small, _, _ = loop_fit(mode, plugin_kwargs=dict(init_scale=2.0**4), **options)
        large, _, _ = loop_fit(mode, plugin_kwargs=dict(init_scale=2.0**12), **options)
        fp32, _, _ = loop_fit("fp32", lightning=True, **options)
        assert small.norms == large.norms and len(small.norms) == 6
        for ours, theirs in zip(small.norms, fp32.norms):
            assert ours.keys() == theirs.keys()
            assert all(ours[k] == pytest.approx(theirs[k], rel=0.02) for k in ours)
        assert torch.allclose(small.after_backward[0], fp32.after_backward[0] * 2.0**4, rtol=0.02)
        return
    kind = "none" if mode.endswith("-true") else None
    ours, trainer, plugin = loop_fit(mode, kind, **options)
    theirs, _, _ = loop_fit(mode, kind, lightning=True, **options)
    assert ours.norms == theirs.norms and len(ours.norms) == 6
    assert trainer.callback_metrics["grad_2.0_norm_total"] == pytest.approx(theirs.norms[-1]["grad_2.0_norm_total"])
    if mode != "fp16-true":  # (Lightning's 16-true has no loss scale: its .grad after backward is unscaled)
        assert all(torch.equal(a, b) for a, b in zip(ours.after_backward, theirs.after_backward))
    assert_tensors_equal(mw_params(ours), mw_params(theirs), f"against Lightning's {LOOP_LIGHTNING[mode]}")
    assert plugin.stats.skipped_steps == 0
    if mode.endswith("-true"):
        masters, _, _ = loop_fit(mode, **options)
        assert masters.norms[0] == theirs.norms[0]


# ================================================================================================================
# a mid-epoch checkpoint, resumed
# ================================================================================================================
class LoopResumable(LoopNet):
    """LoopNet with a step-interval StepLR, taking each batch by the global batch index (Lightning restarts a plain
    DataLoader's epoch on a mid-epoch resume) and a gradient poisoned with inf at the batches in ``poisoned``."""

    def __init__(self, poisoned=(1, 3), **kwargs) -> None:
        super().__init__(**kwargs)
        self.poisoned = set(poisoned)

    def training_step(self, batch, batch_idx):
        x, y = mw_regression_data(self.n, self.features)
        start = (self.batch_index % (self.n // self.batch_size)) * self.batch_size
        return super().training_step((x[start : start + self.batch_size], y[start : start + self.batch_size]),
                                     batch_idx)  # fmt: skip

    def on_after_backward(self) -> None:
        if self.batch_index in self.poisoned:
            self.layer.weight.grad[0, 0] = math.inf

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("mode, kind", LOOP_RUNS, ids=LOOP_IDS)
def test_mid_epoch_checkpoint_resumes_bit_for_bit(mode, kind, tmp_path):
    """``ModelCheckpoint(every_n_train_steps=5)`` in the first epoch, after two skipped steps; a fresh model and
    plugin ``fit(ckpt_path=...)`` to step 12 ends as the uninterrupted run: weights, master weights (compensation,
    rounding noise), the loss scale, the counters, the held scheduler."""
    whole, _, whole_plugin = loop_fit(mode, kind, model_cls=LoopResumable, max_steps=12, max_epochs=-1)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    loop_fit(mode, kind, model_cls=LoopResumable, max_steps=7, max_epochs=-1, callbacks=[saver],
             enable_checkpointing=True, default_root_dir=tmp_path)  # fmt: skip
    torch.manual_seed(1)  # (other initial weights: the checkpoint's must win)
    resumed = LoopResumable(optimizer=loop_optimizer(mode, kind), lr=0.01)
    plugin = loop_plugin(mode, kind)
    trainer = opt_trainer(plugin, max_steps=12, default_root_dir=tmp_path)
    trainer.fit(resumed, ckpt_path=tmp_path / "step=5.ckpt")
    assert plugin.stats.steps == whole_plugin.stats.steps == trainer.global_step == 12
    assert plugin.stats.skipped_steps == whole_plugin.stats.skipped_steps == 2
    assert_tensors_equal(mw_params(resumed), mw_params(whole), "resumed against uninterrupted")
    assert resumed.losses == whole.losses[5:] and resumed.scales == whole.scales[5:]
    assert trainer.optimizers[0].param_groups[0]["lr"] == whole.trainer.optimizers[0].param_groups[0]["lr"]
    opt_assert_nested_equal(plugin.state_dict(), whole_plugin.state_dict(), "the plugin's state")


# ================================================================================================================
# several training dataloaders
# ================================================================================================================
class LoopTwoLoaders(MwMLP):
    """Two training loaders, of 4 batches of 8 and 6 batches of 4 (the second's inputs halved): a dict of loaders
    or a ``CombinedLoader`` of them in ``combined`` mode; the loss sums the loaders' batches there are."""

    def __init__(self, combined: Optional[str] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.combined = combined

    def train_dataloader(self):
        x, y = mw_regression_data(self.n, self.features)
        loaders = {"a": DataLoader(TensorDataset(x, y), batch_size=8),
                   "b": DataLoader(TensorDataset(x[:24] * 0.5, y[:24]), batch_size=4)}  # fmt: skip
        return loaders if self.combined is None else CombinedLoader(loaders, mode=self.combined)

    def training_step(self, batch, batch_idx):
        losses = [nn.functional.mse_loss(self(x).float(), y.float()) for x, y in filter(None, batch.values())]
        loss = torch.stack(losses).sum()
        self.losses.append(float(loss.detach()))
        return loss


LOOP_LOADERS = {None: 12, "max_size_cycle": 12, "min_size": 8, "max_size": 12}  # steps over two epochs
#: Lightning's own bf16-mixed caches autocast's weight casts (Lightning before 2.6; ours never does): a layer run twice
#: in one step then sums its two gradients through one bf16 cast, in bf16, where ours sums two fp32 gradients
LOOP_LIGHTNING_AUTOCAST_CACHES = bool(
    MixedPrecision("bf16-mixed", "cpu").autocast_context_manager()._cache_enabled  # type: ignore[attr-defined]
)


@pytest.mark.parametrize("combined", list(LOOP_LOADERS), ids=lambda c: c or "dict")
@pytest.mark.parametrize("mode", OPT_MODES)
def test_several_training_loaders_train_as_lightning(mode, combined):
    """A dict of training loaders (Lightning's ``max_size_cycle``) and ``CombinedLoader`` modes: the batches cast
    to the mode (a dict of lists in true-half modes), the steps and weights those of Lightning's own plugin."""
    options = dict(model_cls=LoopTwoLoaders, model_kwargs=dict(combined=combined, n=32, optimizer="sgd"),
                   max_epochs=2)  # fmt: skip
    kind = "none" if mode.endswith("-true") else None
    model, trainer, plugin = loop_fit(mode, kind, **options)
    assert trainer.global_step == plugin.stats.steps == LOOP_LOADERS[combined] and plugin.stats.skipped_steps == 0
    assert all(math.isfinite(loss) for loss in model.losses) and model.losses[-1] < model.losses[0]
    if mode == "bf16" and LOOP_LIGHTNING_AUTOCAST_CACHES:
        pytest.skip("this Lightning's bf16-mixed caches autocast's weight casts: the layer run once per loader sums "
                    "its gradients in bf16 through one cast, not in fp32 as Lightning 2.6+ and lightning_mp do")
    if mode != "fp16":
        theirs, _, _ = loop_fit(mode, kind, lightning=True, **options)
        assert_tensors_equal(mw_params(model), mw_params(theirs), f"against Lightning's {LOOP_LIGHTNING[mode]}")


class LoopHalvedAfterBackward(LoopHooked):
    """LoopHooked whose ``on_after_backward`` also halves every gradient in place after reading it."""

    def on_after_backward(self) -> None:
        super().on_after_backward()
        for p in self.parameters():
            p.grad.mul_(0.5)


@pytest.mark.parametrize("writes", [False, True], ids=["reads", "writes"])
@pytest.mark.parametrize("mode, kind", [("bf16-true", None), ("bf16-true", "kahan"), ("bf16-true", "stochastic"),
                                        ("fp16-true", None)])  # fmt: skip
def test_on_after_backward_sees_the_accumulated_gradient_with_master_weights(mode, kind, writes):
    """``accumulate_grad_batches=3``: in ``on_after_backward`` Lightning's ``.grad`` holds the window's sum so far
    (every plain PyTorch loop's too). With master weights the micro-batches sum in fp32 aside; the hook still reads
    that sum (rounded to half; scaled in fp16-true, as Lightning's 16-mixed shows it), and what it writes there is
    the window's sum from then on (a bug before: it read, and wrote, the last micro-batch's gradient alone). The
    weights end within rounding of Lightning's plugin of the mode without master weights."""
    cls = LoopHalvedAfterBackward if writes else LoopHooked
    options = dict(model_cls=cls, model_kwargs=dict(optimizer="sgd", lr=0.05), max_steps=2, accumulate_grad_batches=3)
    scale = dict(init_scale=1.0) if mode == "fp16-true" else None
    ours, _, plugin = loop_fit(mode, kind, plugin_kwargs=scale, **options)
    theirs, _, _ = loop_fit(mode, "none", lightning=True, **options)
    assert len(ours.after_backward) == len(theirs.after_backward) == 6 and plugin.stats.skipped_steps == 0
    for mine, lightnings in zip(ours.after_backward, theirs.after_backward):
        torch.testing.assert_close(mine, lightnings, rtol=0.03, atol=0.03)
    for name, value in mw_params(ours).items():
        torch.testing.assert_close(value.float(), mw_params(theirs)[name].float(), rtol=0.03, atol=0.03, msg=name)
