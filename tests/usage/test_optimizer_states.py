"""User-side tests of ``optimizer_states="bf16"``: Adam's moments held in bf16 between steps.

Through the real Trainer and Fabric, on tiny models and a few steps: the moments a user reads from the optimizer
(during training, in checkpoints) are bf16, training goes as with fp32 moments, a skipped step changes nothing in
every mode, checkpoints resume exactly and convert between dtypes, and what cannot be held is refused before training.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from conftest import TinyRegressor, make_data, make_trainer
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp import MPFabricPrecision, MPPlugin

MOMENTS = ("exp_avg", "exp_avg_sq")
#: every mode the bf16 moments are held in, as (precision, master_weights)
HELD = [("fp32", None), ("bf16", None), ("fp16", None), ("bf16-true", "fp32"), ("bf16-true", "kahan"),
        ("bf16-true", "stochastic"), ("fp16-true", "fp32")]  # fmt: skip


def plugin(precision: str, master_weights=None, **kwargs) -> MPPlugin:
    if precision.startswith("fp16"):
        kwargs.setdefault("init_scale", 2.0**8)
    return MPPlugin(precision, master_weights=master_weights, optimizer_states="bf16", **kwargs)


class StateEachBatch(Callback):
    """The optimizers' state after every training batch (what ``optimizer.state_dict()`` shows the user)."""

    def __init__(self) -> None:
        self.states: list[list[dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states.append([copy.deepcopy(opt.state_dict()["state"]) for opt in trainer.optimizers])


def assert_bit_equal(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a.dtype} vs {b.dtype}, or values differ"
    else:
        assert a == b, where


def moment_dtypes(state: dict) -> set:
    return {entry[key].dtype for entry in state.values() for key in MOMENTS}


# ================================================================================================================
# the moments are bf16, training goes on, and a skipped step changes nothing
# ================================================================================================================
@pytest.mark.parametrize(("precision", "master_weights"), HELD)
def test_moments_are_bf16_and_a_skipped_step_changes_nothing(precision, master_weights):
    model = TinyRegressor(optimizer="adam", poison_grad=(3,))
    seen = StateEachBatch()
    p = plugin(precision, master_weights)
    make_trainer(p, max_steps=8, callbacks=[seen]).fit(model)

    assert all(moment_dtypes(states[0]) == {torch.bfloat16} for states in seen.states)
    assert p.optimizer_states == "bf16" and p.stats.skipped_steps == 1
    assert_bit_equal(seen.states[3], seen.states[2], "the state after the skipped batch 3")  # step counts too
    assert int(seen.states[-1][0][0]["step"]) == 7
    assert model.losses[-1] < 0.5 * model.losses[0]


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw_foreach"])
def test_the_users_implementation_is_kept(optimizer):
    model = TinyRegressor(optimizer=optimizer, poison_loss=(2,))
    seen = StateEachBatch()
    make_trainer(plugin("bf16-true"), max_steps=6, callbacks=[seen]).fit(model)
    opt = model.trainer.optimizers[0]
    assert opt.param_groups[0]["fused" if optimizer == "adamw_fused" else "foreach"] is True
    assert moment_dtypes(seen.states[-1][0]) == {torch.bfloat16}
    assert_bit_equal(seen.states[2], seen.states[1])
    assert model.losses[-1] < model.losses[0]


def test_training_follows_fp32_moments_closely():
    """The same run with fp32 and with bf16 moments: the losses agree to within bf16's rounding."""
    losses = {}
    for states in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = TinyRegressor(optimizer="adam")
        make_trainer(MPPlugin("bf16", optimizer_states=states), max_steps=16).fit(model)
        losses[states] = model.losses
    assert losses["bf16"][-1] < 0.3 * losses["bf16"][0]
    for fp32, bf16 in zip(losses["fp32"], losses["bf16"]):
        assert bf16 == pytest.approx(fp32, rel=0.05)


def test_after_fit_the_optimizer_is_plain_again():
    model = TinyRegressor(optimizer="adam")
    trainer = make_trainer(plugin("bf16"), max_steps=3)
    trainer.fit(model)
    opt = trainer.optimizers[0]
    assert moment_dtypes(opt.state_dict()["state"]) == {torch.float32}  # as torch's Adam keeps them
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    model.net1.weight.grad = torch.ones_like(model.net1.weight)
    opt.step()  # a plain torch step, without the plugin


# ================================================================================================================
# accumulation, schedulers, manual optimization, several optimizers
# ================================================================================================================
def test_accumulation_steps_once_per_window_with_bf16_moments():
    model = TinyRegressor(optimizer="adam")
    seen = StateEachBatch()
    make_trainer(plugin("bf16-true"), max_steps=3, callbacks=[seen], accumulate_grad_batches=2).fit(model)
    steps = [int(states[0][0]["step"]) if states[0] else 0 for states in seen.states]
    assert steps == [0, 1, 1, 2, 2, 3]
    assert moment_dtypes(seen.states[-1][0]) == {torch.bfloat16}


def test_a_scheduler_is_held_after_a_skipped_step_and_torch_sees_its_optimizer_step(recwarn):
    model = TinyRegressor(optimizer="adam", scheduler=True, poison_grad=(1,))
    trainer = make_trainer(plugin("bf16"), max_steps=4)
    trainer.fit(model)
    # 4 batches, one skipped: StepLR(gamma=0.5) stepped 3 times, and never before its optimizer's step
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_manual_optimization_with_bf16_moments():
    model = TinyRegressor(optimizer="adam", manual=True, poison_grad=(2,))
    seen = StateEachBatch()
    p = plugin("bf16-true")
    make_trainer(p, max_steps=5, callbacks=[seen]).fit(model)
    assert moment_dtypes(seen.states[-1][0]) == {torch.bfloat16}
    assert_bit_equal(seen.states[2], seen.states[1])
    assert p.stats.skipped_steps == 1 and model.losses[-1] < model.losses[0]


class TwoOptimizers(LightningModule):
    """Two Adams over two layers, stepped by hand in one training_step."""

    def __init__(self, second: str = "adam") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 1)
        self.second = second
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.b(torch.relu(self.a(x))).float(), y.float())
        self.losses.append(float(loss.detach()))
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()

    def configure_optimizers(self):
        second = (torch.optim.AdamW(self.b.parameters(), lr=0.03) if self.second == "adam"
                  else torch.optim.SGD(self.b.parameters(), lr=0.01, momentum=0.9))  # fmt: skip
        return torch.optim.Adam(self.a.parameters(), lr=0.03), second

    def train_dataloader(self):
        return DataLoader(make_data(32), batch_size=8)


