"""Precision modes: one table of names, the aliases Lightning users already know, and capability checks.

>>> from lightning_mp.modes import parse_precision, resolve_mode
>>> parse_precision("bf16-mixed")
'bf16'
>>> resolve_mode("fp16", "cpu").needs_scaler
True
>>> resolve_mode("bf16-true", "cpu").param_dtype
torch.bfloat16
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lightning_mp.cpu as _cpu
from lightning_mp.cpu import FAST_BF16_ON_CPU, SLOW_BF16_ON_CPU, SLOW_FP16_ON_CPU, CpuCapability


@dataclass(frozen=True)
class PrecisionMode:
    """What one precision mode means for weights, compute and loss scaling.

    Example::

        mode = resolve_mode("bf16", "cuda")
        mode.autocast_dtype  # torch.bfloat16
    """

    name: str
    #: the Lightning precision string reported by ``Trainer.precision``
    lightning_precision: str
    #: dtype for ``torch.autocast``; ``None`` runs without autocast
    autocast_dtype: Optional[torch.dtype]
    #: whether gradients need a loss scale to stay representable
    needs_scaler: bool
    #: TF32 setting the mode implies when the plugin's ``tf32`` is left unset; ``None`` leaves it alone
    tf32: Optional[bool]
    description: str
    #: dtype the model's weights are stored in (outside FP32 guards); ``None`` keeps them fp32
    param_dtype: Optional[torch.dtype] = None

    @property
    def true_half(self) -> bool:
        """Whether the weights themselves are half precision (``bf16-true``, ``fp16-true``)."""
        return self.param_dtype is not None

    @property
    def fp8(self) -> bool:
        """Whether linear layers run FP8 GEMMs (through the FP8 backend: :mod:`lightning_mp.fp8.backend`)."""
        return self.name == "fp8"

    @property
    def autocast_only(self) -> bool:
        """fp32 weights under torch autocast (``bf16``/``fp16``): CUDA autocast runs norms and losses in fp32 itself."""
        return self.autocast_dtype is not None and not self.fp8 and not self.true_half

    @property
    def low_precision_dtypes(self) -> tuple[torch.dtype, ...]:
        """The 16-bit dtypes the mode computes or stores in."""
        return tuple(d for d in (self.autocast_dtype, self.param_dtype) if d is not None)


# Modes that this release runs, in the order of the modes table (docs/modes.md).
MODES: dict[str, PrecisionMode] = {
    m.name: m
    for m in (
        PrecisionMode("fp32", "32-true", None, False, False, "fp32 weights and compute, TF32 off"),
        PrecisionMode("tf32", "32-true", None, False, True, "fp32 weights, TF32 matmul/cuDNN"),
        PrecisionMode("bf16", "bf16-mixed", torch.bfloat16, False, None, "fp32 weights, bf16 autocast"),
        PrecisionMode("fp16", "16-mixed", torch.float16, True, None, "fp32 weights, fp16 autocast, loss scaling"),
        PrecisionMode(
            "bf16-true", "bf16-true", None, False, None, "bf16 weights and compute, fp32 master weights", torch.bfloat16
        ),
        PrecisionMode(
            "fp16-true", "16-true", None, True, None, "fp16 weights and compute, fp32 master weights, loss scaling",
            torch.float16,
        ),
        PrecisionMode(
            "fp8", "transformer-engine", torch.bfloat16, False, None,
            "FP8 GEMMs through the FP8 backend, bf16 weights (fp32 masters) and autocast for the rest",
        ),
    )
}


ALIASES: dict[str, str] = {
    # Lightning's precision strings
    "32-true": "fp32",
    "32": "fp32",
    "16-mixed": "fp16",
    "16": "fp16",
    "bf16-mixed": "bf16",
    "16-true": "fp16-true",
    "transformer-engine": "fp8",
    # dtype names, as Hugging Face (``bf16=True`` / ``torch_dtype="bfloat16"``) and NeMo configs spell them; they
    # name the autocast modes (fp32 weights): half-precision weights are ``bf16-true``/``fp16-true``
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
}

#: NVIDIA Apex AMP opt levels: not aliases (Apex AMP is deprecated, its levels are fp16-only and bundle other
#: settings), but a bad value that is one gets the equivalent named in the error
APEX_OPT_LEVELS: dict[str, str] = {
    "o0": "'fp32'",
    "o1": "'fp16' (fp16 autocast with loss scaling; 'bf16' where the GPU supports it)",
    "o2": "'fp16-true' (fp16 weights with fp32 master weights and fp32 norms, loss scaling)",
    "o3": "'fp16-true' with master_weights='none'",
}

AUTO = "auto"


def accepted_names() -> list[str]:
    """Every string ``parse_precision`` accepts, canonical names first."""
    return [*MODES, AUTO, *ALIASES]


def parse_precision(value: object) -> str:
    """Map a user's precision (a mode name, a Lightning string, a dtype name such as ``"bfloat16"``, or a
    floating ``torch.dtype``) to a canonical mode name.

    Raises:
        ValueError: naming the value and every accepted name.
    """
    original = value
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    elif isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    hint = ""
    if isinstance(value, str):
        key = value.strip().lower()
        if key in MODES or key == AUTO:
            return key
        if key in ALIASES:
            return ALIASES[key]
        if key in APEX_OPT_LEVELS:
            hint = f" Apex AMP's opt level {value.strip()!r} is not accepted; its equivalent is {APEX_OPT_LEVELS[key]}."
        elif close := _close_name(key):
            hint = f" Did you mean {close!r}?"
    raise ValueError(
        f"Unknown precision {original!r}. Accepted values: {', '.join(repr(n) for n in accepted_names())}.{hint}"
    )


def _close_name(key: str) -> Optional[str]:
    """The accepted name a misspelled ``key`` most likely meant (as model arguments get: ``difflib``), among the names
    that hold the digits ``key`` holds: ``'bf-16'`` meant ``'bf16'``, but ``'fp64'`` asks for another bit width."""
    digits = Counter(c for c in key if c.isdigit())
    names = [n for n in accepted_names() if not digits - Counter(c for c in n if c.isdigit())]
    close = difflib.get_close_matches(key, names, n=1)
    return close[0] if close else None


def compute_dtype(mode: PrecisionMode) -> torch.dtype:
    """The dtype a mode's matrix multiplications run in, as Lightning's ``ThroughputMonitor`` reads it to look up
    the device's peak FLOPs: fp32/tf32 -> ``float32`` (TF32 is a matmul setting of fp32), bf16/bf16-true ->
    ``bfloat16``, fp16/fp16-true -> ``float16``, fp8 -> ``int8`` (as Lightning's ``transformer-engine``: its
    FLOPs table lists the FP8 tensor-core rate under int8).

    >>> compute_dtype(MODES["bf16-true"])
    torch.bfloat16
    """
    if mode.fp8:
        return torch.int8
    dtype = mode.param_dtype or mode.autocast_dtype
    return dtype if dtype is not None else torch.float32


def uses_fp8_settings(name: str) -> bool:
    """Whether a requested precision (a canonical name, or ``auto``) may run FP8, where ``fp8=...`` settings apply."""
    return name == AUTO or (name in MODES and MODES[name].fp8)


# ---------------------------------------------------------------------------------------------- the CPU
def slow_on_cpu(mode: PrecisionMode, cpu: Optional[CpuCapability] = None) -> Optional[str]:
    """Why ``mode`` trains far slower than fp32 on a CPU (this machine's unless ``cpu`` is given), in the measured
    words of ``SLOW_BF16_ON_CPU`` / ``SLOW_FP16_ON_CPU`` (:mod:`lightning_mp.cpu`); ``None`` when it does not
    (fp32, or the CPU has the 16-bit kernels the mode needs).

    >>> slow_on_cpu(MODES["bf16"], CpuCapability("AVX2", bf16=False)) == SLOW_BF16_ON_CPU
    True
    """
    cpu = cpu if cpu is not None else _cpu.cpu_capability()
    dtypes = mode.low_precision_dtypes
    if torch.float16 in dtypes and not cpu.fp16:
        return SLOW_FP16_ON_CPU
    if torch.bfloat16 in dtypes and not cpu.bf16:
        return SLOW_BF16_ON_CPU
    return None


def bf16_supported(device_type: str) -> bool:
    """Whether bf16 autocast runs natively on this kind of device (CPU autocast always supports it)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu"


def auto_choice(device_type: str, cpu: Optional[CpuCapability] = None) -> tuple[str, str]:
    """What ``"auto"`` runs on this kind of device, and why (the log line's words). On a CPU: bf16 where it has
    native bf16, else fp32 (:func:`lightning_mp.cpu.cpu_capability`, or ``cpu`` where given).

    >>> auto_choice("cpu", CpuCapability("AVX2", bf16=False))[0]
    'fp32'
    """
    if device_type == "cuda":
        if bf16_supported("cuda"):
            major, minor = torch.cuda.get_device_capability()
            return "bf16", (
                f"the GPU (compute capability {major}.{minor}) supports bf16 (fp8 is opt-in: precision='fp8')"
            )
        return "fp16", "the GPU does not support bf16, so fp16 with dynamic loss scaling"
    if device_type == "cpu":
        cpu = cpu if cpu is not None else _cpu.cpu_capability()
        if cpu.bf16:
            return "bf16", f"the CPU ({cpu.describe()}) has native bf16: {FAST_BF16_ON_CPU}"
        return "fp32", f"the CPU ({cpu.describe()}) has no native bf16: {SLOW_BF16_ON_CPU}"
    return "fp32", f"no mixed-precision mode is known to work on device type {device_type!r}"


class PerformanceWarning(Warning):
    """A setting that works but runs far slower than an alternative the warning names (as pandas'
    ``PerformanceWarning``; not a ``UserWarning``, so it can be filtered on its own:
    ``warnings.filterwarnings("ignore", category=PerformanceWarning)``)."""


def warn_if_slow_on_device(
    mode: PrecisionMode, device_type: str, cpu: Optional[CpuCapability] = None
) -> Optional[str]:
    """Warn (a :class:`PerformanceWarning`, rank zero, through Lightning's ``rank_zero_warn``) when ``mode`` runs far
    slower on ``device_type`` than a mode the device offers, and return the message; ``None`` when it does not.

    On a CPU (this machine's :func:`lightning_mp.cpu.cpu_capability`, or ``cpu`` where given): fp16 without native
    fp16 kernels, and bf16 without native bf16 kernels, with the measured penalty (``SLOW_FP16_ON_CPU``,
    ``SLOW_BF16_ON_CPU`` of :mod:`lightning_mp.cpu`) and the mode to use instead, the one ``auto`` picks there.
    Lightning's own ``precision="16-mixed"`` warns on a CPU too. Called once, at set-up.

    >>> warn_if_slow_on_device(MODES["bf16"], "cpu", CpuCapability("AVX512", bf16=True)) is None
    True
    """
    if device_type != "cpu":
        return None
    cpu = cpu if cpu is not None else _cpu.cpu_capability()
    penalty = slow_on_cpu(mode, cpu)
    if penalty is None:
        return None
    best = _cpu.cpu_mode(cpu)
    instead = f"{best}-true" if mode.true_half and best != "fp32" else best
    native = "fp16" if penalty is SLOW_FP16_ON_CPU else "bf16"
    why = "it needs no loss scaling either" if mode.needs_scaler and best != "fp32" else "MPPlugin('auto') picks it"
    message = (
        f"MPPlugin(precision={mode.name!r}) runs on a CPU without native {native} ({cpu.describe()}): {penalty}."
        f" Use precision={instead!r} on this CPU ({why})."
    )
    rank_zero_warn(message, category=PerformanceWarning)
    return message


def resolve_mode(name: str, device_type: str) -> PrecisionMode:
    """Turn a canonical name (or ``"auto"``) into the mode to run on ``device_type``.

    Raises:
        ValueError: when the hardware cannot run the mode, saying why and what to use instead.
    """
    name = parse_precision(name)
    if name == AUTO:
        return MODES[auto_choice(device_type)[0]]
    mode = MODES[name]
    if name == "fp8":
        from lightning_mp.fp8.support import FP8UnavailableError, fp8_device_problem

        problem = fp8_device_problem(device_type, library=False)  # the backend checks its library and recipe later
        if problem:
            raise FP8UnavailableError(problem)
    if torch.bfloat16 in mode.low_precision_dtypes and not bf16_supported(device_type):
        what = "this GPU" if device_type == "cuda" else f"device type {device_type!r}"
        instead = "'fp16-true'" if mode.true_half else "'fp16'"
        raise ValueError(
            f"precision={name!r} needs hardware bf16 support, which {what} lacks (it needs compute capability 8.0+,"
            f" e.g. A100/H100). Use precision={instead} (with loss scaling) or 'fp32' instead."
        )
    if mode.low_precision_dtypes and device_type not in ("cuda", "cpu"):
        what = "half-precision weights" if mode.true_half else "autocast"
        raise ValueError(
            f"precision={name!r} needs {what} on 'cuda' or 'cpu', but the run is on {device_type!r}."
            " Use precision='fp32' on this device."
        )
    return mode


def provisional_lightning_precision(name: str) -> str:
    """The Lightning string to report before the device is known (``auto`` is settled at setup)."""
    if name == AUTO:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return MODES[auto_choice(device_type)[0]].lightning_precision
    if name in MODES:
        return MODES[name].lightning_precision
    return "32-true"


def running_mode(plugin: object) -> Optional[PrecisionMode]:
    """The mode an ``MPPlugin`` runs in (``auto`` settled for the plugin's device type if set-up has not settled it
    yet); ``None`` for any other precision plugin."""
    mode = getattr(plugin, "mode", None)
    if isinstance(mode, PrecisionMode):
        return mode
    if getattr(plugin, "requested_precision", None) == AUTO:
        return MODES[auto_choice(str(getattr(plugin, "device", "cpu")))[0]]
    return None
