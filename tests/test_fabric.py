"""MPFabricPrecision through a real Lightning ``Fabric`` on the CPU: tiny models, a few steps, numbers compared.

The oracles: Fabric's own precision plugin of the same mode (``MixedPrecision("16-mixed", "cpu")`` for fp16: Fabric
turns ``precision="16-mixed"`` into bf16 on the CPU), the state before a poisoned step, a run that never saw it, an
fp32 run for the master weights, the uninterrupted run for a resume.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Optional

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_mp import MPFabricPrecision, MPPlugin
from lightning_mp.guards import fp32_guard_of

MODES = ("fp32", "bf16", "fp16", "bf16-true", "fp16-true")
SCALING = ("fp16", "fp16-true")
TRUE_HALF = ("bf16-true", "fp16-true")
#: our plugin set up as Fabric's own plugin of the mode runs: GradScaler's initial scale, no master weights (Fabric's
#: optimizer steps the half weights), no loss scale in fp16-true (Fabric's ``16-true`` has none)
AS_FABRIC = {
    "fp16": {"init_scale": 2.0**16},
    "bf16-true": {"master_weights": "none"},
    "fp16-true": {"master_weights": "none", "loss_scale": 1.0},
}

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
]


def fabric_own(mode: str) -> Precision:
    """Fabric's own precision plugin of ``mode`` (on the CPU)."""
    return {
        "fp32": lambda: Precision(),
        "bf16": lambda: MixedPrecision("bf16-mixed", "cpu"),
        "fp16": lambda: MixedPrecision("16-mixed", "cpu"),
        "bf16-true": lambda: HalfPrecision("bf16-true"),
        "fp16-true": lambda: HalfPrecision("16-true"),
    }[mode]()


def ours(mode: str, **kwargs: Any) -> MPFabricPrecision:
    """Our plugin; fp16 modes from a modest loss scale, so that clean steps of the tiny models never overflow."""
    if mode in SCALING and "loss_scale" not in kwargs:
        kwargs.setdefault("init_scale", 2.0**8)
    return MPFabricPrecision(mode, **kwargs)


def mlp(seed: int = 0, norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16), *([nn.BatchNorm1d(16)] if norm else []), nn.GELU(), nn.Linear(16, 1)]
    return nn.Sequential(*layers)


class Scale(nn.Module):
    """``(weight * x).sum()``: the gradient of the weight is ``x`` itself, known exactly."""

    def __init__(self, n: int = 16, value: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((n,), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def batches(n: int, seed: int = 1, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 1, generator=g)) for _ in range(n)]


