"""The loss-spike guard (``MPPlugin(spike_sigma=k, spike_window=n)``), from the user's side, in every mode."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin, NonFiniteTrainingError, PrecisionMonitor

from .conftest import opt_trainer

MODES = ("fp32", "bf16", "fp16", "bf16-true", "fp16-true")


def plugin(mode, **kwargs):
    if mode.startswith("fp16"):
        kwargs.setdefault("init_scale", 2.0**8)  # no overflow on clean steps: every skip here is a spike
    kwargs.setdefault("spike_sigma", 6.0)
    kwargs.setdefault("spike_window", 32)
    return MPPlugin(mode, **kwargs)


class Net(LightningModule):
    """A small regression net with BatchNorm (a buffer a skipped step must not move) and a step LR scheduler."""

    def __init__(self, spike_at=(), factor=1e3, manual=False, samples=8192):
        super().__init__()
        self.samples = samples
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
        self.spike_at, self.factor = set(spike_at), factor
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())  # (true-half: the batch comes in half)
        if self.trainer.global_step in self.spike_at:
            loss = loss * self.factor
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(self.samples, 8, generator=g)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(self.samples, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=16)


class Snapshot(Callback):
    """Everything a skipped step must leave as it was, before and after the step ``at``."""

    def __init__(self, at):
        self.at, self.before, self.after = at, None, None

    @staticmethod
    def _take(trainer, module):
        opt = trainer.optimizers[0]
        state = {f"opt.{i}.{k}": v.detach().clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()
                 if isinstance(v, torch.Tensor)}
        tensors = {n: t.detach().clone() for n, t in module.state_dict().items()}
        return {**tensors, **state, "lr": torch.tensor(opt.param_groups[0]["lr"])}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self.before = self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.before is not None and self.after is None:
            self.after = self._take(trainer, pl_module)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_loss_spike_is_skipped_with_everything_bit_identical(mode):
    snap, p = Snapshot(at=40), plugin(mode)
    factor = 30.0 if mode.startswith("fp16") else 1e3  # (fp16: a spike that does not overflow, to see the scale stay)
    opt_trainer(p, max_steps=44, callbacks=[snap]).fit(Net(spike_at=[40], factor=factor))
    assert p.stats.spike_skips == 1 and p.stats.skipped_steps == 1
    assert snap.before.keys() == snap.after.keys()
    for name, value in snap.before.items():
        assert torch.equal(value, snap.after[name]), name  # weights, BN statistics, AdamW state, the LR
    if mode.startswith("fp16"):
        assert p.stats.loss_scale == 2.0**8  # a spike is no overflow: the scale did not back off


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_smooth_run_of_300_steps_skips_nothing(mode):
    p = plugin(mode)
    opt_trainer(p, max_steps=300).fit(Net())
    assert p.stats.spike_skips == 0 and p.stats.skipped_steps == 0 and p.stats.steps == 300


def test_spikes_in_the_warm_up_are_not_judged():
    p = plugin("bf16", spike_window=64)  # warm-up: 16 steps
    opt_trainer(p, max_steps=20).fit(Net(spike_at=[10]))
    assert p.stats.spike_skips == 0


@pytest.mark.slow
def test_a_spike_in_one_micro_batch_of_an_accumulation_window_skips_the_step():
    class Micro(Net):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * (1e3 if batch_idx == 81 else 1.0)  # the second micro-batch of step 40

    p = plugin("bf16")
    opt_trainer(p, max_steps=44, accumulate_grad_batches=2).fit(Micro())
    assert p.stats.spike_skips == 1 and p.stats.steps == 44


def test_manual_optimization_is_guarded_too():
    p = plugin("bf16")
    opt_trainer(p, max_steps=44).fit(Net(spike_at=[40], manual=True))
    assert p.stats.spike_skips == 1


def test_resume_carries_the_window(tmp_path):
    """A run stopped at step 30 and resumed judges step 34 as the uninterrupted run does: the window of recent losses
    and gradient norms is in the checkpoint (plain tensors and ints). Resumed without it, the guard would still be
    warming up at step 34 (4 clean steps in a new window) and let the spike through."""
    full = plugin("bf16")
    opt_trainer(full, max_steps=36).fit(Net(spike_at=[34], samples=480))
    assert full.stats.spike_skips == 1

    first = plugin("bf16")
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    opt_trainer(first, max_steps=30, enable_checkpointing=True, callbacks=[ckpt]).fit(Net(spike_at=[34], samples=480))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    key, entry = next((k, v) for k, v in saved.items() if isinstance(v, dict) and "spike" in v)
    window = entry["spike"]
    assert window["count"] == 30 and window["values"].shape == (2, 32)
    assert torch.equal(window["values"], first._spike.state_dict()["values"])

    def resume(path):
        again = plugin("bf16")
        callbacks = [ModelCheckpoint(dirpath=tmp_path / path.stem)]
        opt_trainer(again, max_steps=36, enable_checkpointing=True, callbacks=callbacks).fit(
            Net(spike_at=[34], samples=480), ckpt_path=path
        )
        return again

    assert resume(tmp_path / "last.ckpt").stats.spike_skips == 1
    del saved[key]["spike"]
    torch.save(saved, tmp_path / "no_window.ckpt")
    assert resume(tmp_path / "no_window.ckpt").stats.spike_skips == 0


def test_a_checkpoint_window_of_another_length_is_refused_by_name(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    opt_trainer(plugin("bf16"), max_steps=4, enable_checkpointing=True, callbacks=[ckpt]).fit(Net())
    other = plugin("bf16", spike_window=16)
    with pytest.raises(ValueError, match="spike_window=16"):
        opt_trainer(other, max_steps=8, enable_checkpointing=True).fit(Net(), ckpt_path=tmp_path / "last.ckpt")


def test_spikes_in_a_row_stop_training_and_say_spikes_were_the_cause():
    p = plugin("bf16", max_consecutive_skips=5)
    with pytest.raises(NonFiniteTrainingError, match="5 of them were loss or gradient-norm spikes"):
        opt_trainer(p, max_steps=80).fit(Net(spike_at=range(40, 80)))
    assert p.stats.spike_skips == 5


def test_precision_monitor_logs_spike_skips(tmp_path):
    p = plugin("bf16")
    trainer = opt_trainer(p, max_steps=44, callbacks=[PrecisionMonitor(log_every_n_steps=1)],
                          logger=CSVLogger(tmp_path))
    trainer.fit(Net(spike_at=[40]))
    assert trainer.callback_metrics["precision/spike_skips"] == 1


def test_without_the_guard_nothing_is_logged_or_skipped(tmp_path):
    p = MPPlugin("bf16")
    trainer = opt_trainer(p, max_steps=44, callbacks=[PrecisionMonitor(log_every_n_steps=1)],
                          logger=CSVLogger(tmp_path))
    trainer.fit(Net(spike_at=[40]))
    assert p.stats.spike_skips == 0 and "precision/spike_skips" not in trainer.callback_metrics


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spike_sigma": 0}, "spike_sigma=0 is invalid"),
        ({"spike_sigma": -1.0}, "spike_sigma=-1.0 is invalid"),
        ({"spike_sigma": math.inf}, "spike_sigma=inf is invalid"),
        ({"spike_sigma": "6"}, "spike_sigma='6' is invalid"),
        ({"spike_sigma": True}, "spike_sigma=True is invalid"),
        ({"spike_sigma": 6.0, "spike_window": 4}, "spike_window=4 is invalid: use an integer >= 8"),
        ({"spike_sigma": 6.0, "spike_window": 64.0}, "spike_window=64.0 is invalid"),
        ({"spike_sigma": 6.0, "skip_nonfinite": False}, "needs skip_nonfinite=True"),
    ],
)
def test_bad_values_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MPPlugin("bf16", **kwargs)


def test_settable_from_a_lightning_cli_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (the CLI writes its config.yaml into the working directory)
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "spike.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  max_steps: 2\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n  plugins:\n    - class_path: lightning_mp.MPPlugin\n"
        "      init_args: {precision: bf16, spike_sigma: 5.0, spike_window: 16}\n"
    )
    cli = LightningCLI(Net, run=False, args=["--config", str(config)], save_config_callback=None)
    p = cli.trainer.precision_plugin
    assert isinstance(p, MPPlugin) and p.spike_sigma == 5.0 and p.spike_window == 16
    cli.trainer.fit(cli.model)
    assert p.stats.steps == 2


def test_ddp_style_agreement_is_a_max_over_ranks(monkeypatch):
    """Ranks judge their own losses; the flag is all-reduced (MAX), so every rank skips the same steps."""
    from lightning_mp import spike

    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: calls.append(op) or t.fill_(1))
    assert bool(spike.all_ranks_agree(torch.tensor(False))) and calls == [torch.distributed.ReduceOp.MAX]






@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_an_inf_step_is_an_inf_skip_not_a_spike(mode):
    p = plugin(mode)
    opt_trainer(p, max_steps=44).fit(Net(spike_at=[40], factor=math.inf))
    assert p.stats.skipped_steps == 1 and p.stats.spike_skips == 0


class GAN(LightningModule):
    """Manual optimization with two optimizers whose losses live on different scales (the discriminator's ×100):
    the generator's loss multiplied by ``factor`` at batch ``spike_at``. ``one_backward``: one loss through both
    nets, one backward, both optimizers stepped from it."""

    def __init__(self, spike_at=None, factor=30.0, one_backward=False, batches=128):
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
        self.D = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = False
        self.spike_at, self.factor, self.one_backward, self.batches = spike_at, factor, one_backward, batches

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(x.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx)).to(x.device)
        fake = self.G(z)
        bce = nn.functional.binary_cross_entropy_with_logits
        real, zeros = torch.ones(x.shape[0], 1, device=x.device), torch.zeros(x.shape[0], 1, device=x.device)
        g_loss = bce(self.D(fake).float(), real)
        if batch_idx == self.spike_at or (isinstance(self.spike_at, range) and batch_idx in self.spike_at):
            g_loss = g_loss * self.factor
        if self.one_backward:
            opt_g.zero_grad()
            opt_d.zero_grad()
            self.manual_backward(g_loss + bce(self.D(x).float(), real))
            opt_g.step()
            opt_d.step()
            return
        d_loss = 100 * (bce(self.D(x).float(), real) + bce(self.D(fake.detach()).float(), zeros))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.G.parameters(), 1e-3), torch.optim.Adam(self.D.parameters(), 1e-3)

    def train_dataloader(self):
        x = torch.randn(16 * self.batches, 8, generator=torch.Generator().manual_seed(1)) + 2
        return DataLoader(TensorDataset(x), batch_size=16)


def skipped_per_optimizer(p):
    return [s.skipped_steps for s in p.stats.per_optimizer]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_each_optimizer_is_judged_against_its_own_history(mode):
    """A generator spike 30× its usual loss is far inside the discriminator's loss range (×100): judged against one
    shared window it would pass; each optimizer has its own window, so the generator's step is skipped alone."""
    smooth = plugin(mode)
    opt_trainer(smooth, max_steps=-1, max_epochs=1).fit(GAN())
    assert smooth.stats.spike_skips == 0 and skipped_per_optimizer(smooth) == [0, 0]

    p = plugin(mode)
    opt_trainer(p, max_steps=-1, max_epochs=1).fit(GAN(spike_at=100))
    assert p.stats.spike_skips == 1 and skipped_per_optimizer(p) == [1, 0]
    assert [s.steps for s in p.stats.per_optimizer] == [128, 128]


@pytest.mark.slow
def test_optimizers_stepped_from_one_backward_are_both_judged_on_its_loss():
    p = plugin("bf16")
    opt_trainer(p, max_steps=-1, max_epochs=1).fit(GAN(spike_at=100, factor=1e3, one_backward=True))
    assert p.stats.spike_skips == 2 and skipped_per_optimizer(p) == [1, 1]


@pytest.mark.slow
def test_resume_carries_every_optimizers_window(tmp_path):
    """Saved after 80 batches, resumed: a generator spike 3 batches later is judged against the restored windows
    (a new window would still be warming up, 8 clean steps, and let it through)."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = plugin("bf16")
    # (manual optimization: global_step counts both optimizers' steps, so 160 steps are 80 batches)
    opt_trainer(first, max_steps=160, enable_checkpointing=True, callbacks=[ckpt]).fit(GAN(spike_at=50))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    key, entry = next((k, v) for k, v in saved.items() if isinstance(v, dict) and "spike" in v)
    window = entry["spike"]
    assert window["values"].shape == (2, 2, 32) and window["count"] == [79, 80]  # (the generator skipped one)
    assert window["spike_skips"] == 1

    def resume(path):
        again = plugin("bf16")
        callbacks = [ModelCheckpoint(dirpath=tmp_path / path.stem)]
        opt_trainer(again, max_steps=200, enable_checkpointing=True, callbacks=callbacks).fit(
            GAN(spike_at=83), ckpt_path=path
        )
        assert again.stats.steps == 200
        return again

    resumed = resume(tmp_path / "last.ckpt")
    assert resumed.stats.spike_skips == 2 and skipped_per_optimizer(resumed) == [2, 0]
    del saved[key]["spike"]
    torch.save(saved, tmp_path / "no_window.ckpt")
    assert resume(tmp_path / "no_window.ckpt").stats.spike_skips == 0


class Boring(BoringModel):
    """Lightning's own BoringModel: SGD drives its loss to ~0, where half-precision outputs quantize it."""

    def __init__(self, spike_at=None):
        super().__init__()
        self.spike_at = spike_at

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.spike_at:
            batch = batch * 100  # an outlier batch
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 4 * 300), batch_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp16", "fp32", "bf16-true"])
@pytest.mark.parametrize("window", [8, 32])
def test_a_converged_model_is_not_locked_out(mode, window):
    """Converged, the loss sits within rounding steps of 0 and the window's standard deviation is ~0: a step that moves
    by one rounding step is no spike (a rise must also be 1 % of the run's largest loss or gradient norm). Without
    that floor, such a step was skipped, and, since a skipped step changes nothing, every step after it too."""
    p = plugin(mode, spike_window=window)
    opt_trainer(p, max_steps=300).fit(Boring())
    assert p.stats.spike_skips == 0 and p.stats.skipped_steps == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp16"])  # (fp32 converges to weight 0, bias 1: no input moves the loss)
