"""MPPlugin: Lightning's precision-plugin hooks, each handing over to the part that does the work.

Set-up: ``convert_module`` guards the FP32 modules and, in true-half modes, casts the other weights to half (in
place: DDP discards its return value); ``connect`` builds the optimizer step (:mod:`lightning_mp.step`) for the
run's optimizers. The order of one optimizer step is written down in :mod:`lightning_mp.step`; the parts:
:mod:`~lightning_mp.scaling` (loss scale), :mod:`~lightning_mp.master` (master weights),
:mod:`~lightning_mp.buffers`, :mod:`~lightning_mp.schedulers`, :mod:`~lightning_mp.distributed`,
:mod:`~lightning_mp.checkpoint`, :mod:`~lightning_mp.guards`, :mod:`~lightning_mp.fp8`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp import checkpoint, distributed
from lightning_mp.fp8 import FP8Config, FP8Training
from lightning_mp.guards import FP32GuardSpec, apply_fp32_guards
from lightning_mp.master import MasterWeights, cast_module_, parse_master_weights
from lightning_mp.modes import AUTO, MODES, PrecisionMode, auto_choice, parse_precision, provisional_lightning_precision, resolve_mode
from lightning_mp.options import changed_scaler_arguments, check_flags, check_options, make_scaler
from lightning_mp.scaling import DynamicLossScaler, _is_dtensor
from lightning_mp.schedulers import SchedulerHold
from lightning_mp.true_half import MasterWeightsSetup
from lightning_mp.stats import StepStats
from lightning_mp.step import OptimizerSteps


class MPPlugin(MixedPrecision, FSDPPrecision):
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
        device: as ``MixedPrecision``'s: the device type the scaler starts on (the Trainer's device wins at set-up).
        scaler: as ``MixedPrecision``'s: a ``torch.amp.GradScaler`` (fp16 modes) whose settings and state are used;
            a :class:`~lightning_mp.DynamicLossScaler` is used as it is.
        init_scale, growth_factor, backoff_factor, growth_interval: the dynamic loss scale (fp16), as GradScaler's.
        hysteresis: overflowing steps before the scale backs off (fp16; 1 = at once).
        consecutive_hysteresis: refill the hysteresis budget on every clean step (``True``) or only when the scale
            grows (``False``, Megatron-LM's behaviour).
        min_scale, max_scale: floor and cap of the loss scale (fp16).
        loss_scale: a number gives a static loss scale instead of a dynamic one (fp16).
        skip_nonfinite: skip optimizer steps whose gradients hold inf/NaN, in every mode (fp16 always skips).
        max_consecutive_skips: stop with :class:`NonFiniteTrainingError` after this many skipped steps in a row of
            one optimizer; ``None`` never stops.
        hold_schedulers_on_skip: do not step step-interval LR schedulers after a skipped optimizer step.
        tf32: ``True``/``False`` sets TF32 matmul/cuDNN for the run (restored at teardown); ``None``: the mode's.
        release_grads_after_step: set gradients to ``None`` right after the optimizer step in automatic
            optimization (unless the LightningModule overrides ``optimizer_zero_grad``).
        fp32_modules: modules that run in fp32: class names, module-name patterns, classes, ``"defaults"``
            (norms, softmax, losses); ``None``: the defaults; ``[]``: no guards. See :mod:`lightning_mp.guards`.
        master_weights: ``"fp32"`` (default), ``"kahan"``, ``"stochastic"``, ``"none"`` or ``"optimizer"``
            (``bf16-true``/``fp16-true`` only; see :mod:`lightning_mp.master`); ``True``/``False``: fp32/none.
        fp8: :class:`~lightning_mp.fp8.FP8Config` or a dict of its fields, for ``precision="fp8"``.
        reduce_dtype: dtype gradients are reduced in across ranks (``"fp32"``/None, ``"bf16"``, ``"fp16"``).
        fsdp_param_dtype: under FSDP, the dtype parameters are gathered in for compute (None: fp32).
    """

    def __init__(
        self,
        precision: str = "bf16",
        device: Optional[str] = None,
        scaler: Optional[torch.amp.GradScaler] = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = True,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        loss_scale: Optional[float] = None,
        skip_nonfinite: bool = True,
        max_consecutive_skips: Optional[int] = 100,
        hold_schedulers_on_skip: bool = True,
        tf32: Optional[bool] = None,
        release_grads_after_step: bool = True,
        fp32_modules: Optional[list[str]] = None,
        master_weights: Optional[Union[str, bool]] = None,
        fp8: Optional[Union[FP8Config, dict]] = None,
        reduce_dtype: Optional[str] = None,
        fsdp_param_dtype: Optional[str] = None,
    ) -> None:
        # not MixedPrecision.__init__: it needs the device up front and knows two modes only
        self._requested = parse_precision(precision)
        self._scaler_kwargs = dict(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale, max_scale=max_scale, loss_scale=loss_scale,
        )  # fmt: skip
        check_flags(skip_nonfinite=skip_nonfinite, hold_schedulers_on_skip=hold_schedulers_on_skip,
                    release_grads_after_step=release_grads_after_step, consecutive_hysteresis=consecutive_hysteresis)
        check_options(loss_scale=loss_scale, max_consecutive_skips=max_consecutive_skips, tf32=tf32,
                      reduce_dtype=reduce_dtype, fsdp_param_dtype=fsdp_param_dtype, skip_nonfinite=skip_nonfinite,
                      scaler_kwargs=self._scaler_kwargs)  # fmt: skip
        make_scaler(self._scaler_kwargs, "cpu", scaling=True, sharded=False)  # scaler values fail here, before training
        if device is not None and not isinstance(device, str):
            raise ValueError(f"device={device!r} is invalid: use a device type such as 'cuda' or 'cpu', or None.")
        self.skip_nonfinite, self.max_consecutive_skips = skip_nonfinite, max_consecutive_skips
        self.hold_schedulers_on_skip, self.tf32 = hold_schedulers_on_skip, tf32
        self.release_grads_after_step = release_grads_after_step
        self.fp32_guards = FP32GuardSpec.from_arg(fp32_modules)
        self.reduce_dtype, self.fsdp_param_dtype = reduce_dtype, fsdp_param_dtype
        self.fp8_config = FP8Config.from_value(fp8)  # validated now; TE is imported at set-up only
        self._given_scaler = scaler
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.mode: Optional[PrecisionMode] = None
        self.precision = provisional_lightning_precision(self._requested)  # type: ignore[assignment]
        self.scaler: Optional[DynamicLossScaler] = None  # type: ignore[assignment]
        self.stats = StepStats(None)
        self._weights = MasterWeightsSetup(None if master_weights is None else parse_master_weights(master_weights))
        self._steps: Optional[OptimizerSteps] = None
        self._fp8: Optional[FP8Training] = None
        self._sharded = False  # under Lightning's FSDP strategy (picks the scaler class)
        self._tf32_saved: Optional[tuple[bool, bool]] = None
        self._hold = SchedulerHold(self._skipped_for)
        self._sums = distributed.FP32SumReduction()
        self._comm_hooked: list[torch.nn.Module] = []
        self._fsdp_root: Optional[torch.nn.Module] = None
        self._guarded_classes: tuple[type, ...] = ()
        self._converted: Optional[torch.nn.Module] = None
        if fp8 is not None and self._requested not in ("fp8", AUTO):
            rank_zero_warn(f"MPPlugin: fp8 settings are given but precision={self._requested!r}; they take effect with precision='fp8'.")
        if self._requested == AUTO:
            self._weights.check_argument(MODES[auto_choice(self.device)[0]])  # auto never picks true-half
        else:
            self._setup_mode(MODES[self._requested])  # the hardware check waits for set-up, on the real device
            self._warn_unused_arguments()

    # ------------------------------------------------------------------ the mode
    def _setup_mode(self, mode: PrecisionMode) -> None:
        self._weights.check_argument(mode)
        _check_fsdp_param_dtype(mode, self.fsdp_param_dtype)
        if mode.fp8 and self._fp8 is None:
            self._fp8 = FP8Training(self.fp8_config)
        previous, self.mode = self.scaler, mode
        self.precision = mode.lightning_precision  # type: ignore[assignment]
        self.scaler = self._build_scaler(mode, previous)
        self.stats.set_scaler(self.scaler)

    def _build_scaler(self, mode: PrecisionMode, previous: Optional[DynamicLossScaler]) -> Optional[DynamicLossScaler]:
        given = self._given_scaler
        if given is not None:
            if not mode.needs_scaler:
                raise MisconfigurationException(
                    f"MPPlugin(precision={mode.name!r}) got a scaler, but this mode does not scale the loss; pass a"
                    " scaler with precision='fp16' or 'fp16-true' only."
                )
            return DynamicLossScaler.adopt(given, sharded=self._sharded)
        if not (mode.needs_scaler or self.skip_nonfinite):
            return None
        scaler = make_scaler(self._scaler_kwargs, self.device, scaling=mode.needs_scaler, sharded=self._sharded)
        if previous is not None and previous.initialized:
            scaler.load_state_dict(previous.state_dict())
        return scaler

    def _warn_unused_arguments(self) -> None:
        changed = changed_scaler_arguments(self._scaler_kwargs)
        if changed and not self.mode.needs_scaler:
            rank_zero_warn(
                f"MPPlugin: {', '.join(changed)} set, but precision={self.mode.name!r} does not scale the loss;"
                " loss-scaling arguments take effect with precision='fp16' or 'fp16-true'."
            )
        if not self.skip_nonfinite and not self.mode.needs_scaler and self.max_consecutive_skips not in (None, 100):
            raise ValueError(
                f"max_consecutive_skips={self.max_consecutive_skips!r} counts skipped steps, but skip_nonfinite=False"
                f" skips none in precision={self.mode.name!r}. Drop one of the two."
            )

    @property
    def master_weights(self) -> Optional[str]:
        """The master-weights option in force: ``None`` unless the mode is ``bf16-true``/``fp16-true``."""
        return self._weights.kind(self.mode)

    @property
    def masters(self) -> Optional[MasterWeights]:
        """The master weights (``None`` before set-up and without masters)."""
        return self._weights.masters

    @property
    def requested_precision(self) -> str:
        """The precision as the user asked for it (canonical name, ``"auto"`` kept)."""
        return self._requested

    def set_precision(self, precision: str) -> PrecisionMode:
        """Switch among ``fp32``, ``tf32``, ``bf16`` and ``fp16`` between two optimizer steps (``PrecisionSchedule``).

        Skip counters carry over; the loss scale carries over between scaling modes and starts from ``init_scale``
        when fp16 begins. Raises before changing anything if the device cannot run the mode.
        """
        name = parse_precision(precision)
        mode = resolve_mode(auto_choice(self.device)[0] if name == AUTO else name, self.device)
        if self.mode is not None and mode.name == self.mode.name:
            return mode
        current = self.mode.name if self.mode is not None else self._requested
        if self._converted is not None and (mode.fp8 or mode.true_half or (self.mode is not None and (self.mode.true_half or self.mode.fp8))):
            raise ValueError(
                f"set_precision({precision!r}): cannot switch from precision={current!r} to {mode.name!r} during"
                " training: weights' dtypes, FP8 layers and master weights are fixed when training starts. Switch"
                " among 'fp32', 'tf32', 'bf16' and 'fp16', or save a checkpoint and resume it in the other mode."
            )
        self._setup_mode(mode)
        if self._steps is not None:
            self._steps.scaler = self.scaler
            if self.scaler is not None:
                self.scaler.ensure_initialized(torch.device(self.device))
        self._apply_tf32()
        return mode

    # ------------------------------------------------------------------ set-up and teardown
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Guard the FP32 modules; in true-half modes cast the other weights to half. In place, idempotent."""
        self._sharded = distributed.check_strategy(distributed.strategy_of(module), self.mode, self.master_weights)
        if self.scaler is not None and self._sharded != self.scaler.sharded:
            self._setup_mode(self.mode)  # the scaler's class changes, its state carries over
        lightning_module = distributed.unwrap_lightning_module(module)
        device = distributed.root_device(lightning_module, module)
        spec = self.fp32_guards
        if self.mode is not None and self.mode.autocast_only and device.type == "cuda":
            spec = spec.without_autocast_fp32()  # CUDA autocast runs these in fp32 already
        guarded = apply_fp32_guards(module, spec)
        self._guarded_classes = tuple({type(module.get_submodule(name)) for name in guarded})
        if self._sharded and guarded and distributed.fsdp_gather_dtype(self.mode, self.fsdp_param_dtype) is not None:
            distributed.check_fsdp_wraps_guards(module, guarded, self.mode, self.fsdp_param_dtype)
        if self.mode is not None and self.mode.true_half and not self._sharded:
            cast_module_(module, self.mode.param_dtype, keep_fp32=guarded)  # (FSDP: the fp32 shards are the masters)
        if self.mode is not None and self.mode.fp8 and self._fp8 is not None and self._fp8.model is not module:
            self._fp8.convert(module, device=device, announce=rank_zero_info)  # swaps in place, before the optimizers
        self._converted = module
        return module

    @override
    def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> tuple[Any, list, list]:
        module = distributed.unwrap_lightning_module(model)
        device = distributed.root_device(module, model)
        self.device = device.type
        if self._requested == AUTO:
            name, reason = auto_choice(self.device)
            if self.mode is None or self.mode.name != name:
                self._setup_mode(resolve_mode(name, self.device))
                rank_zero_info(f"MPPlugin(precision='auto') chose {name!r} on {device}: {reason}.")
                self._warn_unused_arguments()
        else:
            resolve_mode(self.mode.name, self.device)  # a mode the device cannot run fails before the first step
            if self.scaler is not None and self.scaler.device_type != self.device:
                self._setup_mode(self.mode)  # rebuilt for the real device, state kept
        self._fsdp_root = model if distributed.is_fsdp(model) else None
        if self._fsdp_root is None and self.fsdp_param_dtype not in (None, "fp32"):
            rank_zero_warn(f"MPPlugin: fsdp_param_dtype={self.fsdp_param_dtype!r} is set, but the model is not wrapped by FSDP: it takes effect with strategy='fsdp' only.")
        distributed.apply_reduce_dtype(model, self.reduce_dtype, self.device, self._comm_hooked)
        if self.scaler is not None:
            self.scaler.ensure_initialized(device)
            self.scaler.sync_across_ranks = distributed.world_size() > 1
        self._apply_tf32()
        raw = [getattr(opt, "_optimizer", opt) for opt in optimizers]
        masters = self._weights.connect(self.mode, module or model, raw, fsdp=self._fsdp_root is not None)
        self._steps = OptimizerSteps(
            self.scaler, masters, self.stats, max_consecutive_skips=self.max_consecutive_skips,
            saturation=self._fp8.sentinel.take if self._fp8 is not None and self.mode.fp8 else None,
            release_grads=self.release_grads_after_step and module is not None
            and not is_overridden("optimizer_zero_grad", module, LightningModule),
        )  # fmt: skip
        self._steps.connect(module, raw)
        self.stats.set_namer(self._weights.namer(module or model))
        self._sums.reset()
        if self.hold_schedulers_on_skip and self.scaler is not None:
            self._hold.install(module, lr_schedulers)
        if self._fp8 is not None and self.mode.fp8:
            self._fp8.check(device)  # recipe-specific: e.g. mxfp8 needs Blackwell
            trainer = getattr(module, "_trainer", None)
            self._fp8.configure_weight_cache(
                accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1),
                automatic_optimization=module.automatic_optimization if module is not None else True,
            )
            self._fp8.watch_saturation(self.scaler is not None)  # saturated infs join the step's verdict
        return model, optimizers, lr_schedulers

    def _apply_tf32(self) -> None:
        wanted = self.tf32 if self.tf32 is not None else self.mode.tf32
        if wanted is None:
            self._restore_tf32()  # a switch away from fp32/tf32 gives the flags back
            return
        if self._tf32_saved is None:
            self._tf32_saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = wanted

    def _restore_tf32(self) -> None:
        if self._tf32_saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32_saved
            self._tf32_saved = None

    @override
    def teardown(self) -> None:
        self._restore_tf32()
        if self._fp8 is not None:
            self._fp8.watch_saturation(False)  # TE's own amax reduction back, hooks off
        if self._steps is not None:
            self._steps.end_batch()
        self._hold.remove()
        super().teardown()

    @property
    def mixed_precision_config(self) -> Any:
        """The ``torch.distributed.fsdp.MixedPrecision`` Lightning's FSDP strategy wraps the model with."""
        return distributed.fsdp_mixed_precision(self.mode, self.fsdp_param_dtype, self.reduce_dtype, self._guarded_classes)

    @override
    def tensor_init_context(self) -> Any:
        return Precision.tensor_init_context(self)  # not FSDPPrecision's: weights are created in fp32

    @override
    def module_init_context(self) -> Any:
        return Precision.module_init_context(self)

    @override
    def convert_output(self, data: Any) -> Any:
        return Precision.convert_output(self, data)

    @override
    def convert_input(self, data: Any) -> Any:
        dtype = self.mode.param_dtype if self.mode is not None else None
        return data if dtype is None else apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=dtype)

    # ------------------------------------------------------------------ forward
    @override
    def autocast_context_manager(self) -> Any:
        dtype = self.mode.autocast_dtype if self.mode is not None else None
        # no weight-cast cache: in manual optimization the optimizer steps inside this context
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        dtype = self.mode.param_dtype if self.mode is not None else None
        # true-half: tensors made in forward match the half weights, as Lightning's HalfPrecision
        with _DtypeContextManager(dtype) if dtype is not None else self.autocast_context_manager():
            yield

    def _step_context(self, training: bool) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(self.forward_context())
        if self._fp8 is not None and self.mode is not None and self.mode.fp8:
            stack.enter_context(self._fp8.autocast(training=training))
        return stack

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        steps, module = self._steps, distributed.unwrap_lightning_module(self._converted)
        if steps is not None and module is not None and module._trainer is not None:
            steps.begin_batch(module, [getattr(o, "_optimizer", o) for o in module._trainer.optimizers])
        with self._step_context(training=True):
            yield
        if steps is not None and module is not None and not module.automatic_optimization:
            steps.end_batch()  # manual optimization: the optimizers of this batch have stepped

    @override
    def val_step_context(self) -> Any:
        return self._step_context(training=False)

    @override
    def test_step_context(self) -> Any:
        return self._step_context(training=False)

    @override
    def predict_step_context(self) -> Any:
        return self._step_context(training=False)

    # ------------------------------------------------------------------ backward and step
    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        if self._steps is not None:
            self._steps.before_backward(module)
            if self._steps.masters is not None and distributed.grads_synced(module):
                self._sums.start(self._steps.masters.pending_sums())  # reduced while this backward runs
        return Precision.pre_backward(self, tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        if distributed.grads_synced(module):
            self._sums.wait()
        return Precision.post_backward(self, tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if self._steps is None or not isinstance(model, LightningModule):
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        out = self._steps.run(optimizer, model, closure, lambda: self._after_closure(model, optimizer), **kwargs)
        if self._fp8 is not None:
            self._fp8.weights_updated()  # FP8 weight casts cached across micro-batches expire
        return out

    @override
    def _after_closure(self, model: LightningModule, optimizer: Any) -> None:
        trainer = model.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self._steps.hooks_ran(optimizer)  # what hooks wrote is what the step applies
        self._clip_gradients(model, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm)
        self._steps.hooks_ran(optimizer)  # a configure_gradient_clipping override may write too

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer in manual optimization
        if self._steps is not None:
            self._steps.prepare(optimizer)  # true gradients (unscaled, fp32 in true-half) before clipping
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        if self._steps is not None:
            self._steps.clipped(optimizer)  # the model's half gradients show the clipped ones

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self._steps is not None:
            self._steps.check_before_clamp(optimizer)  # an inf must be seen before clamping makes it finite
        torch.nn.utils.clip_grad_value_(self.main_params(optimizer), clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self._fsdp_root is not None:
            norm = self._fsdp_root.clip_grad_norm_(clip_val)  # the norm over every rank's shards
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)
            norm = norm.full_tensor() if _is_dtensor(norm) else norm  # FSDP2: the norm of all shards
        if self._steps is not None:
            self._steps.record_norm(optimizer, norm)  # the norm read every gradient: it is the verdict

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return self._steps.main_params(optimizer) if self._steps is not None else Precision.main_params(self, optimizer)

    def _skipped_for(self, optimizer: Optional[Optimizer]) -> bool:
        return self._steps is not None and self._steps.skipped_for(optimizer)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        mode = self.mode.name if self.mode is not None else self._requested
        return checkpoint.plugin_state(mode, self.scaler, self.masters, self._fp8, self.stats)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        checkpoint.load_plugin_state(
            state_dict, current_mode=self.mode.name if self.mode is not None else self._requested, scaler=self.scaler,
            masters=self.masters, master_weights=self.master_weights, fp8=self._fp8, stats=self.stats,
            module=self._converted,
        )  # fmt: skip

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written with Lightning's precision="16-mixed" keeps its scale when resumed here
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint:
            self.load_state_dict(checkpoint["MixedPrecision"])


def _check_fsdp_param_dtype(mode: PrecisionMode, wanted: Optional[str]) -> None:
    if wanted in (None, "fp32"):
        return
    if (mode.autocast_dtype or mode.param_dtype) is not distributed.REDUCE_DTYPES[wanted]:
        raise ValueError(
            f"fsdp_param_dtype={wanted!r} applies to precision={wanted!r} (FSDP gathers {wanted} weights for"
            f" autocast to compute with), not to precision={mode.name!r}. Use fsdp_param_dtype='fp32' (or null)"
            " with this mode."
        )
