"""lightning_mp: safe, fast mixed-precision training for PyTorch Lightning through one Trainer flag.

The names below are imported when first used (``lightning_mp.MPPlugin``, ``from lightning_mp import MPPlugin``):
``import lightning_mp`` alone, as ``lightning-mp --version`` does, loads neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers and documentation tools
    from lightning_mp.callbacks import NonFiniteDetector, NonFiniteReport, PrecisionMonitor, PrecisionSchedule
    from lightning_mp.callbacks.monitor import ThroughputMonitor
    from lightning_mp.fabric import MPFabricPrecision
    from lightning_mp.fp8 import FP8Config, FP8UnavailableError
    from lightning_mp.guards import (
        DEFAULT_FP32_MODULES,
        FP32GuardSpec,
        apply_fp32_guards,
        fp32_layer_norm,
        fp32_log_softmax,
        fp32_region,
        fp32_softmax,
        remove_fp32_guards,
    )
    from lightning_mp.master import (
        FP32MasterWeights,
        KahanCompensation,
        MasterWeights,
        StochasticRounding,
        attach_master_weights,
        cast_module_,
        stochastic_round,
    )
    from lightning_mp.modes import PerformanceWarning, PrecisionMode, parse_precision, resolve_mode
    from lightning_mp.nonfinite import NonfiniteGuard
    from lightning_mp.plugin import MPPlugin
    from lightning_mp.prepare import prepare_fp8
    from lightning_mp.scaling import DynamicLossScaler
    from lightning_mp.stats import NonFiniteTrainingError, StepStats

__version__ = "0.2.0.dev0"  # 0.1.0 and the changes under [Unreleased] in CHANGELOG.md


__all__ = [
    "DEFAULT_FP32_MODULES",
    "DynamicLossScaler",
    "FP32GuardSpec",
    "FP32MasterWeights",
    "FP8Config",
    "FP8UnavailableError",
    "KahanCompensation",
    "MasterWeights",
    "NonFiniteDetector",
    "NonFiniteReport",
    "NonfiniteGuard",
    "PrecisionMonitor",
    "PrecisionSchedule",
    "StochasticRounding",
    "ThroughputMonitor",
    "apply_fp32_guards",
    "attach_master_weights",
    "cast_module_",
    "fp32_layer_norm",
    "fp32_log_softmax",
    "fp32_region",
    "fp32_softmax",
    "remove_fp32_guards",
    "stochastic_round",
    "MPPlugin",
    "MPFabricPrecision",
    "NonFiniteTrainingError",
    "PerformanceWarning",
    "PrecisionMode",
    "StepStats",
    "parse_precision",
    "prepare_fp8",
    "resolve_mode",
]

#: where each exported name lives
_SOURCES = {
    "NonFiniteDetector": "lightning_mp.callbacks",
    "NonFiniteReport": "lightning_mp.callbacks",
    "PrecisionMonitor": "lightning_mp.callbacks",
    "PrecisionSchedule": "lightning_mp.callbacks",
    "ThroughputMonitor": "lightning_mp.callbacks.monitor",
    "FP8Config": "lightning_mp.fp8",
    "FP8UnavailableError": "lightning_mp.fp8",
    **dict.fromkeys(
        ["DEFAULT_FP32_MODULES", "FP32GuardSpec", "apply_fp32_guards", "fp32_layer_norm", "fp32_log_softmax",
         "fp32_region", "fp32_softmax", "remove_fp32_guards"],
        "lightning_mp.guards",
    ),
    **dict.fromkeys(
        ["FP32MasterWeights", "KahanCompensation", "MasterWeights", "StochasticRounding", "attach_master_weights",
         "cast_module_", "stochastic_round"],
        "lightning_mp.master",
    ),
    "PerformanceWarning": "lightning_mp.modes",
    "PrecisionMode": "lightning_mp.modes",
    "parse_precision": "lightning_mp.modes",
    "resolve_mode": "lightning_mp.modes",
    "NonfiniteGuard": "lightning_mp.nonfinite",
    "MPPlugin": "lightning_mp.plugin",
    "MPFabricPrecision": "lightning_mp.fabric",
    "prepare_fp8": "lightning_mp.prepare",
    "DynamicLossScaler": "lightning_mp.scaling",
    "NonFiniteTrainingError": "lightning_mp.stats",
    "StepStats": "lightning_mp.stats",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'lightning_mp' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