def poisoned(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch[0].clone(), batch[1]
    x[0, 0] = float("nan")
    return x, y


class Run:
    """A model and an SGD optimizer (momentum: an optimizer state) set up by a CPU ``Fabric`` with ``plugin``."""

    def __init__(self, plugin: Precision, model: Optional[nn.Module] = None, lr: float = 0.05,
                 momentum: float = 0.9, setup_optimizers: bool = False) -> None:
        self.plugin = plugin
        self.fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        raw = model if model is not None else mlp()
        optimizer = torch.optim.SGD(raw.parameters(), lr=lr, momentum=momentum)
        self.model, self.optimizer = self.fabric.setup(raw, optimizer)
        if setup_optimizers:
            plugin.setup_optimizers(self.optimizer)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def step(self, batch: Any, clip: Optional[dict] = None) -> Optional[torch.Tensor]:
        self.fabric.backward(self.loss(batch))
        norm = self.fabric.clip_gradients(self.model, self.optimizer, **clip) if clip else None
        self.optimizer.step()
        self.optimizer.zero_grad()
        return norm

    def window(self, micro: list, clip: Optional[dict] = None) -> None:
        """One optimizer step over ``micro`` micro-batches (gradient accumulation)."""
        for i, batch in enumerate(micro):
            with self.fabric.no_backward_sync(self.model, enabled=i < len(micro) - 1):
                self.fabric.backward(self.loss(batch) / len(micro))
        if clip:
            self.fabric.clip_gradients(self.model, self.optimizer, **clip)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state(self) -> dict[str, Any]:
        """Everything a skipped step must leave as it was, copied."""
        module = self.model.module
        state = {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }
        masters = getattr(self.plugin, "masters", None)
        if masters is not None:
            state["masters"] = copy.deepcopy(masters.state_dict())
        return state


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    """Bit-equality of nested dicts/lists/tensors (NaN equal to NaN at the same place)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a} != {b}"
        same = torch.equal(a, b) or bool((a.isnan() & b.isnan()).eq(a.ne(b)).all())
        assert same, f"{where}: differ by up to {(a.double() - b.double()).abs().max().item():g}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ---------------------------------------------------------------------------------------------- parity with Fabric
@pytest.mark.parametrize("mode", MODES)
def test_trains_as_fabrics_own_precision(mode):
    """Where no step is skipped, the same parameters and optimizer state as Fabric's own plugin, bit for bit."""
    data = batches(4)
    reference = Run(fabric_own(mode))
    run = Run(ours(mode, **AS_FABRIC.get(mode, {})))
    for batch in data:
        reference.step(batch)
        run.step(batch)
    assert_equal(run.state(), reference.state())
    assert run.model.module[0].weight.dtype == reference.model.module[0].weight.dtype
    assert run.plugin.stats.steps == 4
    if mode == "fp16":  # (GradScaler's 65536 overflows the tiny model's first steps: both skip them)
        assert run.plugin.stats.loss_scale == reference.plugin.scaler.get_scale()


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"])
def test_accumulation_with_no_backward_sync_as_fabrics_own(mode):
    """Two micro-batches a step through ``fabric.no_backward_sync``: as Fabric's own plugin, and one step each."""
    data = batches(6)
    reference = Run(fabric_own(mode))
    run = Run(ours(mode, **AS_FABRIC.get(mode, {})))
    for i in range(0, 6, 2):
        reference.window(data[i:i + 2])
        run.window(data[i:i + 2])
    assert_equal(run.state(), reference.state())
    assert run.plugin.stats.steps == 3


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("clip", [{"max_norm": 0.05}, {"clip_val": 0.01}], ids=["norm", "value"])
def test_clip_gradients_as_fabrics_own(mode, clip):
    """``fabric.clip_gradients`` by norm and by value: the same parameters, and the same total norm returned."""
    data = batches(3)
    reference = Run(fabric_own(mode))
    run = Run(ours(mode))
    for batch in data:
        expected = reference.step(batch, clip)
        norm = run.step(batch, clip)
        assert_equal(norm, expected)
    assert_equal(run.state(), reference.state())


# ---------------------------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("mode", MODES)
def test_a_step_with_nan_gradients_changes_nothing(mode):
    """A NaN input (gradients and BatchNorm statistics NaN): parameters, masters, optimizer state and buffers as
    before; the counters count it; the run goes on as a run that never saw the batch."""
    data = batches(4)
    run = Run(ours(mode), model=mlp(norm=True))
    for batch in data[:2]:
        run.step(batch)
    before = run.state()
    run.step(poisoned(data[2]))
    assert_equal(run.state(), before)
    stats = run.plugin.stats
    assert (stats.steps, stats.skipped_steps, stats.consecutive_skips, stats.skipped) == (3, 1, 1, True)
    if mode in SCALING:
        assert stats.loss_scale == 2.0**7  # backed off once
    run.step(data[3])
    assert (stats.steps, stats.skipped_steps, stats.consecutive_skips) == (4, 1, 0)

    clean = Run(ours(mode), model=mlp(norm=True))
    for batch in (data[0], data[1], data[3]):
        clean.step(batch)
    assert_equal(run.state(), clean.state())


@pytest.mark.parametrize("mode", MODES)
def test_a_poisoned_micro_batch_skips_its_window(mode):
    """Gradient accumulation: a NaN in the window's first micro-batch skips the window's step; the buffers its
    forward passes changed go back."""
    data = batches(4)
    run = Run(ours(mode), model=mlp(norm=True))
    run.window(data[:2])
    before = run.state()
    run.window([poisoned(data[2]), data[3]])
    assert_equal(run.state(), before)
    assert (run.plugin.stats.steps, run.plugin.stats.skipped_steps) == (2, 1)


@pytest.mark.parametrize("mode", MODES)
def test_clipping_by_value_cannot_hide_an_inf(mode):
    """An inf gradient clamped to ``clip_val`` is finite: the step is skipped all the same."""
    run = Run(ours(mode), model=Scale(), lr=0.1, momentum=0.0)
    x = torch.full((16,), 0.5)
    run.fabric.backward(run.model(x))
    run.optimizer.step()
    run.optimizer.zero_grad()
    before = run.state()
    x[3] = float("inf")
    run.fabric.backward(run.model(x))
    run.fabric.clip_gradients(run.model, run.optimizer, clip_val=0.25)
    run.optimizer.step()
    assert_equal(run.state(), before)
    assert run.plugin.stats.skipped_steps == 1


@pytest.mark.parametrize("mode", MODES)
def test_clipping_works_on_the_true_gradients(mode):
    """Clipping sees the unscaled gradients (fp16 modes), the ones the loop reads (true-half: the half gradients,
    as Fabric's own plugin clips them; the masters step them in fp32): ``Scale``'s gradient is its input, so the norm
    returned is the input's (in the gradients' dtype, as Fabric's plugins return it) and an SGD step of lr 1 moves
    each weight by the clamped input."""
    x = torch.arange(-8.0, 8.0) / 4  # (bf16 and fp16 hold these exactly)
    run = Run(ours(mode), model=Scale(), lr=1.0, momentum=0.0)
    run.fabric.backward(run.model(x))
    norm = run.fabric.clip_gradients(run.model, run.optimizer, max_norm=1e6)
    rel = {"bf16-true": 2.0**-8, "fp16-true": 2.0**-11}.get(mode, 1e-6)
    assert norm is not None and float(norm.detach()) == pytest.approx(float(x.norm()), rel=rel)
    run.optimizer.zero_grad()

    run = Run(ours(mode), model=Scale(), lr=1.0, momentum=0.0)
    run.fabric.backward(run.model(x))
    run.fabric.clip_gradients(run.model, run.optimizer, clip_val=0.5)
    run.optimizer.step()
    weight = run.plugin.masters.state_dict()["masters"]["weight"] if run.plugin.masters else run.model.weight
    assert torch.equal(weight.float(), 1.0 - x.clamp(-0.5, 0.5))


# ---------------------------------------------------------------------------------------------- master weights
@pytest.mark.parametrize("mode", TRUE_HALF)
def test_master_weights_learn_below_half_resolution(mode):
    """Updates below the half dtype's resolution: Fabric's own true-half run does not move, ours learns as the fp32
    run does (its fp32 masters are the fp32 run's weights, bit for bit; the model holds them rounded)."""
    x = torch.full((16,), 0.5)
    lr = 1e-4  # 1 - 5e-5 rounds back to 1 in bf16 and fp16

    def train(plugin: Precision) -> Run:
        run = Run(plugin, model=Scale(), lr=lr, momentum=0.0)
        for _ in range(20):
            run.fabric.backward(run.model(x))
            run.optimizer.step()
            run.optimizer.zero_grad()
        return run

    fabric_run, fp32_run, run = train(fabric_own(mode)), train(fabric_own("fp32")), train(ours(mode))
    assert torch.equal(fabric_run.model.weight.float(), torch.ones(16))  # Fabric's own: stuck
    assert float(fp32_run.model.weight.detach()[0]) < 1.0 - 1e-3
    masters = run.plugin.masters.state_dict()["masters"]["weight"]
    assert torch.equal(masters, fp32_run.model.weight.detach())
    assert torch.equal(run.model.weight.detach(), masters.to(run.model.weight.dtype))


# ---------------------------------------------------------------------------------------------- FP32 guards, teardown
class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.gate = Gate()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.norm(self.inner(x))))


