"""A weight held by two optimizers, in true-half modes with master weights (``bf16-true``, ``fp16-true``).

What a user expects of an encoder shared by two heads, trained with manual optimization and two optimizers (each
holding the encoder's parameters and its own head): every optimizer's update of the encoder lands, as it does in
fp32, whether each optimizer steps right after its own backward (``interleaved``) or both backward first and then
both step (``both``); with every kind of master weights, under the Trainer and under Fabric. A step one optimizer
skips (an inf in its gradients) changes nothing of what it holds, and the other optimizer's update of the same
batch still lands.

How close is close: the half run computes in bf16 (or fp16), so it drifts from the fp32 run by rounding. Over
:data:`TW_BATCHES` batches of this tiny model the drift (max |diff| over every weight and batch) stays below
:data:`TW_TOL`: measured up to 0.004 with fp32 or Kahan masters and 0.011 (Adam) / 0.017 (SGD) with stochastic
rounding or no masters in bf16, ten times less in fp16; one batch's drift at a skipped step stays below 0.004
(``TW_TOL / 3`` there). Losing one optimizer's updates of the encoder (each optimizer's fp32 masters overwriting the
other's) put the run 0.077 to 0.089 (Adam) and 0.39 to 0.47 (SGD) away, 0.086 to 0.108 in the batch of a skip.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPFabricPrecision, MPPlugin
from tests.usage.conftest import opt_trainer

TW_BATCHES = 10
#: the largest distance (max |diff| over every weight) from the fp32 run that rounding explains (see the docstring)
TW_TOL = 0.03
TW_KINDS = ("fp32", "kahan", "stochastic", "none")


def tw_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * TW_BATCHES, 8, generator=g)
    return TensorDataset(x, 2 * x[:, :1])


class TwHeads(nn.Module):
    """An encoder and two heads; head 1 learns ``y``, head 2 learns ``-y`` (they pull the encoder apart)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 16)
        self.h1 = nn.Linear(16, 1)
        self.h2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, which: int) -> torch.Tensor:
        return (self.h1 if which == 1 else self.h2)(torch.tanh(self.enc(x)))


