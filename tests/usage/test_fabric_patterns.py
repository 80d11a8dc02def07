"""Lightning Fabric features as Fabric's docs and examples use them, with ``MPFabricPrecision`` in every mode (and the
master-weight kinds where they matter): ``fabric.setup_module`` then ``fabric.setup_optimizers``,
``fabric.backward(loss, model=model)``, what ``fabric.clip_gradients`` returns, ``mark_forward_method`` and other
methods of the set-up model, ``fabric.init_module(empty_init=True)`` / ``fabric.init_tensor()``, a LightningModule
driven by Fabric (``fabric.call`` hooks, ``self.optimizers()``, ``self.manual_backward``, ``self.clip_gradients``),
``fabric.save(filter=...)`` and ``fabric.load(strict=False)`` of a partial state.

The oracles: Fabric's own precision plugin of the mode, with ours set up as it runs (``AS_FABRIC``: GradScaler's
scale, no master weights, Fabric's ``16-true`` scales no loss), the same program written the other usual way, the
uninterrupted run for a resume.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import Precision
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp import MPFabricPrecision

from .conftest import fabric_own

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
    pytest.mark.filterwarnings("ignore::lightning_mp.modes.PerformanceWarning"),  # fp16 on the CPU, on purpose
]

MODES = ("fp32", "bf16", "fp16", "bf16-true", "fp16-true")
TRUE_HALF = ("bf16-true", "fp16-true")
#: every mode, and the master-weight kinds of the true-half modes
CASES = [
    ("fp32", None), ("bf16", None), ("fp16", None),
    ("bf16-true", None), ("bf16-true", "kahan"), ("bf16-true", "stochastic"), ("bf16-true", "none"),
    ("fp16-true", None), ("fp16-true", "kahan"), ("fp16-true", "stochastic"), ("fp16-true", "none"),
]
IDS = [mode if kind is None else f"{mode}-{kind}" for mode, kind in CASES]
#: our plugin set up as Fabric's own of the mode runs
AS_FABRIC: dict[str, dict[str, Any]] = {
    "bf16-true": {"master_weights": "none"},
    "fp16-true": {"master_weights": "none", "loss_scale": 1.0},
}
DTYPE = {"fp32": torch.float32, "bf16": torch.float32, "fp16": torch.float32,
         "bf16-true": torch.bfloat16, "fp16-true": torch.float16}  # the weights' dtype after set-up


def _mse_loss_backward_mixes_dtypes() -> bool:
    """Whether this torch's ``mse_loss`` backpropagates a half input against an fp32 target (pytorch#36553: older
    torch fails in the backward, "Found dtype Float but expected BFloat16", whatever the precision plugin)."""
    out = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    try:
        nn.functional.mse_loss(out, torch.zeros(2)).backward()
    except RuntimeError:
        return False
    return True


#: a loss inside ``fabric.autocast()`` in a true-half mode (half outputs, fp32 targets) can backpropagate
MIXED_DTYPE_MSE_BACKWARD = _mse_loss_backward_mixes_dtypes()
NO_MIXED_DTYPE_MSE_BACKWARD = ("this torch's mse_loss cannot backpropagate a half output against an fp32 target "
                               "(pytorch#36553), with Fabric's own plugin as with ours")




def ours(mode: str, kind: Optional[str] = None, **kwargs: Any) -> MPFabricPrecision:
    if kind is not None:
        kwargs["master_weights"] = kind
    if mode.startswith("fp16") and "loss_scale" not in kwargs:
        kwargs.setdefault("init_scale", 2.0**8)
    return MPFabricPrecision(mode, **kwargs)


def as_fabric(mode: str) -> MPFabricPrecision:
    return ours(mode, **AS_FABRIC.get(mode, {}))


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def cpu(plugin: Precision) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, plugins=[plugin])


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    module = getattr(module, "module", module)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def assert_same(a: dict, b: dict, what: str = "weights") -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert a[name].dtype == b[name].dtype, f"{what} {name}: {a[name].dtype} vs {b[name].dtype}"
        diff = (a[name].double() - b[name].double()).abs().max().item()
        assert torch.equal(a[name], b[name]), f"{what} {name}: differs by up to {diff:g}"


def train(fabric: Fabric, model: nn.Module, opt: Any, data: list, named: bool = False) -> list[float]:
    """Steps over ``data``; ``named``: ``fabric.backward(loss, model=model)``."""
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss, **({"model": model} if named else {}))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


# ---------------------------------------------------------------------------------------------- set-up
@pytest.mark.parametrize(("mode", "kind"), CASES, ids=IDS)
def test_setup_module_then_setup_optimizers(mode, kind):
    """Fabric's other set-up: ``model = fabric.setup_module(model)``, the optimizer made from the set-up model's
    parameters, then ``fabric.setup_optimizers(optimizer)``: the run of ``fabric.setup(model, optimizer)``, bit for bit
    (master weights from the exact fp32 values included), with the weights in the mode's dtype."""
    data = batches(3)
    plugin = ours(mode, kind)
    fabric = cpu(plugin)
    model = fabric.setup_module(net())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4))
    losses = train(fabric, model, opt, data)

    together_plugin = ours(mode, kind)
    fabric = cpu(together_plugin)
    raw = net()
    together, together_opt = fabric.setup(raw, torch.optim.Adam(raw.parameters(), lr=1e-2, eps=1e-4))
    assert losses == train(fabric, together, together_opt, data)
    assert_same(params(model), params(together))
    assert {p.dtype for p in model.parameters()} == {DTYPE[mode]}
    assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    if plugin.masters is not None:
        assert_same(plugin.masters.state_dict().get("masters", {}),
                    together_plugin.masters.state_dict().get("masters", {}), "masters")  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_setup_module_then_setup_optimizers_as_fabrics_own(mode):
    data = batches(3)
    results = []
    for plugin in (fabric_own(mode), as_fabric(mode)):
        fabric = cpu(plugin)
        model = fabric.setup_module(net())
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        results.append((train(fabric, model, opt, data), params(model)))
    assert results[1][0] == results[0][0]
    assert_same(results[1][1], results[0][1])


