"""``fabric.load_raw``: a raw state dict (``torch.save(model.state_dict())``, a pretrained model, an optimizer's own
``state_dict()``) loaded straight into a model or optimizer that ``fabric.setup`` set up, as Fabric's docs show it::

    model, optimizer = fabric.setup(model, optimizer)
    fabric.load_raw("pretrained.pt", model)
    fabric.load_raw("optimizer.pt", optimizer)

What a Fabric user expects: the model trains from the loaded weights as if it had been set up with them. In true-half
modes the half weights hold the loaded fp32 values rounded; the master weights (fp32 copies, or the Kahan
compensation) must take the loaded values themselves, so the next step is the one a run set up fresh from the same
weights takes, bit for bit (also where a first step had made the masters already). The oracles: the same weights
set up fresh, Fabric's own plugin of the mode (``master_weights="none"``: its layout), the uninterrupted run.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import HalfPrecision, Precision
from torch import nn

from lightning_mp import MPFabricPrecision

from .conftest import fabric_own

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
    pytest.mark.filterwarnings("ignore::lightning_mp.modes.PerformanceWarning"),  # fp16 on the CPU, on purpose
]

#: every mode, and every master-weight kind of the true-half modes
CASES = [
    ("fp32", None), ("bf16", None), ("fp16", None),
    ("bf16-true", None), ("bf16-true", "kahan"), ("bf16-true", "stochastic"), ("bf16-true", "none"),
    ("fp16-true", None), ("fp16-true", "kahan"), ("fp16-true", "stochastic"), ("fp16-true", "none"),
]
IDS = [mode if kind is None else f"{mode}-{kind}" for mode, kind in CASES]
#: the kinds that keep more than the half weights (what a load must reach)
#: Fabric's own name of each true-half mode
OWN_TRUE_HALF = {"bf16-true": "bf16-true", "fp16-true": "16-true"}


def raw_plugin(mode: str, kind: Optional[str] = None, **kwargs: Any) -> MPFabricPrecision:
    if kind is not None:
        kwargs["master_weights"] = kind
    if mode.startswith("fp16") and "loss_scale" not in kwargs:
        kwargs.setdefault("init_scale", 2.0**8)  # (clean steps of the tiny model never overflow)
    return MPFabricPrecision(mode, **kwargs)


def raw_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def raw_setup(plugin: Precision, seed: int, optimizer: str = "sgd", join: bool = False) -> tuple:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = raw_net(seed)
    opt = (torch.optim.Adam(raw.parameters(), lr=1e-2, eps=1e-4) if optimizer == "adam"
           else torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9 if optimizer == "sgd" else 0.0))  # fmt: skip
    model, opt = fabric.setup(raw, opt)
    if join:
        plugin.setup_optimizers(opt)  # type: ignore[attr-defined]
    return fabric, raw, model, opt


def raw_batches(n: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def raw_train(fabric: Fabric, model: nn.Module, opt: Any, batches: list[torch.Tensor]) -> None:
    for x in batches:
        fabric.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()


def raw_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def raw_assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert a[name].dtype == b[name].dtype, f"{what} {name}: {a[name].dtype} vs {b[name].dtype}"
        diff = (a[name].double() - b[name].double()).abs().max().item()
        assert torch.equal(a[name], b[name]), f"{what} {name}: differs by up to {diff:g}"


def raw_held(plugin: MPFabricPrecision) -> Optional[dict]:
    """What the master weights hold (fp32 masters, or the Kahan compensation), by parameter name."""
    if plugin.masters is None:
        return None
    state = plugin.masters.state_dict()
    return state.get("masters", state.get("compensation"))


@pytest.fixture
def pretrained(tmp_path: Path) -> Path:
    """fp32 weights saved the way pretrained weights are: ``torch.save(model.state_dict())`` of a plain model."""
    path = tmp_path / "pretrained.pt"
    torch.save(raw_net(0).state_dict(), path)
    return path


# ---------------------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("after_a_step", [False, True], ids=["before-training", "after-a-step"])
@pytest.mark.parametrize(("mode", "kind"), CASES, ids=IDS)
def test_load_raw_trains_as_the_same_weights_set_up_fresh(mode, kind, after_a_step, pretrained):
    """fp32 weights loaded with ``fabric.load_raw`` into a set-up model (other weights), right after set-up or after
    a first step made the masters: the next steps, the weights and what the masters hold are those of a model set up
    with the loaded weights, bit for bit. (Stochastic rounding draws from its noise stream at every step: after a
    step it is compared before training only.)"""
    if after_a_step and kind == "stochastic":
        pytest.skip("stochastic rounding's noise moved on with the extra step: nothing to compare bit for bit")
    fresh_plugin = raw_plugin(mode, kind)
    fabric, fresh_raw, fresh, opt = raw_setup(fresh_plugin, seed=0, optimizer="sgd-plain")
    raw_train(fabric, fresh, opt, raw_batches(2))

    plugin = raw_plugin(mode, kind)
    fabric, raw, model, opt = raw_setup(plugin, seed=1, optimizer="sgd-plain")  # (no state left from that step)
    if after_a_step:
        raw_train(fabric, model, opt, [torch.ones(4, 8)])
    fabric.load_raw(pretrained, model)
    raw_train(fabric, model, opt, raw_batches(2))

    raw_assert_equal(raw_params(raw), raw_params(fresh_raw), "weights")
    held, fresh_held = raw_held(plugin), raw_held(fresh_plugin)
    assert (held is None) == (fresh_held is None) == (kind not in (None, "kahan") or not mode.endswith("-true"))
    if held is not None:
        raw_assert_equal(held, fresh_held, "masters")


@pytest.mark.parametrize("mode", ["bf16-true", "fp16-true"])
def test_the_fp32_masters_take_the_loaded_fp32_values(mode, pretrained):
    """Right after ``fabric.load_raw`` and a step of learning rate 0: the half weights are the loaded values rounded,
    and the fp32 masters are the loaded fp32 values themselves (not their rounding, nor the old weights'). (The Kahan
    compensation is half precision: it is compared with a fresh set-up's above.)"""
    plugin = raw_plugin(mode)
    fabric, raw, model, opt = raw_setup(plugin, seed=1)
    raw_train(fabric, model, opt, raw_batches(1))  # (the masters exist)
    fabric.load_raw(pretrained, model)
    for group in opt.param_groups:
        group["lr"] = 0.0
    raw_train(fabric, model, opt, raw_batches(1))
    loaded = torch.load(pretrained, weights_only=True)
    held = raw_held(plugin)
    assert held is not None
    for name, param in raw.named_parameters():
        assert torch.equal(param.detach(), loaded[name].to(param.dtype)), name
        assert torch.equal(held[name], loaded[name]), f"{name}: {(held[name] - loaded[name]).abs().max().item():g} off"


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"])
def test_load_raw_as_fabrics_own_plugin(mode, pretrained):
    """Our plugin set up as Fabric's own of the mode (no master weights in true-half modes, Fabric's 16-true scales no
    loss, the FP32 guards' LayerNorm-free model): the same weights after ``load_raw`` and two steps, bit for bit."""
    own = fabric_own(mode)
    as_own = {"bf16-true": {"master_weights": "none"}, "fp16-true": {"master_weights": "none", "loss_scale": 1.0}}
    results = []
    for plugin in (own, raw_plugin(mode, **as_own.get(mode, {}))):
        fabric, raw, model, opt = raw_setup(plugin, seed=1)
        fabric.load_raw(pretrained, model)
        raw_train(fabric, model, opt, raw_batches(2))
        results.append(raw_params(raw))
    raw_assert_equal(results[1], results[0], "weights")


@pytest.mark.parametrize(("mode", "kind"), [("bf16-true", None), ("fp16-true", "kahan"), ("bf16", None)])
def test_a_partial_state_dict_loaded_with_strict_false(mode, kind, pretrained):
    """``fabric.load_raw(path, model, strict=False)`` with one layer's fp32 weights (a pretrained backbone): that
    layer trains from the loaded values, the other from its own, as the model set up with those weights."""
    backbone = {k: v for k, v in torch.load(pretrained, weights_only=True).items() if k.startswith("0.")}
    path = pretrained.with_name("backbone.pt")
    torch.save(backbone, path)

    reference = raw_net(1)
    reference.load_state_dict(backbone, strict=False)
    fresh_plugin = raw_plugin(mode, kind)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[fresh_plugin])
    fresh, opt = fabric.setup(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    raw_train(fabric, fresh, opt, raw_batches(2))

    plugin = raw_plugin(mode, kind)
    fabric, raw, model, opt = raw_setup(plugin, seed=1)
    fabric.load_raw(path, model, strict=False)
    raw_train(fabric, model, opt, raw_batches(2))
    raw_assert_equal(raw_params(raw), raw_params(reference), "weights")
    if raw_held(plugin) is not None:
        raw_assert_equal(raw_held(plugin), raw_held(fresh_plugin), "masters")


@pytest.mark.parametrize("mode", ["bf16-true", "fp16-true"])
def test_init_module_empty_init_then_load_raw(mode, pretrained):
    """The large-model pattern: ``fabric.init_module(empty_init=True)`` (uninitialised memory), ``fabric.setup``,
    ``fabric.load_raw``: trains as the pretrained weights set up fresh, master weights included; the weights' dtypes
    after set-up are Fabric's own plugin's (half, the FP32-guarded modules aside: there are none here)."""
    fresh_plugin = raw_plugin(mode)
    fabric, fresh_raw, fresh, opt = raw_setup(fresh_plugin, seed=0)
    raw_train(fabric, fresh, opt, raw_batches(2))

    plugin = raw_plugin(mode)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    with fabric.init_module(empty_init=True):
        raw = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9))
    own = Fabric(accelerator="cpu", devices=1, plugins=[HalfPrecision(OWN_TRUE_HALF[mode])])
    with own.init_module(empty_init=True):
        own_model = own.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    assert {n: p.dtype for n, p in raw.named_parameters()} == {
        n: p.dtype for n, p in own_model.module.named_parameters()}
    fabric.load_raw(pretrained, model)
    raw_train(fabric, model, opt, raw_batches(2))
    raw_assert_equal(raw_params(raw), raw_params(fresh_raw), "weights")
    raw_assert_equal(raw_held(plugin), raw_held(fresh_plugin), "masters")


