"""``MPPlugin("bf16-true")`` with Transformer Engine's ``FusedAdam(master_weights=True)`` on a GPU.

The optimizer keeps the fp32 masters (``master_weights="optimizer"``, chosen by itself): the CPU tests
(tests/test_optimizer_masters.py) run the same checks with a stand-in; here the real FusedAdam runs. Skipped
without CUDA or Transformer Engine. Run on the GPU machine::

    source .te/te_install.sh && PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_te_optimizer.py
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("transformer_engine")

from conftest import TinyRegressor, make_trainer  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: E402

from lightning_mp import MPPlugin  # noqa: E402

pytestmark = [pytest.mark.gpu]


class Regressor(TinyRegressor):
    def __init__(self, te: bool = True, remainders: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.te, self.remainders = te, remainders

    def _loss(self, batch):
        x, y = batch  # (batches_by_index makes its batches on the CPU, in fp32)
        x = x.to(self.device, self.net1.weight.dtype)
        return super()._loss((x, y.to(self.device, torch.float32)))  # CUDA's mse_loss backward wants one dtype

    def configure_optimizers(self):
        lr = self.lr * 0.2
        if self.te:
            return FusedAdam(
                self.parameters(),
                lr=lr,
                weight_decay=0.01,
                master_weights=True,
                store_param_remainders=self.remainders,
            )
        return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01, fused=True)


def masters_of(opt) -> dict:
    return {
        i: opt.get_unscaled_state(p, "master_param").cpu().clone()
        for i, p in enumerate(opt.param_groups[0]["params"])
        if opt.state.get(p)
    }


def fit(model, max_steps, plugin=None, ckpt_path=None, **kwargs):
    plugin = plugin or MPPlugin("bf16-true")
    trainer = make_trainer(plugin, max_steps=max_steps, accelerator="gpu", **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return plugin, trainer


@pytest.mark.parametrize("remainders", [False, True])
def test_fused_adam_keeps_the_masters_and_learns(remainders):
    model = Regressor(remainders=remainders)
    plugin, trainer = fit(model, 24)
    assert plugin.master_weights == "optimizer" and plugin.masters is None
    opt = trainer.optimizers[0]
    for p in model.net1.parameters():
        master = opt.get_unscaled_state(p, "master_param")
        assert p.dtype is torch.bfloat16
        if remainders:
            assert master.dtype is torch.int16  # the master's low 16 bits; its high 16 are the bf16 weight
        else:
            assert master.dtype is torch.float32
            assert (p.float() - master).abs().max() <= master.abs().max() * 2**-8  # the bf16 weight: the master rounded
    assert model.losses[-1] < 0.5 * model.losses[0]


def test_fused_adam_masters_start_from_the_exact_fp32_weights():
    model = Regressor(lr=0.0)
    initial = [p.detach().clone() for p in model.parameters()]
    _, trainer = fit(model, 1)
    opt = trainer.optimizers[0]  # (Lightning's teardown moved model and optimizer state back to the CPU)
    for p, value in zip(model.parameters(), initial):
        if p.dtype is torch.bfloat16:
            assert torch.equal(opt.get_unscaled_state(p, "master_param").cpu(), value)


def test_fused_adam_trains_as_the_plugins_fp32_masters():
    runs = {}
    for te in (True, False):
        torch.manual_seed(0)
        model = Regressor(te=te)
        fit(model, 12, plugin=MPPlugin("bf16-true", master_weights="optimizer" if te else "fp32"))
        runs[te] = [p.detach().float() for p in model.parameters()]
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=2**-7 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_a_skipped_step_leaves_fused_adam_alone(where):
    poisoned = 3
    model = Regressor(**{f"poison_{where}": (poisoned,)})
    seen = {}

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == poisoned:
                seen["before"] = (
                    masters_of(trainer.optimizers[0]), [p.detach().clone() for p in pl_module.parameters()]
                )

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == poisoned:
                opt = trainer.optimizers[0]
                seen["after"] = (masters_of(opt), [p.detach().clone() for p in pl_module.parameters()])
                seen["step"] = opt.param_groups[0]["step"]

    plugin, _ = fit(model, 6, callbacks=[Watch()])
    (m0, p0), (m1, p1) = seen["before"], seen["after"]
    assert all(torch.equal(m0[k], m1[k]) for k in m0) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert seen["step"] == poisoned
    assert plugin.stats.as_dict()["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters()) and math.isfinite(model.losses[-1])


def test_resume_restores_fused_adam_masters(tmp_path):
    def run(max_steps, ckpt=None, save=False):
        torch.manual_seed(0)
        model = Regressor(batches_by_index=True)
        callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)] if save else []
        _, trainer = fit(model, max_steps, callbacks=callbacks, enable_checkpointing=save, ckpt_path=ckpt)
        return model, trainer

    full, full_trainer = run(8)
    run(4, save=True)
    resumed, resumed_trainer = run(8, ckpt=str(tmp_path / "last.ckpt"))
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    a, b = masters_of(full_trainer.optimizers[0]), masters_of(resumed_trainer.optimizers[0])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