# ---------------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize(("mode", "kind"), CASES, ids=IDS)
def test_backward_with_the_model_named(mode, kind):
    """``fabric.backward(loss, model=model)`` (the form Fabric asks for with several models): the run of
    ``fabric.backward(loss)``, bit for bit (set up as Fabric's own plugin, Fabric's own run: below)."""
    data = batches(3)
    runs = []
    for named in (False, True):
        plugin = ours(mode, kind)
        fabric = cpu(plugin)
        raw = net()
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        runs.append((train(fabric, model, opt, data, named), params(raw)))
        assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    assert runs[0][0] == runs[1][0]
    assert_same(runs[1][1], runs[0][1])


@pytest.mark.parametrize("mode", MODES)
def test_backward_with_the_model_named_as_fabrics_own(mode):
    data = batches(3)
    results = []
    for plugin in (fabric_own(mode), as_fabric(mode)):
        fabric = cpu(plugin)
        raw = net()
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        results.append((train(fabric, model, opt, data, named=True), params(raw)))
    assert results[1][0] == results[0][0]
    assert_same(results[1][1], results[0][1])


# ---------------------------------------------------------------------------------------------- clip_gradients
def clipped_run(plugin: Precision, data: list, clips: list[dict]) -> tuple[list, dict]:
    fabric = cpu(plugin)
    raw = net()
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    returned = []
    for (x, y), clip in zip(data, clips):
        fabric.backward(nn.functional.mse_loss(model(x), y) * 10, model=model)
        returned.append(fabric.clip_gradients(model, opt, **clip))
        opt.step()
        opt.zero_grad()
    return returned, params(raw)


CLIPS = [{"max_norm": 0.5}, {"clip_val": 0.01}, {"max_norm": 0.5, "norm_type": 1.0}, {"max_norm": 0.5}]