def test_load_state_dict_on_the_fabric_module_is_load_raw(pretrained):
    """``model.load_state_dict(...)`` on the set-up model (what ``load_raw`` calls): the same master weights."""
    plugins = [raw_plugin("bf16-true"), raw_plugin("bf16-true")]
    runs = [raw_setup(plugin, seed=1) for plugin in plugins]
    runs[0][0].load_raw(pretrained, runs[0][2])
    runs[1][2].load_state_dict(torch.load(pretrained, weights_only=True))
    for fabric, _, model, opt in runs:
        raw_train(fabric, model, opt, raw_batches(1))
    raw_assert_equal(raw_held(plugins[0]), raw_held(plugins[1]), "masters")


def test_after_teardown_a_load_is_the_modules_own(pretrained):
    """``plugin.teardown()`` takes the load hooks away with the rest: the module loads as a plain module again."""
    plugin = raw_plugin("bf16-true")
    fabric, raw, model, opt = raw_setup(plugin, seed=1)
    plugin.teardown()
    assert not raw._load_state_dict_pre_hooks and not raw._load_state_dict_post_hooks
    raw.load_state_dict(torch.load(pretrained, weights_only=True))
    assert raw[0].weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- the optimizer
@pytest.mark.parametrize(("mode", "kind"), CASES, ids=IDS)
def test_load_raw_of_model_and_optimizer_resumes(mode, kind, tmp_path):
    """A raw resume: ``torch.save`` of the set-up model's and optimizer's state dicts after two steps, then
    ``load_raw`` of both into a fresh set-up run (the optimizer given to ``plugin.setup_optimizers`` first, as before
    ``fabric.load``). The optimizer state comes back as saved, bit for bit and in its dtype (fp32 where master weights
    step in fp32); where the model's state dict holds everything the run holds (no master weights) the two steps
    after it are the uninterrupted run's, bit for bit."""
    plugin = raw_plugin(mode, kind)
    fabric, raw, model, opt = raw_setup(plugin, seed=0, optimizer="adam", join=True)
    batches = raw_batches(4)
    raw_train(fabric, model, opt, batches[:2])
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    saved = copy.deepcopy(opt.state_dict())
    raw_train(fabric, model, opt, batches[2:])
    whole = raw_params(raw)

    plugin = raw_plugin(mode, kind)
    fabric, raw, model, opt = raw_setup(plugin, seed=5, optimizer="adam", join=True)
    fabric.load_raw(tmp_path / "model.pt", model)
    fabric.load_raw(tmp_path / "optimizer.pt", opt)
    loaded = opt.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert loaded["state"][index][key].dtype == value.dtype, (index, key)
            assert torch.equal(loaded["state"][index][key], value), (index, key)
    raw_train(fabric, model, opt, batches[2:])
    if not mode.endswith("-true") or kind == "none":
        raw_assert_equal(raw_params(raw), whole, "weights")
    assert plugin.stats.steps == 2 and plugin.stats.skipped_steps == 0