GUARDED = ["defaults", "Gate"]  # the defaults (norms, softmax, losses) and a module of one's own


@pytest.mark.parametrize("mode", ["bf16", "fp16-true"])
def test_fp32_guards_run_modules_in_fp32(mode):
    """FP32 guards: a guarded module computes in fp32 (``Gate``, named in ``fp32_modules``), a guarded LayerNorm
    keeps fp32 weights in fp16-true where the rest is fp16; ``fp32_modules=[]`` leaves both to the mode."""
    seen: list[torch.dtype] = []
    half = torch.float16 if mode == "fp16-true" else torch.bfloat16
    for spec, inside in ((GUARDED, torch.float32), ([], half)):
        model = Normed()
        handle = model.gate.register_forward_hook(lambda module, args, out: seen.append(args[0].dtype))
        run = Run(ours(mode, fp32_modules=spec), model=model)
        seen.clear()
        run.step(batches(1)[0])
        assert seen == [inside]
        if mode == "fp16-true":
            assert model.norm.weight.dtype == (torch.float32 if spec else half)
            assert model.inner.weight.dtype == half
        handle.remove()
        run.plugin.teardown()


def hooks_of(module: nn.Module) -> list[tuple[str, int, int, bool]]:
    return [
        (name, len(sub._forward_hooks) + len(sub._forward_pre_hooks), len(sub.__dict__), fp32_guard_of(sub) is None)
        for name, sub in module.named_modules()
    ]


