"""Transformer Engine for FP8: found and imported, whether this machine can run FP8 (device, compute capability,
TE, recipe), and the recipes.

Example::

    from lightning_mp.fp8.support import check_fp8_support, fp8_support_problem

    fp8_support_problem(device_type="cpu")   # "precision='fp8' needs an NVIDIA GPU ... Use precision='fp32' instead."
    check_fp8_support("cuda", "current")      # passes on an H100 with Transformer Engine installed

Transformer Engine is imported only when FP8 actually runs; this module imports without it. The layer swap
(:mod:`lightning_mp.fp8.convert`) and the run-time pieces (:mod:`lightning_mp.fp8.runtime`) build on it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
from typing import Any, Optional, Union

import torch

from lightning_mp.fp8.config import RECIPE_CLASSES, FP8Config

INSTALL_HINT = 'pip install "lightning-mp[fp8]"'
#: compute capability of the first GPUs with FP8 tensor cores (Ada)
FP8_MIN_CAPABILITY = (8, 9)


class FP8UnavailableError(ValueError):
    """FP8 cannot run here: no FP8-capable GPU, no Transformer Engine, or a recipe this GPU/TE lacks.

    Example::

        try:
            check_fp8_support("cuda", "mxfp8")
        except FP8UnavailableError as err:
            print(err)   # ... needs a Blackwell GPU ...; use recipe='delayed', 'current' or 'block'
    """


# --------------------------------------------------------------------------------------------- Transformer Engine
def te_installed() -> bool:
    """Whether ``transformer_engine`` can be found (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def te_version() -> Optional[str]:
    """The installed Transformer Engine version, or ``None`` when it is not installed."""
    if not te_installed():
        return None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return getattr(importlib.import_module("transformer_engine"), "__version__", "unknown")


def import_te() -> Any:
    """``transformer_engine.pytorch``, or an :class:`FP8UnavailableError` naming the install command."""
    if not te_installed():
        raise FP8UnavailableError(fp8_support_problem(device_type="cuda", te_version=None))
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # an installed TE that does not load (CUDA libraries, torch ABI) is reported as such
        raise FP8UnavailableError(
            f"Transformer Engine {te_version()} is installed but `import transformer_engine.pytorch` failed:"
            f" {type(err).__name__}: {err}. Reinstall it for this torch/CUDA ({INSTALL_HINT}), or use precision='bf16'."
        ) from err


def _recipe_module() -> Any:
    import_te()
    return importlib.import_module("transformer_engine.common.recipe")


# --------------------------------------------------------------------------------------------- capability
def device_problem(
    device_type: str,
    capability: Optional[tuple[int, int]] = None,
    device_name: Optional[str] = None,
    who: str = "precision='fp8'",
) -> Optional[str]:
    """Why this device cannot run FP8 GEMMs at all (not an NVIDIA GPU, or compute capability below 8.9), whatever
    the backend (``who``: how the message names what was asked for), or ``None``. On a CPU the mode it names instead
    is the one ``auto`` runs there: bf16 on a CPU with native bf16, else fp32 (:func:`lightning_mp.cpu.cpu_mode`)."""
    if device_type != "cuda":
        from lightning_mp.cpu import cpu_mode

        where = "the CPU" if device_type == "cpu" else f"device type {device_type!r}"
        instead = cpu_mode() if device_type == "cpu" else "fp32"  # the CPU's: bf16 where it has native bf16
        return (
            f"{who} needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada,"
            f" Hopper or Blackwell, e.g. L40S, H100, H200, B200), but the run is on {where}."
            f" Use precision={instead!r} instead."
        )
    name = device_name or "this GPU"
    if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = capability
        instead = "'bf16'" if tuple(capability) >= (8, 0) else "'fp16' (with loss scaling)"
        return (
            f"{who} needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper or Blackwell,"
            f" e.g. L40S, H100, H200, B200), but {name} has compute capability {major}.{minor}."
            f" Use precision={instead} on this GPU instead."
        )
    return None


def fp8_support_problem(
    *,
    device_type: str,
    capability: Optional[tuple[int, int]] = None,
    device_name: Optional[str] = None,
    te_version: Optional[str] = None,
    recipe: str = "delayed",
    recipe_class_present: bool = True,
    te_reason: Optional[str] = None,
) -> Optional[str]:
    """Why FP8 cannot run with these facts, or ``None``: the pure part of :func:`check_fp8_support`.

    Example::

        fp8_support_problem(device_type="cuda", capability=(8, 0), device_name="NVIDIA A100", te_version="2.20.2")
        # "precision='fp8' needs FP8 tensor cores ... NVIDIA A100 has compute capability 8.0. Use precision='bf16' ..."

    Checked in this order: the device, its compute capability, Transformer Engine installed (``te_version``
    ``None`` means not installed), the recipe class in that TE, and TE's own verdict on the recipe
    (``te_reason``, e.g. from ``te.is_mxfp8_available(return_reason=True)``).
    """
    problem = device_problem(device_type, capability, device_name)
    if problem is not None:
        return problem
    name = device_name or "this GPU"
    if te_version is None:
        return (
            "precision='fp8' runs its FP8 matrix multiplies through NVIDIA Transformer Engine, which is not"
            f" installed. Install it with `{INSTALL_HINT}` (or `pip install \"transformer-engine[pytorch]\"`),"
            " or use precision='bf16'."
        )
    cls = RECIPE_CLASSES.get(recipe, recipe)
    if not recipe_class_present:
        return (
            f"fp8 recipe={recipe!r} needs transformer_engine.common.recipe.{cls}, which the installed Transformer"
            f" Engine {te_version} lacks. Upgrade it (`pip install -U 'transformer-engine[pytorch]'`) or use"
            " recipe='delayed'."
        )
    if te_reason is None and capability is not None:
        # TE gave no verdict (an older TE without the check functions): the hardware rules TE 2.20 applies
        if recipe == "mxfp8" and not ((10, 0) <= tuple(capability) < (12, 0)):
            te_reason = "MXFP8 needs compute capability 10.x."
        elif recipe == "block" and tuple(capability) < (9, 0):
            te_reason = "FP8 block scaling needs compute capability 9.0 or higher."
    if te_reason:
        return (
            f"fp8 recipe={recipe!r} ({cls}) cannot run on {name}: {te_reason.strip()}"
            f" {_recipe_advice(recipe, capability)}"
        )
    return None


def _recipe_advice(recipe: str, capability: Optional[tuple[int, int]]) -> str:
    if recipe == "mxfp8":
        what = "MXFP8 needs a Blackwell data-centre GPU (compute capability 10.x, e.g. B200)"
    elif recipe == "block":
        what = "Float8BlockScaling needs compute capability 9.0+ (Hopper or newer) and CUDA 12.9+"
    else:
        what = "FP8 needs compute capability 8.9+ (Ada, Hopper or Blackwell)"
    runnable = ["delayed", "current"] + (["block"] if capability is not None and tuple(capability) >= (9, 0) else [])
    options = ", ".join(repr(r) for r in runnable if r != recipe)
    return f"{what}; use recipe={options} here." if options else f"{what}."


def _te_recipe_reason(te: Any, recipe: str) -> Optional[str]:
    """Transformer Engine's own reason why ``recipe`` cannot run on this GPU, or ``None``."""
    checks = ["is_fp8_available"]
    if recipe == "block":
        checks.append("is_fp8_block_scaling_available")
    elif recipe == "mxfp8":
        checks.append("is_mxfp8_available")
    legacy = None
    for check in checks:
        fn = getattr(te, check, None)
        try:
            if fn is not None:
                ok, reason = fn(return_reason=True)
            else:  # older TE: the same checks on FP8GlobalStateManager, returning (ok, reason)
                if legacy is None:
                    legacy = importlib.import_module("transformer_engine.pytorch.fp8").FP8GlobalStateManager
                method = getattr(legacy, check, None)
                if method is None:
                    continue
                ok, reason = method()
        except (ImportError, AttributeError, TypeError):
            continue
        if not ok:
            return reason or f"Transformer Engine's {check}() is False on this GPU."
    return None


def fp8_support_facts(device: Union[str, torch.device], recipe: str = "delayed") -> dict[str, Any]:
    """What :func:`fp8_support_problem` needs, read from this machine (imports TE only on an FP8-capable GPU)."""
    device = torch.device(device)
    facts: dict[str, Any] = {"device_type": device.type, "recipe": recipe}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["capability"] = tuple(torch.cuda.get_device_capability(index))
        facts["device_name"] = torch.cuda.get_device_name(index)
    facts["te_version"] = te_version()
    capable = facts.get("capability") is not None and facts["capability"] >= FP8_MIN_CAPABILITY
    if device.type == "cuda" and capable and facts["te_version"] is not None:
        te = import_te()
        facts["recipe_class_present"] = hasattr(_recipe_module(), RECIPE_CLASSES[recipe])
        if facts["recipe_class_present"]:
            facts["te_reason"] = _te_recipe_reason(te, recipe)
    return facts


def fp8_device_problem(device_type: str, *, library: bool = True) -> Optional[str]:
    """Why this kind of device cannot run FP8 at all (device, compute capability, and with ``library`` TE
    installed), or ``None``. The plugins check the device here and the backend's library when they connect.

    Cheap (Transformer Engine is looked for, not imported): what ``resolve_mode("fp8", device_type)`` needs.

    Example::

        fp8_device_problem("cpu")   # "precision='fp8' needs an NVIDIA GPU ... Use precision='fp32' instead."
    """
    facts: dict[str, Any] = {"device_type": device_type}
    if device_type == "cuda" and torch.cuda.is_available():
        facts["capability"] = tuple(torch.cuda.get_device_capability())
        facts["device_name"] = torch.cuda.get_device_name()
    facts["te_version"] = te_version() if library else "(not checked)"
    return fp8_support_problem(**facts)


def check_fp8_support(device: Union[str, torch.device], recipe: str = "delayed") -> None:
    """Raise :class:`FP8UnavailableError` saying why FP8 with ``recipe`` cannot run on ``device``, and what to use.

    Example::

        check_fp8_support("cuda", "current")      # passes on an H100 with Transformer Engine installed
        check_fp8_support("cpu")                   # FP8UnavailableError: ... Use precision='fp32' instead.
    """
    problem = fp8_support_problem(**fp8_support_facts(device, recipe))
    if problem:
        raise FP8UnavailableError(problem)


# --------------------------------------------------------------------------------------------- recipes
def recipe_spec(config: FP8Config) -> tuple[str, dict[str, Any]]:
    """The Transformer Engine recipe class name and its arguments (``fp8_format`` as a name), without TE.

    Example::

        recipe_spec(FP8Config(recipe="delayed", amax_history_len=16))
        # ('DelayedScaling', {'fp8_format': 'HYBRID', 'margin': 0, 'amax_history_len': 16, 'amax_compute_algo': 'max'})
    """
    settings = config.recipe_settings()
    kwargs = {k: v for k, v in settings.items() if k != "recipe"}
    if config.recipe == "mxfp8" and config.margin is None:
        kwargs.pop("margin", None)  # MXFP8's margin is TE's business unless the user sets it
    return RECIPE_CLASSES[config.recipe], kwargs


def build_recipe(config: FP8Config) -> Any:
    """The Transformer Engine recipe object for ``config`` (imports TE).

    Example::

        build_recipe(FP8Config(recipe="current"))   # Float8CurrentScaling(fp8_format=Format.HYBRID, ...)
    """
    module = _recipe_module()
    name, kwargs = recipe_spec(config)
    cls = getattr(module, name, None)
    if cls is None:
        raise FP8UnavailableError(
            fp8_support_problem(
                device_type="cuda", te_version=te_version(), recipe=config.recipe, recipe_class_present=False
            )
        )
    kwargs["fp8_format"] = getattr(module.Format, kwargs["fp8_format"])
    return cls(**kwargs)


def autocast_api(te: Any) -> str:
    """``"autocast"`` when this TE has ``te.autocast(recipe=...)``, else ``"fp8_autocast"`` (older TE).

    TE 2.20 keeps ``fp8_autocast`` but warns that it is deprecated on every call; ``autocast`` is the same
    context without the warning.
    """
    fn = getattr(te, "autocast", None)
    if fn is not None:
        try:
            if "recipe" in inspect.signature(fn).parameters:
                return "autocast"
        except (TypeError, ValueError):
            pass
    if getattr(te, "fp8_autocast", None) is None:
        raise FP8UnavailableError(
            f"Transformer Engine {te_version()} has neither te.autocast(recipe=...) nor te.fp8_autocast;"
            f" reinstall it ({INSTALL_HINT})."
        )
    return "fp8_autocast"