@pytest.mark.parametrize("mode", MODES)
def test_clip_gradients_returns_what_fabrics_own_returns(mode):
    """By norm: the total norm of the true gradients (unscaled in fp16, in the gradients' dtype), the norm type
    honoured; by value: ``None``; and the clipped steps: Fabric's own plugin's, bit for bit."""
    data = batches(len(CLIPS))
    theirs, their_params = clipped_run(fabric_own(mode), data, CLIPS)
    mine, my_params = clipped_run(as_fabric(mode), data, CLIPS)
    for clip, a, b in zip(CLIPS, mine, theirs):
        if "clip_val" in clip:
            assert a is None and b is None
        else:
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype == DTYPE[mode] and torch.equal(a, b), (a, b)
            assert math.isfinite(float(a)) and float(a) > clip["max_norm"]  # (so each of these steps clipped)
    assert_same(my_params, their_params)


@pytest.mark.parametrize(("mode", "kind"), [c for c in CASES if c[0] in TRUE_HALF or c[0] == "fp16"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] in TRUE_HALF or c[0] == "fp16"])
def test_the_first_clip_norm_with_master_weights_is_fabrics_own(mode, kind):
    """With any master-weight kind (and any loss scale in fp16) the norm of the first step, from the same weights, is
    the one Fabric's own plugin returns, in its dtype; an fp16 loss scale of 2**12 does not show in it."""
    data = batches(1)
    theirs, _ = clipped_run(fabric_own(mode), data, [{"max_norm": 0.5}])
    scale = {"init_scale": 2.0**12} if mode.startswith("fp16") else {}
    mine, _ = clipped_run(ours(mode, kind, **scale), data, [{"max_norm": 0.5}])
    assert mine[0].dtype == theirs[0].dtype and torch.equal(mine[0], theirs[0]), (mine[0], theirs[0])


# ---------------------------------------------------------------------------------------------- other methods
class Generator(nn.Module):
    """A forward and a ``generate`` that calls it several times, as a language model's sampling does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))

    def generate(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        outputs = []
        for _ in range(steps):
            x = self(x)
            outputs.append(x)
        return torch.stack(outputs)


@pytest.mark.parametrize("mode", MODES)
def test_a_marked_method_runs_as_under_fabrics_own(mode):
    """``model.mark_forward_method("generate")`` and ``model.generate(x)`` on one device, plain and inside
    ``fabric.autocast()``: the dtype and values Fabric's own plugin gives (on one device Fabric calls the method as it
    is, without the precision's conversions: true-half inputs are cast by the caller, as there), before and after a
    training step.

    The step trains through ``model(x)``: a loss through ``generate`` inside ``fabric.autocast()`` uses each weight
    three times in one autocast region, where Fabric's own plugin caches the weights' casts (torch's default) and so
    sums their three gradients in bf16/fp16 before the fp32 gradient; ours keeps no cast cache (an autocast region
    may hold an optimizer step, after which a cached cast would be stale) and sums them in fp32: the gradients differ
    in their last bits there, on purpose."""
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    outputs = []
    for plugin in (fabric_own(mode), as_fabric(mode)):
        fabric = cpu(plugin)
        raw = Generator()
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        model.mark_forward_method("generate")
        inputs = x.to(DTYPE[mode])
        seen = [model.generate(inputs)]
        with fabric.autocast():
            seen.append(model.generate(inputs))
        fabric.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            seen.append(model.generate(inputs))
            seen.append(model(x))
        outputs.append(seen)
    for i, (a, b) in enumerate(zip(*outputs)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i}: {a.dtype} vs {b.dtype}"


def _ddp_generate(fabric: Fabric, folder: str) -> None:
    model = fabric.setup_module(Generator())
    model.mark_forward_method("generate")
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(fabric.global_rank))
    out = model.generate(x)  # (through DDP's forward: the precision's conversions and autocast)
    model.eval()
    with torch.no_grad():
        evaluated = model.generate(x)
    torch.save({"out": out.detach(), "eval": evaluated, "x": x}, f"{folder}/rank{fabric.global_rank}.pt")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("mode", ["bf16", "bf16-true"])
def test_a_marked_method_runs_under_the_precision_through_ddp(mode, tmp_path):
    """Under DDP (2 CPU processes) a marked method goes through the wrapper's forward: inputs converted, the mode's
    autocast or half dtype, the output converted to fp32, as Fabric's own plugin: the values of the method run under
    the mode by hand."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork", plugins=[as_fabric(mode)])
    fabric.launch(_ddp_generate, str(tmp_path))
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        reference = Generator()
        if mode == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                expected = reference.generate(saved["x"])
        else:
            expected = reference.to(torch.bfloat16).generate(saved["x"].to(torch.bfloat16))
        for key in ("out", "eval"):
            assert saved[key].dtype == torch.float32
            assert torch.equal(saved[key], expected.detach().float()), (rank, key)


