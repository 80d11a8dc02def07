"""The share of each FP8 layer's values that its casts saturate or round to zero (``lightning_mp/fp8/shares.py``):
the counts against torchao's own casts, the figures ``PrecisionMonitor(fp8_layers=True)`` logs through the real
Trainer (torchao's real FP8 on the CPU; a Transformer Engine stand-in for delayed scaling, whose fixed scales make
known values saturate), measured on the logging steps only and leaving no hook behind, and compare's fp8 row.
"""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_mp.fp8.shares as shares
from lightning_mp import MPPlugin, PrecisionMonitor
from lightning_mp.fp8.shares import FP8ShareProbe, TensorCast, lost_counts, te_layers
from lightning_mp.tools.compare_engine import ModeResult, _merge_headroom
from lightning_mp.tools.compare_report import format_table
from test_callbacks_monitor import _FP8Net  # (the monitor tests' two-layer model)

try:
    import torchao.float8  # noqa: F401

    TORCHAO = None
except Exception as err:  # not installed, or built for another torch (0.18 needs torch >= 2.10)
    TORCHAO = f"torchao's float8 cannot be imported here: {err}"

needs_torchao = pytest.mark.skipif(TORCHAO is not None, reason=str(TORCHAO))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AO = {"backend": "torchao", "size_rule": "off", "keep_last": 0}
TINY = 1e-6  # x 448 (x 256 rowwise) stays at most half of E4M3's smallest subnormal (2**-10): rounded to zero
FIGURES = {f"{kind}_{tensor}" for kind in ("saturated", "underflow") for tensor in ("input", "weight", "grad")}


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao's float8 runs on the CPU (torch's FP8 matmul there): the GPU checks are what stands aside."""
    if TORCHAO is not None:
        pytest.skip(TORCHAO)
    import lightning_mp.fp8.support as support
    from lightning_mp.fp8.torchao_backend import TorchAOFloat8

    monkeypatch.setattr(TorchAOFloat8, "check", lambda self, device: None)
    monkeypatch.setattr(support, "fp8_device_problem", lambda *args, **kwargs: None)


@pytest.fixture
def passes(monkeypatch) -> list:
    """Every tensor the probe measured: (shape,) per pass."""
    seen: list = []
    real = shares.lost_counts

    def counting(x, cast):
        seen.append(tuple(x.shape))
        return real(x, cast)

    monkeypatch.setattr(shares, "lost_counts", counting)
    return seen


# --------------------------------------------------------------------------------------------- the counts
def test_counts_on_crafted_tensors():
    x = torch.ones(100)
    x[:10] = TINY
    x[10:15] = 0.0
    x[15] = 448.0  # dynamic scaling: 448 / amax 448 = 1
    assert lost_counts(x, TensorCast(E4M3)).tolist() == [0, 10, 95]  # [saturated, rounded to zero, non-zero]
    # a kept scale (delayed scaling): 2 x 300 > 448 saturates, inf and NaN count too; 2**-11 x 2 = 2**-10 rounds to 0
    y = torch.tensor([300.0, 300.0, 1.0, float("inf"), float("nan"), 2.0**-11, 2.0**-10, 0.0])
    assert lost_counts(y, TensorCast(E4M3, kept=lambda: torch.tensor(2.0))).tolist() == [4, 1, 7]
    # E5M2 gradients: max 57344, smallest subnormal 2**-16
    g = torch.tensor([60000.0, 1.0, 2.0**-17, 2.0**-16])
    assert lost_counts(g, TensorCast(E5M2, kept=lambda: 1.0)).tolist() == [1, 1, 4]
    # rowwise: each row from its own amax (a row of tiny values loses nothing)
    rows = torch.tensor([[1.0, TINY, 0.5, 1.0], [TINY, TINY, TINY, TINY]])
    assert lost_counts(rows, TensorCast(E4M3, rowwise=True)).tolist() == [0, 1, 8]
    assert lost_counts(rows, TensorCast(E4M3)).tolist() == [0, 5, 8]


@needs_torchao
@pytest.mark.parametrize("granularity, dtype, pow2", [
    ("TENSORWISE", E4M3, False), ("TENSORWISE", E5M2, False), ("AXISWISE", E4M3, True), ("AXISWISE", E4M3, False),
])
def test_underflow_counts_what_torchaos_own_cast_rounds_to_zero(granularity, dtype, pow2):
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-30, 4, (64, 96), generator=g).float())
    x[3, :7] = 0.0
    axiswise = ScalingGranularity[granularity]
    cast = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig(), scaling_granularity=axiswise,
                                       axiswise_dim=-1 if granularity == "AXISWISE" else None,
                                       round_scales_to_power_of_2=pow2)
    zeros = int(((cast._data.float() == 0) & (x != 0)).sum())
    saturated, flushed, nonzero = lost_counts(x, TensorCast(dtype, rowwise=granularity == "AXISWISE", pow2=pow2))
    assert zeros > 100 and int(flushed) == zeros and int(nonzero) == int((x != 0).sum()) and int(saturated) == 0


# --------------------------------------------------------------------------------------------- through the Trainer
class Net(_FP8Net):
    """Two FP8 layers (the monitor tests' model); the first one's input has a quarter of tiny values (``TINY``,
    rounded to zero by any scaling from the row's or tensor's largest |value| of 1), the rest +-[0.5, 1]."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = (torch.rand(64, 32, generator=g) * 0.5 + 0.5) * torch.randint(0, 2, (64, 32), generator=g).mul(2).sub(1)
        x[:, ::4] = TINY
        x[:, 1] = 1.0  # every row (and the tensor) has its amax at 1
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)


