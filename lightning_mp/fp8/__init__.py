"""FP8 training through NVIDIA Transformer Engine: config, layer filter, layer swap, run-time pieces.

Example::

    >>> from lightning_mp.fp8 import FP8Config
    >>> FP8Config.from_dict({"recipe": "current", "keep_first": 1}).recipe_settings()
    {'recipe': 'current', 'fp8_format': 'HYBRID'}

``MPPlugin("fp8", fp8={...})`` is the usual entry point; :class:`FP8Training` runs the same in a plain loop.
Importing this package never imports Transformer Engine.
"""

from lightning_mp.fp8.config import FP8Config
from lightning_mp.fp8.convert import ConversionReport, ModuleRecord, apply_weights_dtype, convert_to_te
from lightning_mp.fp8.filters import (
    AUTO_MIN_FEATURES,
    ModuleFilter,
    auto_size_rule,
    build_module_filter,
    first_last_rule,
    name_rule,
    te_shape_rule,
)
from lightning_mp.fp8.runtime import (
    FP8Training,
    MicrobatchWeightCache,
    fp8_gemm_modules,
    fp8_scaling_state,
    load_fp8_scaling_state,
)
from lightning_mp.fp8.sentinel import SaturationSentinel
from lightning_mp.fp8.support import (
    FP8UnavailableError,
    build_recipe,
    check_fp8_support,
    fp8_device_problem,
    fp8_support_problem,
    te_installed,
)

__all__ = [
    "AUTO_MIN_FEATURES",
    "ConversionReport",
    "FP8Config",
    "FP8Training",
    "FP8UnavailableError",
    "MicrobatchWeightCache",
    "ModuleFilter",
    "ModuleRecord",
    "SaturationSentinel",
    "apply_weights_dtype",
    "auto_size_rule",
    "build_module_filter",
    "build_recipe",
    "check_fp8_support",
    "convert_to_te",
    "fp8_device_problem",
    "fp8_gemm_modules",
    "first_last_rule",
    "fp8_scaling_state",
    "fp8_support_problem",
    "load_fp8_scaling_state",
    "name_rule",
    "te_installed",
    "te_shape_rule",
]
