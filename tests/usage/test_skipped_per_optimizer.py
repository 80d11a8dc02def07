"""Several optimizers, one skipped: each LR schedule follows its own optimizer's steps.

A GAN-style loop steps a discriminator (D) and a generator (G), each with its own step-interval LR scheduler
(``StepLR``: the LR halves at each scheduler step), and D's loss is poisoned (``* inf``) on some batches: D's step
is skipped there, G's is taken. The user steps the schedulers by the documented recipe, one question per optimizer:

    for opt, scheduler in ((opt_d, sched_d), (opt_g, sched_g)):
        if not plugin.stats.skipped_for(opt):
            scheduler.step()

under the Trainer (manual optimization, ``self.optimizers()`` / ``self.lr_schedulers()``) and under Lightning
Fabric (the optimizers ``fabric.setup`` returned), in fp32, bf16, fp16 and bf16-true with and without master
weights, with plain SGD and with a fused Adam (``fused=True``; in fp16 its verdict reaches the host from the device).

The oracle is the count of steps each optimizer took: G's LR is ``LR * GAMMA ** (G steps)``, D's is held exactly on
its skipped steps and ends at ``LR * GAMMA ** (D steps taken)``; ``skipped_for`` answers for each optimizer, given the
torch optimizer or Lightning's or Fabric's wrapper of it; ``skipped`` answers for the optimizer that stepped last.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPFabricPrecision, MPPlugin
from lightning_mp import stats as stats_module

from .conftest import opt_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers",
    "ignore:The number of training batches",
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`",
    "ignore:The `srun` command is available",
)

SP_LR, SP_GAMMA = 0.1, 0.5  # (powers of two: the LRs compare exactly)
SP_BATCHES, SP_BATCH_SIZE = 6, 4
SP_POISONED = (1, 2, 4)  # the batches whose D loss is multiplied by inf
#: (mode, plugin arguments); fp16 from a modest loss scale, so that clean steps of the tiny model never overflow
SP_MODES = {
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {"init_scale": 2.0**8}),
    "bf16-true": ("bf16-true", {}),
    "bf16-true-no-masters": ("bf16-true", {"master_weights": "none"}),
}


def sp_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = SP_BATCHES * SP_BATCH_SIZE
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g))


def sp_optimizer(params: Any, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=SP_LR, fused=True) if fused else torch.optim.SGD(params, lr=SP_LR)


def sp_scheduler(optimizer: Any) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=SP_GAMMA)


def sp_lr(optimizer: Any) -> float:
    return optimizer.param_groups[0]["lr"]


class SpGan(nn.Module):
    """A generator and a discriminator; ``forward(x, part)`` runs one of them (Fabric converts the inputs there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen, self.disc = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return self.gen(x) if part == "gen" else self.disc(x)


def sp_d_loss(run: Any, real: torch.Tensor, z: torch.Tensor, poisoned: bool) -> torch.Tensor:
    fake = run(z, "gen").detach()
    loss = run(real, "disc").float().mean() - run(fake, "disc").float().mean()
    return loss * float("inf") if poisoned else loss


def sp_g_loss(run: Any, z: torch.Tensor, poisoned: bool = False) -> torch.Tensor:
    loss = -run(run(z, "gen"), "disc").float().mean()
    return loss * float("inf") if poisoned else loss


def sp_batch_record(stats: Any, opt_d: Any, opt_g: Any, d_alone: bool, d_kept: bool) -> dict:
    """What the user sees after a batch's two steps and the schedulers' (``d_alone``: ``stats.skipped`` right after
    D's step; ``d_kept``: D's weight unchanged by its step)."""
    return {
        "d": stats.skipped_for(opt_d),
        "g": stats.skipped_for(opt_g),
        "d_raw": stats.skipped_for(sp_raw(opt_d)),
        "g_raw": stats.skipped_for(sp_raw(opt_g)),
        "skipped_after_d": d_alone,
        "skipped_after_g": stats.skipped,
        "lr_d": sp_lr(opt_d),
        "lr_g": sp_lr(opt_g),
        "d_weight_kept": d_kept,
    }


def sp_raw(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's or Fabric's wrapper."""
    raw = optimizer.optimizer
    assert type(raw) in (torch.optim.SGD, torch.optim.Adam) and raw is not optimizer
    return raw


def sp_step_schedulers(stats: Any, pairs: tuple) -> None:
    """The documented recipe: each schedule held on its own optimizer's skip."""
    for opt, scheduler in pairs:
        if not stats.skipped_for(opt):
            scheduler.step()


def sp_assert_run(records: list[dict], lr_d: float, lr_g: float, stats: Any) -> None:
    assert len(records) == SP_BATCHES
    lr_d_before = SP_LR
    for batch, rec in enumerate(records):
        poisoned = batch in SP_POISONED
        assert (rec["d"], rec["d_raw"]) == (poisoned, poisoned), f"batch {batch}: D's step"
        assert (rec["g"], rec["g_raw"]) == (False, False), f"batch {batch}: G's step was taken"
        # skipped: the last optimizer step's, D's right after D stepped, then G's
        assert (rec["skipped_after_d"], rec["skipped_after_g"]) == (poisoned, False), f"batch {batch}"
        if poisoned:
            assert rec["lr_d"] == lr_d_before and rec["d_weight_kept"], f"batch {batch}: D held exactly"
        else:
            assert rec["lr_d"] == lr_d_before * SP_GAMMA, f"batch {batch}: D's schedule moved"
        lr_d_before = rec["lr_d"]
    d_steps = SP_BATCHES - len(SP_POISONED)
    assert lr_g == SP_LR * SP_GAMMA**SP_BATCHES  # G's LR: one scheduler step per G step taken, none held
    assert lr_d == SP_LR * SP_GAMMA**d_steps
    assert [s.skipped_steps for s in stats.per_optimizer] == [len(SP_POISONED), 0]
    assert stats.steps == 2 * SP_BATCHES and stats.skipped_steps == len(SP_POISONED)


@pytest.fixture
def sp_device_verdicts(monkeypatch) -> list:
    """The verdicts recorded: ``True`` where only the device knew the outcome (a fused optimizer's ``found_inf``)."""
    seen: list = []
    record = stats_module.OptimizerStats.record

    def spy(self, skipped, verdict):
        seen.append(skipped is None)
        return record(self, skipped, verdict)

    monkeypatch.setattr(stats_module.OptimizerStats, "record", spy)
    return seen


# ---------------------------------------------------------------------------------------------- the Trainer
class SpGanModule(LightningModule):
    """Manual optimization: D then G each batch, the schedulers stepped by the user after both steps."""

    def __init__(self, fused: bool = False, poison_g: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.fused, self.poison_g = fused, poison_g
        self.net = SpGan()
        self.records: list[dict] = []
        self.before_first_step: Any = None

    def training_step(self, batch, batch_idx):
        real, z = batch
        opt_d, opt_g = self.optimizers()
        sched_d, sched_g = self.lr_schedulers()
        stats = self.trainer.precision_plugin.stats
        if batch_idx == 0:
            try:
                stats.skipped_for(opt_d)
            except ValueError as err:
                self.before_first_step = err
        d_before = self.net.disc.weight.detach().clone()

        opt_d.zero_grad()
        self.manual_backward(sp_d_loss(self.net, real, z, batch_idx in SP_POISONED))
        opt_d.step()
        d_alone = stats.skipped
        d_kept = torch.equal(d_before, self.net.disc.weight)

        opt_g.zero_grad()
        self.manual_backward(sp_g_loss(self.net, z, batch_idx in self.poison_g))
        opt_g.step()

        sp_step_schedulers(stats, ((opt_d, sched_d), (opt_g, sched_g)))
        self.records.append(sp_batch_record(stats, opt_d, opt_g, d_alone, d_kept))

    def configure_optimizers(self):
        opt_d = sp_optimizer(self.net.disc.parameters(), self.fused)
        opt_g = sp_optimizer(self.net.gen.parameters(), self.fused)
        return [opt_d, opt_g], [
            {"scheduler": sp_scheduler(opt_d), "interval": "step"},
            {"scheduler": sp_scheduler(opt_g), "interval": "step"},
        ]

    def train_dataloader(self):
        return DataLoader(sp_data(), batch_size=SP_BATCH_SIZE)


def sp_fit(mode_id: str, fused: bool = False) -> tuple[SpGanModule, MPPlugin]:
    mode, kwargs = SP_MODES[mode_id]
    plugin = MPPlugin(mode, **kwargs)
    model = SpGanModule(fused=fused)
    opt_trainer(plugin, max_steps=2 * SP_BATCHES, max_epochs=1).fit(model)  # (global_step: both optimizers' steps)
    return model, plugin


@pytest.mark.parametrize("mode_id", SP_MODES)
def test_trainer_manual_gan_each_schedule_follows_its_own_optimizer(mode_id):
    model, plugin = sp_fit(mode_id)
    opt_d, opt_g = model.trainer.optimizers
    sched_d, sched_g = (config.scheduler for config in model.trainer.lr_scheduler_configs)
    sp_assert_run(model.records, sp_lr(opt_d), sp_lr(opt_g), plugin.stats)
    assert sched_g.last_epoch == SP_BATCHES and sched_d.last_epoch == SP_BATCHES - len(SP_POISONED)
    # asked before the optimizer's first step: a ValueError naming the optimizer's class (Lightning's wrapper)
    assert isinstance(model.before_first_step, ValueError)
    assert "LightningSGD" in str(model.before_first_step)


@pytest.mark.parametrize("mode_id", ["fp32", "fp16", "bf16-true"])
def test_trainer_manual_gan_with_fused_optimizers(mode_id, sp_device_verdicts):
    model, plugin = sp_fit(mode_id, fused=True)
    opt_d, opt_g = model.trainer.optimizers
    sp_assert_run(model.records, sp_lr(opt_d), sp_lr(opt_g), plugin.stats)
    if mode_id == "fp16":  # the fused protocol: the step's verdict on the device, read when asked
        assert all(sp_device_verdicts)


# ---------------------------------------------------------------------------------------------- Lightning Fabric
def sp_fabric_run(mode_id: str, fused: bool = False, copies: bool = False) -> tuple[list[dict], Any, Any, Any]:
    mode, kwargs = SP_MODES[mode_id]
    plugin = MPFabricPrecision(mode, **kwargs)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = SpGan()
    opt_d = sp_optimizer(net.disc.parameters(), fused)
    opt_g = sp_optimizer(net.gen.parameters(), fused)
    model, opt_d, opt_g = fabric.setup(net, opt_d, opt_g)
    sched_d, sched_g = sp_scheduler(opt_d), sp_scheduler(opt_g)
    stats = plugin.stats
    with pytest.raises(ValueError, match="FabricAdam" if fused else "FabricSGD"):  # no step yet: Fabric's wrapper named
        stats.skipped_for(opt_d)
    records = []
    for batch_idx, (real, z) in enumerate(DataLoader(sp_data(), batch_size=SP_BATCH_SIZE)):
        d_before = net.disc.weight.detach().clone()
        opt_d.zero_grad()
        fabric.backward(sp_d_loss(model, real, z, batch_idx in SP_POISONED))
        opt_d.step()
        d_alone = stats.skipped
        d_kept = torch.equal(d_before, net.disc.weight)
        opt_g.zero_grad()
        fabric.backward(sp_g_loss(model, z))
        opt_g.step()
        if copies and batch_idx == SP_POISONED[0]:
            # a copy of the plugin mid-run (pickled, deep-copied) keeps the counters; the run's answers go on
            for copied in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
                assert copied.stats.as_dict() == stats.as_dict()
        sp_step_schedulers(stats, ((opt_d, sched_d), (opt_g, sched_g)))
        records.append(sp_batch_record(stats, opt_d, opt_g, d_alone, d_kept))
    plugin.teardown()
    return records, opt_d, opt_g, plugin


@pytest.mark.parametrize("mode_id", SP_MODES)
def test_fabric_gan_each_schedule_follows_its_own_optimizer(mode_id):
    records, opt_d, opt_g, plugin = sp_fabric_run(mode_id, copies=True)
    sp_assert_run(records, sp_lr(opt_d), sp_lr(opt_g), plugin.stats)


@pytest.mark.parametrize("mode_id", ["fp32", "fp16", "bf16-true"])
def test_fabric_gan_with_fused_optimizers(mode_id, sp_device_verdicts):
    records, opt_d, opt_g, plugin = sp_fabric_run(mode_id, fused=True)
    sp_assert_run(records, sp_lr(opt_d), sp_lr(opt_g), plugin.stats)
    if mode_id == "fp16":  # the fused protocol: the step's verdict on the device, read when asked
        assert all(sp_device_verdicts)


# ---------------------------------------------------------------------------------------------- what is accepted
def test_an_optimizer_the_plugin_never_stepped_is_refused_by_name():
    records, opt_d, opt_g, plugin = sp_fabric_run("fp32")
    stranger = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match=r"skipped_for\(AdamW\).*LightningOptimizer.*fabric.setup"):
        plugin.stats.skipped_for(stranger)
    with pytest.raises(ValueError, match="skipped_for\\(str\\)"):
        plugin.stats.skipped_for("opt_d")
    # the run's optimizers stay known, however they are held
    assert plugin.stats.skipped_for(opt_d) is plugin.stats.skipped_for(sp_raw(opt_d)) is False


def test_skipped_is_the_last_step_of_whichever_optimizer_stepped_last():
    """Once an optimizer stops stepping, its last skip no longer shows in ``skipped`` (it did before: any
    optimizer's last step, for ever); ``skipped_for`` still answers for it."""
    plugin = MPFabricPrecision("fp32")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = SpGan()
    model, opt_d, opt_g = fabric.setup(net, *(torch.optim.SGD(m.parameters(), lr=SP_LR) for m in (net.disc, net.gen)))
    real, z = sp_data()[:SP_BATCH_SIZE]
    fabric.backward(sp_d_loss(model, real, z, poisoned=True))
    opt_d.step()
    assert plugin.stats.skipped and plugin.stats.skipped_known() is True
    for _ in range(2):  # G goes on alone
        opt_g.zero_grad()
        fabric.backward(sp_g_loss(model, z))
        opt_g.step()
        assert not plugin.stats.skipped and plugin.stats.skipped_known() is False
    assert plugin.stats.skipped_for(opt_d) and not plugin.stats.skipped_for(opt_g)
    assert plugin.stats.skipped_steps_known() == plugin.stats.skipped_steps == 1
    plugin.teardown()


def test_precision_schedule_counts_every_optimizers_skips():
    """``PrecisionSchedule``'s ``max_skips`` counts skipped optimizer steps: D's and G's in the same batch are two
    (``skipped`` answers for one step only; the callback counts them all)."""
    from lightning_mp import PrecisionSchedule

    plugin = MPPlugin("fp16", init_scale=2.0**8)
    schedule = PrecisionSchedule(fallback={"fp16": "bf16"}, max_skips=2, window=100)
    model = SpGanModule(poison_g=(1,))  # batch 1: D's and G's steps both skipped
    opt_trainer(plugin, max_steps=2 * SP_BATCHES, max_epochs=1, callbacks=[schedule]).fit(model)
    assert [(h["from"], h["to"]) for h in schedule.history] == [("fp16", "bf16")]
    assert schedule.history[0]["step"] == 4  # (global step: both optimizers' steps of batches 0 and 1)
