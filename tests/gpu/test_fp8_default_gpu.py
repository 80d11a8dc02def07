"""MPPlugin("fp8")'s default layout on a GPU with Transformer Engine: the FP8 layers keep fp32 weights (the optimizer
steps them: their own masters), every other weight is bf16 with an fp32 master in the step, and activations are bf16,
as under Lightning's Transformer Engine plugin.

Run on the GPU machine: ``source .te/te_install.sh && PYTHONPATH=.:tests python -m pytest -q -m gpu <this file>``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from gpu.test_fp8_te import LitGPT, bigram_batches, make_fp8_plugin, te_linears, trainer_for
from gpu.test_fp8_te import pytestmark as _te_marks
from lightning_mp.master import FP32MasterWeights

pytestmark = _te_marks
SIZE = dict(vocab=512, hidden=256, layers=2, heads=4, seq=128)


def _fit(plugin, steps, batches, callbacks=(), module=None, **kwargs):
    seed_everything(0)
    module = module if module is not None else LitGPT(batches, lr=3e-3, warmup=1, **SIZE)
    trainer = trainer_for(plugin, steps, callbacks=callbacks, **kwargs)
    trainer.fit(module)
    return module, trainer


def test_the_default_keeps_fp32_fp8_layers_bf16_others_with_fp32_masters_and_bf16_activations():
    batches = bigram_batches(30, 8, SIZE["seq"], SIZE["vocab"])
    seed_everything(0)
    module = LitGPT(batches, lr=3e-3, warmup=1, **SIZE)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    plugin = make_fp8_plugin({"size_rule": "off"})
    outputs: set = set()

    class Dtypes(Callback):
        def on_train_start(self, trainer, pl_module):
            for layer in te_linears(pl_module).values():
                layer.register_forward_hook(lambda mod, args, out: outputs.add(out.dtype))

    _, trainer = _fit(plugin, 30, batches, module=module, callbacks=[Dtypes()])
    assert plugin.master_weights == "fp32" and isinstance(plugin.masters, FP32MasterWeights)
    assert te_linears(module) and all(m.weight.dtype == torch.float32 for m in te_linears(module).values())
    assert all(masters_none for masters_none in (plugin.masters.master_of(m.weight) is None
                                                 for m in te_linears(module).values()))
    assert module.model.tok.weight.dtype == torch.bfloat16  # the residual stream starts bf16
    assert outputs == {torch.bfloat16}  # and stays bf16 through the FP8 layers
    losses = [float(x) for x in module.losses]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    # the optimizer steps fp32 masters whose bf16 rounding is the model's weight
    masters = plugin.masters
    for name, param in module.named_parameters():
        if param.dtype == torch.bfloat16:
            master = masters.master_of(param)
            assert master is not None and master.dtype == torch.float32, name
            assert torch.equal(master.to(torch.bfloat16), param.detach()), name
    assert set(before) == {n for n, _ in module.named_parameters()}  # (the swap renames nothing)
    assert trainer.optimizers[0].state  # Adam state exists: the steps ran


def test_master_weights_none_trains_bf16_weights_alone_and_fp32_weights_stay_an_option():
    batches = bigram_batches(6, 8, SIZE["seq"], SIZE["vocab"])
    plugin = make_fp8_plugin({"size_rule": "off"}, master_weights="none")
    module, _ = _fit(plugin, 6, batches)
    assert plugin.masters is None and plugin.master_weights == "none"
    assert all(m.weight.dtype == torch.bfloat16 for m in te_linears(module).values())
    plugin = make_fp8_plugin({"size_rule": "off", "weights": "fp32"})
    module, _ = _fit(plugin, 6, batches)
    assert plugin.masters is None and plugin.master_weights is None
    assert all(m.weight.dtype == torch.float32 for m in te_linears(module).values())


class _PoisonedGPT(LitGPT):
    """The loss times inf at one batch: its gradients are inf/NaN (saturated into finite values where they pass an
    FP8 cast, which the plugin's saturation check sees)."""

    poison_at = -1

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == self.poison_at else loss


class _Poison(Callback):
    """Parameters, masters and optimizer state after the poisoned batch equal those before it."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.snapshot = None
        self.checked = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            masters = trainer.precision_plugin.masters
            self.snapshot = (
                {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                {n: masters.master_of(p).clone() for n, p in pl_module.named_parameters()
                 if masters is not None and masters.master_of(p) is not None},
                copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != self.at:
            return
        params, masters, state = self.snapshot
        for n, p in pl_module.named_parameters():
            assert torch.equal(p.detach(), params[n]), n
        plugin_masters = trainer.precision_plugin.masters
        for n, p in pl_module.named_parameters():
            if n in masters:
                assert torch.equal(plugin_masters.master_of(p), masters[n]), n
        after = trainer.optimizers[0].state_dict()["state"]
        for key, entry in state.items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(after[key][k]), torch.as_tensor(v)), (key, k)
        self.checked = True


def test_a_poisoned_step_changes_nothing_with_the_default():
    batches = bigram_batches(8, 8, SIZE["seq"], SIZE["vocab"])
    plugin = make_fp8_plugin({"size_rule": "off"})
    poison = _Poison(at=4)
    seed_everything(0)
    module = _PoisonedGPT(batches, lr=3e-3, warmup=1, **SIZE)
    module.poison_at = 4
    _fit(plugin, 8, batches, callbacks=[poison], module=module)
    assert plugin.stats.skipped_steps == 1 and poison.checked and len(poison.snapshot[1]) > 0


def test_resume_with_the_default_matches_the_uninterrupted_run(tmp_path):
    batches = bigram_batches(12, 8, SIZE["seq"], SIZE["vocab"])
    whole, _ = _fit(make_fp8_plugin({"size_rule": "off"}), 12, batches)
    first, trainer = _fit(make_fp8_plugin({"size_rule": "off"}), 6, batches)
    ckpt = str(tmp_path / "half.ckpt")
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert "master_weights" in saved["MPPlugin"] or any("master" in k for k in saved["MPPlugin"])
    seed_everything(0)
    rest = LitGPT(batches, lr=3e-3, warmup=1, **SIZE)
    trainer = trainer_for(make_fp8_plugin({"size_rule": "off"}), 12)
    trainer.fit(rest, ckpt_path=ckpt)
    for (name, a), b in zip(whole.named_parameters(), rest.parameters()):
        assert torch.equal(a, b), name


def test_sharded_strategies_keep_fp32_shards_refused_master_kinds():
    from lightning.pytorch.strategies import FSDPStrategy
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises((MisconfigurationException, ValueError), match="fp32 shards are the master weights"):
        trainer = trainer_for(make_fp8_plugin({}, master_weights="kahan"), 1, strategy=FSDPStrategy())
        trainer.fit(LitGPT(bigram_batches(1, 2, 16, 64), vocab=64, hidden=64, layers=1, heads=2, seq=16))
