"""Callbacks that depend on the precision follow a change of it, whatever changed it: a PrecisionSchedule entry (by
step or epoch), the plugin's own ``set_precision``, a checkpoint resumed in another mode, a second fit with another
plugin. (PrecisionSchedule's own skip window and PrecisionMonitor's counts across fits: tests/test_callbacks_*.py.)

``lightning_mp.ThroughputMonitor``'s device peak (the denominator of ``device/mfu``) is the peak of the dtype each
batch ran in: against the peak Lightning's own ``ThroughputMonitor`` finds in a run started in that mode with
Lightning's plugin (the oracle), and against our monitor in a run started directly in the target mode. The device's
peak FLOPs are made up per dtype (a CPU has no entry in Lightning's table).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TinyRegressor, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.callbacks import throughput_monitor as throughput_module
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_mp import MPPlugin, NonFiniteDetector, PrecisionMonitor, PrecisionSchedule, ThroughputMonitor

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")

#: a made-up device: each dtype its own peak, so a stale peak shows
PEAKS = {torch.float32: 1.0e12, torch.bfloat16: 4.0e12, torch.float16: 3.0e12}
#: the dtype a mode's forward computes in (TinyRegressor.seen_dtypes records it per batch)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lightning_plugin(mode: str):
    """Lightning's own plugin of ``mode`` (the oracle's run); ``precision="16-mixed"`` would turn into bf16 on a CPU."""
    if mode == "fp32":
        return Precision()
    if mode == "bf16":
        return MixedPrecision("bf16-mixed", "cpu")
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))

#: every switch among the modes training can switch between
SWITCHES = [(a, b) for a in DTYPES for b in DTYPES if a != b]


@pytest.fixture(autouse=True)
def made_up_peaks(monkeypatch):
    monkeypatch.setattr(throughput_module, "get_available_flops", lambda device, dtype: PEAKS.get(dtype))


class Metrics(Logger):
    """Every ``log_metrics`` call, kept in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    name = property(lambda self: "metrics")
    version = property(lambda self: 0)

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Model(TinyRegressor):
    flops_per_batch = 10**9  # what ThroughputMonitor reads for device/flops_per_sec and device/mfu


def monitor() -> ThroughputMonitor:
    return ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)


def train(plugin, callbacks, max_steps=6, model=None, precision=None, ckpt_path=None, **kwargs):
    """A fit that logs every batch; the model (its ``seen_dtypes``) and the logged rows."""
    model = model or Model()
    logger = Metrics()
    trainer = make_trainer(
        plugin, max_steps=max_steps, callbacks=callbacks, logger=logger, log_every_n_steps=1, **kwargs,
        **({"precision": precision} if precision is not None else {}),
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model, logger.rows


def peak_per_batch(rows: list[dict[str, float]]) -> dict[int, float]:
    """The peak each logged training batch's device/mfu was computed against (batch index -> FLOPs)."""
    return {
        int(r["train/batches"]) - 1: r["train/device/flops_per_sec"] / r["train/device/mfu"]
        for r in rows
        if "train/device/mfu" in r
    }


def assert_peaks_follow_the_batches(rows, seen_dtypes, skip_batches=0):
    """Every MFU figure is against the peak of the dtype its batch computed in."""
    peaks = peak_per_batch(rows)
    assert peaks, "no device/mfu was logged"
    dtypes = seen_dtypes[skip_batches:]
    for batch, peak in peaks.items():
        assert peak == pytest.approx(PEAKS[dtypes[batch]], rel=1e-9), (batch, dtypes[batch], peak)


def lightning_peak(mode: str) -> float:
    """The oracle: the peak Lightning's own ThroughputMonitor uses in a run of Lightning's plugin of ``mode``."""
    own = LightningThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
    train(lightning_plugin(mode), [own], max_steps=1)
    assert own.available_flops is not None
    return own.available_flops


def direct(mode: str) -> ThroughputMonitor:
    """Our monitor in a run started directly in ``mode``."""
    started = monitor()
    train(MPPlugin(mode), [started], max_steps=1)
    return started


# ---------------------------------------------------------------------------------------------- ThroughputMonitor
@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "schedule-first"])
@pytest.mark.parametrize(("start", "target"), SWITCHES)
def test_mfu_follows_a_scheduled_switch(start, target, monitor_first):
    throughput = monitor()
    schedule = PrecisionSchedule({0: start, 3: target})
    callbacks = [throughput, schedule] if monitor_first else [schedule, throughput]
    trainer, model, rows = train(MPPlugin(start), callbacks, max_steps=6)
    assert model.seen_dtypes == [DTYPES[start]] * 3 + [DTYPES[target]] * 3  # the switch happened at step 3
    assert_peaks_follow_the_batches(rows, model.seen_dtypes)
    assert throughput.available_flops == lightning_peak(target) == direct(target).available_flops
    assert throughput.compute_dtype is DTYPES[target] is direct(target).compute_dtype


def test_mfu_follows_a_switch_at_an_epoch_start():
    throughput = monitor()
    schedule = PrecisionSchedule({0: "fp32", 1: "bf16"}, interval="epoch")
    _, model, rows = train(MPPlugin("fp32"), [schedule, throughput], max_steps=11)  # 8 batches an epoch
    assert model.seen_dtypes == [torch.float32] * 8 + [torch.bfloat16] * 3
    assert_peaks_follow_the_batches(rows, model.seen_dtypes)
    assert throughput.available_flops == lightning_peak("bf16")


class SwitchAt(Callback):
    """The user's own switch: ``MPPlugin.set_precision`` after a chosen optimizer step."""

    def __init__(self, step: int, mode: str) -> None:
        self.step, self.mode = step, mode

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.precision_plugin.set_precision(self.mode)


