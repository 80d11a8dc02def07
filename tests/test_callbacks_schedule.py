"""PrecisionSchedule in a real Trainer on the CPU: switches at the right step or epoch, falls back on
instability, never switches inside an optimizer step, and resumes in the right mode."""

import pickle
import warnings

import pytest
import torch
import yaml
from conftest import TinyRegressor, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import MPPlugin
from lightning_mp.callbacks import NonFiniteDetector, PrecisionMonitor, PrecisionSchedule


class ModeRecorder(Callback):
    """The mode each batch's forward pass runs in (what autocast did, not only what the plugin says)."""

    def __init__(self):
        self.modes, self.dtypes = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.modes.append(trainer.precision_plugin.mode.name)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.dtypes.append(pl_module.seen_dtypes[-1])


def fit(schedule, plugin, max_steps, model=None, ckpt_path=None, **kwargs):
    recorder = ModeRecorder()
    trainer = make_trainer(plugin, max_steps=max_steps, callbacks=[schedule, recorder], **kwargs)
    trainer.fit(model or TinyRegressor(), ckpt_path=ckpt_path)
    return trainer, recorder


def test_switches_at_the_scheduled_steps():
    schedule = PrecisionSchedule({0: "fp32", 3: "bf16-mixed", 5: "16-mixed"})
    trainer, rec = fit(schedule, MPPlugin("bf16"), 7)
    assert rec.modes == ["fp32"] * 3 + ["bf16"] * 2 + ["fp16"] * 2
    assert rec.dtypes == [torch.float32] * 3 + [torch.bfloat16] * 2 + [torch.float16] * 2
    switches = [(h["step"], h["from"], h["to"]) for h in schedule.history]
    assert switches == [(0, "bf16", "fp32"), (3, "fp32", "bf16"), (5, "bf16", "fp16")]
    assert trainer.precision == "16-mixed" and schedule.mode == "fp16"


def test_switches_at_epoch_starts():
    schedule = PrecisionSchedule({0: "fp32", 1: "bf16"}, interval="epoch")
    _, rec = fit(schedule, MPPlugin("fp32"), 12)  # 8 batches an epoch
    assert rec.modes == ["fp32"] * 8 + ["bf16"] * 4
    (switch,) = schedule.history
    assert switch == {"step": 8, "epoch": 1, "from": "fp32", "to": "bf16", "reason": "schedule: from epoch 1"}


def test_never_switches_inside_an_accumulated_step():
    schedule = PrecisionSchedule({1: "bf16"})
    _, rec = fit(schedule, MPPlugin("fp32"), 3, accumulate_grad_batches=2)
    # optimizer step 0 = batches 0 and 1; the switch waits for it to finish
    assert rec.modes == ["fp32", "fp32", "bf16", "bf16", "bf16", "bf16"]


def test_falls_back_after_n_skips_within_m_steps():
    # batches 2 and 4 overflow (steps 3 and 5): two skips within 3 steps -> bf16 from step 5 on
    schedule = PrecisionSchedule(fallback={"fp16": "bf16", "fp8": "bf16"}, max_skips=2, window=3)
    plugin = MPPlugin("fp16", init_scale=256.0)
    with pytest.warns(UserWarning, match="'fp16' -> 'bf16' at global step 5 \\(2 skipped steps within the last 3"):
        _, rec = fit(schedule, plugin, 8, model=TinyRegressor(poison_loss=(2, 4)))
    assert rec.modes == ["fp16"] * 5 + ["bf16"] * 3
    assert schedule.abandoned == {"fp16"}
    assert plugin.stats.skipped_steps == 2  # counters carry over the switch

    # the same two skips further apart than the window: no fallback
    schedule = PrecisionSchedule(fallback={"fp16": "bf16"}, max_skips=2, window=3)
    _, rec = fit(schedule, MPPlugin("fp16", init_scale=256.0), 8, model=TinyRegressor(poison_loss=(2, 5)))
    assert rec.modes == ["fp16"] * 8 and schedule.history == []


