"""MPPlugin inside a real Lightning Trainer on the CPU: autocast, skipping, scaling, schedulers, clipping."""

import math
import warnings

import pytest
import torch
from conftest import StepRecorder, TinyRegressor, assert_state_equal, make_trainer
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_mp import MPPlugin, NonFiniteTrainingError

MODES = ["fp32", "tf32", "bf16", "fp16"]
AUTOCAST_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_each_mode_trains_and_the_loss_falls(mode):
    model = TinyRegressor(n=64, lr=0.25, optimizer="adam")
    plugin = MPPlugin(mode)
    trainer = make_trainer(plugin, max_steps=48)
    trainer.fit(model)
    # the same 8 batches in the first and the last epoch
    first, last = sum(model.losses[:8]) / 8, sum(model.losses[-8:]) / 8
    assert last < 0.1 * first, (first, last)
    dtype = AUTOCAST_DTYPE.get(mode, torch.bfloat16)
    assert set(model.seen_dtypes) == {dtype}
    # weights stay fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert plugin.stats.steps == 48
    if mode == "fp16":  # the scale walks down from 2**16 on the first steps: a few skips are expected
        assert plugin.stats.skipped_steps < 8 and plugin.stats.loss_scale < 2.0**16
    else:
        assert plugin.stats.skipped_steps == 0


def test_is_a_lightning_plugin_with_a_real_precision_string():
    for mode, expected in [("bf16", "bf16-mixed"), ("fp16", "16-mixed"), ("fp32", "32-true"), ("auto", "bf16-mixed")]:
        plugin = MPPlugin(mode)
        assert isinstance(plugin, Precision) and isinstance(plugin, MixedPrecision)
        trainer = make_trainer(plugin, max_steps=1)
        assert trainer.precision == expected
    trainer.fit(TinyRegressor())
    assert trainer.scaler is plugin.scaler


@pytest.mark.parametrize(
    ("mode", "where", "value"),
    [
        ("fp16", "loss", math.inf),
        ("fp16", "grad", math.inf),
        ("fp16", "activation", math.inf),
        ("bf16", "loss", math.nan),
        ("bf16", "grad", math.nan),
        ("bf16", "activation", -math.inf),
        ("fp32", "loss", math.nan),
        ("fp32", "grad", math.inf),
        ("tf32", "grad", math.nan),
    ],
)
@pytest.mark.parametrize("optimizer", ["adam", "adamw_fused"])
def test_poisoned_steps_change_nothing(mode, where, value, optimizer):
    poisoned = (2, 5, 6)
    model = TinyRegressor(optimizer=optimizer, scheduler=True, poison_value=value, **{f"poison_{where}": poisoned})
    plugin = MPPlugin(mode, init_scale=2.0**10)
    recorder = StepRecorder()
    trainer = make_trainer(plugin, max_steps=9, callbacks=[recorder])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. torch's "lr_scheduler.step() before optimizer.step()"
        trainer.fit(model)
    for i in range(9):
        if i in poisoned:
            assert_state_equal(recorder.before[i], recorder.after[i])
        else:
            assert not torch.equal(
                recorder.before[i]["params"]["net1.weight"], recorder.after[i]["params"]["net1.weight"]
            )
            assert recorder.after[i]["lr"] == recorder.before[i]["lr"] * 0.5
    # Adam's step count only counts applied steps
    assert int(trainer.optimizers[0].state[model.net1.weight]["step"]) == 9 - len(poisoned)
    assert recorder.after[-1]["lr"] == pytest.approx(model.lr * 0.2 * 0.5 ** (9 - len(poisoned)))
    stats = plugin.stats
    assert (stats.steps, stats.skipped_steps, stats.consecutive_skips, stats.skipped) == (9, 3, 0, False)
    if mode == "fp16":
        assert stats.loss_scale == 2.0**10 / 2**3
    else:
        assert stats.loss_scale is None
    assert all(math.isfinite(p.abs().sum().item()) for p in model.parameters())


