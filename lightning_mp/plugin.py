"""MPPlugin: Lightning hook wiring for autocast, loss scaling, inf/NaN step skipping, FP32 guards and
half-precision weights with master weights.

Set-up: ``convert_module`` guards the FP32 modules and, in true-half modes, casts the other weights to
bf16/fp16 (both in place: DDP discards its return value); ``connect`` attaches the master weights to the
optimizers (the fp32 masters take the half parameters' places in the param groups).

Order of one optimizer step (automatic optimization), written down because it matters:

1. ``closure()``: ``training_step`` under ``forward_context`` (autocast, or half default dtype in true-half
   modes), ``zero_grad``, ``pre_backward`` (the loss is scaled), ``backward``, ``post_backward``
   (``on_after_backward`` hooks, then with fp32 master weights the half gradients are added into the
   masters' fp32 gradients; micro-batches of gradient accumulation pass here too, so they sum in fp32. Under
   DDP the micro-batches inside ``no_sync`` sum in fp32 on each rank and are all-reduced in fp32 while the last
   micro-batch's backward runs, whose half gradients DDP reduces as usual).
2. Master weights ``prepare``: with ``"kahan"``/``"stochastic"`` an fp32 copy of each half parameter (with an
   fp32 gradient and the parameter's optimizer state) takes its place in the param group until the step is
   done, so everything below works on fp32 (with ``"fp32"`` the optimizer already holds the fp32 masters).
3. ``unscale_`` (fp16): gradients are divided by the scale and checked for inf/NaN in one fused kernel.
4. ``_after_closure``: ``on_before_optimizer_step`` hooks and gradient clipping see true gradients.
   Without loss scaling (bf16/fp32/tf32) the inf/NaN check runs here instead: a read-only pass, or no pass
   at all when clipping by norm computed the total norm (a non-finite norm means a non-finite gradient).
5. ``scaler.step``: the optimizer steps unless a gradient was inf/NaN (fused optimizers skip on the device).
6. Master weights ``finish``: the half weights are written (refreshed from the fp32 masters, rounded with
   compensation, or rounded stochastically) and the parameters get their places and optimizer state back;
   after a skipped step nothing changes.
7. ``scaler.update``: counters and the scale move on the device; then the divergence check, and
   gradients are released so the next forward does not carry them.
8. Lightning steps the LR schedulers; a step-interval scheduler whose optimizer skipped is held.

Distributed: every rank takes the same skip decision (the inf/NaN verdict is all-reduced). Under Lightning's
FSDP strategy the plugin is an ``FSDPPrecision`` (the strategy accepts no other): FSDP keeps the sharded fp32
parameters, autocast casts per op exactly as on one device (so guards and numerics match), gradients are
reduced in fp32 unless ``reduce_dtype`` says otherwise, fp16 uses torch's ``ShardedGradScaler`` machinery and
clipping by norm goes through the root FSDP module's ``clip_grad_norm_`` (a norm over all shards). In true-half
modes FSDP's own mixed precision does the master-weights work: fp32 shards, half weights gathered for compute,
gradients reduced into fp32; guarded modules are wrapped apart and stay fp32.

With ``precision="fp8"``, each step context runs Transformer Engine's autocast inside bf16 autocast (evaluation
without it unless ``fp8_in_eval``); after each optimizer step, FP8 weight casts cached across micro-batches expire.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Generator
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp._host import HostCopy
from lightning_mp.fp8 import FP8Config, FP8Training
from lightning_mp.guards import FP32GuardSpec, apply_fp32_guards
from lightning_mp.master import (
    FP32MasterWeights,
    MasterWeights,
    attach_master_weights,
    cast_module_,
    fp32_values,
    keeps_own_masters,
    parse_master_weights,
    seed_optimizer_masters,
)
from lightning_mp.modes import AUTO, MODES, PLANNED, auto_choice, PrecisionMode, parse_precision, provisional_lightning_precision, resolve_mode
from lightning_mp.scaling import DynamicLossScaler, ShardedDynamicLossScaler, _is_dtensor
from lightning_mp.stats import NonFiniteTrainingError, StepStats

log = logging.getLogger(__name__)

_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_SCALER_DEFAULTS = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "hysteresis": 1,
    "consecutive_hysteresis": True,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "loss_scale": None,
}


class MPPlugin(MixedPrecision, FSDPPrecision):
    """Mixed-precision training for any LightningModule: autocast, loss scaling, inf/NaN step skipping.

    Example::

        from lightning.pytorch import Trainer
        from lightning_mp import MPPlugin

        trainer = Trainer(plugins=[MPPlugin("bf16")], max_steps=100)
        trainer.fit(model)
        print(trainer.precision_plugin.stats)   # steps, skipped_steps, loss_scale, ...

        # bf16 weights with fp32 master weights; routers kept in fp32 besides the default norms/softmax/losses
        MPPlugin("bf16-true", master_weights="fp32", fp32_modules=["defaults", "*.router"])

    Args:
        precision: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"bf16-true"``, ``"fp16-true"`` or
            ``"auto"``; Lightning's strings (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"16-true"``, ...)
            are accepted as aliases.
        init_scale: first loss scale (fp16).
        growth_factor: scale growth after ``growth_interval`` clean steps (fp16).
        backoff_factor: scale backoff on overflow (fp16).
        growth_interval: clean steps between growths (fp16).
        hysteresis: overflowing steps before the scale backs off (fp16; 1 = at once).
        consecutive_hysteresis: refill the hysteresis budget on every clean step (``True``) or only when
            the scale grows (``False``, Megatron-LM's behaviour).
        min_scale: floor of the loss scale (fp16).
        max_scale: cap of the loss scale (fp16).
        loss_scale: a number gives a static loss scale instead of a dynamic one (fp16).
        skip_nonfinite: skip optimizer steps whose gradients hold inf/NaN, in every mode. With ``False``
            bf16/fp32/tf32 step unconditionally (fp16 always skips: its scaler needs it).
        max_consecutive_skips: stop with :class:`NonFiniteTrainingError` after this many skipped steps in a
            row; ``None`` never stops. With fused optimizers on CUDA the check reads the counter one step
            late to avoid a host sync.
        hold_schedulers_on_skip: do not step step-interval LR schedulers after a skipped optimizer step.
        tf32: ``True``/``False`` sets TF32 matmul/cuDNN for the run (restored at teardown); ``None`` uses the
            mode's setting (off for ``fp32``, on for ``tf32``, unchanged for the others).
        release_grads_after_step: set gradients to ``None`` right after the optimizer step in automatic
            optimization, so the next forward pass does not hold last step's gradients (Lightning zeroes
            them only after ``training_step``). Ignored when the LightningModule overrides
            ``optimizer_zero_grad``.
        fp32_modules: modules that run in fp32 (autocast off, fp32 inputs; in true-half modes their parameters
            and buffers stay fp32 too): class names (``"LayerNorm"``, ``"*BatchNorm*"``), module-name patterns
            (``"*.router"``, ``"lm_head"``), module classes (from Python), and ``"defaults"`` for the default
            set (norms, softmax, loss modules; see :data:`lightning_mp.guards.DEFAULT_FP32_MODULES`).
            ``None`` (default): the defaults; ``[]``: no guards.
        master_weights: how updates to half-precision weights keep their precision (``bf16-true`` and
            ``fp16-true`` only): ``"fp32"`` (default: fp32 master copies stepped by the optimizer),
            ``"kahan"`` (a half-precision compensation buffer per parameter), ``"stochastic"`` (stochastic
            rounding of each updated weight), ``"none"`` (plain half weights, as Lightning's ``bf16-true``) or
            ``"optimizer"`` (the optimizer keeps fp32 masters itself, e.g. Transformer Engine's
            ``FusedAdam(master_weights=True)``, whose one kernel reads the half gradients and writes masters and
            half weights; chosen by itself when every optimizer keeps its own masters and this is unset);
            ``True``/``False`` are short for ``"fp32"``/``"none"``.
            See :mod:`lightning_mp.master`. With ``"fp32"`` gradients live on the masters: read them from
            ``optimizer.param_groups``, not from the model's parameters.
        fp8: FP8 settings for ``precision="fp8"`` (NVIDIA Transformer Engine): an
            :class:`~lightning_mp.fp8.FP8Config` or a dict of its fields (``recipe``, ``include``/``exclude``,
            ``keep_first``/``keep_last``, ``size_rule``, ``weights``, ``fp8_in_eval``, ...). ``None``: the defaults
            (delayed scaling, fp32 master weights, output head and small layers in bf16, bf16 evaluation).
        reduce_dtype: the dtype gradients are reduced in across ranks: ``"fp32"`` (``None``, the default: as
            they are, fp32) or ``"bf16"``/``"fp16"`` to halve the traffic (FSDP: its ``reduce_dtype``; DDP: torch's
            bf16/fp16 compression hook). Needs a DDP or FSDP strategy.
        fsdp_param_dtype: under FSDP, the dtype parameters are gathered in for compute: ``"fp32"`` (``None``, the
            default: autocast casts per op, numerics as on one GPU) or the mode's own ``"bf16"``/``"fp16"`` (half
            the all-gather traffic, as Lightning's FSDP plugin; the shards, the optimizer and the gradient
            reduction stay fp32). FP32-guarded modules keep fp32 parameters: FSDP wraps them separately, which
            needs an ``auto_wrap_policy``. Needs the FSDP strategy.

    With ``strategy="fsdp"`` the same plugin works (it is also an ``FSDPPrecision``): in ``bf16-true``/``fp16-true``
    the fp32 shards are the master weights and FSDP gathers half weights (``master_weights="fp32"`` only);
    ``fp8`` is refused there before training starts.
    """

    def __init__(
        self,
        precision: str = "bf16",
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
        # deliberately not MixedPrecision.__init__: it needs the device up front and knows two modes only
        self._requested = parse_precision(precision)
        self._scaler_kwargs = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive_hysteresis,
            "min_scale": min_scale,
            "max_scale": max_scale,
            "loss_scale": loss_scale,
        }
        if loss_scale is not None:
            if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (
                math.isfinite(loss_scale) and loss_scale > 0
            ):
                raise ValueError(f"loss_scale={loss_scale!r} is invalid: use a finite number > 0, or None for dynamic.")
        if max_consecutive_skips is not None and (
            isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1
        ):
            raise ValueError(
                f"max_consecutive_skips={max_consecutive_skips!r} is invalid: use an integer >= 1, or None to never stop."
            )
        for name, value in (
            ("skip_nonfinite", skip_nonfinite),
            ("hold_schedulers_on_skip", hold_schedulers_on_skip),
            ("release_grads_after_step", release_grads_after_step),
            ("consecutive_hysteresis", consecutive_hysteresis),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid: use true or false.")
        if tf32 is not None and not isinstance(tf32, bool):
            raise ValueError(f"tf32={tf32!r} is invalid: use true, false, or null (the mode's default).")
        self._sharded = False  # set when a convert_module sees Lightning's FSDP strategy (picks the scaler class)
        # validate the scaler arguments now, whatever the mode, so YAML typos fail before training
        self._make_scaler("cpu", scaling=True)
        self.fp32_guards = FP32GuardSpec.from_arg(fp32_modules)
        if reduce_dtype is not None and reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                f"reduce_dtype={reduce_dtype!r} is invalid: use one of {sorted(_REDUCE_DTYPES)}, or null for fp32."
            )
        self.reduce_dtype = reduce_dtype
        if fsdp_param_dtype is not None and fsdp_param_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                f"fsdp_param_dtype={fsdp_param_dtype!r} is invalid: use one of {sorted(_REDUCE_DTYPES)}, or null for fp32."
            )
        self.fsdp_param_dtype = fsdp_param_dtype
        self._master_weights_arg = None if master_weights is None else parse_master_weights(master_weights)
        #: "optimizer" when master_weights is unset and the optimizers keep their own masters (found at set-up)
        self._master_weights_found: Optional[str] = None

        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.hold_schedulers_on_skip = hold_schedulers_on_skip
        self.tf32 = tf32
        self.release_grads_after_step = release_grads_after_step

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.mode: Optional[PrecisionMode] = None
        self.precision = provisional_lightning_precision(self._requested)  # type: ignore[assignment]
        self.scaler: Optional[DynamicLossScaler] = None  # type: ignore[assignment]
        self.stats = StepStats(None)
        self._tf32_saved: Optional[tuple[bool, bool]] = None
        self._patched_module: Optional[LightningModule] = None
        self._step_schedulers: set[int] = set()
        self._skip_records: dict[int, Union[bool, Tensor]] = {}
        self._consecutive_copy = HostCopy()  # the consecutive-skip counter, read a step late (no sync)
        self._auto_device: Optional[str] = None
        self._device_for_state: Optional[torch.device] = None
        self._converted: Optional[torch.nn.Module] = None  # the module convert_module guarded (and cast)
        self._masters: Optional[MasterWeights] = None
        # gradient accumulation under DDP with fp32 masters: micro-batches DDP does not reduce are summed in fp32 on
        # each rank, then reduced in fp32 during the last micro-batch's backward (the pending all-reduce)
        self._local_grads = False
        self._pending_reduce: Optional[tuple[list[Tensor], list[Any]]] = None
        # validated now, whatever the mode, so YAML typos fail before training; TE is imported at set-up only
        self.fp8_config = FP8Config.from_value(fp8)
        self._fp8: Optional[FP8Training] = None
        if fp8 is not None and self._requested not in ("fp8", AUTO):
            rank_zero_warn(
                f"MPPlugin: fp8 settings are given but precision={self._requested!r}; they take effect with"
                " precision='fp8'."
            )
        self._fp32_weights_in_checkpoint: dict[str, Tensor] = {}
        self._fsdp_root: Optional[torch.nn.Module] = None  # the root FSDP module, for clipping over all shards
        self._comm_hooked: list[torch.nn.Module] = []  # DDP models that got the reduce_dtype hook
        self._fp32_init: dict[int, Tensor] = {}  # fp32 weights before the true-half cast: the masters' first values
        self._guarded_classes: tuple[type, ...] = ()  # classes of the guarded modules (FSDP keeps them fp32)
        if self._requested in PLANNED:
            resolve_mode(self._requested, self.device)  # raises: known name, not runnable in this release
        if self._requested == AUTO:
            self._check_master_weights_argument(MODES[auto_choice(self.device)[0]])  # auto never picks true-half
        if self._requested != AUTO:
            # the hardware check waits for setup, where the Trainer's real device is known
            self._setup_mode(MODES[self._requested])
            self._warn_unused_scaler_arguments()

    # ------------------------------------------------------------------ construction helpers
    def _make_scaler(self, device: str, *, scaling: bool) -> DynamicLossScaler:
        kw = dict(self._scaler_kwargs)
        loss_scale = kw.pop("loss_scale")
        if loss_scale is not None:
            kw["init_scale"] = float(loss_scale)
            kw["min_scale"] = min(kw["min_scale"], float(loss_scale))
            kw["max_scale"] = max(kw["max_scale"], float(loss_scale))
        cls = ShardedDynamicLossScaler if self._sharded else DynamicLossScaler
        return cls(device, **kw, dynamic=loss_scale is None, scaling=scaling)

    @property
    def master_weights(self) -> Optional[str]:
        """The master-weights option in force: ``None`` unless the mode is ``bf16-true``/``fp16-true``."""
        if self.mode is None or not self.mode.true_half:
            return None
        return self._master_weights_arg or self._master_weights_found or "fp32"

    @property
    def masters(self) -> Optional[MasterWeights]:
        """The master weights attached to the optimizers (``None`` before set-up and for ``"none"``)."""
        return self._masters

    def _check_master_weights_argument(self, mode: PrecisionMode) -> None:
        if self._master_weights_arg is not None and not mode.true_half:
            raise ValueError(
                f"master_weights={self._master_weights_arg!r} applies to half-precision weights, but"
                f" precision={mode.name!r} keeps fp32 weights (there is no master copy to keep)."
                " Use precision='bf16-true' or 'fp16-true', or leave master_weights unset."
            )

    def _check_fsdp_param_dtype(self, mode: PrecisionMode) -> None:
        wanted = self.fsdp_param_dtype
        if wanted in (None, "fp32"):
            return
        if (mode.autocast_dtype or mode.param_dtype) is not _REDUCE_DTYPES[wanted]:
            raise ValueError(
                f"fsdp_param_dtype={wanted!r} applies to precision={wanted!r} (FSDP gathers {wanted} weights for"
                f" autocast to compute with), not to precision={mode.name!r}. Use fsdp_param_dtype='fp32' (or null)"
                " with this mode."
            )

    def _setup_mode(self, mode: PrecisionMode) -> None:
        self._check_master_weights_argument(mode)
        self._check_fsdp_param_dtype(mode)
        if mode.name == "fp8" and self._fp8 is None:
            self._fp8 = FP8Training(self.fp8_config)
        previous = self.scaler
        self.mode = mode
        self.precision = mode.lightning_precision  # type: ignore[assignment]
        if mode.needs_scaler or self.skip_nonfinite:
            self.scaler = self._make_scaler(self.device, scaling=mode.needs_scaler)
            self.scaler.sync_across_ranks = _world_size() > 1
            if previous is not None and previous.initialized:
                self.scaler.load_state_dict(previous.state_dict())
        else:
            self.scaler = None
        self.stats = StepStats(self.scaler)

    def _warn_unused_scaler_arguments(self) -> None:
        assert self.mode is not None
        changed = sorted(k for k, v in self._scaler_kwargs.items() if v != _SCALER_DEFAULTS[k])
        if changed and not self.mode.needs_scaler:
            rank_zero_warn(
                f"MPPlugin: {', '.join(changed)} set, but precision={self.mode.name!r} does not scale the loss;"
                " loss-scaling arguments take effect with precision='fp16' or 'fp16-true'."
            )

    def set_precision(self, precision: str) -> PrecisionMode:
        """Switch the mode between two optimizer steps (what ``PrecisionSchedule`` calls).

        Example::

            trainer.precision_plugin.set_precision("bf16")   # e.g. from a callback's on_train_batch_end

        Skip counters carry over; the loss scale carries over between scaling modes and starts from
        ``init_scale`` when fp16 begins. Raises before changing anything if the device cannot run the mode.
        """
        name = parse_precision(precision)
        if name == AUTO:
            name = auto_choice(self.device)[0]
        mode = resolve_mode(name, self.device)
        if self.mode is not None and mode.name == self.mode.name:
            return mode
        if mode.name == "fp8" and (self._fp8 is None or self._fp8.model is None) and self._converted is not None:
            raise ValueError(
                f"set_precision({precision!r}): FP8 swaps nn.Linear layers for Transformer Engine modules, which"
                " must happen before the optimizers exist. Start training with precision='fp8' (switching from"
                " fp8 to bf16 and back during training works)."
            )
        if self._converted is not None and (mode.true_half or (self.mode is not None and self.mode.true_half)):
            current = self.mode.name if self.mode is not None else self._requested
            raise ValueError(
                f"set_precision({precision!r}): cannot switch from precision={current!r} to {mode.name!r} during"
                " training: the weights' dtype and the optimizers' master weights are fixed when training starts."
                " Switch among 'fp32', 'tf32', 'bf16' and 'fp16', or save a checkpoint and resume it in the other"
                " mode (master weights carry over)."
            )
        self._setup_mode(mode)
        if self.scaler is not None and self._device_for_state is not None:
            self.scaler.ensure_initialized(self._device_for_state)
        self._apply_tf32()
        return mode

    @property
    def requested_precision(self) -> str:
        """The precision as the user asked for it (canonical name, ``"auto"`` kept)."""
        return self._requested

    # ------------------------------------------------------------------ setup / teardown
    @override
    def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> tuple[Any, list, list]:
        module = _unwrap_lightning_module(model)
        device = _root_device(module, model)
        self.device = device.type
        if self._requested == AUTO and (self.mode is None or self._auto_device != self.device):
            name, reason = auto_choice(self.device)
            self._setup_mode(resolve_mode(name, self.device))
            self._auto_device = self.device
            rank_zero_info(f"MPPlugin(precision='auto') chose {name!r} on {device}: {reason}.")
            self._warn_unused_scaler_arguments()
        elif self.scaler is not None and self.scaler._device != self.device:
            self._setup_mode(resolve_mode(self.mode.name, self.device))  # rebuilt for the real device, state kept
        else:
            resolve_mode(self.mode.name, self.device)  # a mode the device cannot run fails before the first step
        self._device_for_state = device
        self._fsdp_root = model if _is_fsdp(model) else None
        self._local_grads, self._pending_reduce = False, None  # nothing carried over from an interrupted run
        if self._fsdp_root is None and self.fsdp_param_dtype not in (None, "fp32"):
            rank_zero_warn(
                f"MPPlugin: fsdp_param_dtype={self.fsdp_param_dtype!r} is set, but the model is not wrapped by FSDP:"
                " it takes effect with strategy='fsdp' only."
            )
        self._apply_reduce_dtype(model)
        if self.scaler is not None:
            self.scaler.ensure_initialized(device)
            self.scaler.sync_across_ranks = _world_size() > 1
        self._apply_tf32()
        self._hold_schedulers(module, optimizers, lr_schedulers)
        self._attach_master_weights(module, model, optimizers)
        self._warn_redundant_optimizer_masters(optimizers)
        if self._fp8 is not None and self.mode.name == "fp8":
            self._fp8.check(device)  # recipe-specific: e.g. mxfp8 needs Blackwell
            trainer = getattr(module, "_trainer", None) if module is not None else None
            self._fp8.configure_weight_cache(
                accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1),
                automatic_optimization=module.automatic_optimization if module is not None else True,
            )
            # inf/NaN that FP8 casts saturate reach no gradient: the sentinel adds them to the step's verdict
            self._fp8.watch_saturation(self.scaler is not None)
        return model, optimizers, lr_schedulers

    def _apply_reduce_dtype(self, model: Any) -> None:
        if self.reduce_dtype in (None, "fp32"):
            return
        if _is_fsdp(model):
            return  # FSDP reduces in mixed_precision_config.reduce_dtype
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            rank_zero_warn(
                f"MPPlugin: reduce_dtype={self.reduce_dtype!r} is set, but the model is not wrapped by DDP or FSDP:"
                " there is no gradient reduction to compress. Use strategy='ddp' or 'fsdp', or leave reduce_dtype unset."
            )
            return
        if any(hooked is model for hooked in self._comm_hooked):
            return
        if self.reduce_dtype == "bf16" and self.device != "cuda":
            raise MisconfigurationException(
                f"MPPlugin(reduce_dtype='bf16') under DDP on {self.device!r}: torch's bf16 gradient compression needs"
                " CUDA and NCCL. Use reduce_dtype='fp16' or leave it unset (fp32) on this device."
            )
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if self.reduce_dtype == "bf16" else default_hooks.fp16_compress_hook
        try:
            model.register_comm_hook(state=None, hook=hook)
        except RuntimeError as err:
            raise MisconfigurationException(
                f"MPPlugin(reduce_dtype={self.reduce_dtype!r}) registers a DDP communication hook, but the model"
                f" already has one ({err}). Pass either reduce_dtype or DDPStrategy(ddp_comm_hook=...), not both."
            ) from err
        self._comm_hooked.append(model)

    def _warn_eps_underflow(self, optimizers: list) -> None:
        """fp16 weights without masters: an optimizer ``eps`` below fp16's smallest value is 0 in its fp16 state."""
        tiny = torch.finfo(torch.float16).smallest_normal * 2.0**-10  # the smallest fp16 subnormal, ~6e-8
        for opt in optimizers:
            for group in getattr(getattr(opt, "_optimizer", opt), "param_groups", []):
                eps = group.get("eps")
                if isinstance(eps, float) and 0 < eps < tiny:
                    rank_zero_warn(
                        f"MPPlugin(precision='fp16-true', master_weights='none'): the optimizer's eps={eps:g} is 0 in the"
                        " fp16 optimizer state, so a parameter whose gradient is 0 gets 0/0 = NaN on the first step."
                        " Use master_weights='fp32' (the default), or eps >= 1e-7 (e.g. 1e-4)."
                    )
                    return

    def _attach_master_weights(self, module: Optional[LightningModule], model: Any, optimizers: list) -> None:
        assert self.mode is not None
        initial, self._fp32_init = self._fp32_init, {}  # never kept past set-up (e.g. validate without optimizers)
        if self.mode.name == "fp16-true" and self.master_weights == "none" and self._fsdp_root is None:
            self._warn_eps_underflow(optimizers)
        if not self.mode.true_half or self.master_weights == "none" or not optimizers or self._fsdp_root is not None:
            return  # (under FSDP the fp32 shards are the master weights)
        raw = [getattr(opt, "_optimizer", opt) for opt in optimizers]
        if self._optimizer_keeps_masters(raw, initial):
            return
        for opt in raw:
            if isinstance(opt, LBFGS):
                raise MisconfigurationException(
                    f"MPPlugin(precision={self.mode.name!r}, master_weights={self.master_weights!r}) cannot step"
                    " LBFGS (it re-evaluates its closure inside the step). Use master_weights='none' with LBFGS."
                )
        existing = self._masters
        if existing is None and initial:
            existing = FP32MasterWeights(initial=initial)
        self._masters = attach_master_weights(raw, self.master_weights, module=module or model, existing=existing)
        if initial and isinstance(self._masters, FP32MasterWeights) and _world_size() > 1:
            self._masters.broadcast_(src=0)  # ranks initialised differently: rank 0's weights, as DDP's, in fp32

    def _warn_redundant_optimizer_masters(self, optimizers: list) -> None:
        """An optimizer that keeps fp32 masters of parameters that are fp32 already holds a second fp32 copy."""
        for opt in optimizers:
            raw = getattr(opt, "_optimizer", opt)
            params = [p for g in raw.param_groups for p in g["params"]]
            if keeps_own_masters(raw) and params and all(p.dtype == torch.float32 for p in params):
                mode = self.mode.name if self.mode is not None else self._requested
                way = (
                    "fp8={'weights': 'bf16'} (the optimizer's masters are then the fp32 copy)"
                    if mode == "fp8"
                    else "precision='bf16-true' (its masters are then the fp32 copy)"
                )
                rank_zero_warn(
                    f"MPPlugin({mode!r}): {type(raw).__name__} keeps fp32 master weights itself (master_weights=True),"
                    " but the parameters it steps are fp32 already, so it holds a second fp32 copy of every weight"
                    f" (4 bytes a parameter for nothing). Use {way}, or master_weights=False in the optimizer."
                )
                return

    def _optimizer_keeps_masters(self, raw: list, initial: dict[int, Tensor]) -> bool:
        """``master_weights="optimizer"`` (asked for, or found: every optimizer keeps its own masters)."""
        assert self.mode is not None
        self._master_weights_found = None  # found again for these optimizers
        own = [keeps_own_masters(opt) for opt in raw]
        names = ", ".join(sorted({type(opt).__name__ for opt in raw}))
        asked = self._master_weights_arg
        if asked == "optimizer":
            if not all(own):
                raise MisconfigurationException(
                    f"MPPlugin(precision={self.mode.name!r}, master_weights='optimizer') needs optimizers that keep fp32"
                    f" master weights themselves, but {names} does not (no master_weights=True). Use Transformer"
                    " Engine's FusedAdam(params, master_weights=True), or master_weights='fp32' (the default) with"
                    " any optimizer."
                )
        elif asked is None and own and all(own):
            self._master_weights_found = "optimizer"
            rank_zero_info(
                f"MPPlugin({self.mode.name!r}): {names} keeps fp32 master weights itself (master_weights=True):"
                " master_weights='optimizer', no second copy."
            )
        elif any(own):
            raise MisconfigurationException(
                f"MPPlugin(precision={self.mode.name!r}, master_weights={self.master_weights!r}) with {names}, which keeps"
                " fp32 master weights itself (master_weights=True): there would be two sets of masters"
                + (" or none where the optimizer steps half weights" if not all(own) else "")
                + ". Use master_weights='optimizer' (or leave it unset) with such an optimizer, or master_weights=False"
                " in the optimizer."
            )
        else:
            return False
        seeded = sum(seed_optimizer_masters(opt, initial) for opt in raw) if initial else 0
        if seeded:
            rank_zero_debug(f"MPPlugin: {seeded} optimizer-held master weights start from the exact fp32 weights.")
        return True

    def _apply_tf32(self) -> None:
        assert self.mode is not None
        wanted = self.tf32 if self.tf32 is not None else self.mode.tf32
        if wanted is None:
            self._restore_tf32()  # a mode switch away from fp32/tf32 gives the flags back
            return
        if self._tf32_saved is None:
            self._tf32_saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = wanted
        torch.backends.cudnn.allow_tf32 = wanted

    def _hold_schedulers(self, module: Optional[LightningModule], optimizers: list, configs: list) -> None:
        self._step_schedulers = {
            id(c.scheduler) for c in configs if getattr(c, "interval", "epoch") == "step" and hasattr(c, "scheduler")
        }
        if not (self.hold_schedulers_on_skip and self.scaler is not None and self._step_schedulers and module is not None):
            return
        if self._patched_module is module:
            return
        original = module.lr_scheduler_step  # the user's override, if any, stays in charge

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if id(scheduler) in self._step_schedulers and self._skipped_for(getattr(scheduler, "optimizer", None)):
                return
            original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
        self._patched_module = module

    def _skipped_for(self, optimizer: Optional[Optimizer]) -> bool:
        record = self._skip_records.get(id(optimizer)) if optimizer is not None else None
        if record is None:
            return False
        return bool(record.item()) if isinstance(record, Tensor) else record

    def _restore_tf32(self) -> None:
        if self._tf32_saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32_saved
            self._tf32_saved = None

    @override
    def teardown(self) -> None:
        self._restore_tf32()
        if self._fp8 is not None:
            self._fp8.watch_saturation(False)  # TE's own amax reduction back, hooks off
        if self._patched_module is not None:
            self._patched_module.__dict__.pop("lr_scheduler_step", None)
            self._patched_module = None
        super().teardown()

    # ------------------------------------------------------------------ the module
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Guard the FP32 modules; in true-half modes cast the other weights to half. In place, idempotent."""
        self._check_sharding(module)
        spec = self.fp32_guards
        if self.mode is not None and self.mode.name in ("bf16", "fp16"):
            lightning_module = _unwrap_lightning_module(module)
            if _root_device(lightning_module, module).type == "cuda":
                spec = spec.without_autocast_fp32()  # CUDA autocast runs these in fp32 already
        guarded = apply_fp32_guards(module, spec)
        self._guarded_classes = tuple({type(module.get_submodule(name)) for name in guarded})
        if self._sharded and guarded and self._fsdp_gather_dtype() is not None:
            self._check_fsdp_wraps_guards(module, guarded)
        if self.mode is not None and self.mode.true_half and not self._sharded:
            # (under FSDP the fp32 shards are the master weights and FSDP gathers half weights for compute)
            before = {id(p): p.data for p in module.parameters() if p.dtype == torch.float32}
            cast_module_(module, self.mode.param_dtype, keep_fp32=guarded)
            if self.master_weights in ("fp32", "optimizer") and self._masters is None:
                # the fp32 tensors the cast replaced (kept, not copied) seed the masters: exact fp32 weights
                cast = {id(p) for p in module.parameters() if p.dtype != torch.float32}
                self._fp32_init = {i: t for i, t in before.items() if i in cast}
        if self.mode is not None and self.mode.name == "fp8" and self._fp8 is not None and self._fp8.model is not module:
            # checks the GPU and Transformer Engine first; swaps in place (before the optimizers exist), casts
            # to bf16 when fp8.weights="bf16" (guarded modules stay fp32), logs one line of what it converted
            lightning_module = _unwrap_lightning_module(module)
            self._fp8.convert(module, device=_root_device(lightning_module, module), announce=rank_zero_info)
        self._converted = module
        return module

    def _check_sharding(self, module: torch.nn.Module) -> None:
        """Under Lightning's FSDP strategy: refuse the modes FSDP cannot shard, use the sharded scaler."""
        lightning_module = _unwrap_lightning_module(module)
        trainer = getattr(lightning_module, "_trainer", None) if lightning_module is not None else None
        strategy = getattr(trainer, "strategy", None)
        sharded = _is_strategy(strategy, "FSDPStrategy")
        if _is_strategy(strategy, "DeepSpeedStrategy"):
            raise MisconfigurationException(
                "MPPlugin does not drive DeepSpeed: DeepSpeed runs its own loss scaling and precision from its config"
                " (Lightning hands them to it through its DeepSpeedPrecision plugin). Use Trainer(precision='bf16-mixed'"
                " or '16-mixed') with DeepSpeedStrategy, or MPPlugin with strategy='ddp', 'fsdp' or ModelParallelStrategy."
            )
        if (
            self.mode is not None
            and (self.mode.true_half or self.mode.name == "fp8")
            and _is_strategy(strategy, "ModelParallelStrategy")
        ):
            raise MisconfigurationException(
                f"MPPlugin(precision={self.mode.name!r}) does not run under ModelParallelStrategy: its FSDP2 shards"
                " are set up in configure_model, before this plugin could cast weights or swap layers. There, set"
                " FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) in"
                " configure_model (the fp32 shards are then the master weights) and use MPPlugin('bf16') for step"
                " skipping and guards."
            )
        if sharded and self.mode is not None and self.mode.name == "fp8":
            raise MisconfigurationException(
                "MPPlugin(precision='fp8') does not run under FSDP: Transformer Engine's modules need their own FSDP"
                " integration. Use MPPlugin('bf16') (or 'bf16-true') with FSDP, or fp8 with strategy='ddp'."
            )
        if sharded and self.mode is not None and self.mode.true_half and self.master_weights != "fp32":
            raise MisconfigurationException(
                f"MPPlugin(precision={self.mode.name!r}, master_weights={self.master_weights!r}) does not run under FSDP:"
                " there the fp32 shards are the master weights and FSDP gathers half-precision weights for compute,"
                " which is master_weights='fp32'. Use master_weights='fp32' (the default) with FSDP, or this option"
                " with strategy='ddp'."
            )
        if sharded != self._sharded:
            self._sharded = sharded
            if self.mode is not None:
                self._setup_mode(self.mode)  # the scaler's class changes, its state carries over

    def _check_fsdp_wraps_guards(self, module: torch.nn.Module, guarded: list[str]) -> None:
        # FSDP keeps modules in full precision by class (isinstance): every module of a guarded class must be guarded
        classes = self._guarded_classes
        for name, sub in module.named_modules():
            if name and isinstance(sub, classes) and not any(name == g or name.startswith(g + ".") for g in guarded):
                twin = next((g for g in guarded if isinstance(sub, type(module.get_submodule(g)))), guarded[0])
                raise MisconfigurationException(
                    f"MPPlugin({self._gather_reason()}) under FSDP keeps guarded modules in fp32 by their class, but the"
                    f" guarded {twin!r} shares its class with the unguarded {name!r} ({type(sub).__name__}), which would"
                    " then lose its half-precision compute. Guard by class (e.g. fp32_modules=['defaults',"
                    f" '{type(sub).__name__}']), give the guarded modules a class of their own, or"
                    + (" use strategy='ddp'." if self.mode is not None and self.mode.true_half else " leave fsdp_param_dtype unset.")
                )
        lightning_module = _unwrap_lightning_module(module)
        strategy = lightning_module._trainer.strategy  # type: ignore[union-attr]
        if strategy.kwargs.get("auto_wrap_policy") is None:
            raise MisconfigurationException(
                f"MPPlugin({self._gather_reason()}) keeps the FP32-guarded modules ({len(guarded)},"
                f" e.g. {guarded[0]!r}) in fp32 by having FSDP wrap them apart, which needs an auto_wrap_policy."
                " Pass FSDPStrategy(auto_wrap_policy={YourBlock}), or fp32_modules=[] to gather every weight in"
                f" {self._gather_reason(short=True)}"
                + (", or leave fsdp_param_dtype unset (fp32 gathers)." if not self.mode.true_half else ".")
            )

    @property
    def mixed_precision_config(self) -> Any:
        """The ``torch.distributed.fsdp.MixedPrecision`` that Lightning's FSDP strategy wraps the model with.

        Parameters (and buffers) stay fp32 in the shards and when gathered; autocast casts per op, exactly as on
        one device, so guarded modules really run in fp32. Gradients are reduced in ``reduce_dtype`` (fp32 unless
        set).
        """
        from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision

        reduce = None if self.reduce_dtype in (None, "fp32") else _REDUCE_DTYPES[self.reduce_dtype]
        gather = self._fsdp_gather_dtype()
        if gather is None:
            return FSDPMixedPrecision(param_dtype=None, reduce_dtype=reduce, buffer_dtype=None)
        # gathered in half for compute; gradients still reduced in fp32 unless reduce_dtype says otherwise, and
        # the guarded modules' classes are wrapped apart with full precision (FSDP's _module_classes_to_ignore)
        true_half = self.mode is not None and self.mode.true_half
        return FSDPMixedPrecision(
            param_dtype=gather,
            reduce_dtype=reduce if reduce is not None else torch.float32,
            buffer_dtype=gather if true_half else None,  # true-half: buffers in half, as on one device
            _module_classes_to_ignore=tuple({*self._guarded_classes, torch.nn.modules.batchnorm._BatchNorm}),
        )

    def _fsdp_gather_dtype(self) -> Optional[torch.dtype]:
        """The dtype FSDP gathers weights in (``None``: fp32): the true-half mode's, or ``fsdp_param_dtype``."""
        if self.mode is not None and self.mode.true_half:
            return self.mode.param_dtype
        return None if self.fsdp_param_dtype in (None, "fp32") else _REDUCE_DTYPES[self.fsdp_param_dtype]

    def _gather_reason(self, short: bool = False) -> str:
        if self.mode is not None and self.mode.true_half:
            return self.mode.name.split("-")[0] if short else f"precision={self.mode.name!r}"
        return str(self.fsdp_param_dtype) if short else f"fsdp_param_dtype={self.fsdp_param_dtype!r}"

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
        if dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=dtype)

    # ------------------------------------------------------------------ forward
    @override
    def autocast_context_manager(self) -> Any:
        dtype = self.mode.autocast_dtype if self.mode is not None else None
        if dtype is None:
            return contextlib.nullcontext()
        # no weight-cast cache: in manual optimization the optimizer steps inside this context
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        param_dtype = self.mode.param_dtype if self.mode is not None else None
        if param_dtype is not None:
            # as Lightning's HalfPrecision: tensors made in forward match the half weights
            with _DtypeContextManager(param_dtype):
                yield
            return
        with self.autocast_context_manager():
            yield

    def _fp8_region(self, training: bool) -> Any:
        if self._fp8 is None or self.mode is None or self.mode.name != "fp8":
            return contextlib.nullcontext()
        return self._fp8.autocast(training=training)

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self.forward_context(), self._fp8_region(training=True):
            yield

    @override
    @contextlib.contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self.forward_context(), self._fp8_region(training=False):
            yield

    @override
    @contextlib.contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self.forward_context(), self._fp8_region(training=False):
            yield

    @override
    @contextlib.contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self.forward_context(), self._fp8_region(training=False):
            yield

    # ------------------------------------------------------------------ backward and step
    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        if self._local_grads and isinstance(self._masters, FP32MasterWeights) and _grads_synced(module):
            # the last micro-batch: reduce the fp32 sums of the earlier ones while its backward runs
            self._pending_reduce = self._masters.all_reduce_grads_async()
            self._local_grads = False
        return Precision.pre_backward(self, tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        tensor = Precision.post_backward(self, tensor, module)  # on_after_backward hooks see the half gradients
        if self._masters is None:
            return tensor
        if _grads_synced(module):
            if self._pending_reduce is not None:
                FP32MasterWeights.wait_all_reduce(self._pending_reduce, _world_size())
                self._pending_reduce = None
            self._masters.carry_grads_()  # DDP reduced this micro-batch's half gradients
        elif isinstance(self._masters, FP32MasterWeights):
            # inside DDP's no_sync: sum in fp32 here, not in the half .grad; reduced before the last micro-batch's
            self._masters.carry_grads_()
            self._local_grads = True
        return tensor

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        scaler = self.scaler
        if scaler is None and self._masters is None:
            step_output = Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        else:
            step_output = self._guarded_step(scaler, optimizer, model, closure, **kwargs)
        if (
            self.release_grads_after_step
            and model.automatic_optimization
            and not is_overridden("optimizer_zero_grad", model, LightningModule)
        ):
            optimizer.zero_grad(set_to_none=True)
        if self._fp8 is not None:
            self._fp8.weights_updated()  # FP8 weight casts cached across micro-batches expire
        return step_output

    def _guarded_step(
        self,
        scaler: Optional[DynamicLossScaler],
        optimizer: Optimizer,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException(
                "MPPlugin cannot check LBFGS steps for inf/NaN (LBFGS re-evaluates its closure)."
                " Use MPPlugin('bf16', skip_nonfinite=False) or MPPlugin('fp32', skip_nonfinite=False) with LBFGS."
            )
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward ran, nothing to step
        masters = self._masters
        if masters is not None:
            masters.prepare(optimizer)  # fp32 gradients (and parameters) for unscaling, hooks, clipping, step
        if scaler is None:  # master weights without the inf/NaN check (skip_nonfinite=False)
            self._after_closure(model, optimizer)
            optimizer.step(**kwargs)
            assert masters is not None
            masters.finish(optimizer, skipped=False)
            return closure_result
        scaler.begin_step()
        if scaler.scaling:
            scaler.unscale_once_(optimizer)  # hooks and clipping must see true gradients
        self._after_closure(model, optimizer)
        scaler.unscale_once_(optimizer)  # without scaling: the check, unless clipping by norm gave the verdict
        if self._fp8 is not None:
            saturated = self._fp8.sentinel.take()  # an inf an FP8 cast made finite: skip the step too
            if saturated is not None:
                scaler.add_found_inf_(optimizer, saturated)
        step_output = scaler.step(optimizer, **kwargs)
        if masters is not None:
            skipped = scaler.last_skipped_host
            # fused optimizers skip on the device: the verdict stays there (no host sync)
            found_inf = scaler.found_inf(optimizer) if skipped is None else None
            masters.finish(optimizer, skipped=skipped, found_inf=found_inf)
        scaler.update()
        if self._patched_module is not None:  # only held LR schedulers read it
            self._skip_records[id(optimizer)] = (
                scaler.last_skipped_host if scaler.last_skipped_host is not None else scaler.counters_tensor()[3].clone()
            )
        self._check_divergence(model)
        return step_output

    def _check_divergence(self, model: LightningModule) -> None:
        limit = self.max_consecutive_skips
        scaler = self.scaler
        if limit is None or scaler is None:
            return
        if scaler.last_skipped_host is False:
            return
        counters = scaler.counters_tensor()
        if scaler.last_skipped_host is True or counters.device.type != "cuda":
            consecutive = scaler.consecutive_skips  # a skipped step is rare: one read is fine
        else:
            copy = self._consecutive_copy
            if copy.started and not copy.ready():
                return
            consecutive = int(copy.value()) if copy.started else None
            copy.start(counters[2])
            if consecutive is None:
                return
        if consecutive >= limit:
            trainer = getattr(model, "_trainer", None)
            step = trainer.global_step if trainer is not None else "?"
            scale = scaler.get_scale() if scaler.scaling else None
            advice = (
                "the loss scale is at its floor: check the model for values that overflow fp16, or use precision='bf16'"
                if scale is not None and scale <= scaler.min_scale
                else "look for a NaN/inf in the data or the loss, lower the learning rate, or add gradient clipping"
            )
            raise NonFiniteTrainingError(
                f"{consecutive} optimizer steps in a row had inf/NaN gradients and were skipped (limit"
                f" max_consecutive_skips={limit}), at global step {step}"
                + (f", loss scale {scale:g}" if scale is not None else "")
                + f". Training stopped: {advice}. NonFiniteDetector names the module that produced it."
            )

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer in manual optimization
        if self._masters is not None:
            self._masters.prepare(optimizer)  # clip the fp32 gradients the optimizer will step
        if self.scaler is not None and self.scaler.scaling:
            # manual optimization clips before opt.step(): unscale first so the clip sees true gradients
            self.scaler.unscale_once_(optimizer)
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self._fsdp_root is not None:
            norm = self._fsdp_root.clip_grad_norm_(clip_val)  # the norm over every rank's shards
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)
            if _is_dtensor(norm):  # sharded parameters (FSDP2 / ModelParallelStrategy): the norm of all shards
                norm = norm.full_tensor()
        self.stats.record_grad_norm(norm)
        if self.scaler is not None:
            self.scaler.record_check_from_(optimizer, norm)  # the norm read every gradient: no second pass

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        mode = self.mode.name if self.mode is not None else self._requested
        state: dict[str, Any] = {"mode": mode}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self._masters is not None:
            state["master_weights"] = self._masters.state_dict()
        if self._fp8 is not None:
            state["fp8"] = self._fp8.state_dict()  # plain tensors: loads with torch.load(weights_only=True)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise ValueError(f"The checkpoint's MPPlugin entry is a {type(state_dict).__name__}, not a dict: it is corrupted.")
        if "scale" in state_dict:  # a bare GradScaler state (Lightning's MixedPrecision or its legacy key)
            state_dict = {"mode": "fp16", "scaler": state_dict}
        if "mode" not in state_dict:
            raise ValueError(
                f"The checkpoint's MPPlugin entry has keys {sorted(state_dict)} but no 'mode': it is corrupted"
                " or was written by another plugin."
            )
        saved_mode = state_dict["mode"]
        current = self.mode.name if self.mode is not None else self._requested
        if saved_mode != current:
            rank_zero_warn(
                f"MPPlugin: the checkpoint was written with precision={saved_mode!r} and training resumes with"
                f" precision={current!r}; skip counters are kept"
                + (", the loss scale starts from init_scale." if saved_mode != "fp16" and current == "fp16" else ".")
            )
        scaler_state = state_dict.get("scaler")
        if scaler_state is not None and self.scaler is not None:
            try:
                self.scaler.load_state_dict(scaler_state)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"The checkpoint's loss-scaler state is corrupted: {err}") from err
        self._load_master_weights(state_dict.get("master_weights"))
        if self._fp8 is not None:
            self._fp8.load_state_dict(state_dict.get("fp8"))  # warns when the recipe changed

    def _load_master_weights(self, saved: Any) -> None:
        current = self.master_weights
        saved_kind = saved.get("kind") if isinstance(saved, dict) else None
        if saved is not None and saved_kind is None:
            raise ValueError("The checkpoint's master-weights state is corrupted: it has no 'kind'.")
        if self._masters is not None:
            if saved is None:
                fp32, self._fp32_weights_in_checkpoint = self._fp32_weights_in_checkpoint, {}
                if fp32:
                    self._masters.load_fp32_values(fp32)
                rank_zero_warn(
                    f"MPPlugin: the checkpoint holds no master weights; master_weights={current!r} starts from the"
                    + (" checkpoint's fp32 weights." if fp32 else " checkpoint's half-precision weights.")
                )
                return
            if saved_kind != current:
                rank_zero_warn(
                    f"MPPlugin: the checkpoint's master weights are {saved_kind!r}, training resumes with"
                    f" master_weights={current!r}: converted through their fp32 values."
                )
            self._masters.load_state_dict(saved)
            return
        if saved is None:
            return
        # no master weights now: fp32 weights (a mixed mode) take the masters' values exactly
        module = self._converted
        params = dict(module.named_parameters()) if module is not None else {}
        values = fp32_values(saved, params)
        restored = 0
        with torch.no_grad():
            for name, value in values.items():
                param = params.get(name)
                if param is not None and param.dtype == torch.float32 and param.shape == value.shape:
                    param.copy_(value)
                    restored += 1
        if not restored:
            rank_zero_warn(
                f"MPPlugin: the checkpoint's {saved_kind!r} master weights are not used: precision="
                f"{self.mode.name if self.mode is not None else self._requested!r}"
                + (" with master_weights='none' trains the half weights alone." if current == "none" else ".")
            )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a mixed-precision checkpoint resumed in a true-half mode: its fp32 weights become the masters
        module_state = checkpoint.get("state_dict")
        self._fp32_weights_in_checkpoint = (
            {k: v for k, v in module_state.items() if isinstance(v, Tensor) and v.dtype == torch.float32}
            if self._masters is not None and isinstance(module_state, dict)
            else {}
        )
        # a checkpoint written with Lightning's precision="16-mixed" keeps its scale when resumed here
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint:
            self.load_state_dict(checkpoint["MixedPrecision"])
        elif type(self).__qualname__ not in checkpoint and self._masters is not None:
            self._load_master_weights(None)


def _grads_synced(module: Any) -> bool:
    """False inside DDP's ``no_sync`` (accumulation): DDP still has to all-reduce the parameters' own gradients."""
    trainer = getattr(module, "_trainer", None)
    model = trainer.strategy.model if trainer is not None else None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return bool(model.require_backward_grad_sync)
    return True


def _is_fsdp(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FullyShardedDataParallel)


def _is_strategy(strategy: Any, name: str) -> bool:
    """Whether ``strategy`` is Lightning's strategy class ``name`` (``False`` where this Lightning has none)."""
    from lightning.pytorch import strategies

    cls = getattr(strategies, name, None)
    return cls is not None and isinstance(strategy, cls)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _unwrap_lightning_module(model: Any) -> Optional[LightningModule]:
    seen = 0
    while not isinstance(model, LightningModule) and hasattr(model, "module") and seen < 8:
        model = model.module
        seen += 1
    return model if isinstance(model, LightningModule) else None


def _root_device(module: Optional[LightningModule], model: Any) -> torch.device:
    trainer = getattr(module, "_trainer", None) if module is not None else None
    if trainer is not None:
        return trainer.strategy.root_device
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param.device if param is not None else torch.device("cpu")