@pytest.mark.parametrize("mode", MODES)
def test_the_module_is_plain_after_teardown(mode):
    """While training the guards sit on the model; after ``plugin.teardown()`` nothing of the plugin is left on it
    (its class, hooks and attributes as a model never set up) or on the optimizer, and its weights are as Fabric's
    own plugin leaves them."""
    plain = hooks_of(Normed())
    model = Normed()
    run = Run(ours(mode, fp32_modules=GUARDED), model=model)
    run.step(batches(1)[0])
    assert fp32_guard_of(model.gate) is not None
    run.plugin.teardown()
    assert type(model) is Normed and hooks_of(model) == plain
    optimizer = run.optimizer.optimizer  # its state loads as torch's again (cast to the parameters' dtype)
    assert not optimizer._optimizer_load_state_dict_pre_hooks and not optimizer._optimizer_load_state_dict_post_hooks
    reference = Run(fabric_own(mode), model=Normed())
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        n: p.dtype for n, p in reference.model.module.named_parameters()}


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plugin_first", [False, True], ids=["model-first", "plugin-first"])
def test_save_load_resumes_bit_identically(mode, plugin_first, tmp_path):
    """``fabric.save``/``fabric.load`` with the plugin in the state: the loss scale, the counters and the master
    weights come back, and the resumed run ends where the uninterrupted one does (a skip on the way), whatever the
    order of the state dict."""
    data = batches(6)
    data[1] = poisoned(data[1])

    def fresh() -> Run:
        return Run(ours(mode), model=mlp(seed=5), setup_optimizers=True)

    whole = fresh()
    for batch in data:
        whole.step(batch)

    first = fresh()
    for batch in data[:3]:
        first.step(batch)
    parts = {"model": first.model, "optimizer": first.optimizer}
    state = {"precision": first.plugin, **parts} if plugin_first else {**parts, "precision": first.plugin}
    first.fabric.save(tmp_path / "ckpt.pt", state)

    resumed = fresh()
    parts = {"model": resumed.model, "optimizer": resumed.optimizer}
    state = {"precision": resumed.plugin, **parts} if plugin_first else {**parts, "precision": resumed.plugin}
    resumed.fabric.load(tmp_path / "ckpt.pt", state)
    assert (resumed.plugin.stats.steps, resumed.plugin.stats.skipped_steps) == (3, 1)
    assert resumed.plugin.stats.loss_scale == first.plugin.stats.loss_scale
    for batch in data[3:]:
        resumed.step(batch)
    assert_equal(resumed.state(), whole.state())
    assert_equal(resumed.plugin.state_dict(), whole.plugin.state_dict())


def test_a_resume_without_the_optimizers_known_warns(tmp_path):
    """Master weights in the checkpoint, but the optimizer unknown to the plugin when fabric.load ran: torch casts
    its state to bf16, and the plugin says how to keep it."""
    run = Run(ours("bf16-true"))
    run.step(batches(1)[0])
    run.fabric.save(tmp_path / "ckpt.pt", {"model": run.model, "optimizer": run.optimizer, "precision": run.plugin})
    resumed = Run(ours("bf16-true"))
    with pytest.warns(UserWarning, match="plugin.setup_optimizers"):
        resumed.fabric.load(tmp_path / "ckpt.pt", {"model": resumed.model, "optimizer": resumed.optimizer,
                                                  "precision": resumed.plugin})