def test_fp16_scale_policy_in_trainer_with_hysteresis_floor_and_cap():
    model = TinyRegressor(poison_loss=(0, 1, 3, 4, 5))
    plugin = MPPlugin("fp16", init_scale=64.0, hysteresis=2, min_scale=16.0, growth_interval=1, max_scale=64.0)
    scales = []

    class Scale(StepRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            scales.append(plugin.stats.loss_scale)

    trainer = make_trainer(plugin, max_steps=8, callbacks=[Scale()])
    trainer.fit(model)
    # o o . o o o . .  -> 2nd overflow in a row backs off; clean step grows (capped at 64) and refills;
    # then two overflows back off, the third again (budget spent), the floor stops at 16
    assert scales == [64.0, 32.0, 64.0, 64.0, 32.0, 16.0, 32.0, 64.0]
    assert plugin.stats.skipped_steps == 5


def test_lr_scheduler_not_held_when_asked():
    model = TinyRegressor(scheduler=True, poison_loss=(1,))
    recorder = StepRecorder()
    trainer = make_trainer(MPPlugin("bf16", hold_schedulers_on_skip=False), max_steps=3, callbacks=[recorder])
    trainer.fit(model)
    assert recorder.after[1]["lr"] == recorder.before[1]["lr"] * 0.5
    assert_state_equal({**recorder.before[1], "lr": 0}, {**recorder.after[1], "lr": 0})


def test_consecutive_skips_stop_training_with_a_clear_error():
    model = TinyRegressor(poison_loss=tuple(range(3, 40)))
    trainer = make_trainer(MPPlugin("fp16", init_scale=8.0, max_consecutive_skips=5), max_steps=40)
    with pytest.raises(NonFiniteTrainingError) as err:
        trainer.fit(model)
    message = str(err.value)
    assert "5 optimizer steps in a row" in message
    assert "max_consecutive_skips=5" in message
    assert "global step 7" in message
    assert "loss scale 1" in message and "floor" in message
    assert model.batches_seen == 8


def test_default_divergence_limit_is_not_hit_by_a_normal_fp16_start():
    # the scale walks down from 2**16 to 1: 16 overflows, far below the default limit
    model = TinyRegressor(poison_loss=tuple(range(0, 17)), n=256)
    plugin = MPPlugin("fp16")
    make_trainer(plugin, max_steps=20).fit(model)
    assert plugin.stats.skipped_steps == 17 and plugin.stats.loss_scale == 1.0  # min_scale floor


def test_bf16_nan_forever_stops():
    model = TinyRegressor(poison_grad=tuple(range(100)), poison_value=math.nan)
    with pytest.raises(NonFiniteTrainingError, match="3 optimizer steps in a row.*max_consecutive_skips=3"):
        make_trainer(MPPlugin("bf16", max_consecutive_skips=3), max_steps=10).fit(model)


def test_clipping_acts_on_unscaled_gradients_in_automatic_mode_with_a_fused_optimizer():
    norms = []

    class Norm(StepRecorder):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()]).item())

    model = TinyRegressor(optimizer="adamw_fused")
    plugin = MPPlugin("fp16", init_scale=2.0**12)
    trainer = make_trainer(plugin, max_steps=3, callbacks=[Norm()], gradient_clip_val=0.5)
    trainer.fit(model)
    # hooks see true gradients (order of 10, not 10 * 4096), then the clip brings them to 0.5
    assert all(1 < n < 1000 for n in norms), norms
    assert plugin.stats.grad_norm == pytest.approx(norms[-1], rel=1e-3)
    # Lightning's own 16-mixed refuses this combination
    with pytest.raises(RuntimeError, match="fused"):
        Trainer(
            precision="16-mixed", accelerator="cpu", max_steps=1, gradient_clip_val=0.5, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ).fit(TinyRegressor(optimizer="adamw_fused"))


def test_clipping_in_manual_optimization_sees_unscaled_gradients():
    clip = 0.01
    seen = []

    class GradNorm(StepRecorder):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()]).item())

    model = TinyRegressor(manual=True, manual_clip=clip, poison_loss=(1,))
    plugin = MPPlugin("fp16", init_scale=2.0**10)
    make_trainer(plugin, max_steps=4, callbacks=[GradNorm()]).fit(model)
    # Lightning's own plugin would clip the scaled gradients and leave clip / scale here (issue #18089)
    clean = [n for i, n in enumerate(seen) if i != 1]
    assert clean == pytest.approx([clip] * 3, rel=1e-3)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.loss_scale == 512.0


