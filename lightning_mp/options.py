"""MPPlugin's arguments: checked before training starts, and the loss scaler they describe."""

from __future__ import annotations

import math
from typing import Any, Optional

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
        isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1
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
