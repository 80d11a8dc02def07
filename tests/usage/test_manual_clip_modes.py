"""User-side tests: manual optimization with ``self.clip_gradients(opt, ...)`` before ``opt.step()``, in every mode.

The pattern of Lightning's docs: ``manual_backward``, then (every ``accumulate`` batches) ``clip_gradients`` and
``opt.step()``, with an ``on_before_optimizer_step`` that reads the gradients' norms (as Lightning's docs log them).
In manual optimization ``opt.step()`` runs inside ``training_step``, where the true-half modes make the default
dtype half, as Lightning's own ``HalfPrecision`` does: whatever the step makes must not take that dtype (a verdict
flag made so once raised ``found_inf must be a float tensor``).

Crossed: every mode x for-loop / foreach / fused Adam, AdamW and SGD x clipping by norm, by value or none x
accumulation over 1 or 2 batches. Oracles: Lightning's own plugin of the mode where no master weights change the
numbers (a clipping threshold never reached changes no bit), a fp32 run with master weights, and a step on a batch
with a NaN input, which must change nothing (the weights, the masters, the optimizer state), whatever clipped.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .conftest import OPT_MODES, opt_assert_nested_equal, opt_params, opt_plugin, opt_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*The number of training batches.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*does not have many workers.*",
)

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda p, eps: torch.optim.Adam(p, lr=1e-2, eps=eps, foreach=False),
    "adam-foreach": lambda p, eps: torch.optim.Adam(p, lr=1e-2, eps=eps, foreach=True),
    "adamw-fused": lambda p, eps: torch.optim.AdamW(p, lr=1e-2, eps=eps, fused=True),
    "sgd": lambda p, eps: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "sgd-foreach": lambda p, eps: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "sgd-fused": lambda p, eps: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
}
#: clipping thresholds no gradient reaches: clipped or not, every bit is the same (by value within fp16's range:
#: torch's clamp of fp16 gradients takes no bound fp16 cannot hold, with Lightning's own plugin too)
CLIPS: dict[str, Optional[tuple[str, float]]] = {"none": None, "norm": ("norm", 1e6), "value": ("value", 1e4)}
#: the optimizers the full matrices (mode x clip x accumulation) run: a for-loop, a fused and a foreach one; every
#: optimizer above runs in every mode in test_every_optimizer_skips_a_nan_batch_with_a_clip
MATRIX = ("adam", "adamw-fused", "sgd-foreach")
TRUE_HALF = ("bf16-true", "fp16-true")
BATCHES, BATCH_SIZE = 8, 8


def _data(poison: Optional[int] = None) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH_SIZE, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(BATCHES * BATCH_SIZE, 1, generator=g)
    if poison is not None:
        x[poison * BATCH_SIZE, 0] = float("nan")  # one NaN in that batch: every gradient becomes NaN
    return TensorDataset(x, y)


class ManualClip(LightningModule):
    """A 2-layer MLP in manual optimization: backward every batch, clip and step every ``accumulate`` batches."""

    def __init__(self, optimizer: str, clip: str = "norm", *, accumulate: int = 1, poison: Optional[int] = None,
                 eps: float = 1e-8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = False
        self.optimizer, self.clip, self.accumulate, self.poison, self.eps = optimizer, clip, accumulate, poison, eps
        self.losses: list[float] = []

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters(), self.eps)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            clip = CLIPS[self.clip]
            if clip is not None:
                self.clip_gradients(opt, gradient_clip_val=clip[1], gradient_clip_algorithm=clip[0])
            opt.step()
            opt.zero_grad()

    def train_dataloader(self):
        return DataLoader(_data(self.poison), batch_size=BATCH_SIZE)


class LogsGradNorms(ManualClip):
    """With the hook Lightning's docs show: ``on_before_optimizer_step`` reads the gradients' norms."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        self.norms.append(float(grad_norm(self.net, norm_type=2)["grad_2.0_norm_total"]))