def test_manual_optimization_skips_and_keeps_state():
    recorder = StepRecorder()
    model = TinyRegressor(manual=True, optimizer="adam", poison_grad=(2,), poison_value=math.nan)
    plugin = MPPlugin("bf16")
    make_trainer(plugin, max_steps=5, callbacks=[recorder]).fit(model)
    assert_state_equal(recorder.before[2], recorder.after[2])
    assert int(next(iter(model.trainer.optimizers[0].state.values()))["step"]) == 4
    assert plugin.stats.skipped_steps == 1


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_gradient_accumulation_matches_one_big_batch(mode):
    """4 micro-batches of 4 accumulate to the same update as one batch of 16 (mean losses)."""
    torch.manual_seed(0)
    big = TinyRegressor(batch_size=16, optimizer="sgd")
    small = TinyRegressor(batch_size=4, optimizer="sgd")
    small.load_state_dict(big.state_dict())
    make_trainer(MPPlugin(mode, init_scale=2.0**8), max_steps=3).fit(big)
    plugin = MPPlugin(mode, init_scale=2.0**8)
    make_trainer(plugin, max_steps=3, accumulate_grad_batches=4).fit(small)
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert plugin.stats.steps == 3


def test_gradient_accumulation_skip_discards_the_whole_window():
    recorder = StepRecorder()
    # micro-batch 5 lies in the 2nd window (4..7); the whole window's update is dropped
    model = TinyRegressor(batch_size=4, optimizer="adam", poison_loss=(5,))
    plugin = MPPlugin("fp16", init_scale=2.0**8)
    make_trainer(plugin, max_steps=3, accumulate_grad_batches=4, callbacks=[recorder]).fit(model)
    assert_state_equal(recorder.before[4], recorder.after[7])
    assert plugin.stats.skipped_steps == 1 and plugin.stats.steps == 3
    assert int(next(iter(model.trainer.optimizers[0].state.values()))["step"]) == 2


