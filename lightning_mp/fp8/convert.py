"""The layer swap: ``nn.Linear``/``nn.LayerNorm`` -> Transformer Engine modules, in place, with a report.

Example::

    from lightning_mp.fp8 import FP8Config, convert_to_te

    report = convert_to_te(model, config=FP8Config(keep_last=1))
    print(report.summary())   # FP8: 24 of 25 nn.Linear -> te.Linear (92.3 % of linear FLOPs), ...
    for record in report.skipped:
        print(record.fqn, record.reason)

Transformer Engine is imported when the swap runs, never at import time.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mp.fp8.config import FP8Config
from lightning_mp.fp8.filters import ModuleFilter, ModuleFilterFn
from lightning_mp.fp8.primary import fit_delayed_scale, is_quantized, remember_original
from lightning_mp.fp8.support import build_recipe, import_te
from lightning_mp.guards import fp32_guard_of

log = logging.getLogger(__name__)

def weights_phrase(weights: str) -> str:
    """How a settled ``fp8={"weights": ...}`` layout reads in a report line."""
    return "fp32 weights in the FP8 layers, bf16 elsewhere" if weights == "mixed" else f"{weights} weights"


#: the parameters' dtype (``"fp8"``: FP8 primary weights whose nominal dtype, and their gradients', is fp32)
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}


@dataclass(frozen=True)
class ModuleRecord:
    """One ``nn.Linear``/``nn.LayerNorm`` the swap looked at.

    Example::

        ModuleRecord("head", "Linear", (4096, 32768), "one of the last 1 linear layer(s), kept in bf16 (keep_last=1)")
    """

    fqn: str
    #: ``"Linear"`` or ``"LayerNorm"``
    kind: str
    #: ``(in_features, out_features)`` for a linear, ``normalized_shape`` for a norm
    shape: tuple[int, ...]
    #: why it stayed a torch module; ``None`` when it was converted
    reason: Optional[str] = None

    @property
    def weight_elements(self) -> int:
        """``in * out`` for a linear: proportional to its GEMM FLOPs per token (0 for a norm)."""
        return self.shape[0] * self.shape[1] if self.kind == "Linear" else 0


@dataclass
class ConversionReport:
    """What :func:`convert_to_te` converted and what it skipped, and why.

    Example::

        report.summary()                       # one line with counts, as logged at INFO
        report.linear_flop_share               # 0.92: share of the linear FLOPs that run in FP8
        [r.fqn for r in report.skipped]        # ['head', ...]
    """

    converted: list[ModuleRecord] = field(default_factory=list)
    skipped: list[ModuleRecord] = field(default_factory=list)
    #: Transformer Engine modules the model held before the swap (a second call converts nothing)
    already_te: int = 0
    weights: str = "fp32"

    @property
    def linear_flop_share(self) -> float:
        """Share of the model's ``nn.Linear`` FLOPs (``sum in*out``) that the converted layers carry.

        Every linear sees the same tokens, so the share of ``in * out`` is the share of GEMM FLOPs; 0.0 when
        the model has no linear layer.
        """
        done = sum(r.weight_elements for r in self.converted)
        total = done + sum(r.weight_elements for r in self.skipped)
        return done / total if total else 0.0

    def count(self, kind: str, converted: bool = True) -> int:
        return sum(r.kind == kind for r in (self.converted if converted else self.skipped))

    #: what the modules the model held before the swap are called in the summary
    already_label = "Transformer Engine modules"

    def summary(self) -> str:
        """One line: counts of converted modules, the FP8 FLOP share, and skips grouped by reason."""
        text = self.head()
        if self.skipped:
            groups = Counter(_reason_group(r.reason or "") for r in self.skipped)
            text += "; kept in torch: " + ", ".join(f"{n} {why}" for why, n in groups.most_common())
        if self.already_te:
            text += f"; {self.already_te} {self.already_label} were already there"
        return text

    def head(self) -> str:
        """The summary's first part: what was swapped for what, the FP8 FLOP share, the weights."""
        lin, lin_all = self.count("Linear"), self.count("Linear") + self.count("Linear", False)
        ln, ln_all = self.count("LayerNorm"), self.count("LayerNorm") + self.count("LayerNorm", False)
        return (
            f"FP8: {lin} of {lin_all} nn.Linear -> te.Linear ({100 * self.linear_flop_share:.1f} % of linear FLOPs),"
            f" {ln} of {ln_all} nn.LayerNorm -> te.LayerNorm, {weights_phrase(self.weights)}"
        )

    def details(self) -> str:
        """Every module, one per line (logged at DEBUG)."""
        lines = [f"  converted {r.kind} {r.fqn} {r.shape}" for r in self.converted]
        lines += [f"  kept      {r.kind} {r.fqn} {r.shape}: {r.reason}" for r in self.skipped]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for JSON or a checkpoint."""
        return {
            "converted": [{"fqn": r.fqn, "kind": r.kind, "shape": list(r.shape)} for r in self.converted],
            "skipped": [
                {"fqn": r.fqn, "kind": r.kind, "shape": list(r.shape), "reason": r.reason} for r in self.skipped
            ],
            "linear_flop_share": self.linear_flop_share,
            "already_te": self.already_te,
            "weights": self.weights,
        }

    def log(self, logger: logging.Logger = log, announce: Optional[Callable[[str], None]] = None) -> None:
        """The summary at INFO (or to ``announce``), the full list at DEBUG."""
        (announce or logger.info)(self.summary())
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("FP8 layer swap, module by module:\n%s", self.details())


def _reason_group(reason: str) -> str:
    for key, label in (
        ("keep_first", "first layers (keep_first)"),
        ("keep_last", "last layers (keep_last)"),
        ("divisible by", "shapes FP8 GEMMs cannot run (not divisible by 16)"),
        ("too small", "too small for FP8 (size rule)"),
        ("include", "not in include"),
        ("exclude", "excluded by name"),
        ("tied", "tied weights"),
        ("FP32 guard", "FP32-guarded"),
        ("hook", "with hooks"),
        ("subclasses", "subclasses of Linear/LayerNorm"),
        ("convert_layernorm", "LayerNorms (convert_layernorm=False)"),
        ("module_filter_fn", "refused by module_filter_fn"),
    ):
        if key in reason:
            return label
    return "other"


def convert_to_te(
    module: nn.Module,
    *,
    config: Optional[FP8Config] = None,
    module_filter_fn: Optional[ModuleFilterFn] = None,
    te: Any = None,
    device: Optional[torch.device] = None,
    announce: Optional[Callable[[str], None]] = None,
    recipe: Any = None,
    weights: Optional[str] = None,
    kept_as: Optional[str] = None,
) -> ConversionReport:
    """Swap the model's eligible ``nn.Linear``/``nn.LayerNorm`` for ``te.Linear``/``te.LayerNorm``, in place.

    Example::

        report = convert_to_te(model, config=FP8Config(exclude=["head"]), module_filter_fn=lambda m, fqn: True)

    The new modules get the old weights exactly (cast to ``config.weights``: fp32, bf16, or quantized to FP8 with
    the fp32 values kept for the optimizer's masters), the same
    ``requires_grad``, and replace the old module at every path where the model holds it. Which modules
    are swapped is decided by :class:`~lightning_mp.fp8.filters.ModuleFilter` over ``config``, ANDed with
    ``module_filter_fn(module, fqn)``; the report says what was converted and why the rest was not, and is
    logged (one INFO line, the full list at DEBUG). Only the swapped modules change dtype: casting the rest
    of the model for ``weights="bf16"`` is :func:`apply_weights_dtype`'s job.

    Args:
        module: the model; its own type is never swapped (only its submodules).
        config: the FP8 settings; ``None`` uses the defaults.
        module_filter_fn: an extra ``(module, fqn) -> bool`` rule, as in torchao's ``convert_to_float8_training``.
        te: the module providing ``Linear`` and ``LayerNorm``; ``None`` imports ``transformer_engine.pytorch``.
        device: where the new modules live; ``None``: with the old weights when those are on a CUDA (or meta)
            device, else on the current CUDA device (Transformer Engine modules need CUDA).
        announce: where the one-line summary goes (e.g. Lightning's ``rank_zero_info``); ``None`` logs it at
            INFO on this module's logger. The module-by-module list is logged at DEBUG either way.
        recipe: with ``config.weights="fp8"``, the Transformer Engine recipe the FP8 weights are made for
            (``None``: built from ``config``).
        weights: the dtype the new modules' weights get (``"fp32"``, ``"bf16"``, ``"fp8"``); ``None``:
            ``config.weights`` (``"auto"``: the old weights' fp32, for the caller to cast).
        kept_as: the weights' dtype in training, for the report, when the caller casts after the swap.
    """
    config = config if config is not None else FP8Config()
    if te is None:
        te = import_te()
    keep = ModuleFilter(module, config, module_filter_fn)
    weights = weights or ("fp32" if config.weights == "auto" else config.weights)  # (auto: the caller casts)
    dtype = WEIGHT_DTYPES[weights]
    report = ConversionReport(weights=kept_as or weights)
    if weights == "fp8" and recipe is None:
        recipe = build_recipe(config)
    fp8_recipe = recipe if weights == "fp8" else None

    for sub, names in submodules_at_paths(module):
        if type(sub).__module__.startswith("transformer_engine"):
            report.already_te += 1
            continue
        if not isinstance(sub, (nn.Linear, nn.LayerNorm)):
            continue
        fqn = names[0]
        kind = "Linear" if isinstance(sub, nn.Linear) else "LayerNorm"
        shape = (sub.in_features, sub.out_features) if isinstance(sub, nn.Linear) else tuple(sub.normalized_shape)
        reason = keep.reason(sub, fqn)
        if reason is not None:
            report.skipped.append(ModuleRecord(fqn, kind, shape, reason))
            continue
        replace_at(module, names, _make_te_module(te, sub, dtype, device, fp8_recipe))
        report.converted.append(ModuleRecord(fqn, kind, shape))
    report.log(announce=announce)
    return report


def submodules_at_paths(module: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Every submodule of ``module`` (not itself) once, with every path it is held at: a layer held twice is then
    swapped for one new layer at both places (:func:`replace_at`)."""
    paths: dict[int, list[str]] = {}
    objects: dict[int, nn.Module] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if name:
            paths.setdefault(id(sub), []).append(name)
            objects[id(sub)] = sub
    return [(objects[key], names) for key, names in paths.items()]


def replace_at(module: nn.Module, names: list[str], new: nn.Module) -> None:
    """Put ``new`` at each of ``names`` (paths in ``module``)."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, new)


def _target_device(old: nn.Module, device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    where = old.weight.device
    if where.type in ("cuda", "meta"):
        return where
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")


def _make_te_module(
    te: Any,
    old: Union[nn.Linear, nn.LayerNorm],
    dtype: torch.dtype,
    device: Optional[torch.device],
    fp8_recipe: Any = None,
) -> nn.Module:
    """The TE module for ``old`` with its values; with ``fp8_recipe``, a linear's weight is an FP8 primary weight."""
    where = _target_device(old, device)
    if isinstance(old, nn.Linear):
        init = te.quantized_model_init(enabled=True, recipe=fp8_recipe) if fp8_recipe is not None else nullcontext()
        with init:
            new = te.Linear(
                old.in_features, old.out_features, bias=old.bias is not None, params_dtype=dtype, device=where
            )
        pairs = [("weight", old.weight)] + ([("bias", old.bias)] if old.bias is not None else [])
    else:
        new = te.LayerNorm(old.normalized_shape[0], eps=old.eps, params_dtype=dtype, device=where)
        pairs = [("weight", old.weight), ("bias", old.bias)]
    with torch.no_grad():
        for name, source in pairs:
            target, wanted = getattr(new, name), source.requires_grad
            if target.shape != source.shape:
                raise RuntimeError(
                    f"Transformer Engine's {type(new).__name__}.{name} has shape {tuple(target.shape)}, the torch"
                    f" module's {tuple(source.shape)}: this Transformer Engine version lays its parameters out"
                    " differently; please report it."
                )
            if source.device.type != "meta" and target.device.type != "meta":
                if is_quantized(target):  # an FP8 primary weight: quantized with a scale that fits it
                    fit_delayed_scale(target, source)
                    remember_original(new, name, source)  # the optimizer's master starts from it
                    source = source.to(target.device, torch.float32)
                target.copy_(source)
            target.requires_grad_(wanted)
    new.train(old.training)
    return new


def apply_weights_dtype(module: nn.Module, weights: str) -> nn.Module:
    """``"bf16"``: cast the model's floating-point parameters and buffers to bf16; ``"fp32"``, ``"fp8"``: no change.

    Example::

        apply_weights_dtype(model, "bf16")   # what Lightning's precision="transformer-engine" does too

    Modules under an FP32 guard (:mod:`lightning_mp.guards`) keep their fp32 parameters and buffers: the
    guard runs them in fp32.
    """
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"weights={weights!r} is invalid. Accepted values: {', '.join(map(repr, WEIGHT_DTYPES))}.")
    if weights in ("fp32", "fp8"):
        return module  # (fp8: only the FP8 layers' weights are FP8, made so by the swap)
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16) if t.is_floating_point() else t

    def visit(m: nn.Module) -> None:
        if fp32_guard_of(m) is not None:
            return
        m._apply(cast, recurse=False)
        for child in m.children():
            visit(child)

    visit(module)
    return module
