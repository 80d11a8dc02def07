"""The plugin's checkpoint entry: what it holds, how it is validated when loaded, and migration from Lightning's.

The entry holds only plain tensors, numbers, strings and dicts (``torch.load(weights_only=True)`` reads it)::

    {"mode": "fp16", "scaler": {...}, "optimizers": [{"steps": 10, "skipped_steps": 1, "consecutive_skips": 0}],
     "master_weights": {"kind": "fp32", "masters": {name: tensor}}, "fp8": {...}, "spike": {"values": tensor, ...},
     "optimizer_states": {"dtype": "bf16", "seed": 24301, "generators": {device: tensor}}}

A checkpoint written with Lightning's ``precision="16-mixed"`` (a bare GradScaler state under ``MixedPrecision``)
resumes with its loss scale. The checkpoint's weights are the truth: its master weights are used only where they
still round to them, parameter by parameter; weights replaced after the masters were saved (an average written into
the checkpoint, an edit) are where training starts (:meth:`lightning_mp.master.MasterWeights.load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_mp.master import MasterWeights, fp32_values, without_parameters
from lightning_mp.modes import MODES
from lightning_mp.stats import StepStats


def plugin_state(
    mode: str, scaler: Any, masters: Optional[MasterWeights], fp8: Any, stats: StepStats, spike: Any = None,
    optimizer_states: Any = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {"mode": mode, "optimizers": [s.state_dict() for s in stats.per_optimizer]}
    if optimizer_states is not None and optimizer_states.active:  # (fp32 moments: nothing, as before the setting)
        state["optimizer_states"] = optimizer_states.state_dict()
    if spike is not None:
        state["spike"] = spike.state_dict()
    scaler_state = scaler.state_dict() if scaler is not None else {}
    if scaler_state:  # (a loss scaler's: the step guard of the other modes keeps nothing, a disabled scaler neither)
        state["scaler"] = scaler_state
    if masters is not None:
        state["master_weights"] = masters.state_dict()
    if fp8 is not None:
        state["fp8"] = fp8.state_dict()
    return state


def normalise(state: Any, host: str = "MPPlugin") -> dict[str, Any]:
    """Check the entry's shape; a bare GradScaler state (Lightning's ``MixedPrecision``) becomes an fp16 entry."""
    if not isinstance(state, dict):
        raise ValueError(f"The checkpoint's {host} entry is a {type(state).__name__}, not a dict: it is corrupted.")
    if "scale" in state:
        state = {"mode": "fp16", "scaler": state}
    if "mode" not in state:
        raise ValueError(
            f"The checkpoint's {host} entry has keys {sorted(state)} but no 'mode': it is corrupted"
            " or was written by another plugin."
        )
    return state


def load_plugin_state(
    state: Any,
    *,
    current_mode: str,
    scaler: Any,
    masters: Optional[MasterWeights],
    master_weights: Optional[str],
    fp8: Any,
    stats: StepStats,
    module: Optional[nn.Module],
    spike: Any = None,
    optimizer_states: Any = None,
    host: str = "MPPlugin",
) -> None:
    state = normalise(state, host)
    saved_mode = state["mode"]
    if saved_mode != current_mode:
        rank_zero_warn(
            f"{host}: the checkpoint was written with precision={saved_mode!r} and training resumes with"
            f" precision={current_mode!r}; skip counters are kept"
            + (", the loss scale starts from init_scale." if _scales(current_mode) and not _scales(saved_mode) else ".")
        )
    scaler_state = state.get("scaler")
    if scaler_state is not None and scaler is not None:
        try:
            scaler.load_state_dict(scaler_state)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"The checkpoint's loss-scaler state is corrupted: {err}") from err
    _load_counters(state, stats)
    saved_dtype = MODES[saved_mode].param_dtype if isinstance(saved_mode, str) and saved_mode in MODES else None
    _load_master_weights(state.get("master_weights"), masters, master_weights, current_mode, module, saved_dtype,
                         host)  # fmt: skip
    if fp8 is not None:
        fp8.load_state_dict(state.get("fp8"))  # warns when the recipe changed
    if spike is not None and state.get("spike") is not None:
        spike.load_state_dict(state["spike"])  # the window of recent losses and gradient norms goes on
    if optimizer_states is not None:  # the rounding noise goes on; one line where the moments' dtype changes
        optimizer_states.load_state_dict(state.get("optimizer_states"), host)


def _scales(mode: Any) -> bool:
    known = MODES.get(mode) if isinstance(mode, str) else None
    return known is not None and known.needs_scaler


def _load_counters(state: dict[str, Any], stats: StepStats) -> None:
    saved = state.get("optimizers")
    if saved is None:  # an older entry: the scaler's totals go to the first optimizer
        scaler_state = state.get("scaler") or {}
        saved = [{k: scaler_state[k] for k in ("steps", "skipped_steps", "consecutive_skips") if k in scaler_state}]
    if not isinstance(saved, list) or not all(isinstance(s, dict) for s in saved):
        raise ValueError("The checkpoint's per-optimizer step counters are corrupted: expected a list of dicts.")
    # every saved optimizer's counters, also where no optimizer is connected yet (validate(ckpt_path=...) restores
    # the plugin's state, as Lightning's restores its scaler's); the checkpoint is the truth for the rest: none yet
    for index, opt_state in enumerate(saved):
        stats.optimizer(index).load_state_dict(opt_state)
    for opt_stats in stats.per_optimizer[len(saved):]:
        opt_stats.load_state_dict({})


def _load_master_weights(
    saved: Any,
    masters: Optional[MasterWeights],
    current: Optional[str],
    mode: str,
    module: Optional[nn.Module],
    saved_dtype: Optional[torch.dtype] = None,
    host: str = "MPPlugin",
) -> None:
    saved_kind = saved.get("kind") if isinstance(saved, dict) else None
    if saved is not None and saved_kind is None:
        raise ValueError("The checkpoint's master-weights state is corrupted: it has no 'kind'.")
    params = dict(module.named_parameters()) if module is not None else {}
    if masters is not None:
        if saved is None:
            rank_zero_warn(
                f"{host}: the checkpoint holds no master weights; master_weights={current!r} starts from the"
                " checkpoint's weights (its exact fp32 values where it holds fp32 weights)."
            )
            return
        if saved_kind != current:
            rank_zero_warn(
                f"{host}: the checkpoint's master weights are {saved_kind!r}, training resumes with"
                f" master_weights={current!r}: converted through their fp32 values."
            )
        # parameters half with masters then and fp32 now (guarded in this run: a mode or fp32_modules change, e.g.
        # bf16-true's LayerNorms resumed in fp16-true) take their masters' values; the rest is the masters' to load
        held = set(masters.named_params())
        fp32_now = {n: v for n, v in fp32_values(saved, params).items() if n not in held}
        _fp32_weights_take(fp32_now, params, saved_dtype)
        # names this model no longer has (layers renamed by the module's on_load_checkpoint, or removed and loaded
        # with strict_loading=False): Lightning loaded without them, so do the masters, whatever their kind
        parts = [saved.get(part) for part in ("masters", "compensation")]
        unknown = {n for part in parts if isinstance(part, dict) for n in part if n not in params} if params else set()
        masters.load_state_dict(without_parameters(saved, set(fp32_now) | unknown))
        return
    if saved is None:
        return
    # no master weights now: fp32 weights (a mixed mode) take the masters' values where they fit
    if not _fp32_weights_take(fp32_values(saved, params), params, saved_dtype):
        rank_zero_warn(
            f"{host}: the checkpoint's {saved_kind!r} master weights are not used: precision={mode!r}"
            + (" with master_weights='none' trains the half weights alone." if current == "none" else ".")
        )


def _fp32_weights_take(
    values: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor], saved_dtype: Optional[torch.dtype]
) -> int:
    """fp32 parameters take the saved masters' values; returns how many did."""
    restored = 0
    with torch.no_grad():
        for name, value in values.items():
            param = params.get(name)
            if param is None or param.dtype != torch.float32 or param.shape != value.shape:
                continue
            value = value.to(param.device, torch.float32)
            # the checkpoint's weight is the truth: a master stands in for it only where it rounds to that weight
            # (weights written after the last step, e.g. an EMA average put in at the end of fit, keep their values)
            if saved_dtype is not None and not torch.equal(value.to(saved_dtype), param.to(saved_dtype)):
                continue
            # a weight the checkpoint holds with more than half precision (an fp32 average saved in its place) is
            # more exact than a master that rounds to it
            if saved_dtype is not None and not torch.equal(param.to(saved_dtype).float(), param):
                continue
            param.copy_(value)
            restored += 1
    return restored


#: the entries of ``torch.amp.GradScaler.state_dict()``: what Lightning's ``MixedPrecision`` saves and loads
TORCH_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def lightning_scaler_state(scaler: Any) -> dict[str, Any]:
    """The loss scale in the form Lightning's ``MixedPrecision`` keeps in checkpoints (under ``"MixedPrecision"``), so
    that a run resumed with ``precision="16-mixed"`` keeps the scale; ``{}`` where no loss scale is in force."""
    if scaler is None or not getattr(scaler, "scaling", False) or not scaler.is_enabled():
        return {}
    state = torch.amp.GradScaler.state_dict(scaler)
    return {key: state[key] for key in TORCH_SCALER_KEYS if key in state}
