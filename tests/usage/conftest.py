"""Shared tiny models and helpers for the user-side tests in tests/usage/.

Several test files add to this module; each keeps its helpers under its own prefix (``opt_`` for
test_optimization.py). Add to it; do not remove others' helpers.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from conftest import make_trainer  # tests/conftest.py
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

# ---------------------------------------------------------------------------------------------------- opt_ helpers
#: every mode the optimization tests cover
OPT_MODES = ("fp32", "bf16", "fp16", "bf16-true", "fp16-true")
OPT_SCALING_MODES = ("fp16", "fp16-true")
OPT_TRUE_HALF_MODES = ("bf16-true", "fp16-true")


def opt_plugin(mode: str, **kwargs: Any):
    """MPPlugin(mode); fp16 modes start from a modest loss scale so that clean steps of the tiny models never
    overflow (an unexpected backoff would blur what a test asserts)."""
    from lightning_mp import MPPlugin

    if mode in OPT_SCALING_MODES:
        kwargs.setdefault("init_scale", 2.0**8)
    return MPPlugin(mode, **kwargs)


def opt_trainer(
    plugin=None, max_steps: int = 4, callbacks=(), precision: Optional[str] = None, **kwargs: Any
) -> Trainer:
    """A quiet CPU Trainer: either ``plugin`` (MPPlugin) or Lightning's own ``precision=`` (a reference run)."""
    if precision is not None:
        kwargs["precision"] = precision
    return make_trainer(plugin, max_steps=max_steps, callbacks=callbacks, **kwargs)


def opt_dataset(n: int = 32, features: int = 8, outputs: int = 1, seed: int = 0) -> TensorDataset:
    """A fixed regression set (inputs, targets), the same for every run with the same arguments."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, outputs, generator=g)
    y = x @ w + 0.1 * torch.randn(n, outputs, generator=g)
    return TensorDataset(x, y)


def opt_loader(dataset: TensorDataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)


def opt_params(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Detached copies of the parameters (their own dtype) whose names start with ``prefix``."""
    return {n: p.detach().clone() for n, p in module.named_parameters() if n.startswith(prefix)}


def opt_float(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in params.items()}


def opt_state(optimizer: Any) -> dict:
    """A deep copy of ``optimizer.state_dict()`` (a LightningOptimizer or a torch optimizer)."""
    return copy.deepcopy(optimizer.state_dict())


def opt_assert_nested_equal(a: Any, b: Any, where: str = "") -> None:
    """Bit-equality of nested dicts/lists/tensors (NaN compares equal to NaN at the same place)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            opt_assert_nested_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            opt_assert_nested_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        same = torch.equal(a, b) or (
            torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        )
        if not same:
            diff = (a.double() - b.double()).abs()
            raise AssertionError(
                f"{where}: not bit-equal ({int((diff != 0).sum())} of {a.numel()} elements differ,"
                f" max |diff| {diff.max().item():g})"
            )
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def opt_all_finite(params: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in params.values())


# ---------------------------------------------------------------------------------------------------------------
# master-weights usage tests (test_master_weights.py): helpers prefixed ``mw_``
# ---------------------------------------------------------------------------------------------------------------
from typing import Any as _MwAny, Optional as _MwOptional

import torch as _mw_torch
from lightning.pytorch import Callback as _MwCallback, LightningModule as _MwLightningModule
from torch import nn as _mw_nn
from torch.utils.data import DataLoader as _MwDataLoader, TensorDataset as _MwTensorDataset

#: half a unit in the last place just below 1.0: updates smaller than this are lost by a half weight of 1.0
MW_HALF_ULP_BELOW_ONE = {"bf16-true": 2.0**-9, "fp16-true": 2.0**-12}
MW_DTYPE = {"bf16-true": _mw_torch.bfloat16, "fp16-true": _mw_torch.float16}


def mw_plugin(precision: str, master_weights: _MwOptional[str] = None, **kwargs: _MwAny):
    from lightning_mp import MPPlugin

    if precision.startswith("fp16"):
        kwargs.setdefault("init_scale", 2.0**8)  # the probes' gradients (256 scaled) never overflow fp16
    if master_weights is None:
        return MPPlugin(precision, **kwargs)
    return MPPlugin(precision, master_weights=master_weights, **kwargs)


def mw_trainer(plugin: _MwAny = None, *, precision: _MwOptional[str] = None, callbacks=(), **kwargs: _MwAny):
    """A quiet CPU Trainer; ``plugin`` an MPPlugin (or None), ``precision`` Lightning's own precision flag."""
    return opt_trainer(plugin, kwargs.pop("max_steps", -1), callbacks, precision, **kwargs)


