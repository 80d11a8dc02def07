"""PrecisionMonitor: log what the precision machinery does, with any precision plugin.

When it reads what (automatic optimization; the order matters):

1. ``on_train_batch_start``: on a logging step with ``layer_stats=True``, forward hooks go on the chosen
   layers (and come off at the end of the batch); with ``fp8_layers=True``, ``StepStats.arm_fp8_shares()`` hooks the
   FP8 layers for the step (read at its end); between logging steps nothing is hooked.
2. ``on_before_optimizer_step``: the gradients are unscaled here (Lightning's ``MixedPrecision`` and
   ``FSDPPrecision`` unscale before this hook, ``MPPlugin`` too), except with a fused optimizer under a
   native scaler, which unscales inside its step: the monitor divides by the scale then. With a native
   scaler the step's inf/NaN verdict is added to device-side counters (no host sync); on logging steps the
   gradient norm and the per-layer gradient figures are computed.
3. ``on_train_batch_end``: after the optimizer step and the scaler update. On logging steps the figures
   are read (with ``MPPlugin``: one ``StepStats.as_dict()`` copy), agreed across ranks through torchmetrics,
   written to every logger at Lightning's own step index (in the same ``log_metrics`` call as the model's metrics
   of the step where Lightning writes those: one CSV row a step), and logged with ``pl_module.log(..., logger=False)``
   so that they reach ``trainer.callback_metrics`` (``EarlyStopping``, ``ModelCheckpoint``) and, with
   ``prog_bar=True``, the progress bar.

This module also holds :class:`ThroughputMonitor`: Lightning's, with the compute dtype read from ``MPPlugin``.
"""

from __future__ import annotations

import importlib.util
import math
import re
import weakref
from collections import defaultdict
from typing import Any, NamedTuple, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor as _LightningThroughputMonitor
from lightning.pytorch.callbacks import throughput_monitor as _throughput_module
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import Metric
from typing_extensions import override

from lightning_mp.callbacks._tensors import _floating_tensors, _local
from lightning_mp.modes import compute_dtype, running_mode
from lightning_mp.stats import StepStats

#: largest finite fp16 value and smallest positive normal fp16 value
FP16_MAX = float(torch.finfo(torch.float16).max)
FP16_TINY = float(torch.finfo(torch.float16).tiny)


class _Counts(NamedTuple):
    """The skip counts of a logging step: MPPlugin's ``StepStats``, or the monitor's own with a native scaler."""

    steps: int
    skipped_steps: int
    consecutive_skips: int
    loss_scale: Optional[float]  # None: the loss is not scaled
    spike_skips: Optional[int]  # None: the loss-spike guard is off


class _Scalars(NamedTuple):
    """The scalar figures of a logging step, agreed over ranks, in the order they are logged."""

    loss_scale: float
    skipped_steps: float
    skip_rate: float
    consecutive_skips: float
    grad_norm: float
    spike_skips: float


SCALAR_NAMES = _Scalars._fields
#: the scalar figures logged as integers
INTEGER_SCALARS = ("skipped_steps", "consecutive_skips", "spike_skips")


class _LayerOutput(NamedTuple):
    """One floating output of a reported layer, on a logging step (device values)."""

    absmax: Tensor
    nonfinite: Tensor  # elements
    numel: int


class _LayerGrads(NamedTuple):
    """A reported layer's parameter gradients on a logging step, over the optimizers that stepped in the batch."""

    absmax: Tensor  # unscaled
    underflow: Tensor | int  # elements (a sum of device counts; 0 for none)
    nonfinite: Tensor | int
    numel: int

    def merge(self, other: _LayerGrads) -> _LayerGrads:
        return _LayerGrads(
            torch.maximum(self.absmax, other.absmax),
            self.underflow + other.underflow,
            self.nonfinite + other.nonfinite,
            self.numel + other.numel,
        )


class _LayerMaxima(NamedTuple):
    """Per-layer largest values, one entry per reported layer; agreed over ranks by the maximum."""

    act_absmax: Any  # a device vector before the agreement, a list of floats after it
    grad_absmax: Any


class _LayerCounts(NamedTuple):
    """Per-layer element counts, one entry per reported layer; agreed over ranks by the sum."""

    act_nonfinite: Any  # a device vector before the agreement, a list of floats after it
    act_numel: Any
    grad_underflow: Any
    grad_nonfinite: Any
    grad_numel: Any


class _HistoryEntry(NamedTuple):
    """One logging step, for the plot (a plain tuple in checkpoints)."""

    step: int
    loss_scale: Optional[float]
    skipped_steps: int