# ------------------------------------------------------------------------------------ init_module / init_tensor
@pytest.mark.parametrize(("mode", "kind"), CASES, ids=IDS)
def test_init_module_empty_init_and_init_tensor_dtypes_as_fabrics_own(mode, kind):
    """``fabric.init_module(empty_init=True)``: after ``fabric.setup`` the weights have the dtypes Fabric's own plugin
    gives them (before it, with master weights, ours are fp32 on purpose: the masters start from them);
    ``fabric.init_tensor()``: tensors in Fabric's own plugin's dtype, master weights or not."""
    dtypes = []
    for plugin in (fabric_own(mode), ours(mode, kind)):
        fabric = cpu(plugin)
        with fabric.init_module(empty_init=True):
            raw = net()
        with fabric.init_tensor():
            tensor = torch.empty(3)
            ones = torch.ones(2, 2)
        model = fabric.setup(raw)
        dtypes.append(({n: p.dtype for n, p in raw.named_parameters()}, tensor.dtype, ones.dtype,
                       model(torch.ones(2, 8)).dtype))  # fmt: skip
    assert dtypes[1] == dtypes[0]
    assert torch.get_default_dtype() == torch.float32


# ---------------------------------------------------------------------------------------------- a LightningModule
class LitRegressor(LightningModule):
    """A LightningModule written for Fabric: manual optimization through ``self.optimizers()``,
    ``self.manual_backward``, ``self.clip_gradients``; hooks Fabric calls with ``fabric.call``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = False
        self.calls: list[tuple] = []
        self.norms: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x.to(self.dtype)).float(), y)
        self.manual_backward(loss)
        if batch_idx % 2:
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="value")
        else:
            self.norms.append(self.fabric.clip_gradients(self, opt, max_norm=0.5))
        opt.step()
        opt.zero_grad()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2, eps=1e-4)

    def on_train_start(self) -> None:
        self.calls.append(("on_train_start", self.dtype, self.net[0].weight.dtype, self.device.type))

    def on_train_end(self) -> None:
        self.calls.append(("on_train_end", self.dtype))


def lit_run(plugin: Precision, data: list) -> tuple:
    fabric = cpu(plugin)
    lit = LitRegressor()
    model, opt = fabric.setup(lit, lit.configure_optimizers())
    fabric.call("on_train_start")
    losses = [float(model.training_step(batch, i)) for i, batch in enumerate(data)]
    fabric.call("on_train_end")
    return lit, losses


@pytest.mark.parametrize("mode", MODES)
def test_a_lightning_module_driven_by_fabric_as_under_fabrics_own(mode):
    """``fabric.setup(lightning_module, optimizer)``, ``fabric.call("on_train_start")``, ``training_step`` with
    ``self.optimizers()``, ``self.manual_backward``, ``self.clip_gradients`` and ``self.fabric.clip_gradients``: the
    hooks see the dtypes Fabric's own plugin gives; losses, norms and weights are its own, bit for bit."""
    data = batches(4)
    theirs, their_losses = lit_run(fabric_own(mode), data)
    mine, my_losses = lit_run(as_fabric(mode), data)
    assert mine.calls == theirs.calls
    assert mine.calls[0][1] == DTYPE[mode]
    assert my_losses == their_losses
    assert [(n.dtype, float(n)) for n in mine.norms] == [(n.dtype, float(n)) for n in theirs.norms]
    assert_same(params(mine), params(theirs))


