"""``master_weights="optimizer"``: true-half training with an optimizer that keeps its own fp32 masters.

Transformer Engine's ``FusedAdam(master_weights=True)`` reads the half gradients and writes fp32 masters and half
weights in one kernel. TE is not installed here: ``OwnMastersAdamW`` stands in with the same interface (a
``master_weights`` attribute, ``initialize_state``/``set_scaled_state``, a ``master_param`` state entry) and
plain AdamW arithmetic. The same behaviour runs with the real FusedAdam on the GPU machine:
tests/gpu/test_te_optimizer.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from conftest import TinyRegressor, make_trainer

from lightning_mp import MPPlugin


class OwnMastersAdamW(torch.optim.Optimizer):
    """Stand-in for TE's FusedAdam(master_weights=True, adam_w_mode=True): AdamW on fp32 masters in its state."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = True
        self.store_param_remainders = False

    def initialize_state(self, param, store_param_remainders):
        state = self.state[param]
        state["step"] = torch.zeros(())
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        state["master_param"] = param.detach().float().clone()

    def set_scaled_state(self, param, name, value):
        self.state[param][name] = value.detach().float().clone()

    def load_state_dict(self, state_dict):
        # as FusedAdam: torch's load casts the state to the parameters' dtype (bf16): set it again in fp32
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            if i in state_dict["state"]:
                self.state[p] = {
                    k: v.clone() if k == "step" else v.float().clone() for k, v in state_dict["state"][i].items()
                }

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self.initialize_state(p, False)
                g = p.grad.float()
                state["step"] += 1
                t = float(state["step"])
                state["exp_avg"].lerp_(g, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                master = state["master_param"]
                master.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                master.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1**t))
                p.copy_(master)
        return loss


class Regressor(TinyRegressor):
    def __init__(self, optimizer_cls=OwnMastersAdamW, **kwargs):
        super().__init__(**kwargs)
        self.optimizer_cls = optimizer_cls

    def configure_optimizers(self):
        if self.optimizer_cls is torch.optim.AdamW:
            return torch.optim.AdamW(self.parameters(), lr=self.lr * 0.2, weight_decay=0.01, foreach=False)
        return self.optimizer_cls(self.parameters(), lr=self.lr * 0.2)


def _masters(opt) -> dict:
    return {
        id(p): opt.state[p]["master_param"].clone() for g in opt.param_groups for p in g["params"] if opt.state.get(p)
    }


def test_an_optimizer_with_its_own_masters_is_used_as_they_are_and_learns():
    model = Regressor()
    plugin = MPPlugin("bf16-true")
    trainer = make_trainer(plugin, max_steps=24)
    trainer.fit(model)
    assert plugin.master_weights == "optimizer" and plugin.masters is None  # no second copy
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["params"][0] is model.net1.weight  # the optimizer steps the model's parameters
    assert model.net1.weight.dtype is torch.bfloat16
    for p in model.net1.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype is torch.float32 and torch.equal(p.detach(), master.to(torch.bfloat16))
    assert model.losses[-1] < 0.5 * model.losses[0]
    assert "master_weights" not in plugin.state_dict()


def test_the_optimizer_masters_start_from_the_exact_fp32_weights():
    model = Regressor(lr=0.0)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in initial.values())  # bf16 would round them
    trainer = make_trainer(MPPlugin("bf16-true"), max_steps=1)
    trainer.fit(model)
    opt = trainer.optimizers[0]
    for name, p in model.named_parameters():
        if p.dtype is torch.bfloat16:
            assert torch.equal(opt.state[p]["master_param"], initial[name]), name


def test_optimizer_masters_train_as_the_plugins_fp32_masters():
    """The same AdamW arithmetic on fp32 masters, once kept by the optimizer, once by the plugin."""
    runs = {}
    for kind, cls in (("optimizer", OwnMastersAdamW), ("fp32", torch.optim.AdamW)):
        torch.manual_seed(0)
        model = Regressor(optimizer_cls=cls)
        plugin = MPPlugin("bf16-true", master_weights=kind)
        make_trainer(plugin, max_steps=12).fit(model)
        runs[kind] = [p.detach().float() for p in model.parameters()]
    for a, b in zip(runs["optimizer"], runs["fp32"]):
        torch.testing.assert_close(a, b, rtol=0, atol=2 ** -8 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_a_skipped_step_leaves_the_optimizer_masters_alone(where):
    poisoned = 3
    model = Regressor(**{f"poison_{where}": (poisoned,)})
    plugin = MPPlugin("bf16-true")
    seen = {}

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == poisoned:
                opt = trainer.optimizers[0]
                seen["before"] = (_masters(opt), copy.deepcopy([p.detach() for p in pl_module.parameters()]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == poisoned:
                opt = trainer.optimizers[0]
                seen["after"] = (_masters(opt), [p.detach().clone() for p in pl_module.parameters()])
                seen["steps"] = {int(s["step"]) for s in opt.state.values()}

    trainer = make_trainer(plugin, max_steps=6, callbacks=[Watch()])
    trainer.fit(model)
    (m0, p0), (m1, p1) = seen["before"], seen["after"]
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert seen["steps"] == {poisoned}  # the optimizer's step counter did not move either
    assert plugin.stats.as_dict()["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters()) and math.isfinite(model.losses[-1])


def test_resume_restores_the_optimizer_masters(tmp_path):
    def run(max_steps, ckpt=None, save=False):
        torch.manual_seed(0)
        model = Regressor(batches_by_index=True)
        callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)] if save else []
        trainer = make_trainer(
            MPPlugin("bf16-true"), max_steps=max_steps, callbacks=callbacks, enable_checkpointing=save
        )
        trainer.fit(model, ckpt_path=ckpt)
        return model, trainer

    full, full_trainer = run(8)
    run(4, save=True)
    ckpt = str(tmp_path / "last.ckpt")
    state = torch.load(ckpt, weights_only=True)  # plain tensors: the masters sit in the optimizer state
    assert any("master_param" in s for s in state["optimizer_states"][0]["state"].values())
    resumed, resumed_trainer = run(8, ckpt=ckpt)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    full_m, resumed_m = _masters(full_trainer.optimizers[0]), _masters(resumed_trainer.optimizers[0])
    assert all(torch.equal(x, y) for x, y in zip(full_m.values(), resumed_m.values()))


def test_optimizer_masters_asked_for_without_such_an_optimizer_is_refused():
    model = Regressor(optimizer_cls=torch.optim.AdamW)
    with pytest.raises(
        MisconfigurationException,
        match=r"master_weights='optimizer'.*AdamW does not.*FusedAdam\(params, master_weights=True\)",
    ):
        make_trainer(MPPlugin("bf16-true", master_weights="optimizer"), max_steps=1).fit(model)


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_two_sets_of_masters_are_refused(kind):
    model = Regressor()
    with pytest.raises(
        MisconfigurationException, match=rf"master_weights='{kind}'.*two sets of masters.*master_weights='optimizer'"
    ):
        make_trainer(MPPlugin("bf16-true", master_weights=kind), max_steps=1).fit(model)


def test_an_optimizer_keeping_masters_of_fp32_weights_is_warned_about():
    model = Regressor()
    with pytest.warns(
        UserWarning, match=r"OwnMastersAdamW keeps fp32 master weights itself.*second fp32 copy.*precision='bf16-true'"
    ):
        make_trainer(MPPlugin("bf16"), max_steps=1).fit(model)