def test_training_step_returning_none_is_left_alone():
    class Sometimes(TinyRegressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 1 else loss

    # as Lightning's 32-true: the optimizer step runs (with whatever gradients there are; here none)
    plugin = MPPlugin("fp16", init_scale=2.0**8)
    make_trainer(plugin, max_steps=4).fit(Sometimes())
    assert plugin.stats.steps == 4 and plugin.stats.skipped_steps == 0 and plugin.stats.loss_scale == 2.0**8


def test_grads_are_released_after_the_step_unless_disabled():
    seen = {}

    class Peek(StepRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[trainer.precision_plugin.release_grads_after_step] = pl_module.net1.weight.grad

    make_trainer(MPPlugin("bf16"), max_steps=2, callbacks=[Peek()]).fit(TinyRegressor())
    make_trainer(MPPlugin("bf16", release_grads_after_step=False), max_steps=2, callbacks=[Peek()]).fit(TinyRegressor())
    assert seen[True] is None and seen[False] is not None
    seen.clear()
    make_trainer(MPPlugin("bf16", skip_nonfinite=False), max_steps=2, callbacks=[Peek()]).fit(TinyRegressor())
    assert seen == {True: None}


def test_skip_nonfinite_false_in_bf16_steps_on_nan():
    model = TinyRegressor(poison_loss=(1,), poison_value=math.nan)
    plugin = MPPlugin("bf16", skip_nonfinite=False)
    make_trainer(plugin, max_steps=3).fit(model)
    assert plugin.scaler is None
    assert torch.isnan(model.net1.weight).any()


def test_tf32_flags_set_for_the_run_and_restored():
    seen = []

    class Flags(StepRecorder):
        def on_train_batch_start(self, *args):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    make_trainer(MPPlugin("tf32"), max_steps=1, callbacks=[Flags()]).fit(TinyRegressor())
    make_trainer(MPPlugin("fp32"), max_steps=1, callbacks=[Flags()]).fit(TinyRegressor())
    make_trainer(MPPlugin("bf16", tf32=True), max_steps=1, callbacks=[Flags()]).fit(TinyRegressor())
    assert seen == [(True, True), (False, False), (True, True)]
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp12"}, "Unknown precision 'fp12'"),
        ({"init_scale": -2.0}, "init_scale=-2.0"),
        ({"growth_factor": 0.5}, "growth_factor=0.5"),
        ({"backoff_factor": 2.0}, "backoff_factor=2.0"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"hysteresis": 0}, "hysteresis=0"),
        ({"min_scale": 10.0, "max_scale": 1.0}, "min_scale=10.0 is larger than max_scale=1.0"),
        ({"loss_scale": 0}, "loss_scale=0"),
        ({"loss_scale": "big"}, "loss_scale='big'"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips=0"),
        ({"skip_nonfinite": "yes"}, "skip_nonfinite='yes'"),
        ({"tf32": 1}, "tf32=1"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MPPlugin(**kwargs)


def test_scaler_arguments_without_scaling_are_reported():
    with pytest.warns(UserWarning, match="hysteresis, init_scale set, but precision='bf16' does not scale the loss"):
        MPPlugin("bf16", init_scale=1024.0, hysteresis=2)


def test_static_loss_scale():
    model = TinyRegressor(poison_loss=(1,))
    plugin = MPPlugin("fp16", loss_scale=128.0)
    make_trainer(plugin, max_steps=4).fit(model)
    assert plugin.stats.loss_scale == 128.0 and plugin.stats.skipped_steps == 1


def test_lbfgs_runs_checked_where_it_can_and_is_refused_with_advice_where_not():
    class WithLBFGS(TinyRegressor):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    with pytest.raises(
        Exception, match="LBFGS evaluates its closure.*loss scale.*'fp32', 'tf32', 'bf16' or 'bf16-true'"
    ):
        make_trainer(MPPlugin("fp16"), max_steps=1).fit(WithLBFGS())
    for mode in ("fp32", "bf16"):
        model = WithLBFGS(poison_grad=(2,))
        plugin = MPPlugin(mode)
        recorder = StepRecorder()
        make_trainer(plugin, max_steps=4, callbacks=[recorder]).fit(model)
        assert plugin.stats.steps == 4 and plugin.stats.skipped_steps == 1, mode
        for name, value in recorder.before[2]["params"].items():  # the poisoned step changed nothing
            assert torch.equal(value, recorder.after[2]["params"][name]), (mode, name)
        assert not torch.equal(recorder.before[1]["params"]["net1.weight"], recorder.after[1]["params"]["net1.weight"])


def test_bf16_clipping_by_norm_gives_the_nonfinite_verdict_without_a_second_pass(check_passes):
    calls = check_passes
    recorder = StepRecorder()
    model = TinyRegressor(optimizer="adamw_fused", poison_grad=(2,), poison_value=math.nan)
    plugin = MPPlugin("bf16")
    make_trainer(plugin, max_steps=4, callbacks=[recorder], gradient_clip_val=1.0).fit(model)
    assert calls == []  # the clip norm served as the check on every step
    assert_state_equal(recorder.before[2], recorder.after[2])
    assert plugin.stats.skipped_steps == 1
    # clipping by value does not read a norm: the check pass runs
    make_trainer(MPPlugin("bf16"), max_steps=2, gradient_clip_val=1.0, gradient_clip_algorithm="value").fit(
        TinyRegressor()
    )
    assert len(calls) == 2


def test_set_precision_between_steps():
    from lightning.pytorch import Callback

    seen = []

    class Switch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.precision, pl_module.seen_dtypes[-1], torch.backends.cuda.matmul.allow_tf32))
            if trainer.global_step == 2:
                trainer.precision_plugin.set_precision("bf16")
            if trainer.global_step == 4:
                trainer.precision_plugin.set_precision("16-mixed")

    before = torch.backends.cuda.matmul.allow_tf32
    model = TinyRegressor(poison_loss=(1, 5))
    plugin = MPPlugin("fp32", init_scale=64.0)
    make_trainer(plugin, max_steps=6, callbacks=[Switch()]).fit(model)
    assert [s[:2] for s in seen] == [
        ("32-true", torch.float32), ("32-true", torch.float32),
        ("bf16-mixed", torch.bfloat16), ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16), ("16-mixed", torch.float16),
    ]
    # fp32 turned TF32 off, bf16 gave it back
    assert [s[2] for s in seen[:2]] == [False, False] and seen[2][2] == before
    # counters carried across the switches; fp16 started from init_scale and backed off once
    assert plugin.stats.skipped_steps == 2 and plugin.stats.steps == 6 and plugin.stats.loss_scale == 32.0
    with pytest.raises(ValueError, match="Unknown precision 'fp12'"):
        plugin.set_precision("fp12")


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_the_plugin_pickles_before_and_after_training(mode):
    """ddp_spawn and checkpoint callbacks pickle the plugin: no closures in its parts, before or after set-up."""
    import pickle

    plugin = MPPlugin(mode)
    pickle.loads(pickle.dumps(plugin))
    make_trainer(plugin, max_steps=2).fit(TinyRegressor())
    again = pickle.loads(pickle.dumps(plugin))
    assert again.stats.steps == plugin.stats.steps == 2


