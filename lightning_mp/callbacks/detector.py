"""NonFiniteDetector: name the module whose forward output, and the one whose gradient, first became inf/NaN.

How one training batch is watched (the order matters):

1. ``on_train_batch_start``: the batch's largest |value| (one reduction per floating tensor of the batch).
2. Forward hooks on the watched modules, in execution order: each floating output's largest |value|
   (``torch.linalg.vector_norm(ord=inf)``: one read-only reduction that propagates NaN and inf) is appended
   to a list on the device; with ``track_inputs`` also each positional input that no watched module produced
   (results of functional code between modules). A tensor hook on each such output and input does the same
   for its gradient during backward, so gradients are recorded in backward order.
3. ``on_before_backward``: the (scaled) loss.
4. ``on_before_optimizer_step``: every parameter gradient's largest |value| (fused ``_foreach_norm`` passes).
5. ``on_train_batch_end``: the lists become small device vectors plus one device flag, "anything
   non-finite?". Nothing is read on the host, except when
   - ``MPPlugin`` knows on the host that a step of the batch was skipped, of any optimizer (a non-fused
     optimizer: no extra sync),
   - the model runs on the CPU (a read costs nothing there),
   - every ``check_every_n_steps`` batches, at the end of fit, and when training stops with an exception,
   - every batch with ``dump_dir``, or with ``action="skip"`` when no loss scaler skips steps.
   Then the earliest non-finite batch since the last read is described: the first non-finite forward value
   (in execution order) and the first non-finite gradient (in backward order).

With a loss scaler that scales (fp16), a step whose forward pass was finite and whose first non-finite
gradient is an inf is the loss scaler's own overflow, which it handles by skipping the step and lowering the
scale: such steps are not reported unless ``report_overflows=True``. A NaN gradient is always reported.
"""

from __future__ import annotations

import math
import os
import re
import warnings
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, cast

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from typing_extensions import override

from lightning_mp.callbacks._tensors import _floating_tensors, _local
from lightning_mp.stats import NonFiniteTrainingError, StepStats

ACTIONS = ("raise", "warn", "skip")


@dataclass
class TensorFinding:
    """Where a non-finite value was first seen."""

    #: qualified name of the module (``""`` is the LightningModule itself); ``None`` for the batch and the loss
    module: Optional[str]
    module_type: Optional[str]
    #: which tensor: ``"output 0"``, ``"input 1"``, ``"batch"``, ``"loss"``, ``"gradient of output 0"``,
    #: ``"gradient of input 0"``, ``"gradient of parameter net1.weight"``
    tensor: str
    shape: Optional[list[int]]
    dtype: Optional[str]
    #: ``"nan"`` or ``"inf"`` (the largest |value| of the tensor)
    value: str
    #: the module's positional floating inputs: ``{"shape", "dtype", "absmax"}`` (``absmax`` is ``None`` when
    #: not recorded; with ``dump_dir`` also ``min``, ``max``, ``mean``, ``std``, ``nonfinite``)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    #: what produced it, in words
    explanation: str = ""


