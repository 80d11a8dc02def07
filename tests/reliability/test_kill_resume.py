"""A run killed at a random step and resumed from its last checkpoint ends bit-identical to an uninterrupted one."""

import random

import pytest
import torch
from conftest import TinyRegressor, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mp import MPPlugin

STEPS = 16
# overflows before and after any kill point, with hysteresis absorbing some of them
POISON = (1, 2, 6, 11, 12, 13)


class Crash(RuntimeError):
    pass


class KillAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Crash(f"killed at step {self.step}")


def make(init):
    model = TinyRegressor(optimizer="adam", scheduler=True, poison_loss=POISON, batches_by_index=True, n=64)
    model.load_state_dict(init)
    return model


def plugin():
    return MPPlugin("fp16", init_scale=2.0**8, hysteresis=2, growth_interval=3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_and_resume_is_bit_identical(tmp_path, seed):
    kill_step = random.Random(seed).randrange(4, STEPS - 2)
    torch.manual_seed(0)
    init = TinyRegressor().state_dict()

    whole = make(init)
    whole_plugin = plugin()
    make_trainer(whole_plugin, max_steps=STEPS).fit(whole)

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=0)
    crashed = make(init)
    with pytest.raises(Crash):
        make_trainer(
            plugin(), max_steps=STEPS, callbacks=[ckpt, KillAt(kill_step)], enable_checkpointing=True
        ).fit(crashed)
    last = tmp_path / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == kill_step

    resumed = make(init)
    resumed_plugin = plugin()
    make_trainer(resumed_plugin, max_steps=STEPS).fit(resumed, ckpt_path=last)

    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{name} differs after a kill at step {kill_step}"
    assert resumed_plugin.stats.as_dict() == whole_plugin.stats.as_dict()
    assert whole_plugin.stats.skipped_steps == len(POISON)
    assert resumed.trainer.optimizers[0].param_groups[0]["lr"] == whole.trainer.optimizers[0].param_groups[0]["lr"]