def test_a_plugin_with_a_given_gradscaler_pickles_and_keeps_it_shown():
    """ddp_spawn pickles the plugin: the user's GradScaler and the scaler training runs through stay one scale."""
    import pickle

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    plugin = MPPlugin("fp16", "cpu", scaler=scaler)
    make_trainer(plugin, max_steps=2).fit(TinyRegressor(poison_loss=(0,)))
    assert scaler.get_scale() == 2.0**7  # one backoff, shown by the user's object
    again = pickle.loads(pickle.dumps(plugin))
    assert type(again.scaler) is torch.amp.GradScaler and again.scaler.get_scale() == 2.0**7
    again._run.scaler.ensure_initialized(torch.device("cpu"))  # (torch re-makes the scale tensor after pickling)
    again._run.scaler.update(2.0**5)  # the copy's training scaler moves: its copy of the user's scaler shows it
    assert again.scaler.get_scale() == 2.0**5 and scaler.get_scale() == 2.0**7


def test_a_given_disabled_gradscaler_is_the_one_shown_and_nothing_is_scaled():
    """MixedPrecision's contract with ``GradScaler(enabled=False)``: trainer.scaler is it; the loss is not scaled and
    no step is skipped (torch's disabled scaler steps on anything), as with Lightning's plugin."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    plugin = MPPlugin("16-mixed", "cpu", scaler=scaler)
    trainer = make_trainer(plugin, max_steps=3)
    trainer.fit(TinyRegressor())
    assert trainer.scaler is scaler and not scaler.is_enabled() and scaler.get_scale() == 1.0
    assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0 and not plugin.skips_nonfinite


def test_a_given_gradscaler_is_the_one_used():
    """MixedPrecision's contract: MPPlugin("16-mixed", device, scaler=GradScaler(...)) trains with that very scaler."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugin = MPPlugin("16-mixed", "cpu", scaler=scaler)
    trainer = make_trainer(plugin, max_steps=4)
    trainer.fit(TinyRegressor(poison_loss=(1,)))
    assert trainer.scaler is scaler and type(scaler) is torch.amp.GradScaler  # used by composition, not changed
    assert scaler.get_scale() == 2.0**9 and plugin.stats.skipped_steps == 1  # one backoff, as torch's
    assert torch.amp.GradScaler("cpu").state_dict().keys() <= scaler.state_dict().keys()
    with pytest.raises(Exception, match="does not scale the loss"):
        MPPlugin("bf16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-true", "fp16", "fp16-true"])
def test_trainer_scaler_is_the_loss_scaler_as_with_lightnings_plugins(mode):
    """Lightning's bf16-mixed and true-precision plugins have no scaler (``trainer.scaler is None``), 16-mixed a
    GradScaler; ours the same, while a poisoned step is still skipped in every mode."""
    scales = mode.startswith("fp16")
    plugin = MPPlugin(mode, **({"init_scale": 2.0**8} if scales else {}))  # (no overflow of its own at the start)
    trainer = make_trainer(plugin, max_steps=3)
    model = TinyRegressor(poison_loss=(1,))
    trainer.fit(model)
    assert (trainer.scaler is not None) is scales and plugin.skips_nonfinite
    assert not scales or isinstance(trainer.scaler, torch.amp.GradScaler)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.steps == 3
