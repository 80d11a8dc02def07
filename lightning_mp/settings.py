"""MPPlugin's options as frozen settings objects, one per concern, each checked once when it is built.

``MPPlugin.__init__`` keeps its flat keyword arguments (a Lightning CLI config maps ``init_args`` one-to-one onto
them) and turns them into one :class:`MPSettings` with :meth:`MPSettings.from_arguments`; the rest of the plugin
reads that:

- :class:`LossScaleSettings`: the fp16 loss scale, dynamic or static;
- :class:`SkipSettings`: skipping inf/NaN steps, the divergence stop, what happens around a skipped step, the
  loss-spike guard;
- :class:`DistributedSettings`: the dtypes gradients are reduced in and FSDP gathers weights in;
- :class:`MPSettings`: those three, the precision, the device the scaler starts on, a given scaler, TF32, the FP32
  guards, the master weights and the fp8 settings.

Every default is written once, in :data:`DEFAULTS` (``None`` defaults mean "unset" and are written as ``None``): the
settings' fields, ``MPPlugin``'s signature and ``DynamicLossScaler``'s take them from there. A bad value raises
``ValueError`` naming it, the accepted values and the fix, when the settings are built (before training). The
checks that need the mode in force are in :meth:`MPSettings.check_mode`, run wherever the mode becomes known.

Example::

    settings = MPSettings.from_arguments(precision="fp16", init_scale=1024.0, hysteresis=2)
    settings.scaling.init_scale    # 1024.0
    settings.changed()             # {'precision': 'fp16', 'init_scale': 1024.0, 'hysteresis': 2}
    settings.scaling.init_scale = 1.0  # dataclasses.FrozenInstanceError
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mp.fp8.config import FP8Config
from lightning_mp.guards import FP32GuardSpec
from lightning_mp.modes import AUTO, MODES, PrecisionMode, parse_precision, uses_fp8_settings
from lightning_mp.spike import MIN_WINDOW

#: ``MPPlugin``'s defaults other than ``None``, written once: the settings below, ``MPPlugin.__init__`` and
#: ``DynamicLossScaler.__init__`` take theirs from here
DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "precision": "bf16",
    # the dynamic loss scale (fp16)
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "hysteresis": 1,
    "consecutive_hysteresis": True,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    # skipped steps
    "skip_nonfinite": True,
    "max_consecutive_skips": 100,
    "hold_schedulers_on_skip": True,
    "release_grads_after_step": True,
    # the check-only steps replayed from a CUDA graph (lightning_mp.capture): off until the GPU suite has run it
    "capture_step": False,
    "spike_window": 128,  # OLMo-core's
    # the dtype Adam's moments are held in between steps (lightning_mp.optim_states)
    "optimizer_states": "fp32",
})  # fmt: skip

#: the dtype names ``reduce_dtype`` and ``fsdp_param_dtype`` accept
REDUCE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
)
#: the kinds of master weights ``master_weights`` accepts (:mod:`lightning_mp.master`)
MASTER_WEIGHT_KINDS: tuple[str, ...] = ("fp32", "kahan", "stochastic", "none", "optimizer")
#: the dtypes ``optimizer_states`` accepts for Adam's moments (:mod:`lightning_mp.optim_states`)
OPTIMIZER_STATE_DTYPES: Mapping[str, Optional[torch.dtype]] = MappingProxyType(
    {"fp32": None, "bf16": torch.bfloat16}  # None: as the optimizer makes them (fp32 beside fp32 weights or masters)
)


@dataclass(frozen=True)
class MasterKind:
    """What a kind of master weights means for the run, said once (the parts ask it, never compare its name).

    ``ours``: this package's master weights step the half weights (fp32 copies, Kahan compensation, stochastic
    rounding); ``keeps_precision``: updates below the half dtype's resolution are kept (by us or by the optimizer), so
    a LayerNorm may compute in bf16 and its weights keep their fp32 values; ``fp32_copy``: an fp32 copy of every weight
    lives between steps, which FSDP's fp32 shards can be (the only kind a sharded true-half or FP8 run takes).
    """

    name: str
    ours: bool
    keeps_precision: bool
    fp32_copy: bool

    @staticmethod
    def of(name: Optional[str]) -> Optional["MasterKind"]:
        """The kind named ``name`` (checked already); ``None`` for ``None`` (no true-half mode)."""
        return None if name is None else _MASTER_KINDS[name]


_MASTER_KINDS: Mapping[str, MasterKind] = MappingProxyType({k.name: k for k in (
    MasterKind("fp32", ours=True, keeps_precision=True, fp32_copy=True),
    MasterKind("kahan", ours=True, keeps_precision=True, fp32_copy=False),
    MasterKind("stochastic", ours=True, keeps_precision=True, fp32_copy=False),
    MasterKind("none", ours=False, keeps_precision=False, fp32_copy=False),
    MasterKind("optimizer", ours=False, keeps_precision=True, fp32_copy=False),
)})  # fmt: skip

_F32 = torch.finfo(torch.float32)  # a loss scale is a float32 tensor
_INT32 = torch.iinfo(torch.int32)  # the growth and hysteresis trackers are int32 tensors
#: the dynamic-scale arguments a static ``loss_scale`` contradicts
_DYNAMIC_ONLY = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis")


# ---------------------------------------------------------------------------------------------- single values
def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: use true or false.")
    return value


def check_scale(name: str, value: Any, *, smallest: float = _F32.tiny) -> float:
    """A scale or scale bound: finite, > 0, at least ``smallest``, and no larger than float32 holds."""
    if is_number(value) and value > 0 and smallest <= value <= _F32.max:  # NaN fails every comparison
        return float(value)
    bounds = f"[{smallest!r}, {_F32.max!r}]" if smallest > 0 else f"(0, {_F32.max!r}]"
    raise ValueError(
        f"{name}={value!r} is invalid: it must be a finite number > 0 that a float32 tensor holds, in {bounds}."
    )


def check_int(name: str, value: Any, low: int, high: int, what: str, *, allow_bool: bool = False) -> int:
    """An integer in ``[low, high]``; an integral float (``3.0``, e.g. after a JSON round trip) counts as one."""
    number = int(value) if isinstance(value, float) and value.is_integer() else value
    if (isinstance(number, bool) and not allow_bool) or not isinstance(number, int) or not low <= number <= high:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {low} and <= {high} ({what}).")
    return int(number)


def check_factors(growth_factor: Any, backoff_factor: Any) -> tuple[float, float]:
    if not is_number(growth_factor) or not 1 < growth_factor < math.inf:
        raise ValueError(f"growth_factor={growth_factor!r} is invalid: it must be a finite number > 1 (e.g. 2.0).")
    if not is_number(backoff_factor) or not 0 < backoff_factor < 1:
        raise ValueError(f"backoff_factor={backoff_factor!r} is invalid: it must lie in (0, 1) (e.g. 0.5).")
    return float(growth_factor), float(backoff_factor)


def check_growth_interval(value: Any) -> int:
    return check_int("growth_interval", value, 1, _INT32.max, "the growth tracker is an int32 tensor; e.g. 2000")


def check_scaler_arguments(
    *,
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    hysteresis: Any,
    min_scale: Any,
    max_scale: Any,
) -> dict[str, Any]:
    """A loss scaler's arguments checked (``ValueError`` naming the value and what is accepted) and normalized
    (floats and ints): scales and bounds a float32 tensor holds, ``growth_interval`` and ``hysteresis`` an int32 one,
    ``min_scale <= max_scale``, and ``init_scale`` between them.
    ``DynamicLossScaler`` and :class:`LossScaleSettings` both check with this."""
    init_scale, min_scale, max_scale = (
        check_scale(name, value)
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale))
    )
    growth_factor, backoff_factor = check_factors(growth_factor, backoff_factor)
    growth_interval = check_growth_interval(growth_interval)
    hysteresis = check_int(
        "hysteresis", hysteresis, 1, _INT32.max,
        "the hysteresis budget is an int32 tensor; 1 backs off on every overflow",
    )  # fmt: skip
    if min_scale > max_scale:
        raise ValueError(f"min_scale={min_scale!r} is larger than max_scale={max_scale!r}; use min_scale <= max_scale.")
    if not min_scale <= init_scale <= max_scale:
        raise ValueError(
            f"init_scale={init_scale!r} lies outside [min_scale={min_scale!r}, max_scale={max_scale!r}];"
            " choose an init_scale between them."
        )
    return {
        "init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
        "growth_interval": growth_interval, "hysteresis": hysteresis, "min_scale": min_scale, "max_scale": max_scale,
    }  # fmt: skip


def parse_master_weights(value: object) -> str:
    """Check a ``master_weights`` value; ``True``/``False`` are short for ``"fp32"``/``"none"``.

    Raises:
        ValueError: naming the value and the accepted ones.
    """
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):  # the command line passes strings
        value = value.strip().lower() == "true"
    if isinstance(value, bool):
        return "fp32" if value else "none"
    if isinstance(value, str) and value.strip().lower() in MASTER_WEIGHT_KINDS:
        return value.strip().lower()
    raise ValueError(
        f"master_weights={value!r} is invalid. Accepted values: {', '.join(repr(k) for k in MASTER_WEIGHT_KINDS)},"
        " true (= 'fp32'), false (= 'none'), or null ('fp32' in the true-half modes)."
    )


def parse_optimizer_states(value: object) -> str:
    """Check an ``optimizer_states`` value (``"fp32"``, ``"bf16"``; any case, ``"float32"``/``"bfloat16"`` too).

    Raises:
        ValueError: naming the value and the accepted ones (8-bit states: why there are none).
    """
    aliases = {"float32": "fp32", "bfloat16": "bf16"}
    name = value.strip().lower() if isinstance(value, str) else None
    name = aliases.get(name, name) if name is not None else None
    if name is not None and name in OPTIMIZER_STATE_DTYPES:
        return name
    hint = ""
    if name is not None and any(k in name for k in ("8", "int", "fp8", "float8")):
        hint = (" 8-bit moments are not offered: the well-kept implementations (torchao's AdamW8bit/AdamWFp8,"
                " bitsandbytes') replace the optimizer class and its step; use one of them directly with"
                " optimizer_states='fp32'.")
    elif name in ("fp16", "float16", "half"):
        hint = " fp16 moments are not offered: the second moment (squared gradients) underflows fp16's range."
    raise ValueError(
        f"optimizer_states={value!r} is invalid. Accepted values: 'fp32' (the default: as the optimizer keeps them)"
        f" and 'bf16' (Adam's and AdamW's moments held in bf16, rounded stochastically).{hint}"
    )


# ---------------------------------------------------------------------------------------------- the settings
#: the plugin class named in messages where settings are built without one (``MPPlugin``'s)
HOST = "MPPlugin"


def _host_field() -> Any:
    """The ``host`` field of a settings object whose checks name the plugin: the class the settings were built for
    (``MPPlugin``, ``MPFabricPrecision``, a subclass), named in its messages; not an argument, not compared."""
    return field(default=HOST, repr=False, compare=False, metadata={"argument": False})


def _is_argument(f: dataclasses.Field) -> bool:
    return f.metadata.get("argument", True)


class ScalerNotUsedError(MisconfigurationException, ValueError):
    """A scaler given to a mode that does not scale the loss: a ``ValueError`` as Fabric's ``MixedPrecision`` and
    Lightning's ``FSDPPrecision`` raise it, and a ``MisconfigurationException`` as Lightning's ``MixedPrecision``
    raises it."""


class _Settings:
    """What every settings object does: its flat arguments, and those that differ from its defaults."""

    @classmethod
    @functools.cache
    def defaults(cls) -> Any:
        """The settings at their defaults (built once: they are frozen)."""
        return cls()

    def arguments(self) -> dict[str, Any]:
        """``MPPlugin``'s keyword arguments these settings hold, by name (groups flattened), in the fields' order."""
        flat: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if not _is_argument(f):
                continue
            value = getattr(self, f.name)
            flat.update(value.arguments() if isinstance(value, _Settings) else {f.name: value})
        return flat

    def changed(self) -> dict[str, Any]:
        """The arguments that differ from their defaults (compared as the settings hold them: parsed)."""
        defaults = type(self).defaults().arguments()
        return {
            name: value
            for name, value in self.arguments().items()
            if value is not defaults[name] and value != defaults[name]
        }


@dataclass(frozen=True)
class LossScaleSettings(_Settings):
    """The fp16 loss scale: dynamic (``init_scale`` ... ``max_scale``: torch's ``GradScaler`` plus hysteresis, a
    floor and a cap), or static (``loss_scale``, a number). Values are kept as given (``repr`` shows them so); the
    scaler gets them normalized (:meth:`scaler_arguments`)."""

    init_scale: float = DEFAULTS["init_scale"]
    growth_factor: float = DEFAULTS["growth_factor"]
    backoff_factor: float = DEFAULTS["backoff_factor"]
    growth_interval: int = DEFAULTS["growth_interval"]
    hysteresis: int = DEFAULTS["hysteresis"]
    consecutive_hysteresis: bool = DEFAULTS["consecutive_hysteresis"]
    min_scale: float = DEFAULTS["min_scale"]
    max_scale: float = DEFAULTS["max_scale"]
    loss_scale: Optional[float] = None

    def __post_init__(self) -> None:
        check_flag("consecutive_hysteresis", self.consecutive_hysteresis)
        loss_scale = self.loss_scale
        if loss_scale is not None:
            if not is_number(loss_scale) or not (math.isfinite(loss_scale) and 0 < loss_scale <= _F32.max):
                raise ValueError(
                    f"loss_scale={loss_scale!r} is invalid: use a finite number > 0 that fp32 can hold (at most"
                    " ~3.4e38), or None for a dynamic scale."
                )
            moved = sorted(name for name in _DYNAMIC_ONLY if getattr(self, name) != DEFAULTS[name])
            if moved:
                raise ValueError(
                    f"loss_scale={loss_scale!r} (a static scale) contradicts {', '.join(moved)}, which configure a"
                    " dynamic one. Pass either loss_scale or the dynamic-scale arguments."
                )
        arguments = self.scaler_arguments()
        del arguments["consecutive_hysteresis"]  # (checked above)
        check_scaler_arguments(**arguments)

    @property
    def dynamic(self) -> bool:
        return self.loss_scale is None

    def scaler_arguments(self) -> dict[str, Any]:
        """``DynamicLossScaler``'s arguments (``dynamic`` aside): a static ``loss_scale`` is its ``init_scale``, and
        the bounds widen to hold it."""
        arguments = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "loss_scale"}
        if self.loss_scale is not None:
            scale = float(self.loss_scale)
            bounds = [check_scale(name, getattr(self, name)) for name in ("min_scale", "max_scale")]
            arguments.update(init_scale=scale, min_scale=min(bounds[0], scale), max_scale=max(bounds[1], scale))
        return arguments


@dataclass(frozen=True)
class SkipSettings(_Settings):
    """Skipped steps: inf/NaN steps skipped in every mode (fp16 always), the divergence stop, LR schedulers held and
    gradients released around a step, and the loss-spike guard (off while ``spike_sigma`` is ``None``)."""

    skip_nonfinite: bool = DEFAULTS["skip_nonfinite"]
    max_consecutive_skips: Optional[int] = DEFAULTS["max_consecutive_skips"]
    hold_schedulers_on_skip: bool = DEFAULTS["hold_schedulers_on_skip"]
    release_grads_after_step: bool = DEFAULTS["release_grads_after_step"]
    capture_step: bool = DEFAULTS["capture_step"]
    spike_sigma: Optional[float] = None
    spike_window: int = DEFAULTS["spike_window"]
    host: str = _host_field()

    def __post_init__(self) -> None:
        for name in ("skip_nonfinite", "hold_schedulers_on_skip", "release_grads_after_step", "capture_step"):
            check_flag(name, getattr(self, name))
        limit = self.max_consecutive_skips
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_consecutive_skips={limit!r} is invalid: use an integer >= 1, or None to never stop.")
        sigma, window = self.spike_sigma, self.spike_window
        if sigma is not None and (
            isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not math.isfinite(sigma) or sigma <= 0
        ):
            raise ValueError(
                f"spike_sigma={sigma!r} is invalid: use a finite number > 0 (e.g. 6.0: skip steps whose loss or"
                " gradient norm is 6 standard deviations above the recent mean), or None to turn the guard off."
            )
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < MIN_WINDOW:
            raise ValueError(
                f"spike_window={window!r} is invalid: use an integer >= {MIN_WINDOW} (the number of recent"
                f" non-skipped steps whose mean and standard deviation the guard compares with; default"
                f" {DEFAULTS['spike_window']})."
            )
        if sigma is None and window != DEFAULTS["spike_window"]:
            rank_zero_warn(
                f"{self.host}: spike_window={window!r} set, but spike_sigma=None: the loss-spike guard is off; set"
                " spike_sigma (e.g. 6.0) to turn it on."
            )
        if sigma is not None and not self.skip_nonfinite:
            raise ValueError(
                f"spike_sigma={sigma!r} skips steps as the inf/NaN check does: it needs skip_nonfinite=True."
            )


@dataclass(frozen=True)
class DistributedSettings(_Settings):
    """Across ranks: the dtype gradients are reduced in and the dtype FSDP gathers weights in for compute (``None``:
    fp32, as ``"fp32"``)."""

    reduce_dtype: Optional[str] = None
    fsdp_param_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("reduce_dtype", "fsdp_param_dtype"):
            value = getattr(self, name)
            if value is not None and value not in REDUCE_DTYPES:
                raise ValueError(f"{name}={value!r} is invalid: use one of {sorted(REDUCE_DTYPES)}, or null for fp32.")


@dataclass(frozen=True)
class MPSettings(_Settings):
    """Everything an ``MPPlugin`` was asked for, checked; built from its arguments by :meth:`from_arguments`.

    The constructor's forms are kept parsed: ``precision`` as the canonical mode name (``"16-mixed"`` ->
    ``"fp16"``), ``fp32_modules`` as an :class:`~lightning_mp.guards.FP32GuardSpec`, ``master_weights`` as a kind
    (``True`` -> ``"fp32"``) and ``fp8`` as an :class:`~lightning_mp.fp8.FP8Config`.
    """

    precision: str = DEFAULTS["precision"]
    #: the device type the scaler starts on (the Trainer's wins at set-up); ``None``: CUDA where there is one
    device: Optional[str] = None
    #: a ``torch.amp.GradScaler`` to use (fp16 modes); it is used through a ``DynamicLossScaler`` that shares its scale
    scaler: Optional[torch.amp.GradScaler] = None
    scaling: LossScaleSettings = field(default_factory=LossScaleSettings)
    skips: SkipSettings = field(default_factory=SkipSettings)
    tf32: Optional[bool] = None
    fp32_modules: FP32GuardSpec = field(default_factory=FP32GuardSpec)
    master_weights: Optional[str] = None
    #: the dtype Adam's moments are held in between steps: ``"fp32"`` (as the optimizer keeps them) or ``"bf16"``
    optimizer_states: str = DEFAULTS["optimizer_states"]
    fp8: FP8Config = field(default_factory=FP8Config)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    #: the plugin class these settings were built for, named in messages (``MPPlugin``, ``MPFabricPrecision``)
    host: str = _host_field()

    @classmethod
    def from_arguments(cls, host: str = HOST, **arguments: Any) -> MPSettings:
        """The settings for ``MPPlugin``'s flat keyword arguments (each goes to the settings object with a field of
        its name; those not given keep their defaults). ``from_arguments(**settings.arguments()) == settings``.
        ``host``: the plugin class they are built for, which their messages name.

        Raises:
            TypeError: for a name no settings object has, as a call with an unknown keyword does.
        """
        grouped: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            group = getattr(cls.defaults(), f.name)
            if isinstance(group, _Settings):
                fields = dataclasses.fields(group)  # type: ignore[arg-type]
                given = {g.name: arguments.pop(g.name) for g in fields if _is_argument(g) and g.name in arguments}
                given.update({g.name: host for g in fields if g.name == "host"})
                grouped[f.name] = type(group)(**given)
            elif _is_argument(f) and f.name in arguments:
                grouped[f.name] = arguments.pop(f.name)
        if arguments:
            raise TypeError(f"MPSettings.from_arguments() got an unexpected keyword argument {next(iter(arguments))!r}")
        return cls(**grouped, host=host)

    def __post_init__(self) -> None:
        put = functools.partial(object.__setattr__, self)  # frozen: the parsed forms are set once, here
        put("precision", parse_precision(self.precision))
        if self.device is not None and not isinstance(self.device, str):
            raise ValueError(f"device={self.device!r} is invalid: use a device type such as 'cuda' or 'cpu', or None.")
        if self.tf32 is not None and not isinstance(self.tf32, bool):
            raise ValueError(f"tf32={self.tf32!r} is invalid: use true, false, or null (the mode's default).")
        if not isinstance(self.fp32_modules, FP32GuardSpec):
            put("fp32_modules", FP32GuardSpec.from_arg(self.fp32_modules))
        if self.master_weights is not None:
            put("master_weights", parse_master_weights(self.master_weights))
        put("optimizer_states", parse_optimizer_states(self.optimizer_states))
        if self.scaler is not None:
            moved = sorted(self.scaling.changed())
            if moved:  # the given scaler is used as it is: these would be ignored without a word
                raise ValueError(
                    f"{self.host}(scaler=...) uses the given scaler's loss scale, so {', '.join(moved)} would be"
                    " ignored. Configure the scaler itself (torch.amp.GradScaler(init_scale=..., growth_factor=...,"
                    " backoff_factor=..., growth_interval=...), or lightning_mp.DynamicLossScaler for hysteresis,"
                    f" min_scale, max_scale and a static scale), or drop scaler= and pass them to {self.host}."
                )
        put("fp8", FP8Config.from_value(self.fp8))  # validated now; the FP8 library is imported at set-up only
        if self.fp8 != FP8Config() and not uses_fp8_settings(self.precision):
            rank_zero_warn(
                f"{self.host}: fp8 settings are given but precision={self.precision!r}; they apply to 'fp8'."
            )
        if self.precision == AUTO:
            if self.master_weights is not None:  # auto: bf16 or fp16 autocast, or fp32: fp32 weights
                _refuse_master_weights(
                    self.master_weights, "precision='auto' picks bf16 or fp16 autocast or fp32, each with fp32"
                )
        elif self.precision in MODES:
            self.check_mode(MODES[self.precision])  # the hardware check waits for set-up, on the real device

    def check_mode(self, mode: PrecisionMode, *, switch: bool = False) -> None:
        """The checks that need the mode in force, in one place; run where the mode becomes known: when these
        settings are built for a named mode, when ``auto`` settles at set-up, and (``switch``) when
        ``MPPlugin.set_precision`` switches between steps, where only what the new mode cannot run with is refused
        (the warnings and the contradictions of the arguments concern the mode the run started in)."""
        if self.master_weights is not None and mode.fp8 and self.fp8.weights in ("fp32", "fp8"):
            raise ValueError(
                f"master_weights={self.master_weights!r} applies to bf16 weights, but fp8={{'weights':"
                f" {self.fp8.weights!r}}} keeps "
                + ("fp32 weights (there is no master copy to keep)" if self.fp8.weights == "fp32" else
                   "FP8 weights, whose fp32 masters the optimizer keeps (FusedAdam(master_weights=True))")
                + ". Leave master_weights unset, or use fp8={'weights': 'auto'} (the default: bf16 weights outside"
                " the FP8 layers).")
        if self.master_weights is not None and not mode.true_half and not mode.fp8:
            _refuse_master_weights(self.master_weights, f"precision={mode.name!r} keeps fp32")
        if self.optimizer_states != "fp32" and self.master_weights in ("none", "optimizer"):
            held = ("steps the half weights, whose moments torch's Adam keeps in the weights' dtype already"
                    if self.master_weights == "none" else
                    "leaves the step to an optimizer that keeps fp32 masters and its own state (Transformer"
                    " Engine's FusedAdam: exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)")
            raise ValueError(
                f"optimizer_states={self.optimizer_states!r} holds the moments of an optimizer that steps fp32"
                f" values, but master_weights={self.master_weights!r} {held}. Use master_weights='fp32' (the"
                " default), 'kahan' or 'stochastic' with optimizer_states='bf16', or leave optimizer_states='fp32'."
            )
        wanted = self.distributed.fsdp_param_dtype
        if wanted not in (None, "fp32") and (mode.autocast_dtype or mode.param_dtype) is not REDUCE_DTYPES[wanted]:
            raise ValueError(
                f"fsdp_param_dtype={wanted!r} applies to precision={wanted!r} (FSDP gathers {wanted} weights for"
                f" autocast to compute with), not to precision={mode.name!r}. Use fsdp_param_dtype='fp32' (or null)"
                " with this mode."
            )
        if self.scaler is not None and not mode.needs_scaler:
            raise ScalerNotUsedError(
                f"{self.host}(precision={mode.name!r}) got a scaler, but this mode does not scale the loss; pass a"
                " scaler with precision='fp16' or 'fp16-true' only."
            )
        if switch or mode.needs_scaler:
            return
        changed = sorted(self.scaling.changed())
        if changed:
            rank_zero_warn(
                f"{self.host}: {', '.join(changed)} set, but precision={mode.name!r} does not scale the loss;"
                " loss-scaling arguments take effect with precision='fp16' or 'fp16-true'."
            )
        skips = self.skips
        if not skips.skip_nonfinite and skips.max_consecutive_skips not in (None, DEFAULTS["max_consecutive_skips"]):
            raise ValueError(
                f"max_consecutive_skips={skips.max_consecutive_skips!r} counts skipped steps, but skip_nonfinite=False"
                f" skips none in precision={mode.name!r}. Drop one of the two."
            )


def _refuse_master_weights(kind: str, weights: str) -> None:
    raise ValueError(
        f"master_weights={kind!r} applies to half-precision weights, but {weights} weights (there is no master copy"
        " to keep). Use precision='bf16-true' or 'fp16-true', or leave master_weights unset."
    )