class MwProbe(_MwLightningModule):
    """Two bias-free ``dim x dim`` layers, ``head`` and ``backbone``, every weight ``init`` (``backbone_init``);
    inputs all ones.

    The loss ``(head(x) + backbone(x)).sum() / batch`` is linear in the weights: every weight's gradient is exactly
    1.0 on every step (in any precision), so plain SGD moves every weight by exactly ``-lr`` a step, and the weights
    after K steps are known exactly (with other ``data``, a weight's gradient is the batch mean of its input).
    ``frozen``: names of layers frozen at the start. ``trainable_only``: ``configure_optimizers`` takes only
    parameters with ``requires_grad`` (the ``BackboneFinetuning`` pattern).
    """

    def __init__(
        self,
        lr: float = 0.0,
        *,
        init: float = 1.0,
        backbone_init: _MwOptional[float] = None,
        dim: int = 4,
        batch_size: int = 2,
        batches: int = 4,
        frozen: tuple = (),
        trainable_only: bool = False,
        momentum: float = 0.0,
        data: _MwOptional[_mw_torch.Tensor] = None,
    ) -> None:
        super().__init__()
        self.head = _mw_nn.Linear(dim, dim, bias=False)
        self.backbone = _mw_nn.Linear(dim, dim, bias=False)
        with _mw_torch.no_grad():
            self.head.weight.fill_(init)
            self.backbone.weight.fill_(init if backbone_init is None else backbone_init)
        for name in frozen:
            getattr(self, name).requires_grad_(False)
        self.lr = lr
        self.momentum = momentum
        self.dim = dim
        self.batch_size = batch_size
        self.batches = batches
        self.trainable_only = trainable_only
        self.data = data  # the inputs (``batch_size * batches`` rows of ``dim``); ones if not given
        self.losses: list = []

    def forward(self, x):
        return self.head(x) + self.backbone(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self(x).float().sum() / x.shape[0]
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad or not self.trainable_only]
        return _mw_torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def train_dataloader(self):
        data = self.data if self.data is not None else _mw_torch.ones(self.batch_size * self.batches, self.dim)
        return _MwDataLoader(_MwTensorDataset(data), batch_size=self.batch_size)

    def val_dataloader(self):
        return self.train_dataloader()

    def predict_dataloader(self):
        return self.train_dataloader()

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val", self(x).float().sum())

    def predict_step(self, batch, batch_idx):
        (x,) = batch
        return self(x)


def mw_regression_data(n: int = 32, features: int = 8, seed: int = 0):
    g = _mw_torch.Generator().manual_seed(seed)
    x = _mw_torch.randn(n, features, generator=g)
    w = _mw_torch.randn(features, 1, generator=g)
    return x, x @ w + 0.1 * _mw_torch.randn(n, 1, generator=g)


class MwMLP(_MwLightningModule):
    """A small regression MLP (``layer``, optional ``norm``, ``out``) on a fixed data set; SGD or Adam."""

    def __init__(
        self,
        lr: float = 0.05,
        *,
        optimizer: str = "sgd",
        features: int = 8,
        hidden: int = 16,
        norm: bool = False,
        batch_size: int = 8,
        n: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        g = _mw_torch.Generator().manual_seed(seed)
        self.layer = _mw_nn.Linear(features, hidden)
        self.norm = _mw_nn.LayerNorm(hidden) if norm else _mw_nn.Identity()
        self.out = _mw_nn.Linear(hidden, 1)
        with _mw_torch.no_grad():
            for p in self.parameters():
                p.copy_(_mw_torch.randn(p.shape, generator=g) * 0.3)
        self.lr = lr
        self.optimizer_name = optimizer
        self.features = features
        self.batch_size = batch_size
        self.n = n
        self.losses: list = []

    def forward(self, x):
        return self.out(_mw_torch.tanh(self.norm(self.layer(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = _mw_nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adam":
            return _mw_torch.optim.Adam(params, lr=self.lr)
        return _mw_torch.optim.SGD(params, lr=self.lr)

    def train_dataloader(self):
        x, y = mw_regression_data(self.n, self.features)
        return _MwDataLoader(_MwTensorDataset(x, y), batch_size=self.batch_size)


def mw_params(module) -> dict:
    """Detached copies of the module's parameters, by name (as the module holds them)."""
    return {name: p.detach().clone() for name, p in module.named_parameters()}


class MwSetLR(_MwCallback):
    """Sets every param group's learning rate at ``on_train_start`` (after a checkpoint's optimizer state is
    restored), e.g. 0 so that a step changes nothing."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_start(self, trainer, pl_module) -> None:
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                group["lr"] = self.lr


class MwRecordWeights(_MwCallback):
    """Records the module's parameters at ``on_train_batch_start`` and ``on_train_batch_end`` of every batch."""

    def __init__(self) -> None:
        self.start: list = []
        self.end: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start.append(mw_params(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end.append(mw_params(pl_module))


def mw_find_fp32_masters(checkpoint: dict) -> dict:
    """The fp32 master weights (``{parameter name: tensor}``) the precision plugin saved in a checkpoint.

    The plugin's entry sits at the checkpoint's top level under the plugin's class name (``"MPPlugin"``); the
    masters are the dict under a ``"masters"`` key inside it. Searched rather than hard-coded below the top level.
    """

    def search(node):
        if isinstance(node, dict):
            masters = node.get("masters")
            if isinstance(masters, dict) and masters and all(isinstance(v, _mw_torch.Tensor) for v in masters.values()):
                return masters
            for value in node.values():
                found = search(value)
                if found is not None:
                    return found
        return None

    skip = {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"}
    for key, value in checkpoint.items():
        if key in skip:
            continue
        found = search(value)
        if found is not None:
            return found
    raise AssertionError(f"no fp32 master weights found in the checkpoint (top-level keys: {sorted(checkpoint)})")


def assert_tensors_equal(actual: dict, expected: dict, what: str) -> None:
    """Two ``{name: tensor}`` dicts bit for bit, each tensor's dtype too; a difference names the largest gap."""
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, f"{what}: {name} is {actual[name].dtype}, expected {value.dtype}"
        if not torch.equal(actual[name], value):
            diff = (actual[name].float() - value.float()).abs().max().item()
            raise AssertionError(f"{what}: {name} differs by up to {diff:g}")


def fabric_own(mode: str) -> Any:
    """Fabric's own plugin of ``mode`` (fp16: GradScaler from our tests' modest scale, so both skip nothing)."""
    from lightning.fabric.plugins import HalfPrecision, MixedPrecision, Precision

    return {
        "fp32": lambda: Precision(),
        "bf16": lambda: MixedPrecision("bf16-mixed", "cpu"),
        "fp16": lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8)),
        "bf16-true": lambda: HalfPrecision("bf16-true"),
        "fp16-true": lambda: HalfPrecision("16-true"),
    }[mode]()
