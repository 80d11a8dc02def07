"""MPPlugin's arguments: checked before training starts, the loss scaler they describe, and how a plugin describes
itself (``repr``, the line logged when ``fit`` starts, the compute dtype)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mp.distributed import REDUCE_DTYPES
from lightning_mp.scaling import DynamicLossScaler, ShardedDynamicLossScaler

SCALER_DEFAULTS: dict[str, Any] = {
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


def check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is invalid: use true or false.")


def check_options(
    *,
    loss_scale: Optional[float],
    max_consecutive_skips: Optional[int],
    tf32: Optional[bool],
    reduce_dtype: Optional[str],
    fsdp_param_dtype: Optional[str],
    device: Optional[str],
    scaler_kwargs: dict[str, Any],
) -> None:
    """Raise ``ValueError`` naming the bad value and the accepted ones; contradicting options are refused too."""
    if loss_scale is not None:
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (
            math.isfinite(loss_scale) and 0 < loss_scale <= 3.4028234663852886e38
        ):
            raise ValueError(
                f"loss_scale={loss_scale!r} is invalid: use a finite number > 0 that fp32 can hold (at most ~3.4e38),"
                " or None for a dynamic scale."
            )
        moved = sorted(
            k for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis")
            if scaler_kwargs[k] != SCALER_DEFAULTS[k]
        )
        if moved:
            raise ValueError(
                f"loss_scale={loss_scale!r} (a static scale) contradicts {', '.join(moved)}, which configure a dynamic"
                " one. Pass either loss_scale or the dynamic-scale arguments."
            )
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips={max_consecutive_skips!r} is invalid: use an integer >= 1, or None to never stop."
        )
    if tf32 is not None and not isinstance(tf32, bool):
        raise ValueError(f"tf32={tf32!r} is invalid: use true, false, or null (the mode's default).")
    if device is not None and not isinstance(device, str):
        raise ValueError(f"device={device!r} is invalid: use a device type such as 'cuda' or 'cpu', or None.")
    for name, value in (("reduce_dtype", reduce_dtype), ("fsdp_param_dtype", fsdp_param_dtype)):
        if value is not None and value not in REDUCE_DTYPES:
            raise ValueError(f"{name}={value!r} is invalid: use one of {sorted(REDUCE_DTYPES)}, or null for fp32.")
    make_scaler(scaler_kwargs, "cpu", scaling=True, sharded=False)  # the scaler's own checks, before training


def make_scaler(scaler_kwargs: dict[str, Any], device: str, *, scaling: bool, sharded: bool) -> DynamicLossScaler:
    kw = dict(scaler_kwargs)
    loss_scale = kw.pop("loss_scale")
    if loss_scale is not None:
        kw["init_scale"] = float(loss_scale)
        kw["min_scale"] = min(kw["min_scale"], float(loss_scale))
        kw["max_scale"] = max(kw["max_scale"], float(loss_scale))
    cls = ShardedDynamicLossScaler if sharded else DynamicLossScaler
    return cls(device, **kw, dynamic=loss_scale is None, scaling=scaling)


def changed_scaler_arguments(scaler_kwargs: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in scaler_kwargs.items() if v != SCALER_DEFAULTS[k])


# ---------------------------------------------------------------------------------------------- what a plugin runs
#: constructor arguments in ``MPPlugin``'s order, each with how to read its value back from a plugin
_SETTINGS: dict[str, Callable[[Any], Any]] = {
    "scaler": lambda p: p._run.given_scaler,
    **{name: (lambda p, n=name: p._run.scaler_kwargs[n]) for name in SCALER_DEFAULTS},
    "skip_nonfinite": lambda p: p._run.skip_nonfinite,
    "max_consecutive_skips": lambda p: p.max_consecutive_skips,
    "hold_schedulers_on_skip": lambda p: p.hold_schedulers_on_skip,
    "tf32": lambda p: p._run.tf32,
    "release_grads_after_step": lambda p: p.release_grads_after_step,
    "fp32_modules": lambda p: p.fp32_guards,
    "master_weights": lambda p: p._weights.asked,
    "fp8": lambda p: p.fp8_config,
    "reduce_dtype": lambda p: p.reduce_dtype,
    "fsdp_param_dtype": lambda p: p.fsdp_param_dtype,
    "spike_sigma": lambda p: p.spike_sigma,
    "spike_window": lambda p: p.spike_window,
}


def changed_settings(plugin: Any) -> dict[str, Any]:
    """The plugin's constructor arguments that differ from their defaults, in the constructor's order."""
    from lightning_mp.fp8.config import FP8Config
    from lightning_mp.guards import FP32GuardSpec

    parameters = inspect.signature(type(plugin).__init__).parameters
    changed: dict[str, Any] = {}
    for name in sorted(_SETTINGS, key=lambda n: list(parameters).index(n) if n in parameters else len(parameters)):
        value = _SETTINGS[name](plugin)
        default = parameters[name].default if name in parameters else None
        if name == "fp32_modules":
            default = FP32GuardSpec.from_arg(default)
        elif name == "fp8":
            default = FP8Config.from_value(default)
        if value is not default and value != default:
            changed[name] = value
    return changed


def _render(name: str, value: Any) -> str:
    from lightning_mp.guards import DEFAULT_FP32_MODULES, DEFAULTS_TOKEN

    if name == "scaler":
        return f"<{type(value).__name__}>"
    if name == "fp32_modules":
        patterns = list(value.patterns)
        if tuple(patterns[: len(DEFAULT_FP32_MODULES)]) == DEFAULT_FP32_MODULES:
            patterns = [DEFAULTS_TOKEN, *patterns[len(DEFAULT_FP32_MODULES) :]]
        return "[" + ", ".join([*(repr(p) for p in patterns), *(c.__name__ for c in value.classes)]) + "]"
    if name == "fp8":
        from lightning_mp.fp8.config import FP8Config

        default = FP8Config()
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return repr({k: v for k, v in fields.items() if v != getattr(default, k)})
    return repr(value)


def describe(plugin: Any) -> str:
    """``repr`` of an ``MPPlugin``: the precision asked for and the arguments that differ from their defaults, plus
    the mode in force when that differs (``auto`` once settled, or a mode ``PrecisionSchedule`` switched to).

    Example::

        describe(MPPlugin("fp16", init_scale=1024.0, hysteresis=2))
        # "MPPlugin('fp16', init_scale=1024.0, hysteresis=2)"
    """
    try:
        arguments = [repr(plugin.requested_precision)]
        arguments += [f"{name}={_render(name, value)}" for name, value in changed_settings(plugin).items()]
    except AttributeError:  # a plugin whose __init__ has not finished: a repr must not raise
        return object.__repr__(plugin)
    text = f"{type(plugin).__name__}({', '.join(arguments)})"
    mode = plugin.mode
    if mode is not None and mode.name != plugin.requested_precision:
        text += f" [running {mode.name!r}]"
    return text


_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MASTERS = {
    "fp32": "fp32 master weights",
    "kahan": "Kahan-compensated {} weights",
    "stochastic": "stochastic rounding of the {} weights",
    "none": "no master weights",
    "optimizer": "the optimizer's own fp32 master weights",
}


def summary(plugin: Any) -> str:
    """One line on what the plugin runs: mode, weights, loss scaling, inf/NaN skipping, FP32 guards, device.

    Example: ``bf16 mixed precision (autocast bf16, fp32 weights, inf/NaN steps skipped, stop after 100 in a row,
    FP32 guards: defaults) on cpu``.
    """
    from lightning_mp.guards import DEFAULT_FP32_MODULES, FP32GuardSpec
    from lightning_mp.modes import AUTO, running_mode

    mode = running_mode(plugin)
    run = plugin._run
    parts: list[str] = []
    if plugin.requested_precision == AUTO:
        parts.append("chosen by 'auto'")
    tf32 = run.tf32 if run.tf32 is not None else mode.tf32
    if mode.fp8:
        parts += [
            f"Transformer Engine FP8 GEMMs, {plugin.fp8_config.recipe} scaling",
            "autocast bf16 for the rest",
            f"{plugin.fp8_config.weights} weights",
        ]
    elif mode.true_half:
        short = _SHORT[mode.param_dtype]
        parts += [f"{short} weights and compute", _MASTERS[plugin.master_weights or "fp32"].format(short)]
    elif mode.autocast_dtype is not None:
        parts += [f"autocast {_SHORT[mode.autocast_dtype]}", "fp32 weights"]
    else:
        parts.append("fp32 weights and compute")
    if mode.name == "tf32" or (tf32 is not None and plugin.device == "cuda"):
        parts.append("TF32 matmul/cuDNN" if tf32 else "TF32 off")
    if run.given_scaler is not None:
        parts.append(f"loss scaling by the given {type(run.given_scaler).__name__}")
    elif mode.needs_scaler:
        kw = run.scaler_kwargs
        if kw["loss_scale"] is not None:
            parts.append(f"static loss scale {kw['loss_scale']:g}")
        else:
            hysteresis = f", hysteresis {kw['hysteresis']}" if kw["hysteresis"] != 1 else ""
            parts.append(f"dynamic loss scale from {kw['init_scale']:g}{hysteresis}")
    if run.given_scaler is None and not mode.needs_scaler and not run.skip_nonfinite:
        parts.append("inf/NaN steps not checked (skip_nonfinite=False)")
    else:
        parts.append("inf/NaN steps skipped")
        if plugin.max_consecutive_skips is not None:
            parts.append(f"stop after {plugin.max_consecutive_skips} in a row")
    spec = plugin.fp32_guards
    if spec.empty:
        parts.append("no FP32 guards")
    elif spec == FP32GuardSpec():
        parts.append("FP32 guards: defaults")
    else:
        extra = [p for p in spec.patterns if p not in DEFAULT_FP32_MODULES] + [c.__name__ for c in spec.classes]
        base = "defaults + " if set(DEFAULT_FP32_MODULES) <= set(spec.patterns) else ""
        parts.append(f"FP32 guards: {base}{', '.join(extra)}")
    if plugin.reduce_dtype is not None:
        parts.append(f"gradients reduced in {plugin.reduce_dtype}")
    if plugin.fsdp_param_dtype is not None:
        parts.append(f"FSDP gathers {plugin.fsdp_param_dtype} weights")
    kind = "mixed precision" if mode.autocast_only else "precision"
    return f"{mode.name} {kind} ({', '.join(parts)}) on {plugin.device}"


def announce(plugin: Any, model: Any = None) -> Optional[str]:
    """Log (rank zero, Lightning's INFO logger) the line that says what precision a ``fit`` runs in, and return it.

    ``model``: the LightningModule; when its Trainer is running ``validate``/``test``/``predict``, nothing is logged.
    """
    trainer = getattr(model, "_trainer", None)
    if trainer is not None and trainer.state.fn != "fit":
        return None
    text = f"lightning_mp: using {summary(plugin)}"
    rank_zero_info(text)
    return text


def plugin_compute_dtype(plugin: Any) -> torch.dtype:
    """``MPPlugin.compute_dtype()``: the dtype its matmuls run in (see :func:`lightning_mp.modes.compute_dtype`)."""
    from lightning_mp.modes import compute_dtype, running_mode

    return compute_dtype(running_mode(plugin))