@pytest.mark.parametrize(("mode", "kind"), [c for c in CASES if c[0] in TRUE_HALF and c[1] != "none"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] in TRUE_HALF and c[1] != "none"])
def test_a_lightning_module_driven_by_fabric_with_master_weights(mode, kind):
    """The same with master weights: the hooks see Fabric's dtypes, every step is taken, the masters step."""
    data = batches(4)
    theirs, _ = lit_run(fabric_own(mode), data)
    plugin = ours(mode, kind)
    mine, losses = lit_run(plugin, data)
    assert mine.calls == theirs.calls
    assert all(math.isfinite(loss) for loss in losses)
    assert plugin.stats.steps == 4 and plugin.stats.skipped_steps == 0
    assert plugin.masters is not None


# ---------------------------------------------------------------------------------------------- partial checkpoints
class Adapted(nn.Module):
    """A frozen base and a trained head (the fine-tuning layout whose checkpoints keep the trained part only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x)))


def adapted_run(mode: str, kind: Optional[str]) -> tuple:
    plugin = ours(mode, kind)
    fabric = cpu(plugin)
    raw = Adapted()
    model, opt = fabric.setup(raw, torch.optim.Adam(raw.head.parameters(), lr=1e-2, eps=1e-4))
    plugin.setup_optimizers(opt)  # (before fabric.load: the optimizer state stays fp32)
    return plugin, fabric, raw, model, opt


@pytest.mark.parametrize(("mode", "kind"), CASES, ids=IDS)
def test_save_with_a_filter_and_load_it_with_strict_false_resumes(mode, kind, tmp_path):
    """``fabric.save(path, state, filter={"model": trained_only})`` keeps the head's weights only; a fresh run
    (the same frozen base) loads it with ``fabric.load(path, state, strict=False)``: the plain values come back, the
    counters, and the rest of the run is the uninterrupted one's, bit for bit, master weights included."""
    data = batches(4)
    plugin, fabric, raw, model, opt = adapted_run(mode, kind)
    train(fabric, model, opt, data)
    whole = params(raw)

    plugin, fabric, raw, model, opt = adapted_run(mode, kind)
    train(fabric, model, opt, data[:2])
    fabric.save(tmp_path / "head.ckpt", {"model": model, "optimizer": opt, "precision": plugin, "step": 2},
                filter={"model": lambda name, value: name.startswith("head.")})  # fmt: skip
    saved = torch.load(tmp_path / "head.ckpt", weights_only=False)
    assert sorted(saved["model"]) == ["head.bias", "head.weight"]

    plugin, fabric, raw, model, opt = adapted_run(mode, kind)
    state = {"model": model, "optimizer": opt, "precision": plugin, "step": 0}
    remainder = fabric.load(tmp_path / "head.ckpt", state, strict=False)
    assert remainder == {} and state["step"] == 2
    assert plugin.stats.steps == 2
    train(fabric, model, opt, data[2:])
    assert_same(params(raw), whole)
    assert plugin.stats.steps == 4 and plugin.stats.skipped_steps == 0


@pytest.mark.parametrize("mode", MODES)
def test_load_a_partial_state_with_strict_false_as_fabrics_own(mode, tmp_path):
    """A checkpoint of model, optimizer, precision and a counter, loaded into ``{"model": model}`` only with
    ``strict=False``: Fabric hands back what it did not load, and the model trains on as under Fabric's own plugin
    doing the same (its own checkpoint)."""
    data = batches(4)
    results = []
    for make in (lambda: fabric_own(mode), lambda: as_fabric(mode)):
        plugin = make()
        fabric = cpu(plugin)
        raw = net()
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        train(fabric, model, opt, data[:2])
        fabric.save(tmp_path / "full.ckpt", {"model": model, "optimizer": opt, "precision": plugin, "step": 2})

        plugin = make()
        fabric = cpu(plugin)
        raw = net(seed=7)
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        remainder = fabric.load(tmp_path / "full.ckpt", {"model": model}, strict=False)
        assert sorted(remainder) == ["optimizer", "precision", "step"] and remainder["step"] == 2
        train(fabric, model, opt, data[2:])
        results.append(params(raw))
    assert_same(results[1], results[0])