@pytest.mark.parametrize(("start", "target"), [("fp32", "bf16"), ("bf16", "fp16"), ("fp16", "fp32")])
def test_mfu_follows_the_plugins_own_switch(start, target):
    throughput = monitor()
    _, model, rows = train(MPPlugin(start), [throughput, SwitchAt(2, target)], max_steps=5)
    assert model.seen_dtypes == [DTYPES[start]] * 2 + [DTYPES[target]] * 3
    assert_peaks_follow_the_batches(rows, model.seen_dtypes)
    assert throughput.available_flops == lightning_peak(target)


def test_mfu_follows_a_resume_in_the_checkpoints_mode(tmp_path):
    plan = {0: "fp32", 3: "bf16"}
    trainer, _, _ = train(MPPlugin("fp32"), [PrecisionSchedule(plan)], max_steps=4, model=Model(batches_by_index=True))
    path = tmp_path / "bf16.ckpt"
    trainer.save_checkpoint(path)

    throughput = monitor()  # the resumed run starts with MPPlugin("fp32"); the checkpoint puts it in bf16
    _, model, rows = train(
        MPPlugin("fp32"), [throughput, PrecisionSchedule(plan)], max_steps=8, model=Model(batches_by_index=True),
        ckpt_path=path,
    )
    assert model.seen_dtypes == [torch.bfloat16] * 4
    peaks = peak_per_batch(rows)
    assert peaks and all(peak == pytest.approx(PEAKS[torch.bfloat16], rel=1e-9) for peak in peaks.values())
    assert throughput.available_flops == lightning_peak("bf16") and throughput.compute_dtype is torch.bfloat16


@pytest.mark.parametrize("second", ["fp16", "lightning-32-true", "lightning-bf16-mixed"])
def test_a_second_fit_with_another_plugin_uses_that_plugins_peak(second):
    throughput = monitor()
    train(MPPlugin("bf16"), [throughput], max_steps=3)
    assert throughput.compute_dtype is torch.bfloat16
    if second.startswith("lightning-"):
        precision = second.removeprefix("lightning-")
        _, model, rows = train(None, [throughput], max_steps=3, precision=precision)
        fresh = monitor()
        train(None, [fresh], max_steps=3, precision=precision)
    else:
        _, model, rows = train(MPPlugin(second), [throughput], max_steps=3)
        fresh = direct(second)
    assert_peaks_follow_the_batches(rows, model.seen_dtypes)
    assert throughput.available_flops == fresh.available_flops
    assert throughput.compute_dtype is fresh.compute_dtype  # None with Lightning's plugins: their dtype is theirs


# ---------------------------------------------------------------------------------------------- PrecisionMonitor
class ScaleAfterStep(Callback):
    """The oracle: the loss scale of the scaler the step ran with, read after the step (``None``: not scaled)."""

    def __init__(self) -> None:
        self.scales: list = []
        self._scaler = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._scaler = trainer.scaler  # MPPlugin.scaler: the scaler that scales, or None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(None if self._scaler is None else self._scaler.get_scale())


@pytest.mark.filterwarnings("ignore:MPPlugin. init_scale set, but precision=")  # (the scale is for the fp16 steps)
@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "schedule-first"])
@pytest.mark.parametrize(("start", "target"), [("bf16", "fp16"), ("fp16", "bf16"), ("fp32", "fp16")])
def test_precision_monitor_logs_the_loss_scale_of_the_mode_each_step_ran_in(tmp_path, start, target, monitor_first):
    """A schedule that switches at the end of a step, ahead of the monitor in the callbacks, changes the scaler
    before the monitor reads the step's figures: the step's own loss scale is logged, and only for fp16 steps."""
    precision = PrecisionMonitor(log_every_n_steps=1)
    oracle = ScaleAfterStep()
    schedule = PrecisionSchedule({0: start, 2: target, 4: start})
    callbacks = [oracle, precision, schedule] if monitor_first else [oracle, schedule, precision]
    _, model, rows = train(MPPlugin(start, init_scale=2.0**8), callbacks, max_steps=6)
    assert model.seen_dtypes == [DTYPES[start]] * 2 + [DTYPES[target]] * 2 + [DTYPES[start]] * 2
    logged = [r.get("precision/loss_scale") for r in rows if "precision/skipped_steps" in r]
    assert logged == oracle.scales
    assert [scale is not None for scale in logged] == [dtype is torch.float16 for dtype in model.seen_dtypes]
    assert [h.loss_scale for h in precision.history] == oracle.scales


# ---------------------------------------------------------------------------------------------- NonFiniteDetector
@pytest.mark.parametrize("detector_first", [True, False], ids=["detector-first", "schedule-first"])
def test_detector_tells_overflows_by_the_mode_each_batch_ran_in(detector_first):
    """An inf gradient from a finite forward pass is fp16's own overflow (the loss scaler skips it, not reported)
    and a fault in bf16: the same poisoned gradient before and after a switch is judged by the batch's mode."""
    detector = NonFiniteDetector(action="warn")
    schedule = PrecisionSchedule({0: "fp16", 3: "bf16"})
    callbacks = [detector, schedule] if detector_first else [schedule, detector]
    model = Model(poison_grad=(1, 4))
    with pytest.warns(UserWarning, match="NonFiniteDetector: inf/NaN at global step 4"):
        train(MPPlugin("fp16", init_scale=2.0**8), callbacks, max_steps=6, model=model)
    assert model.seen_dtypes == [torch.float16] * 3 + [torch.bfloat16] * 3
    assert [(r.batch_idx, r.backward.tensor) for r in detector.reports] == [(4, "gradient of parameter net1.weight")]