def tw_losses(model: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    """The two losses, each computed when called (through ``model``'s forward: under Fabric its wrapper's)."""
    def loss1() -> torch.Tensor:
        return F.mse_loss(model(x, 1).float(), y.float())

    def loss2() -> torch.Tensor:
        return F.mse_loss(model(x, 2).float(), -y.float())

    return loss1, loss2


def tw_optimizers(heads: TwHeads, optim: str) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Each optimizer holds the encoder's parameters and its own head's."""
    def make(params: list) -> torch.optim.Optimizer:
        if optim == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.5)
        return torch.optim.Adam(params, lr=0.01, eps=1e-4)  # (eps: 1e-8 is 0 in fp16-true without masters)

    return (make([*heads.enc.parameters(), *heads.h1.parameters()]),
            make([*heads.enc.parameters(), *heads.h2.parameters()]))


def tw_poisoned(loss: torch.Tensor, batch_idx: int, which: int, poison: dict[int, int]) -> torch.Tensor:
    """``poison``: batch index -> the loss (1 or 2) multiplied by inf there."""
    return loss * math.inf if poison.get(batch_idx) == which else loss


def tw_steps(losses: tuple[Any, Any], opts: tuple[Any, Any], backward: Any, order: str, batch_idx: int,
             poison: dict[int, int]) -> None:
    """The user's program: ``interleaved`` (zero_grad, backward, step, one optimizer after the other) or ``both``
    (both backward, then both step)."""
    (loss1, loss2), (opt1, opt2) = losses, opts
    if order == "interleaved":
        opt1.zero_grad()
        backward(tw_poisoned(loss1(), batch_idx, 1, poison))
        opt1.step()
        opt2.zero_grad()
        backward(tw_poisoned(loss2(), batch_idx, 2, poison))
        opt2.step()
    else:
        opt1.zero_grad()
        opt2.zero_grad()
        backward(tw_poisoned(loss1(), batch_idx, 1, poison))
        backward(tw_poisoned(loss2(), batch_idx, 2, poison))
        opt1.step()
        opt2.step()


def tw_snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


class TwNet(LightningModule):
    """The program under the Trainer (manual optimization); ``snapshots[i]``: the weights after batch ``i - 1``."""

    def __init__(self, order: str, optim: str, poison: dict[int, int]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.heads = TwHeads()
        self.order, self.optim, self.poison = order, optim, poison
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def on_train_start(self) -> None:
        self.snapshots.append(tw_snapshot(self.heads))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opts = self.optimizers()
        tw_steps(tw_losses(self.heads, x, y), opts, self.manual_backward, self.order, batch_idx, self.poison)
        self.snapshots.append(tw_snapshot(self.heads))

    def configure_optimizers(self) -> Any:
        return tw_optimizers(self.heads, self.optim)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tw_data(), batch_size=8)


def tw_trainer_run(plugin: Any, order: str, optim: str, poison: dict[int, int]) -> list[dict[str, torch.Tensor]]:
    """The weights (as fp32) before the first batch and after each one, trained under the Trainer."""
    model = TwNet(order, optim, poison)
    if isinstance(plugin, str):  # Lightning's own precision flag
        opt_trainer(None, max_steps=-1, precision=plugin, max_epochs=1).fit(model)
    else:
        opt_trainer(plugin, max_steps=-1, max_epochs=1).fit(model)
    assert len(model.snapshots) == TW_BATCHES + 1
    return model.snapshots


def tw_fabric_run(plugin: Any, order: str, optim: str, poison: dict[int, int]) -> list[dict[str, torch.Tensor]]:
    """The same program under Lightning Fabric."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    heads = TwHeads()
    opt1, opt2 = tw_optimizers(heads, optim)
    model, opt1, opt2 = fabric.setup(heads, opt1, opt2)
    loader = fabric.setup_dataloaders(DataLoader(tw_data(), batch_size=8))
    snapshots = [tw_snapshot(heads)]
    for batch_idx, (x, y) in enumerate(loader):
        tw_steps(tw_losses(model, x, y), (opt1, opt2), fabric.backward, order, batch_idx, poison)
        snapshots.append(tw_snapshot(heads))
    if hasattr(plugin, "teardown"):
        plugin.teardown()
    return snapshots


@functools.lru_cache(maxsize=None)
def tw_reference(runner: str, order: str, optim: str, poison: tuple = ()) -> list[dict[str, torch.Tensor]]:
    """The fp32 run (``MPPlugin("fp32")``, which skips a step whose gradients hold an inf as the half runs do)."""
    if runner == "fabric":
        return tw_fabric_run(MPFabricPrecision("fp32"), order, optim, dict(poison))
    return tw_trainer_run(MPPlugin("fp32"), order, optim, dict(poison))


def tw_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def tw_plugin(precision: str, kind: str, fabric: bool = False) -> Any:
    kwargs: dict[str, Any] = {"master_weights": kind}
    if precision.startswith("fp16"):
        kwargs["init_scale"] = 2.0**8
    return MPFabricPrecision(precision, **kwargs) if fabric else MPPlugin(precision, **kwargs)


def tw_assert_follows(got: list, ref: list, what: str) -> None:
    distance = max(tw_distance(g, r) for g, r in zip(got, ref))
    assert distance < TW_TOL, f"{what}: {distance:.4f} away from the fp32 run (rounding explains < {TW_TOL})"


# ================================================================================================================
# every optimizer's update lands
# ================================================================================================================
def tw_optim(precision: str, kind: str) -> str:
    """Adam (its rounding drift is the smallest here), but SGD for fp16 weights without masters: Adam's fp16 state
    underflows there (its second moment of gradients near 1e-2 is below fp16's range), as in any fp16 run without
    masters, which no sharing explains."""
    return "sgd" if precision == "fp16-true" and kind == "none" else "adam"


def tw_fp16_both(precision: str, order: str) -> list:
    """fp16 with both backward calls before both steps: the loss scale is taken off the shared encoder's gradient
    twice (once by each optimizer's step), a matter of the loss scaler, not of the masters (``MPPlugin("fp16")``
    does the same)."""
    if precision == "fp16-true" and order == "both":
        return []
    return []


TW_CASES = [
    pytest.param(precision, kind, order, marks=tw_fp16_both(precision, order))
    for precision in ("bf16-true", "fp16-true") for kind in TW_KINDS for order in ("interleaved", "both")
]


@pytest.mark.parametrize("precision, kind, order", TW_CASES)
def test_both_optimizers_updates_of_the_shared_encoder_land(precision, kind, order):
    optim = tw_optim(precision, kind)
    got = tw_trainer_run(tw_plugin(precision, kind), order, optim, {})
    tw_assert_follows(got, tw_reference("trainer", order, optim), f"{precision} {kind} {order} {optim}")


@pytest.mark.parametrize("order", ["interleaved", "both"])
def test_the_fp32_reference_is_lightnings_fp32(order):
    """The reference (``MPPlugin("fp32")``) is Lightning's ``precision="32-true"`` where nothing is skipped."""
    lightning = tw_trainer_run("32-true", order, "adam", {})
    reference = tw_reference("trainer", order, "adam")
    assert max(tw_distance(a, b) for a, b in zip(lightning, reference)) == 0.0


# ================================================================================================================
# a step one optimizer skips leaves the other's update of the same batch
# ================================================================================================================
TW_POISON = {3: 2, 6: 1}  # batch 3: the second loss is inf (opt2 skips); batch 6: the first (opt1 skips)


def tw_assert_skip_keeps_the_other(got: list, ref: list, what: str) -> None:
    """At each poisoned batch, the skipping optimizer's own head keeps its weights bit for bit, and the encoder and
    the other head move as they do in the fp32 run (within a third of :data:`TW_TOL`: one batch's rounding)."""
    for batch, which in TW_POISON.items():
        before, after, ref_before, ref_after = got[batch], got[batch + 1], ref[batch], ref[batch + 1]
        for name in before:
            moved = (after[name] - before[name]).abs().max().item()
            if name.startswith(f"h{which}."):  # held only by the optimizer that skipped
                assert moved == 0.0, f"{what}: {name} moved by {moved} in batch {batch}, whose step was skipped"
                continue
            ref_moved = (ref_after[name] - ref_before[name]).abs().max().item()
            delta = ((after[name] - before[name]) - (ref_after[name] - ref_before[name])).abs().max().item()
            assert delta < TW_TOL / 3, (
                f"{what}: batch {batch} (h{which}'s optimizer skipped) moved {name} by {moved:.4f}, fp32 by"
                f" {ref_moved:.4f} (|diff| {delta:.4f})"
            )
    tw_assert_follows(got, ref, what)


@pytest.mark.parametrize("kind", TW_KINDS)
@pytest.mark.parametrize("precision", ["bf16-true", "fp16-true"])
def test_a_skipped_step_of_one_optimizer_keeps_the_others_update(precision, kind):
    ref = tw_reference("trainer", "interleaved", "sgd", tuple(TW_POISON.items()))
    got = tw_trainer_run(tw_plugin(precision, kind), "interleaved", "sgd", TW_POISON)
    tw_assert_skip_keeps_the_other(got, ref, f"{precision} {kind}")


# ================================================================================================================
# Fabric: the same program, the same expectation
# ================================================================================================================
@pytest.mark.parametrize("precision, kind, order", TW_CASES)
def test_fabric_both_optimizers_updates_land(precision, kind, order):
    optim = tw_optim(precision, kind)
    got = tw_fabric_run(tw_plugin(precision, kind, fabric=True), order, optim, {})
    tw_assert_follows(got, tw_reference("fabric", order, optim), f"Fabric {precision} {kind} {order} {optim}")


@pytest.mark.parametrize("kind", TW_KINDS)
@pytest.mark.parametrize("precision", ["bf16-true", "fp16-true"])
def test_fabric_a_skipped_step_of_one_optimizer_keeps_the_others_update(precision, kind):
    ref = tw_reference("fabric", "interleaved", "sgd", tuple(TW_POISON.items()))
    got = tw_fabric_run(tw_plugin(precision, kind, fabric=True), "interleaved", "sgd", TW_POISON)
    tw_assert_skip_keeps_the_other(got, ref, f"Fabric {precision} {kind}")


@pytest.mark.parametrize("order", ["interleaved", "both"])
@pytest.mark.parametrize("runner", ["trainer", "fabric"])
def test_fp16_mixed_shared_gradient_is_unscaled_once(runner, order):
    """fp16 autocast (fp32 weights, no masters): the shared encoder's gradient loses the loss scale once, whichever
    order the two backward calls and steps come in (before, both backward calls first divided it by the scale twice)."""
    plugin = MPFabricPrecision("fp16", init_scale=2.0**8) if runner == "fabric" else MPPlugin("fp16", init_scale=2.0**8)
    run = tw_fabric_run if runner == "fabric" else tw_trainer_run
    got = run(plugin, order, "sgd", {})
    tw_assert_follows(got, tw_reference(runner, order, "sgd"), f"{runner} fp16 {order} sgd")