# ------------------------------------------------------------------------------------- Fabric's own checkpoints
@pytest.mark.parametrize("mode", MODES)
def test_resume_from_a_checkpoint_of_fabrics_own_plugin(mode, tmp_path):
    """Switching to our plugin mid-project: a checkpoint saved by ``fabric.save`` under Fabric's own plugin, the plugin
    in the state (``{"precision": plugin}``: an empty entry in bf16-mixed, the true-half modes and 32-true,
    GradScaler's state in 16-mixed), loaded with ours in its place: it resumes, and set up as Fabric's own plugin the
    rest of the run is Fabric's own uninterrupted run, bit for bit."""
    data = batches(4)
    plugin = fabric_own(mode)
    fabric = cpu(plugin)
    raw = net()
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9))
    train(fabric, model, opt, data[:2])
    fabric.save(tmp_path / "own.ckpt", {"model": model, "optimizer": opt, "precision": plugin, "step": 2})
    train(fabric, model, opt, data[2:])
    theirs = params(raw)

    for make in (lambda: as_fabric(mode), lambda: ours(mode)):
        plugin = make()
        fabric = cpu(plugin)
        raw = net(seed=7)
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9))
        plugin.setup_optimizers(opt)
        state = {"model": model, "optimizer": opt, "precision": plugin, "step": 0}
        fabric.load(tmp_path / "own.ckpt", state)
        assert state["step"] == 2
        train(fabric, model, opt, data[2:])
        assert plugin.stats.steps == 2 and plugin.stats.skipped_steps == 0
        if plugin.settings == as_fabric(mode).settings:
            assert_same(params(raw), theirs)


# ---------------------------------------------------------------------------------------------- closures, autocast
def closure_run(plugin: Precision, data: list, optimizer: str, how: str) -> tuple[list, dict]:
    fabric = cpu(plugin)
    raw = net()
    opt = (torch.optim.LBFGS(raw.parameters(), lr=0.5, max_iter=3) if optimizer == "lbfgs"
           else torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9))  # fmt: skip
    model, opt = fabric.setup(raw, opt)
    losses = []
    for x, y in data:
        if how == "closure":
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                return loss

            losses.append(float(opt.step(closure).detach()))
        else:  # the forward and the loss inside fabric.autocast() (or not: ""), the backward and the step after it
            with fabric.autocast() if how == "autocast" else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    return losses, params(raw)


@pytest.mark.parametrize(("optimizer", "how"), [("sgd", "closure"), ("lbfgs", "closure"), ("sgd", "autocast")])
@pytest.mark.parametrize("mode", MODES)
def test_closures_and_fabric_autocast_as_fabrics_own(mode, optimizer, how):
    """``optimizer.step(closure)`` (SGD; LBFGS, which evaluates the closure itself several times) and a loss computed
    inside ``fabric.autocast()``: the losses returned and the weights are Fabric's own plugin's, bit for bit. fp16:
    Fabric's own ``GradScaler`` refuses closures; ours runs SGD's (the closure first, then the step) as the loop
    without one, and refuses LBFGS's with a dynamic loss scale, saying why. fp16-true as Fabric's own
    (``loss_scale=1.0``, an unscaled loss) runs LBFGS."""
    if how == "autocast" and mode in TRUE_HALF and not MIXED_DTYPE_MSE_BACKWARD:
        pytest.skip(NO_MIXED_DTYPE_MSE_BACKWARD)
    data = batches(3)
    if mode == "fp16" and how == "closure":
        if optimizer == "lbfgs":
            with pytest.raises(Exception, match="LBFGS evaluates its closure inside step.*loss_scale=1.0"):
                closure_run(as_fabric(mode), data, optimizer, how)
            return
        mine, plain = closure_run(as_fabric(mode), data, optimizer, how), closure_run(as_fabric(mode), data, "sgd", "")
        assert mine[0] == plain[0]
        assert_same(mine[1], plain[1])
        return
    theirs = closure_run(fabric_own(mode), data, optimizer, how)
    mine = closure_run(as_fabric(mode), data, optimizer, how)
    assert mine[0] == theirs[0]
    assert_same(mine[1], theirs[1])


@pytest.mark.parametrize(("mode", "kind"), [(m, None) for m in MODES] + [("bf16-true", "kahan")],
                         ids=[*MODES, "bf16-true-kahan"])
