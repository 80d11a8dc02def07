"""User-side tests: optimizer wrappers that Lightning accepts train in every mode, master weights included.

Three shapes of the same wrapper (Lookahead: ``k`` steps of the base optimizer, then the weights move halfway back to
slow weights kept beside the base optimizer's state):

* :class:`TimmLookahead`, as timm writes it: an ``Optimizer`` subclass that never runs ``Optimizer.__init__``; it
  shares its base optimizer's ``param_groups`` list, keeps the slow weights in the base optimizer's state, and holds
  only the two step-hook dicts torch's ``step`` wrapper reads (none of the ``state_dict``/``load_state_dict`` ones);
* :class:`InitLookahead`: an ``Optimizer`` subclass that runs ``Optimizer.__init__`` on its base's param groups and
  keeps the slow weights in its own state (so torch's ``load_state_dict`` casts both states);
* :class:`DuckLookahead`: not an ``Optimizer`` at all, typed by duck (what Lightning's ``Optimizable`` asks for).

Oracles: Lightning's own plugin of the same mode where no master weights change the numbers; with master weights a
fp32 run (the masters follow it closely), a step on a NaN batch that must change nothing (the weights, the masters,
the wrapper's and the base optimizer's state, bit for bit), and an uninterrupted run for a resumed one.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from .conftest import OPT_MODES, opt_assert_nested_equal, opt_params, opt_plugin, opt_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*The number of training batches.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*does not have many workers.*",
)

TRUE_HALF = ("bf16-true", "fp16-true")


def lightning_plugin(mode: str) -> Any:
    """Lightning's own plugin of ``mode`` (the reference where no master weights change the numbers);
    ``precision="16-mixed"`` would turn into bf16 on a CPU, so its plugin is made here, with our fp16 modes' scale."""
    if mode == "fp32":
        return Precision()
    if mode in ("bf16", "fp16"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode == "fp16" else None
        return MixedPrecision("16-mixed" if mode == "fp16" else "bf16-mixed", "cpu", scaler=scaler)
    return HalfPrecision("16-true" if mode == "fp16-true" else "bf16-true")


# ================================================================================================ the wrappers
class TimmLookahead(Optimizer):
    """Lookahead as timm writes it: ``Optimizer.__init__`` is never run (it would make a second set of param groups);
    the param groups are the base optimizer's own list, the slow weights sit in the base optimizer's state, and of
    torch's hook dicts only the two that torch's ``step`` wrapper reads exist."""

    def __init__(self, base_optimizer: Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state: defaultdict = defaultdict(dict)
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group: dict) -> None:
        for fast in group["params"]:
            if fast.grad is None:
                continue
            state = self._base_optimizer.state[fast]
            if "lookahead_slow_buff" not in state:
                state["lookahead_slow_buff"] = torch.empty_like(fast)
                state["lookahead_slow_buff"].copy_(fast)
            slow = state["lookahead_slow_buff"]
            slow.add_(fast - slow, alpha=group["lookahead_alpha"])
            fast.copy_(slow)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Any:
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self) -> dict:
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


def _lookahead_(params: list, state: dict, count: int, alpha: float, k: int) -> None:
    """The slow weights of the two other shapes, in their own ``state``: made at the first step, pulled every k."""
    with torch.no_grad():
        for fast in params:
            if fast.grad is None:
                continue
            entry = state[fast]
            if "slow" not in entry:
                entry["slow"] = fast.detach().clone()
            if count % k == 0:
                slow = entry["slow"]
                slow.add_(fast - slow, alpha=alpha)
                fast.copy_(slow)


