"""lightning_mp: safe, fast mixed-precision training for PyTorch Lightning through one Trainer flag."""

from lightning_mp.callbacks import NonFiniteDetector, NonFiniteReport, PrecisionMonitor, PrecisionSchedule
from lightning_mp.callbacks.monitor import ThroughputMonitor
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
from lightning_mp.modes import PrecisionMode, parse_precision, resolve_mode
from lightning_mp.plugin import MPPlugin
from lightning_mp.prepare import prepare_fp8
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.stats import NonFiniteTrainingError, StepStats

__version__ = "0.1.0"

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
    "NonFiniteTrainingError",
    "PrecisionMode",
    "StepStats",
    "parse_precision",
    "prepare_fp8",
    "resolve_mode",
]