def test_a_nan_batch_inside_fabric_autocast_is_skipped(mode, kind):
    """The forward and loss inside ``fabric.autocast()`` (a BatchNorm model; the autocast and the model's own forward
    context nest): a NaN batch's step is skipped, weights and running statistics as before it, and the run goes on as
    one that never saw it."""
    if mode in TRUE_HALF and not MIXED_DTYPE_MSE_BACKWARD:
        pytest.skip(NO_MIXED_DTYPE_MSE_BACKWARD)

    def run(poison: bool) -> tuple:
        plugin = ours(mode, kind)
        fabric = cpu(plugin)
        torch.manual_seed(0)
        raw = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        data = batches(3)
        if poison:
            bad = data[1][0].clone()
            bad[0, 0] = float("nan")
            data.insert(1, (bad, data[1][1]))
        for i, (x, y) in enumerate(data):
            before = {**params(raw), **{n: b.clone() for n, b in raw.named_buffers()}}
            with fabric.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            if poison and i == 1:
                assert plugin.stats.skipped
                after = {**params(raw), **{n: b.clone() for n, b in raw.named_buffers()}}
                assert_same(after, before, "after the skipped step")
        return params(raw), {n: b.clone() for n, b in raw.named_buffers()}, plugin.stats.skipped_steps

    poisoned, clean = run(True), run(False)
    assert poisoned[2] == 1 and clean[2] == 0
    assert_same(poisoned[0], clean[0])
    assert_same(poisoned[1], clean[1], "buffers")


# ---------------------------------------------------------------------------------------------- evaluation first
@pytest.mark.parametrize("mode", MODES)
def test_an_evaluation_under_inference_mode_before_training(mode):
    """A loop that evaluates first under ``torch.inference_mode()`` (the plugin's first contact with the model is
    there), then trains, evaluating again between steps: as Fabric's own plugin, bit for bit (in fp16 the loss scale
    made at that first contact is an ordinary tensor, which the backward can use)."""
    data = batches(4)
    x_eval = torch.randn(6, 8, generator=torch.Generator().manual_seed(9))
    results = []
    for plugin in (fabric_own(mode), as_fabric(mode)):
        fabric = cpu(plugin)
        raw = net()
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        seen = []
        for i, (x, y) in enumerate(data):
            if i % 2 == 0:
                model.eval()
                with torch.inference_mode():
                    seen.append(model(x_eval).clone())
                model.train()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        results.append((seen, params(raw)))
    for a, b in zip(results[1][0], results[0][0]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert_same(results[1][1], results[0][1])


# ---------------------------------------------------------------------------------------------- messages
def test_messages_on_the_way_name_the_fabric_plugin(tmp_path):
    """What a Fabric user reads names ``MPFabricPrecision`` (the class in use), not the Trainer's plugin: the fp16
    optimizer-eps warning of a run without master weights, a resume in another mode, a precision entry that is not
    the plugin's."""
    plugin = MPFabricPrecision("fp16-true", master_weights="none", init_scale=2.0**8)
    fabric = cpu(plugin)
    raw = net()
    model, opt = fabric.setup(raw, torch.optim.Adam(raw.parameters(), lr=1e-3))
    with pytest.warns(UserWarning, match=r"^MPFabricPrecision\(precision='fp16-true', master_weights='none'\): the"
                                         r" optimizer's eps=1e-08 is 0"):
        plugin.setup_optimizers(opt)
    fabric.save(tmp_path / "run.ckpt", {"model": model, "optimizer": opt, "precision": plugin})

    plugin = ours("bf16-true")
    fabric = cpu(plugin)
    raw = net()
    model, opt = fabric.setup(raw, torch.optim.Adam(raw.parameters(), lr=1e-3))
    plugin.setup_optimizers(opt)
    with pytest.warns(UserWarning, match=r"^MPFabricPrecision: the checkpoint was written with precision='fp16-true'"):
        fabric.load(tmp_path / "run.ckpt", {"model": model, "optimizer": opt, "precision": plugin})
    with pytest.raises(ValueError, match=r"^The checkpoint's MPFabricPrecision entry has keys \['step'\] but no"):
        plugin.load_state_dict({"step": 3})