@pytest.mark.parametrize(("mode", "kind"), [("bf16-true", None), ("fp16-true", "kahan"), ("bf16-true", "stochastic")])
def test_an_optimizer_state_loaded_before_the_plugin_knew_the_optimizer_warns(mode, kind, tmp_path):
    """``fabric.load_raw(path, optimizer)`` right after ``fabric.setup``, without ``plugin.setup_optimizers``: the
    plugin cannot see the optimizer yet (Fabric tells a precision plugin of no optimizer), so torch's
    ``Optimizer.load_state_dict`` casts the fp32 state of the half weights to their dtype, as under Fabric's own
    ``HalfPrecision`` (whose state is half anyway). The first step says so and how to keep it; training goes on."""
    plugin = raw_plugin(mode, kind)
    fabric, raw, model, opt = raw_setup(plugin, seed=0, optimizer="adam")
    raw_train(fabric, model, opt, raw_batches(2))
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")

    plugin = raw_plugin(mode, kind)
    fabric, raw, model, opt = raw_setup(plugin, seed=0, optimizer="adam")
    fabric.load_raw(tmp_path / "optimizer.pt", opt)
    with pytest.warns(UserWarning, match=r"^MPFabricPrecision: Adam holds a half-precision state.*setup_optimizers"):
        raw_train(fabric, model, opt, raw_batches(1))
    assert all(torch.isfinite(p).all() for p in raw.parameters()) and plugin.stats.skipped_steps == 0

    plugin = raw_plugin(mode, kind)  # given to the plugin first: no warning, the state as saved
    fabric, raw, model, opt = raw_setup(plugin, seed=0, optimizer="adam", join=True)
    fabric.load_raw(tmp_path / "optimizer.pt", opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*holds a half-precision state")
        raw_train(fabric, model, opt, raw_batches(1))


def test_the_set_up_model_pickles_and_copies_and_a_copy_loads_as_a_plain_module(pretrained):
    """Checkpointing and averaging code copies the model mid-run (``torch.save(model)``, ``copy.deepcopy``): the load
    hooks copy as inert ones; the copy loads a state dict as a plain module, and the run's masters do not move."""
    import io
    import pickle

    plugin = raw_plugin("bf16-true")
    fabric, raw, model, opt = raw_setup(plugin, seed=1)
    raw_train(fabric, model, opt, raw_batches(1))
    held = copy.deepcopy(raw_held(plugin))
    buffer = io.BytesIO()
    torch.save(raw, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(raw), pickle.loads(pickle.dumps(raw)), torch.load(buffer, weights_only=False)]
    for copied in (*copies, copy.deepcopy(plugin), pickle.loads(pickle.dumps(plugin))):
        assert copied is not None
    for copied in copies:
        copied.load_state_dict(torch.load(pretrained, weights_only=True))
        assert copied[0].weight.dtype == torch.bfloat16
    raw_assert_equal(raw_held(plugin), held, "masters")


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_a_mixed_runs_checkpoint_resumed_in_true_half_starts_from_its_fp32_weights(kind, tmp_path):
    """``fabric.load`` of a ``bf16`` run's checkpoint (fp32 weights, no master weights) into a set-up ``bf16-true`` run:
    as the plugin's warning says, the masters start from the checkpoint's exact fp32 weights (the model is half when
    Fabric loads them): the run goes on as one set up fresh from those weights, bit for bit."""
    plugin = raw_plugin("bf16")
    fabric, raw, model, opt = raw_setup(plugin, seed=0, optimizer="sgd-plain", join=True)
    raw_train(fabric, model, opt, raw_batches(2))
    fabric.save(tmp_path / "mixed.ckpt", {"model": model, "optimizer": opt, "precision": plugin})
    weights = {name: value.clone() for name, value in raw.state_dict().items()}

    fresh_plugin = raw_plugin("bf16-true", kind)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[fresh_plugin])
    fresh_raw = raw_net(5)
    fresh_raw.load_state_dict(weights)  # (before set-up: the fp32 model)
    fresh, fresh_opt = fabric.setup(fresh_raw, torch.optim.SGD(fresh_raw.parameters(), lr=0.1))
    raw_train(fabric, fresh, fresh_opt, raw_batches(2, seed=4))

    plugin = raw_plugin("bf16-true", kind)
    fabric, raw, model, opt = raw_setup(plugin, seed=5, optimizer="sgd-plain", join=True)
    with pytest.warns(UserWarning, match="holds no master weights.*exact fp32 values"):
        fabric.load(tmp_path / "mixed.ckpt", {"model": model, "optimizer": opt, "precision": plugin})
        raw_train(fabric, model, opt, raw_batches(2, seed=4))
    raw_assert_equal(raw_params(raw), raw_params(fresh_raw), "weights")
    raw_assert_equal(raw_held(plugin), raw_held(fresh_plugin), "masters")


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_weights_swapped_in_and_back_leave_the_run_as_it_was(kind):
    """The evaluation-weights pattern: the model's state dict kept, fp32 weights of another kind (an fp32 average)
    loaded for an evaluation, the kept state dict loaded back before the next step: the run is bit-identical to one
    without the swap (the masters take a load's fp32 values only where the weights still hold them at the next
    step)."""

    def run(swap: bool) -> tuple:
        plugin = raw_plugin("bf16-true", kind)
        fabric, raw, model, opt = raw_setup(plugin, seed=0, optimizer="adam")
        for i, x in enumerate(raw_batches(5)):
            raw_train(fabric, model, opt, [x])
            if swap and i == 2:
                kept = {name: value.clone() for name, value in model.state_dict().items()}
                model.load_state_dict({name: value.float() + 1e-3 for name, value in kept.items()})
                model.eval()
                with torch.no_grad():
                    model(torch.ones(2, 8))
                model.train()
                model.load_state_dict(kept)
        return raw_params(raw), raw_held(plugin)

    swapped, plain = run(True), run(False)
    raw_assert_equal(swapped[0], plain[0], "weights")
    raw_assert_equal(swapped[1], plain[1], "masters")