class Hooks(Callback):
    """The hooks on each FP8 layer: at every batch's start and end, and between forward and backward."""

    def __init__(self) -> None:
        self.start: list[int] = []
        self.mid: list[int] = []
        self.end: list[int] = []

    @staticmethod
    def count(pl_module) -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in (pl_module.net[0], pl_module.net[2]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start.append(self.count(pl_module))

    def on_before_backward(self, trainer, pl_module, loss):
        self.mid.append(self.count(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end.append(self.count(pl_module))


def fit(plugin, monitor, steps, tmp_path, callbacks=(), model=None, **kwargs):
    trainer = Trainer(accelerator="cpu", max_steps=steps, plugins=[plugin], callbacks=[monitor, *callbacks],
                      logger=CSVLogger(str(tmp_path), name="run"), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, **kwargs)
    trainer.fit(model if model is not None else Net())
    return trainer


def csv_rows(tmp_path) -> list[dict]:
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("recipe, grad_format", [("tensorwise", E5M2), ("rowwise", E4M3)])
def test_shares_are_measured_and_logged_on_the_logging_steps_only(fp8_on_cpu, passes, tmp_path, recipe, grad_format):
    monitor = PrecisionMonitor(log_every_n_steps=3, fp8_layers=True)
    hooks = Hooks()
    plugin = MPPlugin("fp8", fp8={**AO, "recipe": recipe})
    fit(plugin, monitor, 6, tmp_path, callbacks=[hooks], log_every_n_steps=3)
    # steps 3 and 6 only: per step and FP8 layer, its input, weight and output gradient once
    assert len(passes) == 2 * 2 * 3
    # each layer's input and weight in the forward, then the output gradients, last layer first
    assert passes[:6] == [(16, 32), (64, 32), (16, 64), (32, 64), (16, 32), (16, 64)]
    # the probe's two hooks per layer between forward and backward of steps 3 and 6, none at any batch's end
    baseline = hooks.start[0]
    assert hooks.end == [baseline] * 6 and hooks.start == hooks.mid  # (armed at the batch's start)
    assert [m - baseline for m in hooks.mid] == [0, 0, 4, 0, 0, 4]
    assert not plugin.stats._fp8_shares.armed
    lost = {k: v for k, v in monitor.last.items() if k.split("/")[1].removeprefix("fp8_") in FIGURES}
    assert {k.split("/", 2)[2] for k in lost} == {"net.0", "net.2"}
    assert {k.split("/")[1] for k in lost} == {f"fp8_{f}" for f in FIGURES}
    assert lost["precision/fp8_underflow_input/net.0"] == pytest.approx(0.25)  # the tiny quarter, exactly
    assert all(v == 0.0 for k, v in lost.items() if "saturated" in k)  # dynamic scaling saturates nothing finite
    assert all(0.0 <= v < 0.25 for k, v in lost.items() if k != "precision/fp8_underflow_input/net.0")
    # the CSV rows of the logging steps carry every share; the other steps' rows none
    rows = csv_rows(tmp_path)
    key = "precision/fp8_underflow_input/net.0"
    assert all(f"precision/fp8_{f}/net.2" in rows[0] for f in FIGURES)
    logged = [r for r in rows if r.get(key)]
    assert len(logged) == 2 and all(float(r[key]) == pytest.approx(0.25) for r in logged)
    assert plugin.stats.fp8_shares() == {}  # read: nothing is armed


def test_nothing_is_measured_without_fp8_layers(fp8_on_cpu, passes, tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=1, layer_stats=True)
    hooks = Hooks()
    plugin = MPPlugin("fp8", fp8=AO)
    fit(plugin, monitor, 3, tmp_path, callbacks=[hooks])
    assert passes == [] and not any(k.startswith("precision/fp8_") for k in monitor.last)
    assert hooks.mid == hooks.start  # the monitor's own layer hooks are on every step
    assert not any("fp8_" in k for k in csv_rows(tmp_path)[0])


def test_a_logging_step_without_backward_reports_its_forward_and_leaves_no_hooks(fp8_on_cpu, passes, tmp_path):
    class NoBackward(Net):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 3 else loss  # the last batch, the logging step's, runs no backward

    monitor = PrecisionMonitor(log_every_n_steps=4, fp8_layers=True)
    plugin = MPPlugin("fp8", fp8=AO)
    model = NoBackward()
    fit(plugin, monitor, -1, tmp_path, model=model, max_epochs=1)
    assert len(passes) == 2 * 2  # each layer's input and weight; no output gradient reached them
    assert not plugin.stats._fp8_shares.armed and Hooks.count(model) == 0  # every hook off at the end of fit
    lost = {k for k in monitor.last if "saturated" in k or "underflow" in k}
    assert lost == {f"precision/fp8_{kind}_{tensor}/{layer}" for kind in ("saturated", "underflow")
                    for tensor in ("input", "weight") for layer in ("net.0", "net.2")}
    assert monitor.last["precision/fp8_underflow_input/net.0"] == pytest.approx(0.25)


def test_gradient_accumulation_counts_every_micro_batch_of_the_logging_step(fp8_on_cpu, passes, tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=2, fp8_layers=True)
    fit(MPPlugin("fp8", fp8=AO), monitor, 2, tmp_path, accumulate_grad_batches=2, log_every_n_steps=2)
    assert len(passes) == 2 * 2 * 3  # the two micro-batches of step 2
    assert monitor.last["precision/fp8_underflow_input/net.0"] == pytest.approx(0.25)


# --------------------------------------------------------------------------------------------- delayed scaling
class DelayedScaling:
    """Stands in for Transformer Engine's recipe class."""

    fp8_format = "Format.HYBRID"


class _Meta:
    def __init__(self, scale: list[float]) -> None:
        self.scale = torch.tensor(scale)
        self.amax_history = torch.ones(1, len(scale))


class FakeTELinear(nn.Linear):
    """A Transformer Engine module's fp8_meta with fixed delayed-scaling scales: input x 2, weight x 4, output
    gradient x 1024."""

    def __init__(self) -> None:
        super().__init__(8, 8, bias=False)
        self.fp8_meta = {"recipe": DelayedScaling(), "scaling_fwd": _Meta([2.0, 4.0, 1.0]),
                         "scaling_bwd": _Meta([1024.0, 1.0])}


class DelayedNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = FakeTELinear()
        with torch.no_grad():
            self.layer.weight.fill_(0.125)
            self.layer.weight[:2] = 200.0  # x 4 = 800 > 448: a quarter saturates
        grad = torch.ones(4, 8)
        grad[:, :2] = 100.0  # x 1024 > 57344 (E5M2): a quarter saturates
        grad[:, 2:4] = 1e-9  # x 1024 below 2**-17: a quarter rounds to zero
        self.register_buffer("grad_out", grad)

    def training_step(self, batch, batch_idx):
        return (self.layer(batch[0]).float() * self.grad_out).sum()  # the output's gradient: grad_out

    def train_dataloader(self):
        x = torch.ones(16, 8)
        x[:, :2] = 300.0  # x 2 = 600 > 448: a quarter saturates
        x[:, 2] = 2.0**-12  # x 2 = 2**-11, below 2**-10: an eighth rounds to zero
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class DelayedProbe(Callback):
    """Hands the plugin's stats a probe on the stand-in's layers (as MPPlugin does for a Transformer Engine run)."""

    def on_fit_start(self, trainer, pl_module):
        probe = FP8ShareProbe(lambda: te_layers(pl_module, recipe="delayed", fp8_format="HYBRID"))
        trainer.precision_plugin.stats.set_fp8_shares(probe)


def test_delayed_scaling_uses_the_modules_own_scales(passes, tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=2, fp8_layers=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*fp8_layers=True\): the run has no FP8 layers")
        fit(MPPlugin("fp32"), monitor, 4, tmp_path, callbacks=[DelayedProbe()], model=DelayedNet(),
            log_every_n_steps=2)
    assert len(passes) == 2 * 3
    lost = {k.split("/")[1]: v for k, v in monitor.last.items() if k.endswith("/layer")}
    assert lost == {"fp8_saturated_input": 0.25, "fp8_underflow_input": pytest.approx(1 / 8),
                    "fp8_saturated_weight": 0.25, "fp8_underflow_weight": 0.0,
                    "fp8_saturated_grad": 0.25, "fp8_underflow_grad": 0.25}
    row = next(r for r in csv_rows(tmp_path) if r.get("precision/fp8_saturated_input/layer"))
    assert float(row["precision/fp8_saturated_grad/layer"]) == 0.25


def test_te_layers_follow_the_recipe():
    model = nn.Sequential(FakeTELinear(), nn.ReLU(), nn.Linear(8, 8))
    delayed = te_layers(model, recipe="delayed", fp8_format="HYBRID")
    assert list(delayed) == ["0"]
    cast_in, cast_w, cast_g = delayed["0"][1]
    assert (cast_in.dtype, cast_w.dtype, cast_g.dtype) == (E4M3, E4M3, E5M2)
    assert float(cast_w.kept()) == 4.0 and float(cast_g.kept()) == 1024.0
    del model[0].fp8_meta["scaling_bwd"]  # not run in FP8 yet: TE's first scale
    assert cast_g.kept() == 1.0
    current = te_layers(model, recipe="current", fp8_format="E4M3")["0"][1]
    assert all(c.kept is None and c.dtype == E4M3 and not c.rowwise for c in current)
    assert te_layers(model, recipe="mxfp8", fp8_format="E4M3") == {}  # per-block scales: not measured


# --------------------------------------------------------------------------------------------- compare's fp8 row
def test_compare_names_the_fp8_layer_losing_most():
    acc: dict = {}
    _merge_headroom(acc, {"precision/fp8_underflow_grad/blocks.0.fc1": 0.02,
                          "precision/fp8_saturated_weight/head": 0.0, "precision/fp8_input_amax/head": 9.0})
    _merge_headroom(acc, {"precision/fp8_underflow_grad/blocks.0.fc1": 0.01,
                          "precision/fp8_saturated_input/blocks.1.fc2": 0.031})
    assert acc == {"fp8_lost": (0.031, "blocks.1.fc2 input saturated")}
    rows = [ModeResult("fp8", step_ms=5.0, steps=5, skipped_steps=0, fp8_lost=0.031,
                       fp8_lost_layer="blocks.1.fc2 input saturated"),
            ModeResult("fp8:current", step_ms=5.0, steps=5, skipped_steps=0, fp8_lost=0.0, fp8_lost_layer="x grad"
                       " underflow")]
    table, _ = format_table(rows)
    assert "FP8 layer losing most blocks.1.fc2 input: 3.1 % saturated" in table
    assert "FP8 casts lost no values" in table
