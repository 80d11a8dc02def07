"""How a plugin describes itself: ``repr`` (its settings that differ from the defaults), the line logged when
``fit`` starts, the compute dtype. Its arguments are checked in :mod:`lightning_mp.settings`."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

# ---------------------------------------------------------------------------------------------- what a plugin runs
#: settings ``repr`` leaves out: the precision (shown first, unnamed) and the device type the scaler starts on (the
#: Trainer's device wins at set-up)
_UNSHOWN = ("precision", "device")


def changed_settings(plugin: Any) -> dict[str, Any]:
    """The plugin's settings that differ from their defaults (:meth:`MPSettings.changed`), in the order of its
    constructor's arguments."""
    parameters = list(inspect.signature(type(plugin).__init__).parameters)
    changed = {name: value for name, value in plugin.settings.changed().items() if name not in _UNSHOWN}
    order = sorted(changed, key=lambda name: parameters.index(name) if name in parameters else len(parameters))
    return {name: changed[name] for name in order}


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
    FP32 guards: defaults) on cpu``. With ``auto``, why it chose the mode follows: ``... on cpu, because the CPU
    (AVX2, no AVX512-BF16 or AMX) has no native bf16: ...``.
    """
    from lightning_mp.modes import AUTO, auto_choice, running_mode

    mode = running_mode(plugin)
    assert mode is not None, "summary() describes a lightning_mp plugin"  # (its mode, or auto's choice for its device)
    parts: list[str] = ["chosen by 'auto'"] if plugin.requested_precision == AUTO else []
    parts += _weights_clauses(plugin, mode)
    parts += _tf32_clauses(plugin, mode)
    parts += _scaling_clauses(plugin, mode)
    parts += _skipping_clauses(plugin, mode)
    parts.append(_guards_clause(plugin))
    parts += _distributed_clauses(plugin)
    kind = "mixed precision" if mode.autocast_only else "precision"
    text = f"{mode.name} {kind} ({', '.join(parts)}) on {plugin.device}"
    if plugin.requested_precision == AUTO:
        name, why = auto_choice(str(plugin.device))
        text += f", because {why}" if name == mode.name else ""  # (a mode switched to since is no choice of auto's)
    return text


def _fp8_weights(plugin: Any) -> str:
    from lightning_mp.fp8.convert import weights_phrase

    fp8 = getattr(getattr(plugin, "_run", None), "fp8", None)
    return weights_phrase(str(getattr(fp8, "weights", None) or plugin.fp8_config.weights))


def _weights_clauses(plugin: Any, mode: Any) -> list[str]:
    """The dtypes the weights are kept and the compute runs in (and the master weights of a true-half mode)."""
    if mode.fp8:
        from lightning_mp.fp8.config import BACKEND_TITLES

        return [
            f"{BACKEND_TITLES.get(plugin.fp8_config.backend, plugin.fp8_config.backend)} FP8 GEMMs,"
            f" {plugin.fp8_config.recipe} scaling",
            "autocast bf16 for the rest",
            _fp8_weights(plugin) + (f", {plugin.master_weights} master weights"
                                    if plugin.master_weights not in (None, "none") else ""),
        ]
    if mode.true_half:
        assert mode.param_dtype is not None  # true-half modes cast the weights
        short = _SHORT[mode.param_dtype]
        return [f"{short} weights and compute", _MASTERS[plugin.master_weights or "fp32"].format(short)]
    if mode.autocast_dtype is not None:
        return [f"autocast {_SHORT[mode.autocast_dtype]}", "fp32 weights"]
    return ["fp32 weights and compute"]


def _tf32_clauses(plugin: Any, mode: Any) -> list[str]:
    """TF32, where the mode is ``tf32`` or the setting (given, or the mode's) applies on CUDA."""
    tf32 = plugin.settings.tf32 if plugin.settings.tf32 is not None else mode.tf32
    if mode.name == "tf32" or (tf32 is not None and plugin.device == "cuda"):
        return ["TF32 matmul/cuDNN" if tf32 else "TF32 off"]
    return []


def _scaling_clauses(plugin: Any, mode: Any) -> list[str]:
    """The loss scaling: a given scaler, a static or a dynamic scale; none where the mode needs none."""
    settings = plugin.settings
    if settings.scaler is not None:
        return [f"loss scaling by the given {type(settings.scaler).__name__}"]
    if not mode.needs_scaler:
        return []
    scaling = settings.scaling
    if scaling.loss_scale is not None:
        return [f"static loss scale {scaling.loss_scale:g}"]
    hysteresis = f", hysteresis {scaling.hysteresis}" if scaling.hysteresis != 1 else ""
    return [f"dynamic loss scale from {scaling.init_scale:g}{hysteresis}"]


def _skipping_clauses(plugin: Any, mode: Any) -> list[str]:
    """Whether inf/NaN steps are checked and skipped, and after how many in a row the run stops."""
    settings = plugin.settings
    if settings.scaler is None and not mode.needs_scaler and not settings.skips.skip_nonfinite:
        return ["inf/NaN steps not checked (skip_nonfinite=False)"]
    parts = ["inf/NaN steps skipped"]
    if plugin.max_consecutive_skips is not None:
        parts.append(f"stop after {plugin.max_consecutive_skips} in a row")
    return parts


def _guards_clause(plugin: Any) -> str:
    """The FP32 guards on the plugin's device: none, the defaults, or the defaults and/or the extra ones."""
    from lightning_mp.guards import DEFAULT_FP32_MODULES

    spec = plugin._fp32_guard_spec(plugin.device)
    native_layer_norm = "" if spec.plain_layer_norm else " (plain LayerNorms in bf16)"
    if spec.empty:
        return "no FP32 guards"
    if spec.patterns == DEFAULT_FP32_MODULES and not spec.classes:
        return f"FP32 guards: defaults{native_layer_norm}"
    extra = [p for p in spec.patterns if p not in DEFAULT_FP32_MODULES] + [c.__name__ for c in spec.classes]
    listed = ["defaults"] if set(DEFAULT_FP32_MODULES) <= set(spec.patterns) else []
    return f"FP32 guards: {' + '.join(listed + ([', '.join(extra)] if extra else []))}{native_layer_norm}"


def _distributed_clauses(plugin: Any) -> list[str]:
    """The dtypes gradients are reduced in and FSDP gathers the weights in, where set."""
    parts = []
    if plugin.reduce_dtype is not None:
        parts.append(f"gradients reduced in {plugin.reduce_dtype}")
    if plugin.fsdp_param_dtype is not None:
        parts.append(f"FSDP gathers {plugin.fsdp_param_dtype} weights")
    return parts


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

    mode = running_mode(plugin)
    assert mode is not None, "compute_dtype() describes a lightning_mp plugin"
    return compute_dtype(mode)