@dataclass
class NonFiniteReport:
    """One non-finite training batch, as ``NonFiniteDetector`` found it (``detector.reports``)."""

    step: int
    epoch: int
    batch_idx: int
    rank: int
    forward: Optional[TensorFinding]
    backward: Optional[TensorFinding]
    #: parameters whose gradient was non-finite at ``on_before_optimizer_step`` (first 10)
    nonfinite_params: list[str]
    #: other non-finite batches found in the same read (after this one)
    later_batches: int = 0
    #: later reads that found the same thing again (folded into this report instead of warning again)
    repeats: int = 0
    dump_path: Optional[str] = None
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain values only (what a dump file holds; ``torch.load(weights_only=True)`` reads it)."""
        return asdict(self)


class NonFiniteDetector(Callback):
    """Name the first module whose forward output, and the first whose gradient, became inf or NaN.

    Example::

        from lightning.pytorch import Trainer
        from lightning_mp import NonFiniteDetector

        detector = NonFiniteDetector(action="raise")
        trainer = Trainer(precision="16-mixed", callbacks=[detector])
        trainer.fit(model)
        # NonFiniteTrainingError: NonFiniteDetector: inf/NaN at global step 812 (epoch 0, batch 812)
        #   forward:  `blocks.3.fc2` (Linear): output 0 [8, 2048, 4096] torch.float16 is inf: `blocks.3.fc2`
        #             produced it from finite inputs
        #             its inputs: #0 [8, 2048, 16384] torch.float16 max|x|=2.1e+03
        #   backward: ...
        detector.reports[0].forward.module   # "blocks.3.fc2"

    Works with any precision plugin, ``MPPlugin`` or Lightning's. Between reads it keeps one largest-|value|
    figure per watched tensor on the device and never syncs; see the module docstring for when it reads.

    Cost: one read-only reduction (``torch.aminmax``) over each watched module output, each of their gradients
    and each parameter gradient, a step: on a GPU, bandwidth-bound, about the time it takes to read the
    activations and gradients once. Measured on the CPU (thread CPU time, MPPlugin("bf16"), an MLP of four
    Linear-LayerNorm-GELU blocks): +8 to +10 % of the step at width 512 / batch 64 (8 ms steps), +6 to +8 % at
    width 1024 / batch 256 (38 ms steps); ``track_inputs=True`` adds 1 to 2 points there, more in models with
    much functional code between modules. ``benchmarks/bench_overhead.py --modes mp-bf16+log,mp-bf16+detector``
    measures it on a GPU.

    Args:
        action: ``"raise"`` stops training with ``NonFiniteTrainingError``; ``"warn"`` warns and goes on;
            ``"skip"`` warns and makes sure the optimizer step changes nothing: ``MPPlugin`` and a native
            fp16 scaler already skip such steps; without a scaler the detector sets the gradients to ``None``
            before the step (one host sync a step, to decide). Lightning still steps LR schedulers then.
        check_every_n_steps: on a GPU, read the device flags every this many training batches when nothing else
            says a step was non-finite (the report still names the right step, up to this many batches late).
            On the CPU the flags are read every batch (it costs nothing there).
        modules: a regular expression: watch only modules whose qualified name matches it (``re.search``).
        leaves_only: watch only modules without children (``False``: containers too; their own code between
            children is then covered too, at more cost).
        track_inputs: also check positional inputs of watched modules that no watched module produced (the
            results of functional code between modules), and their gradients: reports then tell code between
            modules from the modules themselves exactly, and give every input's largest |value|. It reads
            those tensors too (in a transformer block about half as much again).
        report_overflows: also report fp16 loss-scale overflows (a finite forward pass whose first
            non-finite gradient is inf), which the loss scaler handles itself.
        dump_dir: a folder: for each reported batch, save the batch and the named modules' inputs to
            ``<dump_dir>/nonfinite_step<step>_rank<rank>.pt`` (``torch.load(..., weights_only=True)``). It
            keeps module inputs alive until the end of each batch and reads the flags every batch: a setting
            for a debugging run.
    """

    #: it reads gradients (``action="skip"`` clears them only where no loss scaler checks steps): MPPlugin's
    #: verdict need not look again after this hook
    reads_gradients_only = True

    def __init__(
        self,
        action: Literal["raise", "warn", "skip"] = "raise",
        check_every_n_steps: int = 50,
        modules: Optional[str] = None,
        leaves_only: bool = True,
        track_inputs: bool = False,
        report_overflows: bool = False,
        dump_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        if action not in ACTIONS:
            raise ValueError(f"action={action!r} is invalid: use one of {', '.join(repr(a) for a in ACTIONS)}.")
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps={check_every_n_steps!r} is invalid: use an integer >= 1.")
        self._pattern: Optional[re.Pattern] = None
        if modules is not None:
            if not isinstance(modules, str) or not modules:
                raise ValueError(f"modules={modules!r} is invalid: use a regular expression string, or None for all.")
            try:
                self._pattern = re.compile(modules)
            except re.error as err:
                raise ValueError(f"modules={modules!r} is not a valid regular expression: {err}.") from err
        for name, value in (
            ("leaves_only", leaves_only),
            ("track_inputs", track_inputs),
            ("report_overflows", report_overflows),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid: use true or false.")
        if dump_dir is not None and (not isinstance(dump_dir, str) or not dump_dir):
            raise ValueError(f"dump_dir={dump_dir!r} is invalid: use a folder path, or None.")
        self.action = action
        self.check_every_n_steps = check_every_n_steps
        self.modules = modules
        self.leaves_only = leaves_only
        self.track_inputs = track_inputs
        self.report_overflows = report_overflows
        self.dump_dir = dump_dir

        #: every non-finite batch reported so far
        self.reports: list[NonFiniteReport] = []
        self._names: list[str] = []
        self._types: list[str] = []
        self._handles: list[Any] = []
        self._param_names: dict[int, str] = {}
        self._root: Optional[Any] = None  # a weak reference to the LightningModule
        self._record: Optional[_BatchRecord] = None
        self._pending: list[_BatchRecord] = []
        self._produced: dict[int, tuple[Any, int]] = {}
        self._grad_hooked: dict[int, Any] = {}
        self._batches = 0
        self._skips_seen: Optional[int] = None  # MPPlugin's skipped steps at the previous batch's end
        self._last_step_seen = -1
        self._root_type = ""
        # reads cost nothing on the CPU; tests turn this off to exercise the delayed read
        self._read_every_batch_on_cpu = True

    # ------------------------------------------------------------------ set-up
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()
        self._root_type = type(pl_module).__name__
        self._names, self._types = [], []
        for name, module in pl_module.named_modules():
            if module is pl_module and name == "" and (self.leaves_only or self._pattern is not None):
                continue
            if self.leaves_only and next(module.children(), None) is not None:
                continue
            if self._pattern is not None and self._pattern.search(name) is None:
                continue
            index = len(self._names)
            self._names.append(name)
            self._types.append(type(module).__name__)
            self._handles.append(module.register_forward_hook(self._forward_hook(index), with_kwargs=False))
        self._param_names = {id(p): n for n, p in pl_module.named_parameters()}
        self._root = weakref.ref(pl_module)
        self._skips_seen = None  # (a checkpoint may still set the plugin's counts)
        if self.dump_dir is not None and trainer.is_global_zero:
            os.makedirs(self.dump_dir, exist_ok=True)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(trainer)
        self._remove_hooks()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # e.g. MPPlugin stopped after too many skipped steps: say which module produced them
        self._finish_record()
        try:
            self._check(trainer, stopping=True)
        except Exception as err:  # never hide the original error
            warnings.warn(f"NonFiniteDetector could not describe the non-finite steps: {err!r}")
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ recording
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        scaler = trainer.scaler
        scaled = scaler is not None and scaler.is_enabled() and getattr(scaler, "scaling", True)
        rec = _BatchRecord(trainer.global_step, trainer.current_epoch, batch_idx, scaled)
        self._record = rec
        self._produced.clear()
        self._grad_hooked.clear()
        batch_tensors = _floating_tensors(batch, skip_sparse=True)
        for k, t in enumerate(batch_tensors):
            slot = rec.push_fwd(t, ("batch", -1, k))
            self._produced[id(t)] = (weakref.ref(t), slot)
        if self.dump_dir is not None:
            rec.batch = batch

    def _forward_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            rec = self._record
            if rec is None:
                return
            call = len(rec.calls)
            inputs = []
            for k, t in enumerate(_floating_tensors(args, skip_sparse=True)):
                slot = self._slot_of(t)
                if slot is None and self.track_inputs:
                    slot = rec.push_fwd(t, ("input", call, k))
                    self._produced[id(t)] = (weakref.ref(t), slot)
                    self._watch_grad(rec, t, ("input", call, k))
                inputs.append((tuple(t.shape), t.dtype, slot))
            outputs = []
            for k, t in enumerate(_floating_tensors(output, skip_sparse=True)):
                slot = rec.push_fwd(t, ("output", call, k))
                self._produced[id(t)] = (weakref.ref(t), slot)
                self._watch_grad(rec, t, ("output", call, k))
                outputs.append((tuple(t.shape), t.dtype, slot))
            rec.calls.append((index, inputs, outputs))
            if self.dump_dir is not None:
                held = [t for t in _floating_tensors(args, skip_sparse=True)]
                rec.held[call] = [(t, t._version) for t in held]

        return hook

    def _slot_of(self, t: Tensor) -> Optional[int]:
        entry = self._produced.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def _watch_grad(self, rec: _BatchRecord, t: Tensor, event: tuple[str, int, int]) -> None:
        if not (t.requires_grad and torch.is_grad_enabled()):
            return
        seen = self._grad_hooked.get(id(t))
        if seen is not None and seen() is t:
            return
        self._grad_hooked[id(t)] = weakref.ref(t)

        def grad_hook(grad: Tensor) -> None:
            if grad is not None and not grad.is_sparse and grad.numel() > 0:
                rec.push_bwd(grad, event)

        t.register_hook(grad_hook)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        rec = self._record
        if rec is not None and isinstance(loss, Tensor) and loss.is_floating_point() and loss.numel() > 0:
            rec.push_fwd(loss, ("loss", -1, 0))

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        rec = self._record
        if rec is None:
            return
        grouped: dict[tuple[torch.device, torch.dtype], list[tuple[str, Tensor]]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                g = _local(g)
                g = g._values() if g.is_sparse else g
                if g.numel() == 0:
                    continue
                grouped[(g.device, g.dtype)].append((self._param_name(trainer, p), g))
        maxima = []
        for entries in grouped.values():
            maxima.append(_absmax_each([g for _, g in entries]))
            rec.par_names.extend(n for n, _ in entries)
        rec.par_values.extend(maxima)
        # (MPPlugin skips in every mode unless told not to; Lightning's plugins where a loss scaler is)
        skips = getattr(trainer.precision_plugin, "skips_nonfinite", trainer.scaler is not None)
        if self.action == "skip" and not skips and rec.par_values:
            # nothing else skips this step: decide on the host (one sync) and leave the parameters alone
            latest = torch.cat(rec.par_values)
            if not bool(torch.isfinite(latest).all()):
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
                rec.skipped_here = True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rec = self._finish_record()
        if rec is None:
            return
        self._batches += 1
        device_is_cpu = rec.any_bad is not None and rec.any_bad.device.type == "cpu"
        plugin_skipped = self._plugin_skipped(trainer)  # (every batch: the count it compares with moves on)
        read = (
            (device_is_cpu and self._read_every_batch_on_cpu)
            or self.dump_dir is not None
            or rec.skipped_here
            or self._batches % self.check_every_n_steps == 0
            or plugin_skipped
        )
        if read:
            self._check(trainer)
        rec.held.clear()
        rec.batch = None

    def _plugin_skipped(self, trainer: Trainer) -> bool:
        """Whether MPPlugin skipped a step of this batch (any optimizer's), as the host knows without waiting."""
        skipped, self._skips_seen = _plugin_skipped_since(getattr(trainer.precision_plugin, "stats", None),
                                                          self._skips_seen)
        return skipped

    def _finish_record(self) -> Optional[_BatchRecord]:
        rec, self._record = self._record, None
        self._produced.clear()
        self._grad_hooked.clear()
        if rec is None:
            return None
        rec.finish()
        if rec.any_bad is not None:
            self._pending.append(rec)
        return rec

    def _param_name(self, trainer: Trainer, param: Tensor) -> str:
        name = self._param_names.get(id(param))
        if name is None:  # MPPlugin's fp32 stand-in of a half parameter, inside the step
            stats = getattr(trainer.precision_plugin, "stats", None)
            name = stats.name_of(param) if isinstance(stats, StepStats) else None
        return name or "?"

    # ------------------------------------------------------------------ reading and reporting
    def _check(self, trainer: Trainer, stopping: bool = False) -> None:
        """Read the flags of the batches since the last read; report the first non-finite one."""
        pending, self._pending = self._pending, []
        found, found_rec = self._first_report(pending, trainer)
        world = trainer.world_size
        if self.action == "raise" and world > 1 and not stopping:
            _raise_if_another_rank_found(trainer, found)
        if found is None or self._folded_into_last(found):
            return
        self._last_step_seen = found.step
        found.message = _format_message(found, world, self._root_type)
        if self.dump_dir is not None:
            found.dump_path = _dump_report(self.dump_dir, self._names, found, found_rec)
            if found.dump_path:
                found.message += f"\n  dumped the batch and the modules' inputs to {found.dump_path}"
        self.reports.append(found)
        if self.action == "raise" and not stopping:
            raise NonFiniteTrainingError(found.message)
        warnings.warn(found.message, UserWarning, stacklevel=2)

    def _first_report(
        self, pending: list[_BatchRecord], trainer: Trainer
    ) -> tuple[Optional[NonFiniteReport], Optional[_BatchRecord]]:
        """The report of the first pending batch with a finding, and its record; the batches after it are counted."""
        if not pending:
            return None, None
        # (every pending record has its flag: _finish_record)
        flags = torch.stack([cast(Tensor, r.any_bad) for r in pending]).tolist()  # one host copy for the window
        bad = [r for r, f in zip(pending, flags) if f]
        for i, rec in enumerate(bad):
            report = self._describe(rec, trainer)
            if report is not None:
                report.later_batches = len(bad) - i - 1
                return report, rec
        return None, None

    def _folded_into_last(self, found: NonFiniteReport) -> bool:
        """Whether ``found`` repeats the last report in the next batches (e.g. the weights are NaN now): then it is
        counted there instead of reported again."""
        last = self.reports[-1] if self.reports else None
        if (
            self.action == "raise"
            or last is None
            or _signature(last) != _signature(found)
            or found.step > self._last_step_seen + self.check_every_n_steps + 1
        ):
            return False
        last.repeats += 1 + found.later_batches
        self._last_step_seen = found.step
        return True

    def _describe(self, rec: _BatchRecord, trainer: Trainer) -> Optional[NonFiniteReport]:
        fwd, bwd, par = _split_values(rec)
        first_fwd = _first_nonfinite(fwd)
        first_bwd = _first_nonfinite(bwd)
        first_par = _first_nonfinite(par)
        if first_fwd is None and first_bwd is None and first_par is None:
            return None
        if first_fwd is None and self._is_scaler_overflow(rec, bwd, par, first_bwd, first_par):
            return None  # the loss scaler's own overflow: it skips the step and lowers the scale
        describer = _Describer(self._names, self._types, self._root_type, self._root, self.track_inputs)
        forward = describer.forward_finding(rec, fwd, first_fwd) if first_fwd is not None else None
        backward = None
        if first_bwd is not None:
            backward = describer.backward_finding(rec, fwd, bwd, first_bwd)
        elif first_par is not None:
            backward = describer.param_grad_finding(rec.par_names[first_par], par[first_par])
        if forward is not None and backward is not None:
            backward.explanation += "; the forward pass was already non-finite, which explains it"
        bad_params = [rec.par_names[i] for i, v in enumerate(par) if not math.isfinite(v)]
        return NonFiniteReport(
            step=rec.step,
            epoch=rec.epoch,
            batch_idx=rec.batch_idx,
            rank=trainer.global_rank,
            forward=forward,
            backward=backward,
            nonfinite_params=bad_params[:10],
        )

    def _is_scaler_overflow(
        self, rec: _BatchRecord, bwd: list[float], par: list[float], first_bwd: Optional[int], first_par: Optional[int]
    ) -> bool:
        """Whether a finite forward's first non-finite gradient is an inf of a scaled backward, not to be reported
        (``report_overflows=False``)."""
        if not rec.scaled or self.report_overflows:
            return False
        first_grad = bwd[first_bwd] if first_bwd is not None else par[cast(int, first_par)]  # (one is set)
        return math.isinf(first_grad)


# ---------------------------------------------------------------------------------------------- helpers
class _BatchRecord:
    """What one training batch left on the device, and the host-side map of what each value is."""

    __slots__ = (
        "step", "epoch", "batch_idx", "scaled", "calls", "fwd_values", "fwd_events", "bwd_values", "bwd_events",
        "par_values", "par_names", "fwd", "bwd", "par", "any_bad", "held", "batch", "skipped_here",
    )

    def __init__(self, step: int, epoch: int, batch_idx: int, scaled: bool) -> None:
        self.step, self.epoch, self.batch_idx, self.scaled = step, epoch, batch_idx, scaled
        self.calls: list[tuple[int, list, list]] = []
        self.fwd_values: list[tuple[Tensor, Tensor]] = []  # (min, max) per tensor
        self.fwd_events: list[tuple[str, int, int]] = []
        self.bwd_values: list[tuple[Tensor, Tensor]] = []
        self.bwd_events: list[tuple[str, int, int]] = []
        self.par_values: list[Tensor] = []
        self.par_names: list[str] = []
        self.fwd: Optional[Tensor] = None
        self.bwd: Optional[Tensor] = None
        self.par: Optional[Tensor] = None
        self.any_bad: Optional[Tensor] = None
        self.held: dict[int, list[tuple[Tensor, int]]] = {}
        self.batch: Any = None
        self.skipped_here = False

    def push_fwd(self, t: Tensor, event: tuple[str, int, int]) -> int:
        self.fwd_values.append(_extremes(t))
        self.fwd_events.append(event)
        return len(self.fwd_values) - 1

    def push_bwd(self, g: Tensor, event: tuple[str, int, int]) -> None:
        self.bwd_values.append(_extremes(g))
        self.bwd_events.append(event)

    def finish(self) -> None:
        """Stack the per-tensor figures into three vectors and one "anything non-finite" flag (device ops)."""
        with torch.no_grad():
            device = None
            if self.fwd_values:
                self.fwd = _stack(self.fwd_values)
                device = self.fwd.device
            if self.bwd_values:
                self.bwd = _stack(self.bwd_values, device)
                device = device or self.bwd.device
            if self.par_values:
                self.par = torch.cat([v.to(device) if device is not None else v for v in self.par_values])
            parts = [v for v in (self.fwd, self.bwd, self.par) if v is not None]
            if parts:
                self.any_bad = ~torch.isfinite(torch.cat(parts)).all()
        self.fwd_values, self.bwd_values, self.par_values = [], [], []


def _extremes(t: Tensor) -> tuple[Tensor, Tensor]:
    # one read-only pass; NaN propagates to both, +-inf to one of them. (vector_norm(ord=inf) would do too on a
    # GPU, but on the CPU it is ~20x slower than aminmax.)
    with torch.no_grad():
        return torch.aminmax(_local(t.detach()))


def _stack(values: list[tuple[Tensor, Tensor]], device: Optional[torch.device] = None) -> Tensor:
    """Largest |value| per recorded tensor, as one float32 vector (NaN where a tensor held a NaN)."""
    device = device or values[0][0].device
    lows = torch.stack([v[0].to(device) for v in values]).float()
    highs = torch.stack([v[1].to(device) for v in values]).float()
    return torch.maximum(highs, lows.neg_())


def _absmax_each(grads: list[Tensor]) -> Tensor:
    """Largest |value| of each gradient: one fused multi-tensor pass on a GPU."""
    with torch.no_grad():
        if grads[0].is_cuda:
            try:
                return torch.stack(list(torch._foreach_norm(grads, math.inf))).float()
            except (AttributeError, RuntimeError):
                pass
        return _stack([torch.aminmax(g) for g in grads])


def _signature(report: NonFiniteReport) -> tuple:
    return tuple(
        (f.module, f.tensor) if f is not None else None for f in (report.forward, report.backward)
    )


def _split_values(rec: _BatchRecord) -> tuple[list[float], list[float], list[float]]:
    """The batch's forward, backward and parameter-gradient figures, read in one sync (only for a non-finite batch)."""
    parts = [v for v in (rec.fwd, rec.bwd, rec.par) if v is not None]
    values = torch.cat(parts).tolist()
    n_fwd = 0 if rec.fwd is None else rec.fwd.numel()
    n_bwd = 0 if rec.bwd is None else rec.bwd.numel()
    return values[:n_fwd], values[n_fwd : n_fwd + n_bwd], values[n_fwd + n_bwd :]


def _first_nonfinite(values: list[float]) -> Optional[int]:
    for i, v in enumerate(values):
        if not math.isfinite(v):
            return i
    return None


def _kind(value: float) -> str:
    return "nan" if math.isnan(value) else "inf"


def _display(name: Optional[str], root_type: str) -> str:
    if name is None:
        return "the loss computation"
    return f"`{name}`" if name else f"`{root_type}` (the LightningModule)"


def _tensor_stats(t: Tensor) -> dict[str, Any]:
    with torch.no_grad():
        x = t.detach().float()
        finite = torch.isfinite(x)
        values = x[finite]
        stats: dict[str, Any] = {"nonfinite": int((~finite).sum())}
        if values.numel():
            stats.update(
                min=float(values.min()), max=float(values.max()), mean=float(values.mean()),
                std=float(values.std()) if values.numel() > 1 else 0.0,
            )
        return stats


def _plugin_skipped_since(stats: Any, seen: Optional[int]) -> tuple[bool, Optional[int]]:
    """Whether MPPlugin skipped a step, of any optimizer (a GAN's discriminator too), since its count was ``seen``,
    and the count now; as the host knows without waiting (never syncs: a fused optimizer's verdict on its way from the
    device says nothing, and the count stays)."""
    if not isinstance(stats, StepStats):
        return False, seen
    total = stats.skipped_steps_known()
    if total is None:
        return False, seen
    if seen is None:  # (no count to compare with: the last step's verdict)
        return stats.skipped_known() is True, total
    return total > seen, total


def _raise_if_another_rank_found(trainer: Trainer, found: Optional[NonFiniteReport]) -> None:
    """Every rank stops together: a rank whose own data stayed finite raises too."""
    any_found = trainer.strategy.reduce_boolean_decision(found is not None, all=False)
    if any_found and found is None:
        raise NonFiniteTrainingError(
            f"NonFiniteDetector: another rank found inf/NaN values (global step {trainer.global_step});"
            " its error names the module."
        )


class _Describer:
    """Puts a non-finite batch's figures into words: which module, which tensor, and why (host side, read only
    while reporting)."""

    def __init__(
        self, names: list[str], types: list[str], root_type: str, root: Optional[Any], track_inputs: bool
    ) -> None:
        self._names, self._types, self._root_type = names, types, root_type
        self._root = root  # a weak reference to the LightningModule
        self.track_inputs = track_inputs

    def param_grad_finding(self, name: str, value: float) -> TensorFinding:
        """The finding of a non-finite parameter gradient while every checked activation gradient was finite."""
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        return TensorFinding(
            module=owner,
            module_type=self.type_of_name(owner),
            tensor=f"gradient of parameter {name}",
            shape=None,
            dtype=None,
            value=_kind(value),
            explanation=(
                "every checked activation gradient was finite: the backward of "
                f"{_display(owner, self._root_type)} computed it, or code after backward (on_after_backward,"
                " gradient hooks, an earlier accumulation micro-batch) changed it"
            ),
        )

    def forward_finding(self, rec: _BatchRecord, fwd: list[float], i: int) -> TensorFinding:
        kind, call, k = rec.fwd_events[i]
        value = _kind(fwd[i])
        if kind == "batch":
            return TensorFinding(
                None, None, "batch", None, None, value, explanation=f"tensor {k} of the batch holds inf/NaN"
            )
        if kind == "loss":
            return TensorFinding(
                None, None, "loss", [], None, value,
                explanation="training_step's loss is non-finite while every watched module output was finite: "
                "the code that computes the loss from the model's output produced it",
            )
        index, inputs, outputs = rec.calls[call]
        name = self._names[index]
        infos = outputs if kind == "output" else inputs
        shape, dtype, _ = infos[k]
        input_stats = [
            {"shape": list(s), "dtype": str(d), "absmax": None if slot is None else fwd[slot]} for s, d, slot in inputs
        ]
        if call in rec.held:
            for stats, (t, version) in zip(input_stats, rec.held[call]):
                stats.update(_tensor_stats(t))
                if t._version != version:
                    stats["modified_in_place"] = True
        if kind == "output":
            unknown = any(s["absmax"] is None for s in input_stats)
            poisoned = self.nonfinite_weights(name)
            explanation = (
                f"{_display(name, self._root_type)} produced it from finite inputs"
                if not unknown
                else f"{_display(name, self._root_type)} produced it (some inputs were not checked: track_inputs=False)"
            )
            if poisoned:
                explanation = (
                    f"{_display(name, self._root_type)}'s own weights are non-finite ({', '.join(poisoned[:4])}):"
                    " an earlier step applied a non-finite update, or they were loaded or written so"
                )
        else:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            explanation = (
                f"the input arrived non-finite: code outside the watched modules (in the forward of "
                f"{_display(parent, self._root_type)}) produced it before {_display(name, self._root_type)} ran"
            )
        return TensorFinding(
            module=name,
            module_type=self._types[index],
            tensor=f"{kind} {k}",
            shape=list(shape),
            dtype=str(dtype),
            value=value,
            inputs=input_stats,
            explanation=explanation,
        )

    def backward_finding(self, rec: _BatchRecord, fwd: list[float], bwd: list[float], j: int) -> TensorFinding:
        kind, call, k = rec.bwd_events[j]
        index, inputs, outputs = rec.calls[call]
        name = self._names[index]
        shape, dtype, _ = (outputs if kind == "output" else inputs)[k]
        where = f"gradient of {kind} {k} of {_display(name, self._root_type)}"
        culprit: Optional[str]
        culprit_type: Optional[str]
        culprit, culprit_type = name, self._types[index]
        if j == 0:
            culprit, culprit_type = None, None
            explanation = (
                f"the first gradient checked in backward, the {where}, was already non-finite: the backward of the"
                " loss computation (training_step's code after the last watched module) produced it"
            )
        else:
            prev_kind, prev_call, prev_k = rec.bwd_events[j - 1]
            prev_index = rec.calls[prev_call][0]
            prev_name = self._names[prev_index]
            if prev_kind == "output":
                culprit, culprit_type = prev_name, self._types[prev_index]
                explanation = (
                    f"the backward of {_display(prev_name, self._root_type)} produced it: the gradient of its output"
                    f" was finite and the next gradient checked, the {where}, was not"
                    + ("" if self.track_inputs else " (or code between them: track_inputs=False)")
                )
            else:
                parent = prev_name.rsplit(".", 1)[0] if "." in prev_name else ""
                culprit, culprit_type = parent, self.type_of_name(parent)
                explanation = (
                    f"code between the watched modules produced it, in the backward of the forward code of "
                    f"{_display(parent, self._root_type)}: the gradient of input {prev_k} of"
                    f" {_display(prev_name, self._root_type)} was finite and the next gradient checked, the {where},"
                    " was not"
                )
        input_stats = []
        if culprit is not None and culprit in self._names:
            for c, (idx, ins, _) in enumerate(rec.calls):
                if self._names[idx] == culprit:
                    input_stats = [
                        {"shape": list(s), "dtype": str(d), "absmax": None if slot is None else fwd[slot]}
                        for s, d, slot in ins
                    ]
                    if c in rec.held:
                        for stats, (t, _) in zip(input_stats, rec.held[c]):
                            stats.update(_tensor_stats(t))
                    break
        return TensorFinding(
            module=culprit,
            module_type=culprit_type,
            tensor=f"gradient of {kind} {k} of `{name or self._root_type}`",
            shape=list(shape),
            dtype=str(dtype),
            value=_kind(bwd[j]),
            inputs=input_stats,
            explanation=explanation,
        )

    def type_of_name(self, name: str) -> Optional[str]:
        if name in self._names:
            return self._types[self._names.index(name)]
        return self._root_type if name == "" else None

    def nonfinite_weights(self, name: str) -> list[str]:
        """The module's own parameters and buffers that hold inf/NaN (read only while reporting a finding)."""
        root = self._root() if self._root is not None else None
        if root is None:
            return []
        try:
            module = root.get_submodule(name)
        except AttributeError:
            return []
        prefix = f"{name}." if name else ""
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        return [prefix + n for n, t in tensors if t.is_floating_point() and not bool(torch.isfinite(_local(t)).all())]


def _format_message(report: NonFiniteReport, world: int, root_type: str) -> str:
    """The report in words: the warning's or the error's text."""
    rank = f"[rank {report.rank}] " if world > 1 else ""
    lines = [
        f"{rank}NonFiniteDetector: inf/NaN at global step {report.step}"
        f" (epoch {report.epoch}, batch {report.batch_idx})"
    ]
    for label, finding in (("forward: ", report.forward), ("backward:", report.backward)):
        if finding is None:
            lines.append(f"  {label} every checked value was finite")
            continue
        tensor = finding.tensor
        if finding.shape is not None and finding.dtype is not None:
            tensor += f" {finding.shape} {finding.dtype}"
        head = f"the {tensor}" if finding.module is None else (
            f"{_display(finding.module, root_type)} ({finding.module_type}): {tensor}"
        )
        lines.append(f"  {label} {head} is {'NaN' if finding.value == 'nan' else finding.value}:"
                     f" {finding.explanation}")
        if finding.inputs:
            described = "; ".join(
                f"#{i} {s['shape']} {s['dtype']} max|x|="
                + ("unchecked" if s.get("absmax") is None else f"{s['absmax']:.4g}")
                + (
                    f" min={s['min']:.4g} max={s['max']:.4g} mean={s['mean']:.4g} std={s['std']:.4g}"
                    if "mean" in s
                    else ""
                )
                + (f" non-finite={s['nonfinite']}" if s.get("nonfinite") else "")
                for i, s in enumerate(finding.inputs)
            )
            lines.append(f"            its inputs: {described}")
    if report.nonfinite_params:
        lines.append(f"  parameters with non-finite gradients: {', '.join(report.nonfinite_params)}")
    if report.later_batches:
        lines.append(f"  ({report.later_batches} later batch(es) since the last check were non-finite too)")
    return "\n".join(lines)


def _dump_report(
    dump_dir: Optional[str], names: list[str], report: NonFiniteReport, rec: Optional[_BatchRecord]
) -> Optional[str]:
    """Save the batch and the named modules' inputs (``dump_dir``); the file's path."""
    if rec is None or dump_dir is None or (rec.batch is None and not rec.held):
        return None

    def inputs_of(module: Optional[str]) -> list[Tensor]:
        if module is None:
            return []
        for c, (idx, _, _) in enumerate(rec.calls):
            if names[idx] == module and c in rec.held:
                return [t.detach().cpu() for t, _ in rec.held[c]]
        return []

    payload = {
        "report": report.as_dict(),
        "batch": apply_to_collection(rec.batch, Tensor, lambda t: t.detach().cpu()),
        "forward_module_inputs": inputs_of(report.forward.module if report.forward else None),
        "backward_module_inputs": inputs_of(report.backward.module if report.backward else None),
    }
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, f"nonfinite_step{report.step}_rank{report.rank}.pt")
    torch.save(payload, path)
    return path
