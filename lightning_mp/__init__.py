"""lightning_mp: safe, fast mixed-precision training for PyTorch Lightning through one Trainer flag."""

from lightning_mp.modes import PrecisionMode, parse_precision, resolve_mode
from lightning_mp.plugin import MPPlugin
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.stats import NonFiniteTrainingError, StepStats

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScaler",
    "MPPlugin",
    "NonFiniteTrainingError",
    "PrecisionMode",
    "StepStats",
    "parse_precision",
    "resolve_mode",
]
