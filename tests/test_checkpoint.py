"""Checkpoints: the plugin's state is saved and restored, resume continues exactly, old checkpoints migrate."""

import pytest
import torch
from conftest import TinyRegressor, make_trainer
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mp import MPPlugin


def fit(plugin, max_steps, ckpt_path=None, model=None, **model_kwargs):
    model = model or TinyRegressor(optimizer="adam", scheduler=False, **model_kwargs)
    trainer = make_trainer(plugin, max_steps=max_steps)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_resume_matches_an_uninterrupted_run(tmp_path, mode):
    # overflows before (batch 2) and after (batches 9, 10) the checkpoint taken mid-epoch, after 6 steps
    poison = {"poison_loss": (2, 9, 10), "batches_by_index": True}
    torch.manual_seed(0)
    init = TinyRegressor().state_dict()

    whole = TinyRegressor(optimizer="adam", **poison)
    whole.load_state_dict(init)
    full_plugin = MPPlugin(mode, init_scale=2.0**8, hysteresis=2)
    fit(full_plugin, 16, model=whole)

    first = TinyRegressor(optimizer="adam", **poison)
    first.load_state_dict(init)
    trainer, _ = fit(MPPlugin(mode, init_scale=2.0**8, hysteresis=2), 6, model=first)
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)

    resumed_plugin = MPPlugin(mode, init_scale=2.0**8, hysteresis=2)
    second = TinyRegressor(optimizer="adam", **poison)
    fit(resumed_plugin, 16, ckpt_path=path, model=second)

    for a, b in zip(whole.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert resumed_plugin.stats.as_dict() == full_plugin.stats.as_dict()
    assert resumed_plugin.stats.skipped_steps == 3 and resumed_plugin.stats.steps == 16
    if mode == "fp16":
        # batch 2 absorbed by hysteresis; 9 and 10 in a row back off once
        assert resumed_plugin.stats.loss_scale == 2.0**7


def test_checkpoint_loads_with_weights_only_and_holds_the_plugin_state(tmp_path):
    trainer, _ = fit(MPPlugin("fp16", init_scale=2.0**9, hysteresis=2), 4, poison_loss=(1, 2))
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["MPPlugin"]
    assert state["mode"] == "fp16"
    assert state["scaler"]["scale"] == 2.0**8
    assert state["scaler"]["skipped_steps"] == 2 and state["scaler"]["steps"] == 4
    assert state["scaler"]["hysteresis"] == 2


def test_bf16_state_is_saved_too(tmp_path):
    trainer, _ = fit(MPPlugin("bf16"), 3, poison_grad=(1,), poison_value=float("nan"))
    path = tmp_path / "b.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["MPPlugin"]
    # the counts are the plugin's, per optimizer; without a loss scale there is no scaler state to keep
    assert state["mode"] == "bf16" and state["optimizers"] == [{"steps": 3, "skipped_steps": 1, "consecutive_skips": 0}]
    assert "scaler" not in state


def test_an_older_bf16_checkpoint_with_a_check_only_scaler_state_resumes(tmp_path):
    """Checkpoints of earlier releases kept a check-only scaler state in bf16 (scale 1, ``scaling: False``, the
    counts): they resume, the counts come back, and an fp16 run that loads one starts from its own init_scale."""
    trainer, _ = fit(MPPlugin("bf16"), 3, poison_grad=(1,), poison_value=float("nan"))
    path = tmp_path / "old.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    old_scaler = {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                  "_growth_tracker": 0, "hysteresis": 1, "consecutive_hysteresis": True, "_hysteresis_tracker": 1,
                  "min_scale": 1.0, "max_scale": 2.0**24, "dynamic": True, "scaling": False,
                  "steps": 3, "skipped_steps": 1, "consecutive_skips": 0, "last_skipped": 0}
    checkpoint["MPPlugin"] = {"mode": "bf16", "scaler": old_scaler}  # (the oldest entries had no per-optimizer part)
    torch.save(checkpoint, path)
    plugin = MPPlugin("bf16")
    fit(plugin, 5, ckpt_path=path)
    assert plugin.stats.steps == 5 and plugin.stats.skipped_steps == 1

    fp16 = MPPlugin("fp16", init_scale=2.0**10)
    with pytest.warns(UserWarning, match="loss scale starts from init_scale"):
        fit(fp16, 4, ckpt_path=path)
    assert fp16.stats.loss_scale == 2.0**10 and fp16.stats.skipped_steps == 1


def test_lightning_16_mixed_checkpoint_resumes_with_its_scale(tmp_path):
    native = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer, _ = fit(native, 8, poison_loss=(1, 3))
    path = tmp_path / "native.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["MixedPrecision"]["scale"] == 2.0**8

    plugin = MPPlugin("fp16", init_scale=2.0**15)
    scales = []

    class Peek(torch.nn.Module):
        pass

    trainer2 = make_trainer(plugin, max_steps=9)
    trainer2.fit(TinyRegressor(optimizer="adam"), ckpt_path=path)
    scales.append(plugin.stats.loss_scale)
    assert scales == [2.0**8]  # one clean step after resume: the scale came from the checkpoint, not init_scale


def test_resume_in_another_mode_says_so(tmp_path):
    trainer, _ = fit(MPPlugin("fp16", init_scale=2.0**9), 8, poison_loss=(1,))
    path = tmp_path / "fp16.ckpt"
    trainer.save_checkpoint(path)
    plugin = MPPlugin("bf16")
    with pytest.warns(UserWarning, match="written with precision='fp16'.*resumes with precision='bf16'"):
        fit(plugin, 9, ckpt_path=path)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.loss_scale is None


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("garbage", "not a dict: it is corrupted"),
        ({"foo": 1}, "no 'mode': it is corrupted"),
        ({"mode": "fp16", "scaler": {"scale": 1.0}}, "loss-scaler state is corrupted.*missing"),
    ],
)
def test_corrupted_plugin_entry_is_a_clear_error(tmp_path, entry, match):
    trainer, _ = fit(MPPlugin("fp16"), 2)
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["MPPlugin"] = entry
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=match):
        fit(MPPlugin("fp16"), 4, ckpt_path=path)


def test_a_given_gradscaler_resumes_with_the_checkpoints_scale(tmp_path):
    """fp16 with the user's GradScaler: the scale a checkpoint holds comes back on resume, and the new run's own
    GradScaler (as given, not changed) shows it."""
    first_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer, _ = fit(MPPlugin("fp16", "cpu", scaler=first_scaler), 6, poison_loss=(1, 3))
    assert first_scaler.get_scale() == 2.0**8
    path = tmp_path / "given.ckpt"
    trainer.save_checkpoint(path)

    second_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    plugin = MPPlugin("fp16", "cpu", scaler=second_scaler)
    fit(plugin, 7, ckpt_path=path)
    assert type(second_scaler) is torch.amp.GradScaler and plugin.scaler is second_scaler
    assert second_scaler.get_scale() == 2.0**8  # the checkpoint's scale, not its init_scale
    assert plugin.stats.skipped_steps == 2 and plugin.stats.steps == 7
