"""Copies of the module taken during ``fit`` are plain modules after it; guards the user applied stay.

Weight-averaging callbacks (``copy.deepcopy(pl_module)``: Lightning's ``WeightAveraging``, ``EMAWeightAveraging``,
``StochasticWeightAveraging``) and checkpointing code (``torch.save(pl_module)``) copy the module while the plugin's
FP32 guards are on it. With a model holding a LayerNorm, a BatchNorm, a softmax and a loss module (the defaults
guard all four), in every mode, after ``fit``:

* a copy taken mid-fit (deep-copied; pickled and loaded after the fit; pickled and loaded during it) carries no
  guard, and its forward is bit-identical to that of a plain module holding the same tensors (under the autocast the
  run used);
* a second ``fit`` with such a copy as the model trains and leaves it plain;
* guards the user applied before ``fit`` are still there on the module and on its copies, which compute as a plain
  copy with the same user guards;
* the run's optimizer loads a state dict as torch's does (the state cast to each parameter's dtype).
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp.guards import FP32Guard, apply_fp32_guards, fp32_guard_of

from .conftest import OPT_MODES, opt_assert_nested_equal, opt_plugin, opt_trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers", "ignore:The number of training batches")

CF_BATCHES, CF_BATCH_SIZE, CF_CLASSES = 4, 8, 3
CF_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the modes that run forward under CPU autocast
CF_DEFAULT_GUARDED = ("norm", "bn", "soft", "loss")


class CfModel(LightningModule):
    """Linear, LayerNorm, BatchNorm, Linear; a Softmax and a CrossEntropyLoss module in the loss; SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.bn, self.out = nn.Linear(4, 8), nn.LayerNorm(8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.soft, self.loss = nn.Softmax(dim=-1), nn.CrossEntropyLoss()
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(CF_BATCHES * CF_BATCH_SIZE, 4, generator=g)
        self.y = torch.randint(0, CF_CLASSES, (CF_BATCHES * CF_BATCH_SIZE,), generator=g)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.norm(self.inp(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return self.loss(logits, y) + self.soft(logits).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=CF_BATCH_SIZE)


def cf_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def cf_loaded(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class CfCopies(Callback):
    """At the end of the second batch: a deep copy, the pickled bytes, and a pickle round-trip made there."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != 1:
            return
        assert fp32_guard_of(pl_module.bn) is not None  # the run's guards are on the module (and copied with it)
        self.deep = copy.deepcopy(pl_module)
        self.data = cf_saved(pl_module)
        self.round_trip = cf_loaded(self.data)
        assert fp32_guard_of(self.deep.bn) is not None and fp32_guard_of(self.round_trip.bn) is not None

    def copies(self) -> dict[str, CfModel]:
        return {"deepcopy": self.deep, "pickled": cf_loaded(self.data), "round trip": self.round_trip}


def cf_fit(mode: str, model: CfModel, callbacks=(), max_steps: int = 3):
    trainer = opt_trainer(opt_plugin(mode), max_steps, callbacks)
    trainer.fit(model)
    return trainer


def cf_forward(mode: str, module: CfModel, train: bool) -> tuple[torch.Tensor, ...]:
    """Logits, softmax and loss of a fixed batch, under the autocast the run's forward used (none in fp32 and the
    true-half modes), in train mode (with autograd; BatchNorm updates its statistics) or eval mode."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(CF_BATCH_SIZE, 4, generator=g).to(module.inp.weight.dtype)
    y = torch.randint(0, CF_CLASSES, (CF_BATCH_SIZE,), generator=g)
    dtype = CF_AUTOCAST.get(mode)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    module.train(train)
    with autocast, torch.set_grad_enabled(train):
        logits = module(x)
        out = (logits, module.soft(logits), module.loss(logits, y))
    return tuple(t.detach() for t in out)


def cf_plain_twin(pristine: CfModel, module: CfModel) -> CfModel:
    """A copy of the module as made before fit (plain, or with the user's guards), holding copies of ``module``'s
    tensors in their dtypes."""
    twin = copy.deepcopy(pristine)
    twin.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)
    return twin


def cf_assert_computes_as(mode: str, module: CfModel, twin: CfModel, where: str) -> None:
    for train in (False, True):
        opt_assert_nested_equal(cf_forward(mode, module, train), cf_forward(mode, twin, train), f"{where} {train=}")
    opt_assert_nested_equal(module.state_dict(), twin.state_dict(), f"{where} buffers")  # BatchNorm's statistics


def cf_guarded(module: nn.Module) -> list[str]:
    return [name for name, sub in module.named_modules() if fp32_guard_of(sub) is not None]


def cf_assert_plain(module: nn.Module, where: str, user: tuple[str, ...] = ()) -> None:
    """No guard but the user's; no hook, no instance ``forward`` left of the run's."""
    assert cf_guarded(module) == list(user), where
    for name, sub in module.named_modules():
        if name not in user:
            assert not sub._forward_pre_hooks and not sub._forward_hooks, f"{where}: hooks on {name!r}"
            assert "forward" not in vars(sub), f"{where}: forward on {name!r}"
            assert not any(isinstance(v, FP32Guard) for v in vars(sub).values()), f"{where}: a guard on {name!r}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", OPT_MODES)