def test_a_spike_after_convergence_is_still_skipped(mode):
    p = plugin(mode)
    opt_trainer(p, max_steps=300).fit(Boring(spike_at=250))
    assert p.stats.spike_skips == 1


def _saved_window(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    opt_trainer(plugin("bf16"), max_steps=30, enable_checkpointing=True, callbacks=[ckpt]).fit(Net(samples=480))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    key = next(k for k, v in saved.items() if isinstance(v, dict) and "spike" in v)
    return saved, key


def test_the_checkpoint_keeps_the_runs_peak_and_reads_one_without_it(tmp_path):
    saved, key = _saved_window(tmp_path)
    window = saved[key]["spike"]
    assert window["peak"].shape == (2,) and bool((window["peak"] >= window["values"].amax(1)).all())
    del window["peak"]  # (a checkpoint written before the peak was kept: the window's largest values stand in)
    torch.save(saved, tmp_path / "old.ckpt")
    again = plugin("bf16")
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "b")]
    opt_trainer(again, max_steps=36, enable_checkpointing=True, callbacks=callbacks).fit(
        Net(spike_at=[34], samples=480), ckpt_path=tmp_path / "old.ckpt"
    )
    assert again.stats.spike_skips == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("values", torch.full((2, 32), math.nan), "holds inf/NaN"),
        ("values", torch.zeros(3, 32), "shape"),
        ("count", -1, "count=-1"),
        ("count", [3, 4], "count=\\[3, 4\\]"),
        ("peak", torch.zeros(5), "'peak'"),
        ("peak", torch.tensor([math.inf, 1.0]), "'peak' holds inf/NaN"),
        ("spike_skips", "2", "spike_skips='2'"),
    ],
)
def test_a_malformed_window_in_the_checkpoint_is_refused_by_name(tmp_path, field, value, match):
    saved, key = _saved_window(tmp_path)
    saved[key]["spike"][field] = value
    torch.save(saved, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=match):
        opt_trainer(plugin("bf16"), max_steps=36).fit(Net(samples=480), ckpt_path=tmp_path / "bad.ckpt")


def test_a_window_without_sigma_is_not_silently_ignored():
    with pytest.warns(UserWarning, match="spike_window=64 set, but spike_sigma=None"):
        MPPlugin("bf16", spike_window=64)


@pytest.mark.slow
def test_numpy_numbers_are_accepted():
    import numpy as np

    p = plugin("bf16", spike_sigma=np.float64(6.0), spike_window=np.int64(32))
    opt_trainer(p, max_steps=44).fit(Net(spike_at=[40]))
    assert p.stats.spike_skips == 1


@pytest.mark.slow
def test_one_optimizers_spikes_in_a_row_stop_training_and_name_it():
    """The generator's steps are all spikes from batch 100 while the discriminator's are clean: the generator's own
    streak reaches the limit, and the message says spikes were the cause (a streak shared by both optimizers was
    reset by every clean discriminator step)."""
    p = plugin("bf16", max_consecutive_skips=5)
    with pytest.raises(NonFiniteTrainingError, match="of optimizer 0 in a row.*5 of them were loss or gradient-norm"):
        opt_trainer(p, max_steps=-1, max_epochs=1).fit(GAN(spike_at=range(100, 128)))
    assert skipped_per_optimizer(p) == [5, 0] and p.stats.spike_skips == 5