def test_several_optimizers_each_hold_bf16_moments():
    model = TwoOptimizers()
    seen = StateEachBatch()
    make_trainer(plugin("bf16-true"), max_steps=24, callbacks=[seen]).fit(model)  # (max_steps counts both)
    assert all(moment_dtypes(state) == {torch.bfloat16} for state in seen.states[-1])
    assert model.losses[8] < 0.8 * model.losses[0]  # the same batch, two epochs later


# ================================================================================================================
# checkpoints
# ================================================================================================================
def _fit(p, steps, model, ckpt_path=None):
    trainer = make_trainer(p, max_steps=steps)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(("precision", "master_weights"), [("bf16", None), ("bf16-true", "stochastic")])
def test_resume_matches_an_uninterrupted_run(tmp_path, precision, master_weights):
    poison = {"poison_loss": (2, 9), "batches_by_index": True}
    torch.manual_seed(0)
    init = TinyRegressor().state_dict()
    whole = TinyRegressor(optimizer="adam", **poison)
    whole.load_state_dict(init)
    _fit(plugin(precision, master_weights), 12, whole)

    first = TinyRegressor(optimizer="adam", **poison)
    first.load_state_dict(init)
    path = tmp_path / "mid.ckpt"
    _fit(plugin(precision, master_weights), 6, first).save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # plain tensors
    assert moment_dtypes(checkpoint["optimizer_states"][0]["state"]) == {torch.bfloat16}
    assert checkpoint["MPPlugin"]["optimizer_states"]["dtype"] == "bf16"

    second = TinyRegressor(optimizer="adam", **poison)
    _fit(plugin(precision, master_weights), 12, second, ckpt_path=path)
    for a, b in zip(whole.parameters(), second.parameters()):
        assert torch.equal(a, b)  # the rounding noise resumes where it was


@pytest.mark.parametrize(("saved", "resumed"), [("fp32", "bf16"), ("bf16", "fp32")])
def test_resume_with_another_state_dtype_converts_with_one_line(tmp_path, caplog, saved, resumed):
    path = tmp_path / "a.ckpt"
    _fit(MPPlugin("bf16-true", optimizer_states=saved), 3, TinyRegressor(optimizer="adam")).save_checkpoint(path)
    seen = StateEachBatch()
    with caplog.at_level(logging.INFO):
        trainer = make_trainer(MPPlugin("bf16-true", optimizer_states=resumed), max_steps=5, callbacks=[seen])
        trainer.fit(TinyRegressor(optimizer="adam"), ckpt_path=path)
    lines = [r.getMessage() for r in caplog.records if "optimizer moments are" in r.getMessage()]
    assert lines == [
        f"MPPlugin: the checkpoint's optimizer moments are {saved}, training resumes with"
        f" optimizer_states={resumed!r}: converted as the optimizer state loads"
        + (" (exactly)." if resumed == "fp32" else " (rounded to nearest once).")
    ]
    expected = torch.bfloat16 if resumed == "bf16" else torch.float32
    assert moment_dtypes(seen.states[0][0]) == {expected} and int(seen.states[0][0][0]["step"]) == 4


