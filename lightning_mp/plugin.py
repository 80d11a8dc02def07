"""MPPlugin: Lightning's precision-plugin hooks, each handing over to the part that does the work.

Set-up: ``convert_module`` guards the FP32 modules and, in true-half modes, casts the other weights to half (in
place: DDP discards its return value); ``connect`` builds the optimizer step (:mod:`lightning_mp.step`) for the
run's optimizers, whose Lightning hooks (backward, the step, clipping) live in
:class:`~lightning_mp.step_hooks.StepHooks`. The order of one optimizer step is written down in
:mod:`lightning_mp.step`; the parts:
:mod:`~lightning_mp.scaling` (loss scale), :mod:`~lightning_mp.master` (master weights),
:mod:`~lightning_mp.buffers`, :mod:`~lightning_mp.schedulers`, :mod:`~lightning_mp.distributed`,
:mod:`~lightning_mp.checkpoint`, :mod:`~lightning_mp.guards`, :mod:`~lightning_mp.fp8`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities import apply_to_collection
from torch import Tensor
from typing_extensions import override

import lightning_mp.distributed as distributed
from lightning_mp.checkpoint import lightning_scaler_state, load_plugin_state, plugin_state
from lightning_mp.host import TrainerHost
from lightning_mp.guards import guard_for_run
from lightning_mp.master import fp32_state_dict_
from lightning_mp.modes import PrecisionMode
from lightning_mp.options import announce
from lightning_mp.schedulers import SchedulerHold
from lightning_mp.settings import MPSettings
from lightning_mp.step_hooks import StepHooks
from lightning_mp.surface import PrecisionRun
from lightning_mp.true_half import cast_weights_


# (mode, precision, device and scaler are read-only views here of attributes Lightning's bases declare writable)
class MPPlugin(PrecisionRun, StepHooks, MixedPrecision, FSDPPrecision):  # type: ignore[misc, override]
    """Mixed-precision training for any LightningModule: autocast, loss scaling, inf/NaN step skipping.

    Example::

        trainer = Trainer(plugins=[MPPlugin("bf16")], max_steps=100)
        trainer.fit(model)
        print(trainer.precision_plugin.stats)   # steps, skipped_steps, loss_scale, ...
        MPPlugin("bf16-true", master_weights="fp32", fp32_modules=["defaults", "*.router"])
        MPPlugin("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda"))   # MixedPrecision's constructor

    Args:
        precision: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"bf16-true"``, ``"fp16-true"``, ``"fp8"`` or
            ``"auto"``; Lightning's strings (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ...) are aliases.
        device: as ``MixedPrecision``'s: the device type the scaler starts on (the Trainer's wins at set-up).
        scaler: as ``MixedPrecision``'s (fp16): a ``torch.amp.GradScaler`` given trains through a
            ``DynamicLossScaler`` with its settings and state and stays a ``torch.amp.GradScaler``, sharing its scale.
        init_scale: the first loss scale (fp16 modes), as GradScaler's.
        growth_factor: the scale is multiplied by this after ``growth_interval`` clean steps.
        backoff_factor: the scale is multiplied by this on a backoff.
        growth_interval: clean steps in a row before the scale grows.
        hysteresis: overflowing steps before a backoff (1 = at once, as GradScaler).
        consecutive_hysteresis: refill the hysteresis budget on every clean step (``True``) or only on growth
            (``False``, Megatron-LM's).
        min_scale: the scale's floor.
        max_scale: the scale's cap.
        loss_scale: a number gives a static loss scale (all fp16 modes); ``None``: dynamic.
        skip_nonfinite: skip optimizer steps whose gradients hold inf/NaN, in every mode (fp16 always skips).
        max_consecutive_skips: stop (:class:`NonFiniteTrainingError`) after this many skips in a row; ``None``: never.
        hold_schedulers_on_skip: hold step-interval LR schedulers after a skipped step.
        tf32: ``True``/``False`` sets TF32 matmul/cuDNN for the run (restored at teardown); ``None``: the mode's.
        release_grads_after_step: gradients to ``None`` right after the step (automatic optimization).
        capture_step: ``True``: in ``fp32``/``tf32``/``bf16`` on CUDA with torch's ``Adam``/``AdamW``
            (``capturable=True``) or ``SGD``, the check, the skip and the optimizer's update replayed from a CUDA
            graph (:mod:`lightning_mp.capture`); ``False`` (the default for now): the eager step.
        fp32_modules: modules run in fp32 (class names, name patterns, classes, ``"defaults"``); ``None``: the
            defaults (norms, softmax, losses; in ``bf16-true`` with master weights plain ``nn.LayerNorm`` modules
            run in bf16, their kernel computing in fp32); ``[]``: none.
        master_weights: ``"fp32"`` (the default of true-half modes), ``"kahan"``, ``"stochastic"``, ``"none"``,
            ``"optimizer"`` (:mod:`lightning_mp.master`).
        optimizer_states: ``"fp32"`` (the default: as the optimizer keeps them) or ``"bf16"``: Adam's and AdamW's
            moments held in bf16 between steps, each step torch's own on fp32 copies, rounded back stochastically
            (:mod:`lightning_mp.optim_states`); with fp32 weights or master weights (not ``master_weights="none"``).
        fp8: :class:`~lightning_mp.fp8.FP8Config` or a dict of its fields, for ``precision="fp8"``.
        reduce_dtype: the dtype gradients are reduced in across ranks (``"fp32"``/``None``, ``"bf16"``, ``"fp16"``).
        fsdp_param_dtype: the dtype FSDP gathers parameters in for compute (``"fp32"``/``None``, ``"bf16"``,
            ``"fp16"``).
        spike_sigma: skip, as an inf/NaN step, a step whose loss or gradient norm exceeds mean + ``spike_sigma`` std
            of the last ``spike_window`` clean steps; ``None``: off (:mod:`lightning_mp.spike`).
        spike_window: the clean steps the spike statistics cover.

    The arguments become one frozen :class:`~lightning_mp.settings.MPSettings` (``plugin.settings``), checked once,
    here: every bad value raises before training. The defaults shown are :data:`lightning_mp.settings.DEFAULTS`.
    """

    def _start(self, settings: MPSettings) -> None:
        super()._start(settings)  # (not MixedPrecision.__init__: it needs the device up front and knows two modes)
        self._hold = SchedulerHold()
        self._comm_hooked: list[Any] = []  # DDP models given a reduce_dtype hook
        self._fsdp_root: Optional[torch.nn.Module] = None  # the root FSDP module
        self._guarded_classes: tuple[type[torch.nn.Module], ...] = ()  # guarded module types
        self._converted: Optional[torch.nn.Module] = None  # the module convert_module saw

    @property
    def _fp8(self) -> Any:
        return self._run.fp8

    def check_precision_switch(self, precision: str) -> None:
        """Raise ``ValueError`` now if :meth:`set_precision` could not switch to ``precision`` during training."""
        self._run.check_switch(precision)

    def set_precision(self, precision: str) -> PrecisionMode:
        """Switch among fp32/tf32/bf16/fp16 between steps (``PrecisionSchedule``); counters and the scale carry over."""
        return self._run.switch(precision, started=self._converted is not None)  # (counters and step follow)

    # ------------------------------------------------------------------ set-up and teardown
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Guard the FP32 modules; in true-half modes cast the other weights to half. In place, idempotent."""
        strategy = distributed.strategy_of(module)
        self._run.set_sharded(distributed.check_strategy(strategy, self.mode, self.master_weights, self.fp8_config))
        device = distributed.root_device(distributed.unwrap_lightning_module(module), module)
        guarded, unguard = guard_for_run(module, self._fp32_guard_spec(device.type))
        self._patches.add(f"FP32 guards on {len(guarded)} modules of {type(module).__name__}", unguard)
        self._guarded_classes = tuple({type(module.get_submodule(name)) for name in guarded})
        half_gathers = distributed.fsdp_gather_dtype(self.mode, self.fsdp_param_dtype) is not None
        if self._run.sharded and guarded and half_gathers:
            distributed.check_fsdp_wraps_guards(module, guarded, self.mode, self.fsdp_param_dtype)
        if not self._run.sharded:  # (FSDP: the fp32 shards are the masters; it gathers half weights)
            self._patches.add(f"fp32 weights of the guarded modules of {type(module).__name__}",
                              cast_weights_(module, self.mode, guarded))  # fmt: skip
        self._run.convert_fp8(module, device)  # swaps layers in place, before the optimizers exist
        self._converted = module
        return module

    def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> tuple[Any, list, list]:
        module = distributed.unwrap_lightning_module(model)
        device = distributed.root_device(module, model)
        self._run.connect(device)
        mode = self._run.mode
        assert mode is not None  # (settled by connect)
        announce(self, module)  # rank zero, once per fit: "lightning_mp: using bf16 mixed precision (...) on cuda"
        dtypes = (self.reduce_dtype, self.fsdp_param_dtype)
        fp8 = self._fp8 if mode.fp8 else None
        self._fsdp_root = distributed.connect(model, self._run.scaler, *dtypes, self._comm_hooked, fp8=fp8)
        raw = [getattr(opt, "_optimizer", opt) for opt in optimizers]
        release = self.release_grads_after_step and module is not None and not is_overridden(
            "optimizer_zero_grad", module, LightningModule)  # fmt: skip
        steps = self._open_steps(TrainerHost(module, type(self).__name__), module or model, raw, device=device,
                                 fsdp=self._fsdp_root is not None, release_grads=release, module=module)  # fmt: skip
        if self.hold_schedulers_on_skip and self._run.scaler is not None:
            if self._hold.install(module, lr_schedulers, skipped_for=steps.skipped_for):
                self._patches.add(f"lr_scheduler_step on {type(module).__name__}", self._hold.remove)
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        try:
            if self._steps is not None:
                self._steps.close()  # the last batch ends, the gradient hooks go
        finally:
            self._patches.undo_all()  # guards, the scheduler hold, TF32, FP8 hooks: the module is a plain module again
            if self.masters is not None:
                # Lightning's teardown moved the model and the optimizer state to the CPU: the masters follow, so
                # the GPU memory is freed as with Lightning's plugins (they come back at the next fit's set-up)
                self.masters.to_(torch.device("cpu"))
            super().teardown()

    @property
    def mixed_precision_config(self) -> Any:
        """The ``torch.distributed.fsdp.MixedPrecision`` Lightning's FSDP strategy wraps the model with."""
        dtypes = (self.fsdp_param_dtype, self.reduce_dtype)
        return distributed.fsdp_mixed_precision(self.mode, *dtypes, self._guarded_classes)

    # not FSDPPrecision's: weights are created in fp32, outputs are left as they are
    tensor_init_context, module_init_context = Precision.tensor_init_context, Precision.module_init_context
    convert_output = Precision.convert_output

    @override
    def convert_input(self, data: Any) -> Any:
        mode = self._run.mode  # (read once: these run on every step)
        dtype = mode.param_dtype if mode is not None else None
        return data if dtype is None else apply_to_collection(data, Tensor, _convert_fp_tensor, dst_type=dtype)

    # ------------------------------------------------------------------ forward
    @override
    def autocast_context_manager(self) -> Any:
        mode = self._run.mode
        dtype = mode.autocast_dtype if mode is not None else None
        # no weight-cast cache: in manual optimization the optimizer steps inside this context
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @override
    def forward_context(self) -> Any:
        mode = self._run.mode
        dtype = mode.param_dtype if mode is not None else None
        # true-half: tensors made in forward match the half weights, as Lightning's HalfPrecision
        return _DtypeContextManager(dtype) if dtype is not None else self.autocast_context_manager()

    def _step_context(self, training: bool) -> Any:
        run = self._run
        if run.fp8 is None or run.mode is None or not run.mode.fp8:
            return self.forward_context()
        return _entered(self.forward_context(), run.fp8.autocast(training=training))

    @override
    def train_step_context(self) -> Any:
        steps, module = self._steps, distributed.unwrap_lightning_module(self._converted)
        if steps is None or module is None:
            return self._step_context(training=True)
        if module._trainer is not None:
            steps.begin_batch(module, module._trainer.optimizers)
        context = self._step_context(training=True)
        # manual optimization: the optimizers of this batch have stepped when training_step returns
        return context if module.automatic_optimization else _ThenOnSuccess(context, steps.end_batch)

    @override
    def val_step_context(self) -> Any:
        return self._step_context(training=False)

    test_step_context = predict_step_context = val_step_context

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return plugin_state(self._run.name, self._run.scaler, self.masters, self._fp8, self.stats, self._spike,
                            self._states)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = dict(scaler=self._run.scaler, masters=self.masters, master_weights=self.master_weights, fp8=self._fp8)
        load_plugin_state(state_dict, current_mode=self._run.name, stats=self.stats, module=self._converted,
                          spike=self._spike, optimizer_states=self._states, host=type(self).__name__,
                          **parts)  # fmt: skip

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # what Lightning's own MixedPrecision reads: precision="16-mixed" resumes this checkpoint with its scale
        lightning_state = lightning_scaler_state(self._run.scaler)
        if lightning_state:
            checkpoint.setdefault("MixedPrecision", lightning_state)
        module = distributed.unwrap_lightning_module(self._converted)
        if module is not None and isinstance(checkpoint.get("state_dict"), dict):  # (after a run: fp32 guarded weights)
            fp32_state_dict_(checkpoint["state_dict"], module)
        self._states.compact_checkpoint(checkpoint.get("optimizer_states"))  # (after a run: bf16 moments as during it)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written with Lightning's precision="16-mixed" keeps its scale when resumed here
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint:
            self.load_state_dict(checkpoint["MixedPrecision"])


class _ThenOnSuccess:
    """``context``, then ``after()`` once it exits without an exception."""

    __slots__ = ("context", "after")

    def __init__(self, context: Any, after: Callable[[], None]) -> None:
        self.context, self.after = context, after

    def __enter__(self) -> Any:
        return self.context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        suppressed = self.context.__exit__(*exc)
        if exc[0] is None:
            self.after()
        return suppressed


def _entered(*managers: Any) -> contextlib.ExitStack:
    """The context managers entered now, left together when the returned stack closes."""
    stack = contextlib.ExitStack()
    for manager in managers:
        stack.enter_context(manager)
    return stack