def test_copies_mid_fit_are_plain_after_fit(mode):
    model, copies = CfModel(), CfCopies()
    pristine = copy.deepcopy(model)
    cf_fit(mode, model, [copies])
    cf_assert_plain(model, "the module")
    for how, duplicate in copies.copies().items():
        cf_assert_computes_as(mode, duplicate, cf_plain_twin(pristine, duplicate), how)
        assert cf_guarded(duplicate) == [], how  # (what is left of the run's guards is inert, gone at the next run)


@pytest.mark.slow
@pytest.mark.parametrize("mode", OPT_MODES)
def test_a_copy_mid_fit_trains_and_is_left_plain(mode):
    model, copies = CfModel(), CfCopies()
    cf_fit(mode, model, [copies])
    for how, duplicate in copies.copies().items():
        before = {k: v.clone() for k, v in duplicate.state_dict().items()}
        again = cf_fit(mode, duplicate, max_steps=2)
        assert again.global_step == 2, how
        after = duplicate.state_dict()
        assert not torch.equal(before["inp.weight"].float(), after["inp.weight"].float()), how
        assert all(torch.isfinite(t).all() for t in after.values() if t.is_floating_point()), how
        cf_assert_plain(duplicate, how)


@pytest.mark.slow
@pytest.mark.parametrize("mode", OPT_MODES)
def test_user_guards_stay_on_the_module_and_its_copies(mode):
    """The user guards the LayerNorm and the last Linear; the run guards the rest (BatchNorm, softmax, loss)."""
    user = ("norm", "out")
    model, copies = CfModel(), CfCopies()
    assert apply_fp32_guards(model, list(user)) == list(user)
    pristine = copy.deepcopy(model)
    cf_fit(mode, model, [copies])
    cf_assert_plain(model, "the module", user)
    for how, duplicate in copies.copies().items():
        assert cf_guarded(duplicate) == list(user), how
        cf_assert_computes_as(mode, duplicate, cf_plain_twin(pristine, duplicate), how)
        cf_fit(mode, duplicate, max_steps=2)
        cf_assert_plain(duplicate, f"{how}, fitted", user)


@pytest.mark.slow
@pytest.mark.parametrize("mode", OPT_MODES)
def test_the_runs_optimizer_loads_state_as_torch_after_fit(mode):
    model = CfModel()
    trainer = cf_fit(mode, model)
    optimizer = trainer.optimizers[0]
    state = copy.deepcopy(optimizer.state_dict())
    reference = copy.deepcopy(optimizer)  # torch's: hooks are not copied; parameters of the same dtypes
    optimizer.load_state_dict(state)
    reference.load_state_dict(state)
    opt_assert_nested_equal(optimizer.state_dict(), reference.state_dict(), mode)