class OwnClipping(ManualClip):
    """With a ``configure_gradient_clipping`` override (shared with automatic optimization; unused in manual)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def lightning_plugin(mode: str) -> Any:
    """Lightning's own plugin of ``mode`` (``precision="16-mixed"`` would turn into bf16 on a CPU)."""
    if mode == "fp32":
        return Precision()
    if mode in ("bf16", "fp16"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode == "fp16" else None
        return MixedPrecision("16-mixed" if mode == "fp16" else "bf16-mixed", "cpu", scaler=scaler)
    return HalfPrecision("16-true" if mode == "fp16-true" else "bf16-true")


def _fit(model: ManualClip, plugin: Any, callbacks=()) -> ManualClip:
    opt_trainer(plugin, max_steps=-1, max_epochs=1, callbacks=list(callbacks)).fit(model)
    return model


_REFERENCES: dict[tuple, dict] = {}


def _reference(mode: str, optimizer: str, accumulate: int, eps: float) -> dict:
    """The weights after Lightning's own plugin trained the model without clipping (made once per case)."""
    key = (mode, optimizer, accumulate, eps)
    if key not in _REFERENCES:
        model = _fit(LogsGradNorms(optimizer, "none", accumulate=accumulate, eps=eps), lightning_plugin(mode))
        _REFERENCES[key] = opt_params(model)
    return _REFERENCES[key]


# ================================================================================================ the tests
@pytest.mark.parametrize("hooked", [ManualClip, LogsGradNorms, OwnClipping], ids=["plain", "hook", "own-clipping"])
@pytest.mark.parametrize("optimizer", ["adam", "adamw-fused"])
@pytest.mark.parametrize("mode", TRUE_HALF)
def test_clip_by_norm_before_step_in_true_half_modes(mode, optimizer, hooked):
    """The reported case: fp16-true (and bf16-true), manual optimization, ``clip_gradients(opt, 1e6, "norm")``
    before ``opt.step()``, Adam or fused AdamW, a 2-layer MLP, 3 steps: trains."""
    plugin = opt_plugin(mode)
    model = hooked(optimizer, "norm")
    before = opt_params(model)
    opt_trainer(plugin, max_steps=3).fit(model)
    assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    assert all(not torch.equal(before[n].float(), p.float()) for n, p in opt_params(model).items())


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("optimizer", MATRIX)
@pytest.mark.parametrize("mode", OPT_MODES)
def test_manual_clip_trains_as_lightnings_own_plugin(mode, optimizer, clip, accumulate):
    """Where no master weights change the numbers (true-half: ``master_weights="none"``; fp16 weights then need an
    ``eps`` fp16 holds, as in Lightning's run), the weights after training are Lightning's own plugin's, bit for bit:
    a clipping threshold never reached changes nothing."""
    kwargs = {"master_weights": "none"} if mode in TRUE_HALF else {}
    eps = 1e-4 if mode == "fp16-true" else 1e-8
    model = _fit(LogsGradNorms(optimizer, clip, accumulate=accumulate, eps=eps), opt_plugin(mode, **kwargs))
    want = _reference(mode, optimizer, accumulate, eps)
    opt_assert_nested_equal(opt_params(model), want, f"{mode}, {optimizer}, clip {clip}, accumulate {accumulate}")
    assert model.norms and all(n == n for n in model.norms)  # the hook read the gradients before every step


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("optimizer", MATRIX)
@pytest.mark.parametrize("mode", TRUE_HALF)
def test_manual_clip_with_master_weights_follows_fp32(mode, optimizer, clip, accumulate):
    """With master weights (the default) the weights differ from a master-less run by design: clipped by a
    threshold never reached or not, they are the same bits, and close to a fp32 run's; the loss goes down."""
    ours = _fit(LogsGradNorms(optimizer, clip, accumulate=accumulate), opt_plugin(mode))
    unclipped = _fit(ManualClip(optimizer, "none", accumulate=accumulate), opt_plugin(mode))
    opt_assert_nested_equal(opt_params(ours), opt_params(unclipped), f"{mode}, {optimizer}: clipped vs not")
    fp32 = _reference("fp32", optimizer, accumulate, 1e-8)
    tolerance = 3e-2 if mode == "bf16-true" else 5e-3
    for name, value in fp32.items():
        torch.testing.assert_close(opt_params(ours)[name].float(), value, atol=tolerance, rtol=0,
                                   msg=lambda m, name=name: f"{name} vs a fp32 run: {m}")
    half = len(ours.losses) // 2
    assert sum(ours.losses[half:]) < sum(ours.losses[:half]), ours.losses


def _snapshot(module: LightningModule, plugin: Any) -> dict:
    masters = getattr(plugin, "masters", None)
    held = {}
    if masters is not None and hasattr(masters, "master_of"):
        held = {n: masters.master_of(p).detach().clone() for n, p in module.named_parameters()
                if masters.master_of(p) is not None}
    return {"params": opt_params(module), "masters": held,
            "optimizer": copy.deepcopy(module.trainer.optimizers[0].state_dict())}


class AroundWindow(Callback):
    """Snapshots at the start of the first batch and the end of the last batch of one accumulation window."""

    def __init__(self, first: int, last: int, plugin: Any) -> None:
        self.first, self.last, self.plugin = first, last, plugin
        self.before: Optional[dict] = None
        self.after: Optional[dict] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.first:
            self.before = _snapshot(pl_module, self.plugin)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.last:
            self.after = _snapshot(pl_module, self.plugin)


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("optimizer", MATRIX)
@pytest.mark.parametrize("mode", OPT_MODES)
def test_manual_clip_step_on_a_nan_batch_changes_nothing(mode, optimizer, clip, accumulate):
    """A NaN input in the first batch of a window: that window's step is skipped, whatever clipped (a norm of NaN,
    a clamp that would make NaN finite), and leaves the weights, the masters and the optimizer state as they were;
    the steps before and after it train."""
    plugin = opt_plugin(mode)
    first = 4 if accumulate == 2 else 3
    around = AroundWindow(first, first + accumulate - 1, plugin)
    model = LogsGradNorms(optimizer, clip, accumulate=accumulate, poison=first)
    start = opt_params(model)
    _fit(model, plugin, [around])
    assert plugin.stats.steps == BATCHES // accumulate and plugin.stats.skipped_steps == 1
    assert around.before is not None and around.after is not None
    opt_assert_nested_equal(around.after, around.before, f"{mode}, {optimizer}, clip {clip}: the NaN window")
    end = opt_params(model)
    assert all(torch.isfinite(p).all() for p in end.values())
    assert all(not torch.equal(end[n], around.after["params"][n]) for n in end)  # trained after the skip
    assert all(not torch.equal(start[n].to(end[n].dtype), around.before["params"][n]) for n in end)  # and before


class Automatic(ManualClip):
    """The same model and data in automatic optimization (no clipping)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).float(), y.float())



@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", OPT_MODES)
def test_every_optimizer_skips_a_nan_batch_with_a_clip(mode, optimizer):
    test_manual_clip_step_on_a_nan_batch_changes_nothing(mode, optimizer, "norm", 1)

@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, kind",
    [(m, None) for m in OPT_MODES if m not in TRUE_HALF]
    + [(m, k) for m in TRUE_HALF for k in ("fp32", "kahan", "stochastic", "none")],
)
def test_manual_step_is_the_automatic_step(mode, kind):
    """``opt.step()`` in ``training_step`` (where true-half modes make the default dtype half) steps as automatic
    optimization does, bit for bit: the verdict, the masters' write-back and stochastic rounding's random draws take
    no dtype from there. Wide layers: stochastic rounding draws for every weight."""
    kwargs = {"master_weights": kind} if kind is not None else {}
    eps = 1e-4 if mode == "fp16-true" else 1e-8
    runs = []
    for module in (Automatic, ManualClip):
        model = module("sgd", "none", eps=eps)
        model.net = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 1))  # (seeded by the constructor)
        runs.append(opt_params(_fit(model, opt_plugin(mode, **kwargs))))
    opt_assert_nested_equal(runs[1], runs[0], f"{mode}, {kind}: manual vs automatic optimization")