# ================================================================================================================
# what cannot be held is refused before training
# ================================================================================================================
@pytest.mark.parametrize(
    ("value", "match"),
    [("fp8", r"optimizer_states='fp8' is invalid.*'fp32'.*'bf16'.*8-bit moments are not offered.*AdamW8bit"),
     ("fp16", r"optimizer_states='fp16' is invalid.*underflows"),
     ("int4", r"optimizer_states='int4' is invalid"),
     (True, r"optimizer_states=True is invalid")],
)  # fmt: skip
def test_a_bad_value_is_refused_with_the_accepted_ones(value, match):
    with pytest.raises(ValueError, match=match):
        MPPlugin("bf16", optimizer_states=value)


@pytest.mark.parametrize("master_weights", ["none", "optimizer"])
def test_master_weights_that_leave_the_moments_to_the_optimizer_are_refused(master_weights):
    with pytest.raises(ValueError, match=rf"optimizer_states='bf16'.*master_weights='{master_weights}'"):
        MPPlugin("bf16-true", master_weights=master_weights, optimizer_states="bf16")


class OtherOptimizer(TinyRegressor):
    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        return self.make(self.parameters())


@pytest.mark.parametrize(
    ("make", "name"),
    [(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "SGD, which keeps its momentum buffer"),
     (lambda p: torch.optim.LBFGS(p), "LBFGS, which keeps its own kind of state"),
     (lambda p: torch.optim.Adagrad(p), "Adagrad"),
     (lambda p: torch.optim.Adam(p, differentiable=True), r"Adam\(differentiable=True\)")],
)  # fmt: skip
def test_an_optimizer_it_cannot_hold_is_refused_before_training(make, name):
    model = OtherOptimizer(make)
    with pytest.raises(MisconfigurationException, match=rf"MPPlugin\(optimizer_states='bf16'\).*{name}"):
        make_trainer(plugin("bf16"), max_steps=2).fit(model)
    assert model.losses == []  # nothing trained


def test_an_optimizer_beside_an_adam_is_refused_too():
    with pytest.raises(MisconfigurationException, match=r"SGD, which keeps its momentum buffer"):
        make_trainer(plugin("bf16"), max_steps=2).fit(TwoOptimizers(second="sgd"))


# ================================================================================================================
# Fabric
# ================================================================================================================
def test_fabric_loop_holds_bf16_moments_skips_and_checkpoints(tmp_path):
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    precision = MPFabricPrecision("bf16-true", optimizer_states="bf16")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = make_data(32).tensors
    losses, states = [], []
    for step in range(8):
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss * (math.inf if step == 3 else 1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        states.append(copy.deepcopy(optimizer.state_dict()["state"]))
    assert moment_dtypes(states[-1]) == {torch.bfloat16}
    assert_bit_equal(states[3], states[2])
    assert precision.stats.skipped_steps == 1 and losses[-1] < 0.5 * losses[0]

    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": optimizer, "precision": precision})
    saved = torch.load(tmp_path / "f.ckpt", weights_only=True)
    assert moment_dtypes(saved["optimizer"]["state"]) == {torch.bfloat16}
    assert saved["precision"]["optimizer_states"]["dtype"] == "bf16"
    precision.teardown()


def test_the_plugin_and_the_optimizer_pickle_and_copy_mid_fit():
    import pickle

    copies = []

    class CopyMidFit(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                copies.append(pickle.loads(pickle.dumps(trainer.precision_plugin)))
                copies.append(copy.deepcopy(trainer.precision_plugin))
                copies.append(copy.deepcopy(trainer.optimizers[0]))

    make_trainer(plugin("bf16-true"), max_steps=3, callbacks=[CopyMidFit()]).fit(TinyRegressor(optimizer="adam"))
    assert [c.optimizer_states for c in copies[:2]] == ["bf16", "bf16"]
    assert moment_dtypes(copies[2].state_dict()["state"]) == {torch.bfloat16}  # (see the docs: load it to step it)
    model = TinyRegressor(optimizer="adam")
    make_trainer(copies[0], max_steps=2).fit(model)  # a copy trains a new run
    assert model.losses[-1] < model.losses[0]