class PrecisionMonitor(Callback):
    """Log the loss scale, skipped steps, gradient norm and, on request, per-layer fp16 headroom.

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.loggers import CSVLogger
        from lightning_mp import PrecisionMonitor

        trainer = Trainer(precision="16-mixed", logger=CSVLogger("logs"), max_steps=200,
                          callbacks=[PrecisionMonitor(layer_stats=True)])
        trainer.fit(model)   # logs/lightning_logs/version_0/metrics.csv: precision/loss_scale, ...
        trainer.callback_metrics["precision/skip_rate"]   # also there: EarlyStopping/ModelCheckpoint can watch it

    It needs a logger: a ``Trainer`` without one (``logger=False``) raises ``MisconfigurationException`` when
    ``fit`` starts, as Lightning's ``LearningRateMonitor`` does.

    Works with ``MPPlugin`` (reads ``plugin.stats``), with Lightning's ``MixedPrecision`` / ``FSDPPrecision``
    (reads ``trainer.scaler`` and the gradients of ``on_before_optimizer_step``), and with no scaler at all
    (``"bf16-mixed"``, ``"32-true"``: nothing is skipped, the loss scale is not logged). There, where no plugin can
    skip a step, the monitor also checks the loss and the weights on its logging steps and warns once (rank zero)
    when they turn inf/NaN: ``skip_rate`` would stay 0 beside a model that no longer trains.

    Logged every ``log_every_n_steps`` optimizer steps, at the step index Lightning's own metrics use:

    - ``precision/loss_scale``: the loss scale after the step's update (only when the step scaled the loss; with
      ``PrecisionSchedule``, the scale of the mode the step ran in, also when the schedule switches right after it);
    - ``precision/skipped_steps``: optimizer steps skipped for inf/NaN gradients so far;
    - ``precision/skip_rate``: the share of optimizer steps skipped since the previous logging step;
    - ``precision/spike_skips``: steps the loss-spike guard skipped so far (with ``MPPlugin(spike_sigma=...)``);
    - ``precision/consecutive_skips``: skipped steps in a row up to this step;
    - ``precision/grad_norm``: the 2-norm of the unscaled gradients of the logging step;
    - with ``layer_stats=True``, for each layer (modules that own parameters, or those ``layers`` matches):
      ``precision/act_absmax/<layer>`` (largest |output|), ``precision/act_headroom/<layer>``
      (log2(65504 / largest |output|): bits left before fp16 overflows; <= 0 means it would),
      ``precision/act_nonfinite/<layer>`` (share of inf/NaN output elements), ``precision/grad_absmax/<layer>``
      (largest |parameter gradient|, unscaled), ``precision/grad_headroom/<layer>`` (log2(65504 / (largest
      |gradient| x loss scale))), ``precision/grad_underflow/<layer>`` (share of gradient elements that are
      zero or, multiplied by the loss scale, below fp16's smallest normal 2**-14) and
      ``precision/grad_nonfinite/<layer>``.

    With several processes every figure is agreed through a torchmetrics ``Metric`` (maxima and element
    counts reduced over ranks), so every rank computes, and rank zero logs, the same numbers.

    Every figure is also logged through ``pl_module.log(name, value, logger=False)`` on the logging steps, so it
    lands in ``trainer.callback_metrics`` on every rank (and keeps its last value between logging steps):
    ``EarlyStopping(monitor="precision/skip_rate", mode="min")`` or ``ModelCheckpoint(monitor=...)`` can watch
    it. The loggers get the figures from the monitor itself (``logger=False`` there), at the monitor's own
    ``log_every_n_steps``, which may differ from the Trainer's.

    Cost: with ``MPPlugin`` or without a scaler nothing between logging steps (a few Python comparisons); with a
    native scaler, two or three tiny in-place device ops a step to count skips (no host sync); on logging steps
    a few host copies, one gradient-norm pass and, with ``layer_stats``, forward hooks on the chosen layers and
    a few reductions per layer output and gradient. Measured on the CPU (thread CPU time, small MLPs, 8 to 38 ms
    steps): within the measurement's +-3 % noise at the defaults, and with ``layer_stats=True`` every 10 steps.

    Args:
        log_every_n_steps: log every this many optimizer steps; ``None`` uses the Trainer's
            ``log_every_n_steps``.
        layer_stats: also log the per-layer figures (on logging steps only).
        layers: a regular expression; with ``layer_stats``, report the modules whose qualified name matches
            it (``re.search``) instead of the modules that own parameters.
        plot: a PNG path: at the end of fit, rank zero draws the loss scale and the skipped steps over the
            logging steps (needs matplotlib: ``pip install matplotlib``); when there is nothing to draw (no
            logging step ran) or the file cannot be written, a warning says why.
        prog_bar: also show the scalar figures (loss scale, skipped steps, skip rate, consecutive skips, gradient
            norm; not the per-layer ones) on the progress bar.
        fp8_layers: with ``MPPlugin("fp8")``, also log each FP8 layer's scaling as ``precision/fp8_<figure>/<layer>``
            (the backend's ``layer_stats()``: scale, amax, headroom) and the shares its casts lose in the logging
            step, ``fp8_saturated_<tensor>`` and ``fp8_underflow_<tensor>`` (:mod:`lightning_mp.fp8.shares`).
        moment_underflow: also log the share of the optimizers' Adam moments that are zero or subnormal in the dtype
            they are held in, ``precision/moment_underflow/exp_avg`` and ``.../exp_avg_sq`` (after the logging
            step; one pass over the moments then, none between logging steps). With
            ``MPPlugin(optimizer_states="bf16")`` it shows what bf16 moments lose; any optimizer that keeps
            ``exp_avg``/``exp_avg_sq`` state is read.
    """

    #: it reads gradients and never writes them: MPPlugin's verdict need not look again after this hook
    reads_gradients_only = True

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        layer_stats: bool = False,
        layers: Optional[str] = None,
        plot: Optional[str] = None,
        prog_bar: bool = False,
        fp8_layers: bool = False,
        moment_underflow: bool = False,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                f"log_every_n_steps={log_every_n_steps!r} is invalid: use an integer >= 1, or None for the"
                " Trainer's log_every_n_steps."
            )
        for name, flag in (("layer_stats", layer_stats), ("prog_bar", prog_bar), ("fp8_layers", fp8_layers),
                           ("moment_underflow", moment_underflow)):  # fmt: skip
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r} is invalid: use true or false.")
        self._layer_pattern: Optional[re.Pattern] = None
        if layers is not None:
            if not isinstance(layers, str) or not layers:
                raise ValueError(f"layers={layers!r} is invalid: use a regular expression string, or None.")
            try:
                self._layer_pattern = re.compile(layers)
            except re.error as err:
                raise ValueError(f"layers={layers!r} is not a valid regular expression: {err}.") from err
            if not layer_stats:
                rank_zero_warn(
                    "PrecisionMonitor: layers= is set but layer_stats=False; pass layer_stats=True to log them."
                )
        if plot is not None:
            if not isinstance(plot, str) or not plot:
                raise ValueError(f"plot={plot!r} is invalid: use a file path such as 'precision.png', or None.")
            if importlib.util.find_spec("matplotlib") is None:
                raise ModuleNotFoundError(
                    f"PrecisionMonitor(plot={plot!r}) needs matplotlib, which is not installed:"
                    " pip install matplotlib (or lightning-mp[plot]), or leave plot unset."
                )
        self.log_every_n_steps = log_every_n_steps
        self.layer_stats = layer_stats
        self.layers = layers
        self.plot = plot
        self.prog_bar = prog_bar
        self.fp8_layers = fp8_layers
        self.moment_underflow = moment_underflow

        #: the figures of the last logging step (the same numbers on every rank)
        self.last: dict[str, float] = {}
        #: ``(step, loss_scale or None, skipped_steps)`` per logging step, for the plot
        self.history: list[_HistoryEntry] = []

        self._every = 1
        self._names: list[str] = []  # qualified layer names
        self._modules: list[nn.Module] = []
        self._hooks: list[Any] = []  # (and the FP8 share probe, armed for the logging step)
        self._agreement: Optional[_RankAgreement] = None
        self._native = _NativeSkips()
        self._logging_step = False
        self._stepped = False
        self._step_scaler: Any = None  # the loss scaler the batch's optimizer step ran with (None: not scaled)
        self._grad_norm: Optional[Tensor] = None
        self._act: dict[int, list[_LayerOutput]] = defaultdict(list)  # per layer index
        self._grad: dict[int, _LayerGrads] = {}  # per layer index
        self._grad_scale_used = 1.0
        self._sharded = False  # FSDP / ModelParallel: each rank holds a shard of the gradients
        self._window_start: Optional[tuple[int, int]] = None  # (steps, skipped) at the previous logging step
        self._plugin: Optional[weakref.ref] = None  # the precision plugin whose counts the figures follow
        self._shared_row = _SharedRow()  # the figures of a step Lightning logs go into its row
        self._nonfinite: Optional[Tensor] = None  # a logging step's loss or weights hold inf/NaN (no plugin skips)
        self._ranks_nonfinite = False  # the same, agreed over ranks and read with the logged figures
        self._warned_nonfinite = False  # (once a fit)

    def __getstate__(self) -> dict[str, Any]:  # (a weak reference does not pickle, nor the wrapper of a running fit)
        return {**self.__dict__, "_plugin": None, "_shared_row": _SharedRow()}

    def _start_run(self) -> None:
        """Forget the counts of another precision plugin's run (what ``state_dict`` saves, and the last figures)."""
        self.last, self.history = {}, []
        self._native = _NativeSkips()
        self._window_start = None

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use `PrecisionMonitor` callback with `Trainer` that has no logger. Pass one, e.g."
                " `Trainer(logger=CSVLogger('logs'))`, or leave `logger` at its default."
            )
        plugin = trainer.precision_plugin
        if self._plugin is not None and self._plugin() is not plugin:
            # another plugin counts from its own start: a window or history of the last one would mix two runs
            # (a negative skip rate); a checkpoint given to fit restores them after this
            self._start_run()
        self._plugin = weakref.ref(plugin)
        self._warned_nonfinite = False
        # (Trainer.log_every_n_steps: set by Lightning's logger connector, not declared on the class)
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]
        self._every = self.log_every_n_steps if self.log_every_n_steps is not None else every
        self._names, self._modules = [], []
        if self.fp8_layers and not _runs_fp8(plugin):  # (warned once a fit)
            rank_zero_warn(_NO_FP8_LAYERS.format(type(plugin).__name__ + _in_mode(plugin)))
        if self.layer_stats:
            self._names, self._modules = _choose_layers(pl_module, self._layer_pattern)
            if not self._names:
                rank_zero_warn(
                    "PrecisionMonitor(layer_stats=True) found no layers to report"
                    + (f" matching layers={self.layers!r}." if self.layers else " (no module owns parameters).")
                )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        n_layers = len(self._names)
        n_max = len(_Scalars._fields) + len(_LayerMaxima._fields) * n_layers
        # and the non-finite loss or weights seen, and the sum of the squared gradient-norm shards
        n_sum = len(_LayerCounts._fields) * n_layers + 2
        self._agreement = _RankAgreement(n_max, n_sum).to(device)
        self._native.reset_device(device)
        self._shared_row.install(trainer)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()
        if self.plot is None or not trainer.is_global_zero:
            return
        why = _nothing_to_draw(self.history, self._every, trainer)
        if why is not None:
            if not getattr(trainer, "fast_dev_run", False):  # (Lightning said logging is off)
                rank_zero_warn(f"PrecisionMonitor(plot={self.plot!r}) drew nothing: {why}.")
            return
        try:
            _draw(self.history, self.plot, _precision_name(trainer))
        except (ImportError, OSError) as err:
            rank_zero_warn(f"PrecisionMonitor(plot={self.plot!r}) could not write the plot: {err}")
            return
        rank_zero_info(
            f"PrecisionMonitor: plotted the loss scale and skipped steps of {len(self.history)} logging steps"
            f" to {self.plot}"
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hooks()
        self._shared_row.remove()

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._every <= 0:
            return
        # the same rule as Lightning's should_update_logs: the batch that makes the n-th optimizer step
        self._logging_step = (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % self._every == 0
        if not self._logging_step:
            if self._hooks:  # the last logging step did not step (training_step returned None)
                self._remove_hooks()
                self._act.clear()
            return
        if self._names and not self._hooks:
            for i, module in enumerate(self._modules):
                self._hooks.append(module.register_forward_hook(self._forward_hook(i)))
        self._hooks += _arm_fp8_shares(trainer) if self.fp8_layers else []

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._stepped = True
        stats = _mp_stats(trainer)
        scaler = trainer.scaler
        self._step_scaler = scaler if scaler is not None and scaler.is_enabled() else None
        still_scaled = False
        if stats is None:
            self._native.steps += 1
            if scaler is not None and scaler.is_enabled():
                still_scaled = self._native.observe(scaler, optimizer)
        if not self._logging_step:
            return
        # gradient figures of the logging step: one norm pass, and per layer one pass per statistic
        scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
        seen_scale = scale if still_scaled else 1.0  # (still_scaled implies an enabled scaler)
        self._grad_scale_used = scale
        grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [g for g in grads if g.numel() > 0]
        if grads:
            norm = _total_norm(grads)
            norm = norm / seen_scale if seen_scale != 1.0 else norm
            self._grad_norm = norm if self._grad_norm is None else torch.sqrt(self._grad_norm**2 + norm**2)
        self._sharded = _grads_are_sharded(trainer)
        if self._names:
            _layer_grads(self._modules, self._grad, seen_scale, scale)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._stepped = self._stepped, False
        if not stepped:
            return  # an accumulation micro-batch (or a step that did not run): the step is not over
        step_scaler, self._step_scaler = self._step_scaler, None
        stats = _mp_stats(trainer)
        if stats is None:
            self._native.after_step(trainer.scaler)
        if self._logging_step:
            if not self._warned_nonfinite and stats is None and step_scaler is None:  # nothing skips such a step
                self._nonfinite = _nonfinite_flag(pl_module, outputs)
            self._log(trainer, pl_module, stats, step_scaler)
            self._logging_step = False
            self._remove_hooks()

    # ------------------------------------------------------------------ reading
    def _log(self, trainer: Trainer, pl_module: LightningModule, stats: Optional[StepStats], step_scaler: Any) -> None:
        counts = self._counts(trainer, stats, step_scaler)
        grad_norm, self._grad_norm = self._grad_norm, None
        scalars, maxima, sums = self._agree(counts, self._skip_rate(counts), grad_norm)
        self._act.clear()
        self._grad.clear()
        self._warn_if_nonfinite(trainer)
        figures = _scalar_figures(scalars, counts, grad_norm is not None)
        figures.update(_layer_figures(self._names, maxima, sums, self._grad_scale_used))
        figures.update(_fp8_figures(stats) if self.fp8_layers and stats is not None else {})
        figures.update(_moment_figures(trainer) if self.moment_underflow else {})
        self.last = figures
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # where Lightning logs this step's metrics
        self.history.append(
            _HistoryEntry(trainer.global_step, figures.get("precision/loss_scale"), int(scalars.skipped_steps))
        )
        # a step Lightning writes the model's metrics of: the figures join that write, one row (CSVLogger); a step
        # only the monitor logs: a row of its own, at the same step index
        if not self._shared_row.join(trainer, figures):
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=step)
        # callback_metrics (and the progress bar): CPU tensors, so a GPU run makes no host-to-device copies here
        scalar_names = {f"precision/{name}" for name in SCALAR_NAMES}
        scalar_metrics = {k: torch.tensor(float(v)) for k, v in figures.items() if k in scalar_names}
        layer_metrics = {k: torch.tensor(float(v)) for k, v in figures.items() if k not in scalar_names}
        for metrics, prog_bar in ((scalar_metrics, self.prog_bar), (layer_metrics, False)):
            if metrics:
                pl_module.log_dict(metrics, prog_bar=prog_bar, logger=False, on_step=True, on_epoch=False)

    def _counts(self, trainer: Trainer, stats: Optional[StepStats], step_scaler: Any) -> _Counts:
        """The counts after the step, and the loss scale of the scaler the step ran with: a callback ahead of this
        one (``PrecisionSchedule``) may have switched the mode since, and with it the scaler."""
        if stats is None:
            return _Counts(*self._native.read(), _scale_of(step_scaler), None)
        read = stats.as_dict()  # one host copy
        spikes = read.get("spike_skips") if getattr(stats, "_spike", None) is not None else None
        # (read's loss scale is the scaler's in force now: the step's unless the mode changed since)
        loss_scale = read["loss_scale"] if step_scaler is trainer.scaler else _scale_of(step_scaler)
        return _Counts(read["steps"], read["skipped_steps"], read["consecutive_skips"], loss_scale, spikes)

    def _skip_rate(self, counts: _Counts) -> float:
        """The share of optimizer steps skipped since the previous logging step (its window starts here)."""
        previous = self._window_start if self._window_start is not None else (0, 0)
        window = counts.steps - previous[0]
        self._window_start = (counts.steps, counts.skipped_steps)
        return (counts.skipped_steps - previous[1]) / window if window > 0 else 0.0

    def _agree(
        self, counts: _Counts, skip_rate: float, grad_norm: Optional[Tensor]
    ) -> tuple[_Scalars, _LayerMaxima, _LayerCounts]:
        """The figures agreed over ranks (through torchmetrics), read with one host copy."""
        agreement = self._agreement
        assert agreement is not None  # made in on_fit_start
        device = agreement.device
        nan = math.nan
        local = _Scalars(
            loss_scale=counts.loss_scale if counts.loss_scale is not None else nan,
            skipped_steps=counts.skipped_steps,
            skip_rate=skip_rate,
            consecutive_skips=counts.consecutive_skips,
            grad_norm=nan,
            spike_skips=counts.spike_skips if counts.spike_skips is not None else nan,
        )
        scalars = torch.tensor(local, dtype=torch.float64, device=device)
        norm_at = SCALAR_NAMES.index("grad_norm")
        maxima, sums = _layer_vectors(len(self._names), self._act, self._grad, device)
        squares = torch.zeros(2, dtype=torch.float64, device=device)  # [non-finite loss or weights, squared norm]
        nonfinite, self._nonfinite = self._nonfinite, None
        if nonfinite is not None:
            squares[0] = nonfinite.to(device=device, dtype=torch.float64)
        if grad_norm is not None:
            norm = grad_norm.to(device=device, dtype=torch.float64)
            if self._sharded:
                squares[1] = norm**2  # the norm over all shards: the square root of the sum over ranks
            else:
                scalars[norm_at] = norm  # replicated gradients (DDP): the same on every rank
        agreement.reset()
        agreement.update(torch.cat([scalars, *maxima]), torch.cat([*sums, squares]))
        agreed_max, agreed_sum = (v.reshape(-1) for v in agreement.compute())  # synced over ranks by torchmetrics
        if self._sharded and grad_norm is not None:
            agreed_max[norm_at] = agreed_sum[-1].sqrt()
        values = torch.cat([agreed_max, agreed_sum[:-1]]).tolist()
        self._ranks_nonfinite = values.pop() > 0  # any rank's loss or weights: read with the rest, no sync of its own
        n_scalars, n_maxima = len(_Scalars._fields), len(_LayerMaxima._fields) * len(self._names)
        return (
            _Scalars(*values[:n_scalars]),
            _LayerMaxima(*_per_layer(values[n_scalars : n_scalars + n_maxima], len(_LayerMaxima._fields))),
            _LayerCounts(*_per_layer(values[n_scalars + n_maxima :], len(_LayerCounts._fields))),
        )

    def _warn_if_nonfinite(self, trainer: Trainer) -> None:
        """Once a fit: the loss or the weights turned inf/NaN and no precision plugin skips such steps here."""
        if not self._ranks_nonfinite or self._warned_nonfinite:
            return
        self._ranks_nonfinite, self._warned_nonfinite = False, True
        plugin = type(trainer.precision_plugin).__name__
        rank_zero_warn(
            f"PrecisionMonitor: the loss or the weights hold inf/NaN at step {trainer.global_step}, and no precision"
            f" plugin skips such steps here ({plugin}, no loss scaler): precision/skip_rate stays 0 while the model"
            " no longer trains. lightning_mp.MPPlugin skips inf/NaN steps in every mode and stops a run that"
            " diverges; NonFiniteDetector names the module where the first inf/NaN appears."
        )

    # ------------------------------------------------------------------ per-layer figures (logging steps only)
    def _forward_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for t in _floating_tensors(output):
                t = _local(t.detach())
                self._act[index].append(_LayerOutput(_absmax(t), (~torch.isfinite(t)).sum(), t.numel()))

        return hook

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ plot and checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        steps, skipped, consecutive = self._native.read()
        return {
            "native_steps": steps,
            "native_skipped_steps": skipped,
            "native_consecutive_skips": consecutive,
            "window_start": list(self._window_start) if self._window_start is not None else None,
            "history": [list(h) for h in self.history],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._native.load(
            int(state_dict.get("native_steps", 0)),
            int(state_dict.get("native_skipped_steps", 0)),
            int(state_dict.get("native_consecutive_skips", 0)),
        )
        window = state_dict.get("window_start")
        self._window_start = (int(window[0]), int(window[1])) if window is not None else None
        self.history = [
            _HistoryEntry(int(s), None if v is None else float(v), int(k)) for s, v, k in state_dict.get("history", [])
        ]


class ThroughputMonitor(_LightningThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` (same arguments, same metrics), with the compute dtype read from ``MPPlugin``.

    Lightning's own looks up the device's peak FLOPs (for ``device/mfu``) by the plugin's class: every
    ``MixedPrecision`` subclass counts as fp16 unless ``precision == "bf16-mixed"``, so ``MPPlugin`` in ``fp32``,
    ``tf32``, ``bf16-true`` or ``fp8`` gets fp16's peak. This one uses the mode's dtype (``compute_dtype``:
    ``float32`` with TF32 when the run turns it on, ``bfloat16``, ``float16``, ``int8`` for FP8 as Lightning's
    ``transformer-engine`` precision does); with any other precision plugin it is Lightning's unchanged.

    The peak follows the mode in force at each batch, whatever changed it (a ``PrecisionSchedule`` entry,
    ``MPPlugin.set_precision``, a checkpoint resumed in another mode): at the start of every batch the mode is
    compared with the one the peak was looked up for (a few attribute reads; the table is read again only when
    it changed). ``device/mfu`` is Lightning's windowed figure: for ``window_size`` batches after a switch its
    throughput still counts batches of the previous mode, divided by the new mode's peak.

    Example::

        from lightning_mp import MPPlugin, ThroughputMonitor

        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
        Trainer(plugins=[MPPlugin("bf16-true")], callbacks=[monitor])   # device/mfu against the bf16 peak
    """

    #: the dtype the peak FLOPs were looked up for (``None`` before set-up or with another precision plugin)
    compute_dtype: Optional[torch.dtype] = None
    #: what the peak was looked up for: (mode name, TF32 in force, device); ``None``: Lightning's own look-up
    _peak_of: Optional[tuple[str, Optional[bool], torch.device]] = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # Lightning's look-up, right for any other precision plugin
        self.compute_dtype, self._peak_of = None, None  # (a fit before this one may have used MPPlugin)
        self._follow_precision(trainer)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._follow_precision(trainer)

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._follow_precision(trainer)

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._follow_precision(trainer)

    @override
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._follow_precision(trainer)

    def _follow_precision(self, trainer: Trainer) -> None:
        """Look the peak up for the mode in force, if it is not the one the peak was looked up for.

        Called at the start of each batch (not at its end: a switch at the end of a batch, by a callback that
        runs before this one, concerns the next batch) so that the batch's figure uses the mode it ran in.
        """
        plugin = trainer.precision_plugin
        mode = running_mode(plugin)
        if mode is None:
            return  # another precision plugin: Lightning's look-up at set-up stands (its dtype never changes)
        asked = getattr(getattr(plugin, "settings", None), "tf32", None)  # MPPlugin(tf32=...); None: the mode's
        tf32 = asked if asked is not None else mode.tf32
        device = trainer.strategy.root_device
        peak_of = (mode.name, tf32, device)
        if peak_of == self._peak_of:
            return
        self._peak_of = peak_of
        self.compute_dtype = compute_dtype(mode)
        self.available_flops = _available_flops(device, self.compute_dtype, tf32)
        for throughput in self._throughputs.values():
            throughput.available_flops = self.available_flops


def _available_flops(device: torch.device, dtype: torch.dtype, tf32: Optional[bool]) -> Optional[int]:
    """Lightning's peak-FLOPs table lookup; for fp32 with TF32 set by the run, the TF32 (or the plain fp32) peak."""
    if dtype is not torch.float32 or tf32 is None or device.type != "cuda":
        return _throughput_module.get_available_flops(device, dtype)
    # Lightning picks the TF32 peak from the matmul precision in force; the plugin sets it only at set-up, later
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        return _throughput_module.get_available_flops(device, dtype)
    finally:
        torch.set_float32_matmul_precision(saved)


# ---------------------------------------------------------------------------------------------- helpers
def _scalar_figures(scalars: _Scalars, counts: _Counts, has_grad_norm: bool) -> dict[str, float]:
    """The scalar figures by name, leaving out those the run does not have."""
    present = {
        "loss_scale": counts.loss_scale is not None,
        "grad_norm": has_grad_norm,
        "spike_skips": counts.spike_skips is not None,  # the loss-spike guard is on
    }
    return {
        f"precision/{name}": int(value) if name in INTEGER_SCALARS else value
        for name, value in scalars._asdict().items()
        if present.get(name, True)
    }


def _choose_layers(pl_module: nn.Module, pattern: Optional[re.Pattern]) -> tuple[list[str], list[nn.Module]]:
    """The reported layers' names and modules: those ``pattern`` matches, else the modules that own parameters."""
    names: list[str] = []
    modules: list[nn.Module] = []
    for name, module in pl_module.named_modules():
        if module is pl_module:
            continue
        if pattern is not None:
            chosen = pattern.search(name) is not None
        else:
            chosen = next(module.parameters(recurse=False), None) is not None
        if chosen:
            names.append(name)
            modules.append(module)
    return names, modules


def _layer_figures(names: list[str], maxima: _LayerMaxima, sums: _LayerCounts, scale: float) -> dict[str, float]:
    """The per-layer figures by name (``scale``: the loss scale the logging step's gradients were seen at)."""
    figures: dict[str, float] = {}
    for i, layer in enumerate(names):
        if sums.act_numel[i] > 0:
            figures[f"precision/act_absmax/{layer}"] = maxima.act_absmax[i]
            figures[f"precision/act_headroom/{layer}"] = _headroom(maxima.act_absmax[i])
            figures[f"precision/act_nonfinite/{layer}"] = sums.act_nonfinite[i] / sums.act_numel[i]
        if sums.grad_numel[i] > 0:
            figures[f"precision/grad_absmax/{layer}"] = maxima.grad_absmax[i]
            figures[f"precision/grad_headroom/{layer}"] = _headroom(maxima.grad_absmax[i] * scale)
            figures[f"precision/grad_underflow/{layer}"] = sums.grad_underflow[i] / sums.grad_numel[i]
            figures[f"precision/grad_nonfinite/{layer}"] = sums.grad_nonfinite[i] / sums.grad_numel[i]
    return figures


def _layer_grads(modules: list[nn.Module], per_layer: dict[int, _LayerGrads], seen_scale: float, scale: float) -> None:
    """Add each layer's parameter-gradient figures of this optimizer step to ``per_layer`` (device values)."""
    # |g_true| * scale < tiny  <=>  |g_seen| < tiny * seen_scale / scale
    threshold = FP16_TINY * seen_scale / scale
    with torch.no_grad():
        for i, module in enumerate(modules):
            grads = [_local(p.grad) for p in module.parameters(recurse=False) if p.grad is not None]
            grads = [g for g in grads if g.numel() > 0]
            if not grads:
                continue
            figures = _LayerGrads(
                absmax=torch.stack([_absmax(g) for g in grads]).max() / seen_scale,
                underflow=sum((g.abs() < threshold).sum() for g in grads),
                nonfinite=sum((~torch.isfinite(g)).sum() for g in grads),
                numel=sum(g.numel() for g in grads),
            )
            earlier = per_layer.get(i)  # several optimizers step in one batch
            per_layer[i] = figures if earlier is None else earlier.merge(figures)


def _layer_vectors(
    n: int, act: dict[int, list[_LayerOutput]], grad: dict[int, _LayerGrads], device: torch.device
) -> tuple[_LayerMaxima, _LayerCounts]:
    """This rank's per-layer figures as device vectors (zeros for a layer without outputs or gradients)."""
    f64 = torch.float64
    maxima = _LayerMaxima(*torch.zeros(len(_LayerMaxima._fields), n, dtype=f64, device=device))  # (row views)
    sums = _LayerCounts(*torch.zeros(len(_LayerCounts._fields), n, dtype=f64, device=device))
    for i, outputs in act.items():
        maxima.act_absmax[i] = torch.stack([o.absmax for o in outputs]).max().to(device, f64)
        sums.act_nonfinite[i] = torch.stack([o.nonfinite for o in outputs]).sum().to(device, f64)
        sums.act_numel[i] = float(sum(o.numel for o in outputs))
    for i, grads in grad.items():
        maxima.grad_absmax[i] = grads.absmax.to(device, f64)
        sums.grad_underflow[i] = torch.as_tensor(grads.underflow).to(device, f64)
        sums.grad_nonfinite[i] = torch.as_tensor(grads.nonfinite).to(device, f64)
        sums.grad_numel[i] = float(grads.numel)
    return maxima, sums


def _nothing_to_draw(history: list[_HistoryEntry], every: int, trainer: Trainer) -> Optional[str]:
    """Why the plot would be empty, or ``None`` when there is something to draw."""
    if history:
        return None
    if every <= 0:
        return "logging is off (the Trainer's log_every_n_steps=0); set PrecisionMonitor(log_every_n_steps=N)"
    return (
        f"no logging step ran: fit made {trainer.global_step} optimizer steps and the monitor logs every"
        f" {every}; pass a smaller log_every_n_steps"
    )


def _precision_name(trainer: Trainer) -> str:
    """The run's precision as the plot's title names it: the mode in force (``MPPlugin``), or Lightning's string."""
    mode = getattr(trainer.precision_plugin, "mode", None)
    return str(mode.name) if mode is not None else str(getattr(trainer.precision_plugin, "precision", "?"))


def _draw(history: list[_HistoryEntry], path: str, precision: str = "?") -> None:
    """Draw the loss scale and the skipped steps over the logging steps to a PNG file, titled with the precision
    (and, where the loss is not scaled, saying so: a run without skips is then one flat line at 0)."""
    from matplotlib.figure import Figure  # optional dependency, checked at construction

    steps = [h.step for h in history]
    scales = [h.loss_scale for h in history]
    skipped = [h.skipped_steps for h in history]
    has_scale = any(s is not None for s in scales)
    figure = Figure(figsize=(7, 5 if has_scale else 3), layout="constrained")
    axes = figure.subplots(2 if has_scale else 1, 1, sharex=True, squeeze=False)[:, 0]
    if has_scale:
        axes[0].step(steps, [s if s is not None else math.nan for s in scales], where="post")
        axes[0].set_yscale("log", base=2)
        axes[0].set_ylabel("loss scale")
    title = f"PrecisionMonitor: {precision}, {skipped[-1] if skipped else 0} skipped steps"
    axes[0].set_title(title if has_scale else f"{title} (no loss scale: {precision} does not scale the loss)")
    axes[-1].step(steps, skipped, where="post", color="tab:red")
    axes[-1].set_ylabel("skipped steps (total)")
    axes[-1].set_xlabel("optimizer step")
    figure.savefig(path, dpi=100)


class _SharedRow:
    """The monitor's figures in the row Lightning writes for the model's metrics of the same step.

    Lightning's logger connector hands each logger one ``log_metrics`` call per logged step (``CSVLogger``: one
    row); a second call for the step, the monitor's own, would be a second row. For the fit, the connector's
    ``log_metrics`` is wrapped (on that one object, removed at teardown) so that its next train-step write (the one
    ``update_train_step_metrics`` makes right after ``on_train_batch_end``) carries the figures too. Logging them
    through ``pl_module.log(logger=True)`` instead would write them again, stale, on later logged steps.
    """

    def __init__(self) -> None:
        self.pending: Optional[dict[str, float]] = None
        self._connector: Any = None
        self._wrapper: Any = None
        self._previous: Any = None

    def install(self, trainer: Trainer) -> None:
        self.remove()
        connector = trainer._logger_connector
        original = connector.log_metrics
        self._previous = connector.__dict__.get("log_metrics")  # another monitor's wrapper, or none

        def log_metrics(metrics: Any, step: Optional[int] = None) -> None:
            pending, self.pending = self.pending, None
            if pending is not None and step is None:  # the train step's write: Lightning's own step index
                metrics = {**metrics, **pending}
            else:
                self.pending = pending
            original(metrics, step)

        self._wrapper = log_metrics
        setattr(connector, "log_metrics", log_metrics)  # this trainer's connector only, until teardown
        self._connector = connector

    def remove(self) -> None:
        connector, self._connector, self.pending = self._connector, None, None
        if connector is None or connector.__dict__.get("log_metrics") is not self._wrapper:
            return
        if self._previous is not None:
            setattr(connector, "log_metrics", self._previous)
        else:
            del connector.log_metrics

    def join(self, trainer: Trainer, figures: dict[str, float]) -> bool:
        """Hand ``figures`` to the connector's write of this step, if it makes one (``Trainer(log_every_n_steps)``,
        the last step, ``fast_dev_run``; and only where the model logged something to write); ``False`` else."""
        connector = trainer._logger_connector
        if self._connector is not connector or not trainer.loggers:
            return False
        writes = connector.should_update_logs or getattr(trainer, "fast_dev_run", False)
        if not writes or not connector.metrics["log"]:
            return False
        self.pending = figures
        return True


#: the Adam moments ``moment_underflow`` reads
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _moment_figures(trainer: Trainer) -> dict[str, float]:
    """The share of each Adam moment's elements that are zero or subnormal in their dtype, over the optimizers and
    ranks (element counts summed: shards add up, replicas keep their share). Empty where no optimizer keeps them."""
    counts: dict[str, list[Tensor]] = {key: [] for key in _MOMENTS}
    sizes = dict.fromkeys(_MOMENTS, 0)
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            for key in _MOMENTS:
                value = state.get(key) if isinstance(state, dict) else None
                if isinstance(value, Tensor) and value.is_floating_point():
                    local = _local(value)
                    counts[key].append((local.abs() < torch.finfo(local.dtype).tiny).sum())
                    sizes[key] += local.numel()
    found = [key for key in _MOMENTS if counts[key]]
    if not found:
        return {}
    device = trainer.strategy.root_device
    totals = torch.tensor([[float(sizes[k]) for k in found]], dtype=torch.float64, device=device)
    totals = torch.cat([torch.stack([torch.stack(counts[k]).sum().to(device, torch.float64) for k in found])[None],
                        totals])  # fmt: skip
    agreed = trainer.strategy.reduce(totals, reduce_op="sum").tolist()  # (one host read, on logging steps)
    return {f"precision/moment_underflow/{k}": under / size if size else 0.0
            for k, under, size in zip(found, agreed[0], agreed[1])}  # fmt: skip


def _mp_stats(trainer: Trainer) -> Optional[StepStats]:
    """MPPlugin's StepStats (read fresh: each plugin has its own), or None for other plugins."""
    stats = getattr(trainer.precision_plugin, "stats", None)
    return stats if isinstance(stats, StepStats) else None


def _nonfinite_flag(pl_module: LightningModule, outputs: Any) -> Tensor:
    """Whether the step's loss or any weight (this rank's shard) holds inf/NaN, as a device value (no host sync)."""
    with torch.no_grad():
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        weights = [_local(p.detach()) for p in pl_module.parameters()]
        finite = [torch.isfinite(w).all() for w in weights if w.numel() > 0 and w.is_floating_point()]
        if isinstance(loss, Tensor) and loss.is_floating_point():
            finite.append(torch.isfinite(loss.detach()).all())
        if not finite:
            return torch.zeros((), dtype=torch.bool)
        device = finite[0].device
        return ~torch.stack([f.to(device) for f in finite]).all()


def _total_norm(grads: list[Tensor]) -> Tensor:
    with torch.no_grad():
        get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
        if get_total_norm is not None:
            return get_total_norm(grads, 2.0).float()
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).float() for g in grads]))


def _grads_are_sharded(trainer: Trainer) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))


def _absmax(t: Tensor) -> Tensor:
    """Largest |value| in one read-only pass (NaN if any NaN), as float32."""
    low, high = torch.aminmax(_local(t.detach()))
    return torch.maximum(high.float(), low.float().neg_())


def _scale_of(scaler: Any) -> Optional[float]:
    """A loss scaler's scale (``None`` for no scaler: the loss was not scaled)."""
    return scaler.get_scale() if scaler is not None else None


def _per_layer(values: list[float], n_figures: int) -> list[list[float]]:
    """``values`` (one figure's layers after another's) cut into ``n_figures`` lists of one entry per layer."""
    n = len(values) // n_figures
    return [values[k * n : (k + 1) * n] for k in range(n_figures)]


def _headroom(absmax: float) -> float:
    """Bits between ``absmax`` and fp16's largest value (inf for all-zero, -inf for inf, nan for nan)."""
    if math.isnan(absmax):
        return math.nan
    if absmax == 0:
        return math.inf
    if math.isinf(absmax):
        return -math.inf
    return math.log2(FP16_MAX / absmax)


class _NativeSkips:
    """Skip counters for a native ``torch.amp.GradScaler``, kept on the device between logging steps.

    The verdict comes from the scaler's per-optimizer ``found_inf`` when the gradients were unscaled before
    ``on_before_optimizer_step``; a fused optimizer unscales inside its step, so then a drop of the scale
    across the step tells (a native scaler backs off on every overflow).
    """

    def __init__(self) -> None:
        self.steps = 0  # host: optimizer steps seen
        self._init = (0, 0)
        self._skipped: Optional[Tensor] = None
        self._consecutive: Optional[Tensor] = None
        self._scale_before: Optional[Tensor] = None
        self._compare_scale = False

    def reset_device(self, device: torch.device) -> None:
        self._skipped = torch.full((), float(self._init[0]), dtype=torch.float32, device=device)
        self._consecutive = torch.full((), float(self._init[1]), dtype=torch.float32, device=device)
        self._scale_before = torch.zeros((), dtype=torch.float32, device=device)

    def observe(self, scaler: Any, optimizer: Any) -> bool:
        """Record this optimizer's verdict; returns whether its gradients are still scaled."""
        found = scaler._found_inf_per_device(optimizer)  # documented private accessor; {} until unscaled
        if found:
            flags = list(found.values())
            flag = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).amax()
            self._count(flag)
            return False
        scale = scaler._get_scale_async()
        if scale is not None and not self._compare_scale:
            assert self._scale_before is not None  # reset_device ran (on_fit_start)
            self._scale_before.copy_(scale, non_blocking=True)
            self._compare_scale = True
        return True

    def after_step(self, scaler: Any) -> None:
        if self._compare_scale and scaler is not None:
            scale = scaler._get_scale_async()
            assert self._scale_before is not None  # _compare_scale: observe wrote it
            if scale is not None:
                self._count(scale.to(self._scale_before.device) < self._scale_before)
        self._compare_scale = False

    def _count(self, flag: Tensor) -> None:
        assert self._skipped is not None and self._consecutive is not None  # reset_device ran (on_fit_start)
        flag = flag.to(device=self._skipped.device, dtype=torch.float32)
        self._skipped.add_(flag)
        self._consecutive.add_(1).mul_(flag)

    def read(self) -> tuple[int, int, int]:
        if self._skipped is None or self._consecutive is None:  # (set together)
            return self.steps, self._init[0], self._init[1]
        skipped, consecutive = torch.stack([self._skipped, self._consecutive]).tolist()
        return self.steps, int(skipped), int(consecutive)

    def load(self, steps: int, skipped: int, consecutive: int) -> None:
        self.steps = steps
        self._init = (skipped, consecutive)
        if self._skipped is not None and self._consecutive is not None:  # (set together)
            self._skipped.fill_(skipped)
            self._consecutive.fill_(consecutive)


class _RankAgreement(Metric):
    """Figures agreed over ranks: maxima (largest value on any rank) and sums (element counts).

    A torchmetrics aggregator over vectors: ``compute()`` gathers the states of every rank and reduces them
    with ``dist_reduce_fx``; on one process it returns them as they are.
    """

    full_state_update = False
    # the states add_state makes
    maxima: Tensor
    sums: Tensor

    def __init__(self, n_max: int, n_sum: int) -> None:
        super().__init__(sync_on_compute=True)
        self.add_state("maxima", default=torch.full((n_max,), -math.inf, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("sums", default=torch.zeros(n_sum, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, maxima: Tensor, sums: Tensor) -> None:
        self.maxima = torch.maximum(self.maxima, maxima.to(self.maxima))
        self.sums = self.sums + sums.to(self.sums)

    def compute(self) -> tuple[Tensor, Tensor]:
        return self.maxima, self.sums


def _runs_fp8(plugin: Any) -> bool:
    mode = getattr(plugin, "mode", None)
    return mode is not None and bool(getattr(mode, "fp8", False))


def _fp8_figures(stats: StepStats) -> dict[str, float]:
    """Each FP8 layer's scaling figures (:meth:`StepStats.fp8_layers`) and the shares its casts lost in this step
    (:meth:`StepStats.fp8_shares`, where the monitor armed them), as ``precision/fp8_<figure>/<layer>``."""
    return {
        f"precision/fp8_{figure}/{layer}": float(value)
        for per_layer in (stats.fp8_layers(), stats.fp8_shares())
        for layer, figures in per_layer.items()
        for figure, value in figures.items()
    }


def _arm_fp8_shares(trainer: Trainer) -> list[Any]:
    """Arm the FP8 share probe for the step (again at each of its micro-batches: the counts add up): ``[a handle]``
    whose ``remove()`` disarms it, or ``[]`` without FP8 layers."""
    stats = _mp_stats(trainer)
    return [_Disarm(stats)] if stats is not None and stats.arm_fp8_shares() else []


class _Disarm(NamedTuple):
    """Takes the FP8 share probe's hooks off with the monitor's own (``remove()``), read or not."""

    stats: StepStats

    def remove(self) -> None:
        self.stats.disarm_fp8_shares()


_NO_FP8_LAYERS = (
    "PrecisionMonitor(fp8_layers=True): the run has no FP8 layers to report (it needs MPPlugin('fp8'); the precision"
    " plugin is {})."
)


def _in_mode(plugin: Any) -> str:
    mode = getattr(plugin, "mode", None)
    return f" in {mode.name!r}" if mode is not None else ""