class InitLookahead(Optimizer):
    """A wrapper that runs ``Optimizer.__init__`` on its base optimizer's param groups (the same group dicts) and keeps
    the slow weights in its own state; its checkpoint holds both states, each loaded by torch's ``load_state_dict``."""

    def __init__(self, base: Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self.base, self.alpha, self.k = base, alpha, k
        super().__init__(base.param_groups, base.defaults)
        for group in self.param_groups:
            group.setdefault("slow_count", 0)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Any:
        loss = self.base.step(closure)
        for group in self.param_groups:
            group["slow_count"] += 1
            _lookahead_(group["params"], self.state, group["slow_count"], self.alpha, self.k)
        return loss

    def state_dict(self) -> dict:
        return {"base": self.base.state_dict(), "own": super().state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.base.load_state_dict(state_dict["base"])
        super().load_state_dict(state_dict["own"])
        self.param_groups = self.base.param_groups  # one set of group dicts again (the LR a scheduler sets)


class DuckLookahead:
    """Not an ``Optimizer``: what Lightning's ``Optimizable`` protocol asks for, over a base optimizer."""

    def __init__(self, base: Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self.base, self.alpha, self.k = base, alpha, k
        self.defaults = base.defaults
        self.state: defaultdict = defaultdict(dict)
        self.count = 0

    @property
    def param_groups(self) -> list:
        return self.base.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none)

    def step(self, closure: Optional[Callable] = None) -> Any:
        loss = self.base.step(closure)
        self.count += 1
        for group in self.param_groups:
            _lookahead_(group["params"], self.state, self.count, self.alpha, self.k)
        return loss

    def _params(self) -> list:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        slow = {i: self.state[p]["slow"] for i, p in enumerate(self._params()) if "slow" in self.state.get(p, {})}
        return {"base": self.base.state_dict(), "slow": slow, "count": self.count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.base.load_state_dict(state_dict["base"])
        params = self._params()
        self.state = defaultdict(dict, {params[i]: {"slow": t.clone()} for i, t in state_dict["slow"].items()})
        self.count = state_dict["count"]


class OldTimmLookahead(TimmLookahead):
    """Lookahead as older timm versions and their forks write it: the base optimizer kept as ``base_optimizer`` (the
    attribute SAM-style optimizers also have), stepped once per step as any optimizer steps."""

    def __init__(self, base_optimizer: Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        super().__init__(base_optimizer, alpha, k)
        self.base_optimizer = base_optimizer


WRAPPERS: dict[str, Callable[[Optimizer], Any]] = {
    "timm": TimmLookahead,
    "timm-old": OldTimmLookahead,
    "super-init": InitLookahead,
    "duck": DuckLookahead,
}


def base_of(wrapper: Any) -> Optimizer:
    wrapper = getattr(wrapper, "_optimizer", wrapper)  # (a LightningOptimizer)
    return wrapper._base_optimizer if isinstance(wrapper, TimmLookahead) else wrapper.base


# ================================================================================================ the model
def _data(n: int = 32, poison: Optional[int] = None, batch_size: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    if poison is not None:
        x[poison * batch_size, 0] = float("nan")  # one NaN in that batch: every gradient becomes NaN
    return TensorDataset(x, y)


class Wrapped(LightningModule):
    """A small MLP trained by AdamW under a wrapper (``WRAPPERS``); ``poison``: the batch with a NaN input."""

    def __init__(self, wrapper: str, *, poison: Optional[int] = None, batch_size: int = 8, eps: float = 1e-8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.wrapper, self.poison, self.batch_size, self.eps = wrapper, poison, batch_size, eps
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return WRAPPERS[self.wrapper](torch.optim.AdamW(self.parameters(), lr=1e-2, eps=self.eps))

    def train_dataloader(self):
        return DataLoader(_data(poison=self.poison, batch_size=self.batch_size), batch_size=self.batch_size)


def snapshot(module: LightningModule, plugin: Any = None) -> dict:
    """Everything a skipped step must leave as it was: the weights, the masters, both optimizers' states."""
    wrapper = module.trainer.optimizers[0]
    masters = getattr(plugin, "masters", None)
    held = {}
    if masters is not None and hasattr(masters, "master_of"):
        held = {n: masters.master_of(p).detach().clone() for n, p in module.named_parameters()
                if masters.master_of(p) is not None}
    return {
        "params": opt_params(module),
        "masters": held,
        "wrapper": copy.deepcopy(wrapper.state_dict()),
        "wrapper state": _indexed(wrapper),
        "base": copy.deepcopy(base_of(wrapper).state_dict()),
    }


def _indexed(wrapper: Any) -> dict:
    """A copy of the wrapper's own state, keyed by the parameters' places in its param groups (not the tensors)."""
    params = [p for group in wrapper.param_groups for p in group["params"]]
    return {i: copy.deepcopy(wrapper.state[p]) for i, p in enumerate(params) if p in wrapper.state}


class AroundWindow(Callback):
    """Snapshots at the start of batch ``first`` and at the end of batch ``last`` (an accumulation window)."""

    def __init__(self, first: int, last: int, plugin: Any = None) -> None:
        self.first, self.last, self.plugin = first, last, plugin
        self.before: Optional[dict] = None
        self.after: Optional[dict] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.first:
            self.before = snapshot(pl_module, self.plugin)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.last:
            self.after = snapshot(pl_module, self.plugin)


def _state_tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _state_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _state_tensors(v)]
    return []


# ================================================================================================ the tests
@pytest.mark.parametrize("mode", OPT_MODES)
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapper_trains_as_with_lightnings_own_plugin(wrapper, mode):
    """Where no master weights change the numbers (true-half: ``master_weights="none"``), the plugin trains the
    wrapper to the same bits as Lightning's own plugin of the mode (fp16 weights without masters: an ``eps`` fp16
    holds, else Adam's fp16 state makes 0/0 in Lightning's run too)."""
    kwargs = {"master_weights": "none"} if mode in TRUE_HALF else {}
    eps = 1e-4 if mode == "fp16-true" else 1e-8
    ours = Wrapped(wrapper, eps=eps)
    opt_trainer(opt_plugin(mode, **kwargs), max_steps=4).fit(ours)
    reference = Wrapped(wrapper, eps=eps)
    opt_trainer(lightning_plugin(mode), max_steps=4).fit(reference)
    opt_assert_nested_equal(opt_params(ours), opt_params(reference), f"{wrapper}, {mode} vs Lightning's plugin")
    opt_assert_nested_equal(base_of(ours.trainer.optimizers[0]).state_dict(),
                            base_of(reference.trainer.optimizers[0]).state_dict(), "the base optimizer's state")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp32", "kahan", "stochastic"])
@pytest.mark.parametrize("mode", TRUE_HALF)
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapper_trains_with_master_weights(wrapper, mode, kind):
    """With master weights the wrapper trains (the loss goes down), close to a fp32 run, and the state it keeps for
    half parameters is fp32 (the slow weights, the base optimizer's moments)."""
    ours = Wrapped(wrapper)
    plugin = opt_plugin(mode, master_weights=kind)
    opt_trainer(plugin, max_steps=8).fit(ours)
    assert plugin.stats.steps == 8 and plugin.stats.skipped_steps == 0
    reference = Wrapped(wrapper)
    opt_trainer(precision="32-true", max_steps=8).fit(reference)
    first, second = sum(ours.losses[:4]), sum(ours.losses[4:])  # (two epochs of the same four batches)
    assert second < 0.9 * first, ours.losses
    tolerance = 2e-2 if mode == "bf16-true" else 4e-3
    for name, value in opt_params(reference).items():
        torch.testing.assert_close(opt_params(ours)[name].float(), value, atol=tolerance, rtol=0,
                                   msg=lambda m, name=name: f"{name} vs a fp32 run: {m}")
    wrapper_obj = ours.trainer.optimizers[0]
    for what, state in (("base", base_of(wrapper_obj).state), ("wrapper", wrapper_obj.state)):
        for tensor in _state_tensors(dict(state)):
            if tensor.dim():  # (step counts are 0-dim)
                assert tensor.dtype == torch.float32, f"{what} state of a half parameter is {tensor.dtype}"


#: how the steps are taken: Trainer arguments
HOW = {
    "plain": {},
    "accumulate": {"accumulate_grad_batches": 2},
    "clip-norm": {"gradient_clip_val": 0.5},
    "clip-value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
}


@pytest.mark.slow
@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("mode", OPT_MODES)
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapper_step_on_a_nan_batch_changes_nothing(wrapper, mode, how):
    """A batch with a NaN input is skipped (its accumulation window's step, clipped or not): the weights, the masters,
    the wrapper's and the base optimizer's state (Adam's moments and step, the slow weights, the lookahead count)
    stay bit for bit as they were."""
    plugin = opt_plugin(mode)
    accumulate = HOW[how].get("accumulate_grad_batches", 1)
    around = AroundWindow(2, 2 + accumulate - 1, plugin)
    model = Wrapped(wrapper, poison=2)
    steps = 4 if accumulate == 1 else 3
    opt_trainer(plugin, max_steps=steps, callbacks=[around], **HOW[how]).fit(model)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.steps == steps
    assert around.before is not None and around.after is not None
    opt_assert_nested_equal(around.after, around.before, f"{wrapper}, {mode}, {how}: the NaN batch")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("mode", TRUE_HALF)
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapper_resumes_from_a_checkpoint_as_uninterrupted(wrapper, mode, tmp_path):
    """A checkpoint holds the wrapper's fp32 state (the slow weights, the base's moments); resumed, the run goes on as
    the uninterrupted one, bit for bit, and the state of the half parameters stays fp32."""
    # one full batch an epoch: every step sees the same data, interrupted or not; k=2: the slow weights exist at
    # the checkpoint (step 3) and move again after it
    uninterrupted = Wrapped(wrapper, batch_size=32)
    opt_trainer(opt_plugin(mode), max_steps=6).fit(uninterrupted)

    first = Wrapped(wrapper, batch_size=32)
    trainer = opt_trainer(opt_plugin(mode), max_steps=3)
    trainer.fit(first)
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)

    resumed = Wrapped(wrapper, batch_size=32)
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # other weights: the checkpoint must win
    opt_trainer(opt_plugin(mode), max_steps=6).fit(resumed, ckpt_path=path)
    opt_assert_nested_equal(opt_params(resumed), opt_params(uninterrupted), f"{wrapper}, {mode}: resumed")
    got, want = resumed.trainer.optimizers[0], uninterrupted.trainer.optimizers[0]
    opt_assert_nested_equal(got.state_dict(), want.state_dict(), "the wrapper's checkpoint state")
    for tensor in _state_tensors(dict(base_of(got).state)) + _state_tensors(dict(got.state)):
        if tensor.dim():
            assert tensor.dtype == torch.float32, f"state of a half parameter loaded as {tensor.dtype}"
