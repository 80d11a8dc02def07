"""Fault injection under ``MPPlugin("fp8")``: where the fault enters × what × how the step runs, per recipe.

The FP8 column of tests/reliability/test_fault_matrix.py (which runs on the CPU and so cannot reach FP8). For
every cell the poisoned step changes nothing (parameters, optimizer state and LR bit-identical), the counters
follow the policy (one skipped step, no loss scale: fp8 runs in bf16 autocast), and training then recovers
(every other step moves the weights, the last loss is finite, Transformer Engine's delayed-scaling scales
stay finite).

The model is two ``nn.Linear(64, 64)`` (both dimensions divisible by 16, as FP8 GEMMs need; batches of 16
rows), both converted to ``te.Linear`` (``size_rule="off"``, ``keep_last=0``), so the poisoned activation
is the input of an FP8 GEMM.

Saturation (first seen on an H200 with Transformer Engine 2.20.2, then fixed): TE's casts to FP8 saturate
(``cvt.rn.satfinite``), so an inf/-inf activation entering an FP8 GEMM becomes +-448 / scale and the output, loss
and every gradient stay finite; the same for an inf loss when the last layer runs in FP8 without a bias (its output
gradient saturates). The gradient check alone let the optimizer step on it. The saturation sentinel
(lightning_mp.fp8.sentinel) now adds those to the step's verdict: from TE's own amaxes with delayed scaling (and
scrubs the poisoned step's amaxes so the history holds no inf), from checks of each FP8 GEMM's input and output
gradient with the other recipes. ``test_fp8_saturated_inf_activation_is_skipped`` and
``test_fp8_saturated_inf_loss_gradient_is_skipped`` were strict xfails before the fix.

Skipped unless CUDA, compute capability >= 8.9 and ``transformer_engine`` are present. Run on the GPU machine::

    source .te/te_install.sh && PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_fault_fp8.py

Imports only torch, lightning, Transformer Engine and lightning_mp (the GPU machine has no jsonargparse).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip(
        "needs a GPU with compute capability >= 8.9 and Transformer Engine (run on the GPU machine)",
        allow_module_level=True,
    )
pytest.importorskip("transformer_engine")

from conftest import StepRecorder, TinyRegressor, assert_state_equal, make_trainer  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_mp import MPPlugin  # noqa: E402
from lightning_mp.fp8 import fp8_scaling_state  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.fp8]

HIDDEN = 64
BATCH = 16
WHERE = ("loss", "grad", "activation")
WHAT = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
HOW = ("automatic", "accumulate4")
#: the cells where the inf saturates in the FP8 cast (see the module docstring): skipped through the sentinel
SATURATED = [("activation", what, how) for what in ("inf", "-inf") for how in HOW]
CELLS = [cell for cell in itertools.product(WHERE, WHAT, HOW) if cell not in SATURATED]
CONFIGS = [("delayed", "adam"), ("delayed", "adamw_fused"), ("current", "adam")]
CONFIG_IDS = ["delayed-adam", "delayed-fused", "current-adam"]
STEPS = 5
POISONED_STEP = 2
BASE_LR = 0.05  # TinyRegressor's; Adam/AdamW run at a fifth of it


class FP8Regressor(TinyRegressor):
    """TinyRegressor (its poison hooks, training step and optimizers) with 64-wide layers and 64-wide targets."""

    def __init__(self, bias: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net1 = nn.Linear(HIDDEN, HIDDEN)
        self.net2 = nn.Linear(HIDDEN, HIDDEN, bias=bias)
        self.poisoned = 0

    def _poison_grads(self) -> None:
        if self.batch_index in self.poison_grad:
            assert self.net1.weight.grad is not None, "no gradient of net1.weight to poison"
            self.net1.weight.grad[0, 0] = self.poison_value
            self.poisoned += 1

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, HIDDEN, generator=g)
        w = torch.randn(HIDDEN, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        y = x @ w + 0.1 * torch.randn(self.n, HIDDEN, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def te_linears(model: nn.Module) -> dict[str, nn.Module]:
    import transformer_engine.pytorch as te

    return {name: m for name, m in model.named_modules() if isinstance(m, te.Linear)}


def run_cell(recipe: str, optimizer: str, where: str, what: str, how: str, bias: bool = True) -> None:
    accumulate = 4 if how == "accumulate4" else 1
    # the poisoned micro-batch is the 2nd of optimizer step POISONED_STEP's window
    poisoned_batch = POISONED_STEP * accumulate + (1 if accumulate > 1 else 0)
    model = FP8Regressor(
        bias=bias,
        optimizer=optimizer,
        scheduler=True,
        batch_size=BATCH,
        n=BATCH * STEPS * accumulate,
        poison_value=WHAT[what],
        **{f"poison_{where}": (poisoned_batch,)},
    )
    plugin = MPPlugin("fp8", fp8={"recipe": recipe, "size_rule": "off", "keep_last": 0})
    seen_modes: list = []

    class SentinelMode(Callback):
        def on_train_start(self, trainer, pl_module):
            seen_modes.append(plugin._fp8.sentinel.mode)

    recorder = StepRecorder()
    trainer = make_trainer(
        plugin,
        max_steps=STEPS,
        callbacks=[recorder, SentinelMode()],
        accumulate_grad_batches=accumulate,
        accelerator="gpu",
    )
    trainer.fit(model)

    # both layers ran in FP8, and the fault really entered
    assert trainer.precision == "transformer-engine"
    assert plugin._fp8.sentinel.mode is None  # detached at teardown
    assert seen_modes == ["amax" if recipe == "delayed" else "hooks"]
    linears = te_linears(model)
    assert set(linears) == {"net1", "net2"} and all(m.fp8 for m in linears.values()), "not every layer ran in FP8"
    if where == "grad":
        assert model.poisoned == 1, f"the gradient was poisoned {model.poisoned} times"

    # the poisoned step changed nothing
    first, last = POISONED_STEP * accumulate, POISONED_STEP * accumulate + accumulate - 1
    assert_state_equal(recorder.before[first], recorder.after[last])
    # every other step moved the weights
    for step in range(STEPS):
        if step != POISONED_STEP:
            a, b = recorder.before[step * accumulate], recorder.after[step * accumulate + accumulate - 1]
            assert not torch.equal(a["params"]["net1.weight"], b["params"]["net1.weight"]), f"step {step} did not move"
    # counters and LR follow the policy: one skip, no loss scale, the scheduler held once
    stats = plugin.stats.as_dict()
    assert (stats["steps"], stats["skipped_steps"], stats["consecutive_skips"]) == (STEPS, 1, 0), stats
    assert stats["loss_scale"] is None
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == BASE_LR * 0.2 * 0.5 ** (STEPS - 1)
    assert int(next(iter(opt.state.values()))["step"]) == STEPS - 1
    # and training recovered, FP8 scales included (delayed scaling keeps its last scale for a non-finite amax)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(model.losses[-1])
    for name, entry in fp8_scaling_state(model).items():
        for key in ("scale_fwd", "scale_bwd"):
            if key in entry:
                assert torch.isfinite(entry[key]).all() and (entry[key] > 0).all(), f"{name} {key}: {entry[key]}"
        for key in ("amax_history_fwd", "amax_history_bwd"):  # the poisoned step's amaxes were scrubbed
            if key in entry:
                assert torch.isfinite(entry[key]).all(), f"{name} {key} holds inf/NaN: {entry[key]}"


@pytest.mark.parametrize("recipe, optimizer", CONFIGS, ids=CONFIG_IDS)
def test_fault_matrix_fp8(recipe, optimizer, capsys):
    failures = []
    for where, what, how in CELLS:
        try:
            run_cell(recipe, optimizer, where, what, how)
        except AssertionError as err:
            first_line = str(err).splitlines()[0] if str(err) else "assertion failed"
            failures.append(f"fp8-{recipe}-{optimizer}/{where}/{what}/{how}: {first_line}")
    with capsys.disabled():
        print(f"\nfault matrix [fp8, {recipe}, {optimizer}]: {len(CELLS)} cells, {len(CELLS) - len(failures)} passed")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("cell", SATURATED, ids=["/".join(c) for c in SATURATED])
@pytest.mark.parametrize("recipe, optimizer", CONFIGS, ids=CONFIG_IDS)
def test_fp8_saturated_inf_activation_is_skipped(recipe, optimizer, cell):
    run_cell(recipe, optimizer, *cell)


@pytest.mark.parametrize("what", ["inf", "-inf"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_saturated_inf_loss_gradient_is_skipped(recipe, what):
    run_cell(recipe, "adam", "loss", what, "automatic", bias=False)
