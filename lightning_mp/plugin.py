"""MPPlugin: Lightning hook wiring for autocast, loss scaling and inf/NaN step skipping.

Order of one optimizer step (automatic optimization), written down because it matters:

1. ``closure()``: ``training_step`` under ``forward_context`` (autocast), ``zero_grad``, ``pre_backward``
   (the loss is scaled), ``backward``, ``post_backward``.
2. ``unscale_`` (fp16): gradients are divided by the scale and checked for inf/NaN in one fused kernel.
3. ``_after_closure``: ``on_before_optimizer_step`` hooks and gradient clipping see true gradients.
   Without loss scaling (bf16/fp32/tf32) the inf/NaN check runs here instead: a read-only pass, or no pass
   at all when clipping by norm computed the total norm (a non-finite norm means a non-finite gradient).
4. ``scaler.step``: the optimizer steps unless a gradient was inf/NaN (fused optimizers skip on the device).
5. ``scaler.update``: counters and the scale move on the device; then the divergence check, and
   gradients are released so the next forward does not carry them.
6. Lightning steps the LR schedulers; a step-interval scheduler whose optimizer skipped is held.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Generator
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp.modes import AUTO, MODES, PLANNED, auto_choice, PrecisionMode, parse_precision, provisional_lightning_precision, resolve_mode
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.stats import NonFiniteTrainingError, StepStats

log = logging.getLogger(__name__)

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


class MPPlugin(MixedPrecision):
    """Mixed-precision training for any LightningModule: autocast, loss scaling, inf/NaN step skipping.

    Example::

        from lightning.pytorch import Trainer
        from lightning_mp import MPPlugin

        trainer = Trainer(plugins=[MPPlugin("bf16")], max_steps=100)
        trainer.fit(model)
        print(trainer.precision_plugin.stats)   # steps, skipped_steps, loss_scale, ...

    Args:
        precision: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or ``"auto"``; Lightning's strings
            (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ...) are accepted as aliases.
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
        # validate the scaler arguments now, whatever the mode, so YAML typos fail before training
        self._make_scaler("cpu", scaling=True)

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
        self._lagged_consecutive = _LaggedRead()
        self._auto_device: Optional[str] = None
        self._device_for_state: Optional[torch.device] = None
        if self._requested in PLANNED:
            resolve_mode(self._requested, self.device)  # raises: known name, not runnable in this release
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
        return DynamicLossScaler(device, **kw, dynamic=loss_scale is None, scaling=scaling)

    def _setup_mode(self, mode: PrecisionMode) -> None:
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
                " loss-scaling arguments take effect with precision='fp16'."
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
        if self.scaler is not None:
            self.scaler.ensure_initialized(device)
            self.scaler.sync_across_ranks = _world_size() > 1
        self._apply_tf32()
        self._hold_schedulers(module, optimizers, lr_schedulers)
        return model, optimizers, lr_schedulers

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
        if self._patched_module is not None:
            self._patched_module.__dict__.pop("lr_scheduler_step", None)
            self._patched_module = None
        super().teardown()

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
        with self.autocast_context_manager():
            yield

    # ------------------------------------------------------------------ backward and step
    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return Precision.pre_backward(self, tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        scaler = self.scaler
        if scaler is None:
            step_output = Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        else:
            step_output = self._guarded_step(scaler, optimizer, model, closure, **kwargs)
        if (
            self.release_grads_after_step
            and model.automatic_optimization
            and not is_overridden("optimizer_zero_grad", model, LightningModule)
        ):
            optimizer.zero_grad(set_to_none=True)
        return step_output

    def _guarded_step(
        self, scaler: DynamicLossScaler, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException(
                "MPPlugin cannot check LBFGS steps for inf/NaN (LBFGS re-evaluates its closure)."
                " Use MPPlugin('bf16', skip_nonfinite=False) or MPPlugin('fp32', skip_nonfinite=False) with LBFGS."
            )
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward ran, nothing to step
        scaler.begin_step()
        if scaler.scaling:
            scaler.unscale_once_(optimizer)  # hooks and clipping must see true gradients
        self._after_closure(model, optimizer)
        scaler.unscale_once_(optimizer)  # without scaling: the check, unless clipping by norm gave the verdict
        step_output = scaler.step(optimizer, **kwargs)
        scaler.update()
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
            consecutive = self._lagged_consecutive(counters[2])
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
        if self.scaler is not None and self.scaler.scaling:
            # manual optimization clips before opt.step(): unscale first so the clip sees true gradients
            self.scaler.unscale_once_(optimizer)
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)
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

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written with Lightning's precision="16-mixed" keeps its scale when resumed here
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint:
            self.load_state_dict(checkpoint["MixedPrecision"])


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


class _LaggedRead:
    """Read a small CUDA tensor without waiting: returns the value copied at an earlier call, or None."""

    def __init__(self) -> None:
        self._host: Optional[Tensor] = None
        self._event: Optional[Any] = None

    def __call__(self, tensor: Tensor) -> Optional[int]:
        value = None
        if self._event is not None:
            if not self._event.query():
                return None
            value = int(self._host.item())
        if self._host is None:
            self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return value