def test_an_abandoned_mode_is_not_scheduled_again():
    schedule = PrecisionSchedule({0: "fp16", 6: "fp32", 7: "fp16"}, fallback={"fp16": "bf16"}, max_skips=1, window=5)
    with pytest.warns(UserWarning, match="'fp16' -> 'bf16'"):
        _, rec = fit(schedule, MPPlugin("fp32", init_scale=256.0), 9, model=TinyRegressor(poison_loss=(1,)))
    assert rec.modes == ["fp16", "fp16", "bf16", "bf16", "bf16", "bf16", "fp32", "bf16", "bf16"]
    assert "abandoned" in schedule.history[-1]["reason"]


def test_resume_continues_in_the_saved_mode(tmp_path):
    plan = {0: "fp32", 3: "bf16"}
    trainer, _ = fit(PrecisionSchedule(plan), MPPlugin("fp32"), 5, model=TinyRegressor(batches_by_index=True))
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"]["PrecisionSchedule"]
    assert state["mode"] == "bf16" and state["history"][-1]["to"] == "bf16"

    resumed = PrecisionSchedule(plan)
    plugin = MPPlugin("fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, rec = fit(resumed, plugin, 8, model=TinyRegressor(batches_by_index=True), ckpt_path=path)
    # MPPlugin warns when a checkpoint's mode differs from its own: the schedule switched it first
    assert not [w for w in caught if "was written with precision" in str(w.message)]
    assert rec.modes == ["bf16"] * 3 and rec.dtypes == [torch.bfloat16] * 3
    assert resumed.history == state["history"] and trainer.precision == "bf16-mixed"


def test_resume_after_a_fallback_keeps_the_fallback(tmp_path):
    kwargs = dict(fallback={"fp16": "bf16"}, max_skips=1, window=4)
    with pytest.warns(UserWarning, match="'fp16' -> 'bf16'"):
        plugin = MPPlugin("fp32", init_scale=256.0)
        trainer, _ = fit(PrecisionSchedule({0: "fp16"}, **kwargs), plugin, 4, model=TinyRegressor(poison_loss=(1,)))
    path = tmp_path / "fallback.ckpt"
    trainer.save_checkpoint(path)
    resumed = PrecisionSchedule({0: "fp16"}, **kwargs)
    plugin = MPPlugin("fp16", init_scale=512.0)
    _, rec = fit(resumed, plugin, 6, model=TinyRegressor(), ckpt_path=path)
    assert rec.modes == ["bf16", "bf16"] and resumed.abandoned == {"fp16"}
    assert plugin.stats.skipped_steps == 1  # MPPlugin's counters came back too


class SwitchAt(Callback):
    """The user's own switch: ``MPPlugin.set_precision`` after a chosen optimizer step."""

    def __init__(self, step, mode):
        self.step, self.mode = step, mode

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.precision_plugin.set_precision(self.mode)


@pytest.mark.parametrize("user_first", [True, False], ids=["user-switch-first", "schedule-first"])
def test_skips_before_the_users_own_switch_do_not_count_against_the_new_mode(user_first):
    # fp16 skips step 2 (batch 1); the user switches to bf16 after step 3; bf16 skips step 6 (batch 5): one skip
    # of bf16 within the window, not two, so bf16 stays (as in a run that started in bf16 and skipped once)
    schedule = PrecisionSchedule(fallback={"fp16": "bf16", "bf16": "fp32"}, max_skips=2, window=10)
    user = SwitchAt(3, "bf16")
    recorder = ModeRecorder()
    callbacks = [user, schedule, recorder] if user_first else [schedule, user, recorder]
    plugin = MPPlugin("fp16", init_scale=256.0)
    make_trainer(plugin, max_steps=8, callbacks=callbacks).fit(TinyRegressor(poison_loss=(1, 5)))
    assert recorder.modes == ["fp16"] * 3 + ["bf16"] * 5
    assert schedule.history == [] and schedule.abandoned == set() and schedule.mode == "bf16"
    assert plugin.stats.skipped_steps == 2


def test_a_second_fit_with_another_plugin_runs_the_schedule_afresh():
    plan = dict(schedule={0: "fp32", 3: "fp16"}, fallback={"fp16": "bf16"}, max_skips=2, window=10)
    reused = PrecisionSchedule(**plan)
    fit(reused, MPPlugin("fp32", init_scale=256.0), 5, model=TinyRegressor(poison_loss=(4,)))  # fp16 skips once
    assert reused.mode == "fp16" and len(reused._skips) == 1

    # a new Trainer with another plugin, from step 0: the same as a schedule that never ran before
    _, rec = fit(reused, MPPlugin("bf16", init_scale=256.0), 6, model=TinyRegressor(poison_loss=(4,)))
    fresh = PrecisionSchedule(**plan)
    _, oracle = fit(fresh, MPPlugin("bf16", init_scale=256.0), 6, model=TinyRegressor(poison_loss=(4,)))
    assert oracle.modes == ["fp32"] * 3 + ["fp16"] * 3 and oracle.dtypes == [torch.float32] * 3 + [torch.float16] * 3
    assert (rec.modes, rec.dtypes) == (oracle.modes, oracle.dtypes)
    assert reused.state_dict() == fresh.state_dict()


def test_requires_mpplugin():
    trainer = make_trainer(None, max_steps=2, callbacks=[PrecisionSchedule({0: "fp32"})], precision="bf16-mixed")
    with pytest.raises(MisconfigurationException, match="switches precision through MPPlugin.*MixedPrecision"):
        trainer.fit(TinyRegressor())


def test_arguments_are_validated():
    # fp8 is a known name: a fallback from it can be given, whether or not this machine runs it
    pickle.dumps(PrecisionSchedule({0: "fp32"}, fallback={"fp8": "bf16"}))
    for kwargs, fragment in [
        ({"schedule": {0: "fp17"}}, r"schedule\[0\]='fp17': Unknown precision 'fp17'. Accepted values: 'fp32'"),
        ({"schedule": {-1: "bf16"}}, "schedule key -1 is invalid"),
        ({"schedule": {True: "bf16"}}, "schedule key True is invalid"),
        ({"schedule": [0, "bf16"]}, "schedule=\\[0, 'bf16'\\] is invalid"),
        ({"fallback": {"fp16": "fp16"}}, "falls back to the same mode"),
        ({"fallback": {"half": "bf16"}}, "fallback key 'half': Unknown precision 'half'"),
        ({"schedule": {0: "bf16"}, "interval": "batch"}, "interval='batch' is invalid"),
        ({"fallback": {"fp16": "bf16"}, "max_skips": 5, "window": 4}, "max_skips=5 is larger than window=4"),
        ({"fallback": {"fp16": "bf16"}, "max_skips": 0}, "max_skips=0 is invalid"),
        ({}, "needs a schedule"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            PrecisionSchedule(**kwargs)


def test_all_three_callbacks_from_a_lightning_cli_yaml(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 4,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}},
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "plugins": [{"class_path": "lightning_mp.MPPlugin", "init_args": {"precision": "fp32"}}],
            "callbacks": [
                {
                    "class_path": "lightning_mp.callbacks.PrecisionSchedule",
                    "init_args": {"schedule": {0: "fp32", 2: "bf16"}, "fallback": {"fp16": "bf16"}, "window": 50},
                },
                {
                    "class_path": "lightning_mp.callbacks.PrecisionMonitor",
                    "init_args": {"log_every_n_steps": 2, "layer_stats": True, "layers": "net1"},
                },
                {
                    "class_path": "lightning_mp.callbacks.NonFiniteDetector",
                    "init_args": {"action": "warn", "check_every_n_steps": 10, "track_inputs": True},
                },
            ],
        },
    }
    path = tmp_path / "callbacks.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(TinyRegressor, args=["fit", "--config", str(path)], save_config_callback=None)
    schedule, monitor, detector = (
        next(c for c in cli.trainer.callbacks if isinstance(c, kind))
        for kind in (PrecisionSchedule, PrecisionMonitor, NonFiniteDetector)
    )
    assert schedule.schedule == {0: "fp32", 2: "bf16"} and schedule.mode == "bf16"
    assert monitor.layers == "net1" and "precision/act_absmax/net1" in monitor.last
    assert (detector.action, detector.check_every_n_steps, detector.track_inputs) == ("warn", 10, True)