# ---------------------------------------------------------------------------------------------- the plugin itself
def test_the_arguments_are_mpplugins():
    ours_ = inspect.signature(MPFabricPrecision.__init__).parameters
    theirs = inspect.signature(MPPlugin.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in ours_.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()]


def test_bad_arguments_raise_before_training():
    with pytest.raises(ValueError, match="precision"):
        MPFabricPrecision("fp12")
    with pytest.raises(ValueError, match="reduce_dtype='bf16'.*ddp_comm_hook"):
        MPFabricPrecision("bf16", reduce_dtype="bf16")
    assert repr(MPFabricPrecision("fp16", init_scale=1024.0)) == "MPFabricPrecision('fp16', init_scale=1024.0)"


def test_fp8_needs_transformer_engine_and_a_gpu():
    """``fp8`` is accepted; set-up on a machine that cannot run it fails with what it needs."""
    from lightning_mp.fp8 import FP8UnavailableError

    plugin = MPFabricPrecision("fp8")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    with pytest.raises(FP8UnavailableError, match="fp8"):
        fabric.setup(mlp())


def test_training_before_setup_says_what_to_do():
    plugin = MPFabricPrecision("bf16")
    with pytest.raises(Exception, match="fabric.setup"):
        plugin.pre_backward(torch.ones(()), None)


# ---------------------------------------------------------------------------------------------- DDP
def _ddp_train(fabric: Fabric, folder: str, value: float) -> None:
    """Six steps; at steps 2 and 3 rank 1 alone finds a non-finite gradient (written after DDP's all-reduce)."""
    model = fabric.setup(mlp(seed=fabric.global_rank))  # ranks initialised differently: DDP broadcasts rank 0's
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    for step, batch in enumerate(batches(6)):
        fabric.backward(nn.functional.mse_loss(model(batch[0]), batch[1]))
        if step in (2, 3) and fabric.global_rank == 1:
            next(model.parameters()).grad[0, 0] = value
        optimizer.step()
        optimizer.zero_grad()
    plugin = fabric.strategy.precision
    torch.save({"params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
                "stats": plugin.stats.as_dict(), "masters": plugin.masters.state_dict() if plugin.masters else None},
               f"{folder}/rank{fabric.global_rank}.pt")  # fmt: skip


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize(("mode", "value"), [("bf16", math.nan), ("fp16", math.inf), ("bf16-true", math.nan)])
def test_ddp_every_rank_skips_what_one_rank_sees(mode, value, tmp_path):
    """DDP on the CPU (gloo, 2 processes): an inf/NaN on one rank only skips the step on every rank; the ranks'
    weights, fp32 masters (ranks initialised differently) and counters stay the same."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork", plugins=[ours(mode)])
    fabric.launch(_ddp_train, str(tmp_path), value)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert_equal(ranks[0], ranks[1])
    assert (ranks[0]["stats"]["steps"], ranks[0]["stats"]["skipped_steps"]) == (6, 2)
    assert all(torch.isfinite(p).all() for p in ranks[0]["params"].values())
    assert (ranks[0]["masters"] is not None) == (mode == "bf16-true")


# ---------------------------------------------------------------------------------------------- the example
def test_the_fabric_example_trains_and_resumes(tmp_path):
    """``examples/fabric_bf16_true.py`` at a tiny size: trains, saves the plugin with the run, resumes its counters,
    and leaves the model plain."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)  # `examples` is a package at the repository root, not an installed one
    from examples.fabric_bf16_true import main

    tiny = ["--width=32", "--depth=1", "--heads=2", "--seq-len=32", "--batch-size=4", "--max-bytes=40000",
            "--accelerator=cpu", "--log-every=100"]
    first = main([*tiny, "--steps=3", f"--checkpoint={tmp_path / 'ckpt.pt'}"])
    assert first["step"] == 3 and first["stats"]["steps"] == 3 and torch.isfinite(torch.tensor(first["val_loss"]))
    assert first["model"].blocks[0].mlp[0].weight.dtype == torch.bfloat16
    resumed = main([*tiny, "--steps=4", f"--resume={tmp_path / 'ckpt.pt'}"])
    assert resumed["step"] == 4 and resumed["stats"]["steps"] == 4
    assert all(fp32_guard_of(m) is None and not m._forward_hooks for m in resumed["model"].modules())
