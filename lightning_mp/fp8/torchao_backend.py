"""FP8 training through torchao's float8 (``fp8={"backend": "torchao"}``): checks, layer swap, compiled layers,
bf16 evaluation, the saturation watch, checkpoint state.

Example (a plain loop; ``MPPlugin("fp8", fp8={"backend": "torchao"})`` wires the same calls to Lightning's hooks)::

    import torch
    from lightning_mp.fp8.torchao_backend import TorchAOFloat8

    fp8 = TorchAOFloat8({"backend": "torchao", "recipe": "rowwise_with_gw_hp"})
    fp8.convert(model, device="cuda")               # checks, swaps nn.Linear -> Float8Linear, logs one line
    fp8.watch_saturation()                          # an inf reaching an FP8 cast raises a device flag
    opt = torch.optim.AdamW(model.parameters())     # (the swap keeps the parameters: before or after is the same)
    for x in batches:
        with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
            loss = model(x)
        loss.backward()
        saturated = fp8.sentinel.take()             # > 0: an FP8 operand held inf/NaN (MPPlugin skips on the device)
        if not saturated.item():
            opt.step()
        opt.zero_grad()

torchao is imported only when FP8 runs; this module imports without it. Tested with torchao 0.18.0 (torch 2.11 on
CUDA, 2.13 on the CPU); the API it uses (``Float8LinearConfig.from_recipe_name(recipe)``,
``convert_to_float8_training``, ``precompute_float8_dynamic_scale_for_fsdp``) is older, but older releases are not
tested, so the install hint names 0.18.

The recipes (torchao's own, ``Float8LinearConfig.from_recipe_name``; scales dynamic, from each tensor's amax):

========================  ==========================================================================================
``"tensorwise"``          one scale a tensor; input and weight E4M3, output gradient E5M2; all three GEMMs in FP8
                          (cuBLAS's tensorwise kernel: the fastest). The default.
``"rowwise"``             one scale a row (power-of-2 scales); input, weight and output gradient all E4M3; all three
                          GEMMs in FP8 (the rowwise CUTLASS kernel).
``"rowwise_with_gw_hp"``  as ``"rowwise"`` for the output GEMM (input and weight rowwise E4M3) and the input
                          gradient's (output gradient rowwise E4M3 times the weight with one tensorwise E4M3 scale),
                          but the weight gradient's GEMM in high precision (the input and the output gradient as they
                          are, bf16 under autocast): torchao's most accurate recipe; one GEMM of three not in FP8.
========================  ==========================================================================================

Decisions, and why:

* **The swap.** The layers :class:`~lightning_mp.fp8.filters.ModuleFilter` admits (``include``/``exclude``,
  ``keep_first``/``keep_last``, both sides divisible by 16 -- what ``torch._scaled_mm`` needs for every torchao
  recipe, as torchao's own auto filter checks --, the size rule, no tied weights, no hooks, no FP32 guard) become
  ``Float8Linear`` through torchao's public ``convert_to_float8_training`` applied to each admitted layer; a layer held
  at two paths becomes one ``Float8Linear`` at both. ``Float8Linear`` keeps the ``nn.Linear``'s own parameter objects
  (``weights="fp8"``: the weight becomes a new parameter around the same data, torchao's FSDP2 tensor, which
  ``prepare_fp8`` makes before the optimizer exists) and adds no buffer, so the model's ``state_dict`` has the plain
  model's keys and an optimizer made before the swap still steps the right tensors. ``nn.LayerNorm`` stays torch's
  (torchao swaps linears only).
* **torch.compile: each FP8 layer's forward is compiled unless the model is compiled already.** torchao's casts
  (amax, scale, cast, for the input, the weight and the output gradient) are separate eager kernels; torchao is
  faster than bf16 only when Inductor fuses them, so an eager ``Float8Linear`` is slower than the ``nn.Linear`` it
  replaced. Compiling per layer (one compiled function per layer shape, shared by the layers of that shape) keeps
  the rest of the user's model, the plugin's hooks and this module's sentinel hooks eager and needs nothing from the
  user; a model the user compiled (``torch.compile(model)`` handed to the Trainer, an ``OptimizedModule`` inside,
  ``module.compile()``) traces the layers with everything else, where Inductor fuses the casts into their
  neighbours too: then the layers are not compiled again. Only on CUDA (the CPU runs torchao's casts, but slowly
  either way). The escape: ``compile_layers=False`` (or ``True`` to force), on the backend before ``convert``
  (``MPPlugin(...).fp8.compile_layers = False``).
* **Evaluation in bf16 (``fp8_in_eval=False``, the default).** ``Float8Linear`` casts in every forward, training or
  not. Each converted layer's forward goes through one switch that :meth:`TorchAOFloat8.autocast` sets: in
  ``autocast(training=False)`` without ``fp8_in_eval`` the layer computes ``F.linear`` in the surrounding autocast
  dtype, as the ``nn.Linear`` did. Outside any region (a plain call) the layers run FP8, as torchao's do. With
  ``weights="fp8"`` (FSDP2 gathers FP8 weights) evaluation runs FP8: the gathered weights are FP8.
* **Weights.** ``"bf16"`` casts the model's floating weights to bf16 outside FP32 guards (the plugin keeps fp32
  master weights), ``"fp32"`` leaves them. ``"fp8"`` is torchao's FSDP2 float8 all-gather
  (``enable_fsdp_float8_all_gather``: fp32 shards, FP8 gathers, half a bf16 gather's bytes): recipe ``"tensorwise"``
  only (torchao gathers tensorwise-scaled weights only; ``"rowwise"`` and ``"rowwise_with_gw_hp"`` are refused), and
  only under FSDP2 (``ModelParallelStrategy``): :meth:`TorchAOFloat8.connect_optimizers` refuses it when the FP8
  layers' weights are not sharded. After each optimizer step :meth:`TorchAOFloat8.weights_updated` computes every
  FP8 weight's scale for the next gathers with one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``;
  without it each weight's gather all-reduces its own amax); :meth:`TorchAOFloat8.release` and the next
  :meth:`TorchAOFloat8.connect_optimizers` drop those scales (the weights may be loaded anew in between).
* **Saturation.** torchao scales each tensor (tensorwise) or row (the rowwise recipes) from its own amax: an inf
  makes the scale 0 and the cast produces NaN in eager mode (which then reaches the gradients), but a compiled cast's
  min/max need not propagate NaN and can clamp it to the FP8 maximum, a finite value no gradient check sees. The
  sentinel (:class:`Float8Watch`) reads, before each training forward of an FP8 layer, the amax of its input and its
  weight, and in backward the amax of its output gradient (a tensor hook on the output: no ``BackwardHookFunction``
  around the layer's inputs, which a full backward hook would add). The hooks write only into one device buffer (the
  last amaxes and their running maximum, which keeps a NaN or inf), so a compiled model traces them without a graph
  break; ``sentinel.take()`` turns the running maxima into the step's flag on the device: no host sync. The last
  amaxes are what :meth:`TorchAOFloat8.layer_stats` reports.
* **Checkpoints.** Dynamic scaling keeps no state: :meth:`TorchAOFloat8.state_dict` records the recipe (its FP8
  formats and the weight-gradient GEMM's precision) and torchao's version only, and a checkpoint from another recipe
  or backend loads with a warning.
* **The CPU.** torch runs torchao's FP8 matmuls on the CPU too (the tests train there, the hardware check aside);
  ``Float8Linear`` casts its input to the autocast dtype under CUDA's autocast only, so the layers' forward does it
  under the CPU's, and a CPU step computes what a GPU step does.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mp.fp8.config import FP8Config
from lightning_mp.fp8.convert import (
    ConversionReport,
    ModuleRecord,
    apply_weights_dtype,
    replace_at,
    submodules_at_paths,
    weights_phrase,
)
from lightning_mp.fp8.filters import ModuleFilter, ModuleFilterFn
from lightning_mp.fp8.support import FP8_MIN_CAPABILITY, FP8UnavailableError, device_problem

log = logging.getLogger("lightning_mp.fp8")

STATE_FORMAT = 1
#: the torchao release this module is tested with (named in the install hint)
TESTED_TORCHAO = "0.18"
INSTALL_HINT = f'pip install "torchao>={TESTED_TORCHAO}"'
#: the FP8 formats of torchao's recipes: (input, weight, output gradient); tensorwise is what TE calls HYBRID
RECIPE_FORMATS: dict[str, tuple[str, str, str]] = {
    "tensorwise": ("e4m3fn", "e4m3fn", "e5m2"),
    "rowwise": ("e4m3fn", "e4m3fn", "e4m3fn"),
    "rowwise_with_gw_hp": ("e4m3fn", "e4m3fn", "e4m3fn"),  # (not in the weight-gradient GEMM: high precision there)
}
#: the recipes whose weight-gradient GEMM runs in high precision (the input and output gradient not cast to FP8)
HIGH_PRECISION_GRAD_WEIGHT = frozenset({"rowwise_with_gw_hp"})
#: the recipes with rowwise scales (what the device probe runs)
ROWWISE_RECIPES = frozenset({"rowwise", "rowwise_with_gw_hp"})
_WEIGHTS = ("fp32", "bf16", "mixed", "fp8")
#: module-name parts that wrappers insert (FSDP's units, activation checkpointing, torch.compile): not in the names
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


# --------------------------------------------------------------------------------------------- torchao
def torchao_installed() -> bool:
    """Whether ``torchao`` can be found (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


def torchao_version() -> Optional[str]:
    """The installed torchao version, or ``None`` when it is not installed."""
    if not torchao_installed():
        return None
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(importlib.import_module("torchao"), "__version__", "unknown"))


def import_float8() -> Any:
    """``torchao.float8``, or an :class:`FP8UnavailableError` naming the install command."""
    if not torchao_installed():
        raise FP8UnavailableError(torchao_support_problem(device_type="cuda", torchao_version=None))
    try:
        return importlib.import_module("torchao.float8")
    except Exception as err:  # an installed torchao that does not load (its torch pin, a broken install)
        raise FP8UnavailableError(
            f"torchao {torchao_version()} is installed but `import torchao.float8` failed: {type(err).__name__}:"
            f" {err}. Install a torchao release built for torch {torch.__version__} ({INSTALL_HINT}), or use"
            " precision='bf16'."
        ) from err


def float8_linear_config(recipe: str, *, fsdp_float8_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``);
    imports torchao.

    Example::

        float8_linear_config("tensorwise", fsdp_float8_all_gather=True)   # FSDP2 gathers FP8 weights
    """
    if recipe not in RECIPE_FORMATS:
        raise ValueError(f"torchao recipe={recipe!r} is invalid. Accepted values: {_ACCEPTED}.")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(_FP8_WEIGHTS_TENSORWISE_ONLY)
    float8 = import_float8()
    try:
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
    except (AssertionError, ValueError, KeyError) as err:
        raise FP8UnavailableError(
            f"torchao {torchao_version()} does not know the float8 recipe {recipe!r} ({err}). Upgrade it"
            f" ({INSTALL_HINT}), or use precision='bf16'."
        ) from err
    if fsdp_float8_all_gather:
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


_ACCEPTED = ", ".join(map(repr, RECIPE_FORMATS))
_FP8_WEIGHTS_TENSORWISE_ONLY = (
    "fp8 weights='fp8' with backend='torchao' is FSDP2's float8 all-gather, which torchao runs for"
    " recipe='tensorwise' only (its rowwise recipes, 'rowwise' and 'rowwise_with_gw_hp', scale the weight per row)."
    " Use recipe='tensorwise', or weights='auto' (fp32 shards gathered in bf16)."
)


# --------------------------------------------------------------------------------------------- capability
def torchao_support_problem(
    *,
    device_type: str,
    capability: Optional[tuple[int, int]] = None,
    device_name: Optional[str] = None,
    torchao_version: Optional[str] = None,
    recipe: str = "tensorwise",
    probe_error: Optional[str] = None,
) -> Optional[str]:
    """Why torchao float8 cannot run with these facts, or ``None``: the pure part of :meth:`TorchAOFloat8.check`.

    Example::

        torchao_support_problem(device_type="cuda", capability=(8, 0), torchao_version="0.18.0")
        # "... needs FP8 tensor cores ... this GPU has compute capability 8.0. Use precision='bf16' ..."

    Checked in this order: the device, its compute capability (8.9: Ada, Hopper, Blackwell; rowwise scaling runs
    there too with torch 2.7+), torchao installed (``torchao_version`` ``None``: not installed), and the result of
    one small ``torch._scaled_mm`` with the recipe's scales on the device (``probe_error``: what torch raised).
    """
    problem = device_problem(device_type, capability, device_name, who="precision='fp8' with backend='torchao'")
    if problem is not None:
        return problem
    name = device_name or "this GPU"
    if torchao_version is None:
        return (
            "precision='fp8' with backend='torchao' runs its FP8 matrix multiplies through torchao's float8"
            f" training, and torchao is not installed. Install it with `{INSTALL_HINT}` (a release built for your"
            " torch), use backend='transformer_engine', or use precision='bf16'."
        )
    if probe_error is not None:
        other = "'tensorwise'" if recipe in ROWWISE_RECIPES else None
        instead = f"use recipe={other} here, or precision='bf16'" if other else "use precision='bf16'"
        return (
            f"precision='fp8' with backend='torchao', recipe={recipe!r}: torch {torch.__version__} cannot run its"
            f" FP8 matrix multiply on {name} (torch._scaled_mm with {_scale_layout(recipe)} scales failed:"
            f" {probe_error});"
            f" {instead}."
        )
    return None


def _scale_layout(recipe: str) -> str:
    """``"rowwise"`` for the rowwise recipes (``rowwise_with_gw_hp``'s tensorwise weight scale in the input gradient's
    GEMM is expanded to a row of scales by torchao), else ``"tensorwise"``."""
    return "rowwise" if recipe in ROWWISE_RECIPES else "tensorwise"


def scaled_mm_probe(device: torch.device, recipe: str) -> Optional[str]:
    """Run one 16 x 32 x 16 ``torch._scaled_mm`` with ``recipe``'s scale layout on ``device``; what it raised, or
    ``None``. Cached per device and scale layout (both rowwise recipes run the rowwise one).

    Example::

        scaled_mm_probe(torch.device("cuda"), "rowwise")   # None on an H100
    """
    key = (str(device), _scale_layout(recipe))
    if key not in _PROBES:
        try:
            a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
            b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
            if key[1] == "rowwise":
                scale_a, scale_b = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
            else:
                scale_a, scale_b = torch.ones((), device=device), torch.ones((), device=device)
            out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            _PROBES[key] = None if float(out[0, 0]) == 32.0 else f"wrong result {float(out[0, 0])} (expected 32)"
        except Exception as err:  # whatever torch says is the reason
            _PROBES[key] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return _PROBES[key]


_PROBES: dict[tuple[str, str], Optional[str]] = {}


def torchao_support_facts(device: Union[str, torch.device], recipe: str = "tensorwise") -> dict[str, Any]:
    """What :func:`torchao_support_problem` needs, read from this machine (the probe runs on an FP8-capable GPU
    with torchao installed only)."""
    device = torch.device(device)
    facts: dict[str, Any] = {"device_type": device.type, "recipe": recipe, "torchao_version": torchao_version()}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["capability"] = tuple(torch.cuda.get_device_capability(index))
        facts["device_name"] = torch.cuda.get_device_name(index)
        if facts["capability"] >= FP8_MIN_CAPABILITY and facts["torchao_version"] is not None:
            facts["probe_error"] = scaled_mm_probe(torch.device("cuda", index), recipe)
    elif device.type == "cuda":
        facts["probe_error"] = f"CUDA is not available to this torch ({torch.__version__})"
    return facts


# --------------------------------------------------------------------------------------------- the swap
def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (also through the subclass FSDP2's fully_shard makes)."""
    return any(c.__name__ == "Float8Linear" and c.__module__.startswith("torchao.") for c in type(module).__mro__)


def float8_linears(model: nn.Module) -> dict[str, nn.Module]:
    """``{fqn: Float8Linear}`` of ``model``, by the unwrapped model's names (FSDP's, activation checkpointing's and
    ``torch.compile``'s name parts left out, as :func:`lightning_mp.fp8.runtime.named_modules_unwrapped` does)."""
    out: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():  # parents first: a wrapped module replaces its wrapper
        if is_float8_linear(module):
            out[".".join(p for p in fqn.split(".") if p not in _WRAPPER_PARTS)] = module
    return out


@dataclass
class TorchAOConversionReport(ConversionReport):
    """:class:`~lightning_mp.fp8.convert.ConversionReport` of a torchao swap: linears only, its own summary line.

    Example::

        report.summary()
        # FP8 (torchao, tensorwise): 24 of 25 nn.Linear -> Float8Linear (92.3 % of linear FLOPs), bf16 weights,
        # layers compiled; kept in torch: 1 last layers (keep_last)
    """

    recipe: str = "tensorwise"
    #: whether each Float8Linear's forward is compiled (``None``: not decided yet)
    compiled: Optional[bool] = None

    already_label = "Float8Linear layers"

    def head(self) -> str:
        lin, lin_all = self.count("Linear"), self.count("Linear") + self.count("Linear", False)
        text = (
            f"FP8 (torchao, {self.recipe}): {lin} of {lin_all} nn.Linear -> Float8Linear"
            f" ({100 * self.linear_flop_share:.1f} % of linear FLOPs), {weights_phrase(self.weights)}"
        )
        if self.compiled is not None:
            text += ", layers compiled" if self.compiled else ", layers not compiled"
        return text


def convert_to_torchao(
    module: nn.Module,
    *,
    config: Optional[FP8Config] = None,
    linear_config: Any = None,
    module_filter_fn: Optional[ModuleFilterFn] = None,
    weights: str = "bf16",
    compiled: Optional[bool] = None,
    announce: Optional[Callable[[str], None]] = None,
) -> TorchAOConversionReport:
    """Swap the model's eligible ``nn.Linear`` layers for torchao's ``Float8Linear``, in place; the report is logged.

    Example::

        report = convert_to_torchao(model, config=FP8Config(backend="torchao", size_rule="off", keep_last=0))

    Which layers: :class:`~lightning_mp.fp8.filters.ModuleFilter` over ``config`` ANDed with ``module_filter_fn``
    (see the module docstring). The new layers hold the old parameter objects (dtype unchanged: casting is
    :func:`~lightning_mp.fp8.convert.apply_weights_dtype`'s job). Runs on any device; the FP8 matrix multiplies need
    a GPU that :meth:`TorchAOFloat8.check` accepts.

    Args:
        module: the model; its own type is never swapped (only its submodules).
        config: the FP8 settings (``None``: ``FP8Config(backend="torchao")``).
        linear_config: torchao's ``Float8LinearConfig`` (``None``: built for ``config.recipe``).
        module_filter_fn: an extra ``(module, fqn) -> bool`` rule, as torchao's own.
        weights: the dtype the run keeps the weights in, for the report.
        compiled: whether the layers' forwards will be compiled, for the report.
        announce: where the one-line summary goes; ``None`` logs it at INFO on ``lightning_mp.fp8``.
    """
    config = config if config is not None else FP8Config(backend="torchao")
    if linear_config is None:
        linear_config = float8_linear_config(config.recipe)
    float8 = import_float8()
    keep = ModuleFilter(module, config, module_filter_fn)
    report = TorchAOConversionReport(weights=weights, recipe=str(config.recipe), compiled=compiled)
    for sub, names in submodules_at_paths(module):  # (a layer held twice: one Float8Linear at both places)
        if is_float8_linear(sub):
            report.already_te += 1
            continue
        if not isinstance(sub, nn.Linear):
            continue
        fqn, shape = names[0], (sub.in_features, sub.out_features)
        reason = keep.reason(sub, fqn)
        if reason is not None:
            report.skipped.append(ModuleRecord(fqn, "Linear", shape, reason))
            continue
        new = float8.convert_to_float8_training(sub, config=linear_config)  # a root nn.Linear: returns its swap
        new.train(sub.training)
        replace_at(module, names, new)
        report.converted.append(ModuleRecord(fqn, "Linear", shape))
    report.log(log, announce=announce)
    return report


def model_is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` (or a module in it) is compiled already: ``torch.compile(model)`` handed to Lightning
    (which records it on the module), an ``OptimizedModule`` inside, or ``module.compile()``."""
    if getattr(model, "_compiler_ctx", None) is not None:
        return True
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    kind = getattr(optimized, "OptimizedModule", ()) if optimized is not None else ()
    return any((kind and isinstance(m, kind)) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())  # fmt: skip


# --------------------------------------------------------------------------------------------- the forward switch
class ForwardRoute:
    """What every converted layer's forward reads: FP8 or ``F.linear`` now, compiled or eager.

    ``fp8`` is set by :meth:`TorchAOFloat8.autocast` (off in evaluation without ``fp8_in_eval``); ``compile`` once
    at :meth:`TorchAOFloat8.convert`. Plain booleans: the layers pickle and deep-copy with it.
    """

    __slots__ = ("fp8", "compile", "backend")

    def __init__(self, compile: bool = False, backend: str = "inductor") -> None:
        self.fp8 = True
        self.compile = compile
        self.backend = backend

    def __getstate__(self) -> dict[str, Any]:
        return {"fp8": self.fp8, "compile": self.compile, "backend": self.backend}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fp8, self.compile, self.backend = state["fp8"], state["compile"], state["backend"]


#: one compiled Float8Linear.forward per (layer shape, bias, dtype, recipe, backend): layers of one shape share it,
#: and each shape's compile cache holds only its own graphs
_COMPILED: dict[tuple, Callable[..., Tensor]] = {}


def _compiled_forward(module: nn.Module, backend: str) -> Callable[..., Tensor]:
    config = getattr(module, "config", None)
    key = (module.in_features, module.out_features, module.bias is not None, module.weight.dtype, repr(config),
           backend)  # fmt: skip
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = torch.compile(_float8_class(module).forward, backend=backend)
    return fn


def _fp8_gather_weight(module: nn.Module) -> Any:
    """The local shard of ``module``'s weight where FSDP2 gathers it in FP8 (torchao's
    ``WeightWithDynamicFloat8CastTensor`` inside a DTensor), else ``None``."""
    local = getattr(module.weight, "_local_tensor", None)
    return local if type(local).__name__ == "WeightWithDynamicFloat8CastTensor" else None


def _float8_class(module: nn.Module) -> Any:
    return next(c for c in type(module).__mro__ if c.__name__ == "Float8Linear")


def _float8_forward(route: ForwardRoute, module: Any, input: Tensor) -> Tensor:
    """A converted layer's forward: ``F.linear`` where FP8 is off, else torchao's (compiled when chosen).

    ``Float8Linear`` casts its input to the autocast dtype under CUDA's autocast only; under the CPU's the route
    does it, so the layer sees what it sees on a GPU (an fp32 input beside bf16 output gradients would otherwise
    reach ``rowwise_with_gw_hp``'s high-precision weight-gradient GEMM with two dtypes)."""
    if not route.fp8:
        return F.linear(input, module.weight, module.bias)  # in the surrounding autocast dtype, as nn.Linear
    if input.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        input = input.to(torch.get_autocast_dtype("cpu"))
    if route.compile:
        return _compiled_forward(module, route.backend)(module, input)
    return _float8_class(module).forward(module, input)


class _Region:
    """``route.fp8`` set for the region, put back after."""

    __slots__ = ("_route", "_on", "_was")

    def __init__(self, route: ForwardRoute, on: bool) -> None:
        self._route, self._on, self._was = route, on, True

    def __enter__(self) -> None:
        self._was, self._route.fp8 = self._route.fp8, self._on

    def __exit__(self, *exc: Any) -> None:
        self._route.fp8 = self._was


# --------------------------------------------------------------------------------------------- the saturation watch
class Float8Watch:
    """Amaxes of what reaches an FP8 layer's casts, and a device flag raised when one is inf/NaN.

    Example::

        watch = Float8Watch()
        watch.attach(float8_linears(model))
        model(x).sum().backward()
        watch.take()            # tensor(0.) on the device; > 0 when an input, weight or output gradient held inf/NaN
        watch.amaxes()          # {"blocks.0.fc1": {"input_amax": ..., "weight_amax": ..., "grad_amax": ...}}

    Before each training forward (grad enabled, module in train mode) of a watched layer: the amax (``max |x|``) of
    its input and of its weight, one reduction each; in backward, that of its output gradient (a tensor hook on the
    output). The hooks only write into one buffer made at :meth:`attach` (per layer: the last amaxes, and their
    running maximum since the last :meth:`take`, where a NaN or inf stays), so they hold no Python state a compiled
    model would trace as a side effect; :meth:`take` turns the running maxima into the flag in three kernels, on
    the device: no host sync.
    """

    mode = "hooks"
    _NAMES = ("input_amax", "weight_amax", "grad_amax")

    def __init__(self) -> None:
        self._buffer: Optional[Tensor] = None  # (layers, 2, 3): [last, running max] x [input, weight, grad]
        self._names: list[str] = []
        self._handles: list[Any] = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, layers: dict[str, nn.Module]) -> str:
        """Watch ``layers`` (``{fqn: Float8Linear}``, on one device); returns the mode (``"hooks"``)."""
        self.detach()
        if not layers:
            return self.mode
        first: Any = next(iter(layers.values()))
        device = first.weight.device
        self._buffer = torch.full((len(layers), 2, 3), -1.0, device=device)  # -1: not seen yet
        self._buffer[:, 1] = 0.0
        self._names = list(layers)
        for row, module in zip(self._buffer.unbind(0), layers.values()):
            self._handles.append(module.register_forward_pre_hook(functools.partial(_watch_before, row)))
            self._handles.append(module.register_forward_hook(functools.partial(_watch_after, row)))
        return self.mode

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._buffer, self._names = None, []

    def take(self) -> Optional[Tensor]:
        """How many amaxes were inf/NaN since the last ``take`` (a new 0-dim float tensor on the device), and reset;
        ``None`` when nothing is watched."""
        if self._buffer is None:
            return None
        running = self._buffer[:, 1]
        flag = (~torch.isfinite(running)).sum().float()
        running.zero_()
        return flag

    def amaxes(self) -> dict[str, dict[str, float]]:
        """The last amaxes per layer as floats (one host read for all); a layer not run yet is left out."""
        if self._buffer is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for fqn, values in zip(self._names, self._buffer[:, 0].tolist()):
            seen = {name: v for name, v in zip(self._NAMES, values) if v != -1.0}
            if seen:
                out[fqn] = seen
        return out


def _record(row: Tensor, slots: slice, amax: Tensor) -> None:
    """``amax`` (1-D) into the row's last values and its running maximum (NaN kept: ``maximum`` propagates it)."""
    row[0, slots].copy_(amax)
    torch.maximum(row[1, slots], amax, out=row[1, slots])


def _watch_before(row: Tensor, module: nn.Module, args: tuple) -> None:
    if not (module.training and torch.is_grad_enabled()) or not args or not isinstance(args[0], Tensor):
        return None
    x, weight = args[0], getattr(module, "weight", None)
    with torch.no_grad():
        # (not FSDP2's FP8-gathered weight: cast already)
        if isinstance(weight, Tensor) and type(weight) in (Tensor, nn.Parameter):
            both = torch.stack([torch.linalg.vector_norm(x.detach(), math.inf).float(),
                                torch.linalg.vector_norm(weight.detach(), math.inf).float()])  # fmt: skip
            _record(row, slice(0, 2), both)
        else:
            _record(row, slice(0, 1), torch.linalg.vector_norm(x.detach(), math.inf).float().reshape(1))
    return None


def _watch_after(row: Tensor, module: nn.Module, args: tuple, output: Any) -> None:
    if module.training and torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad:
        output.register_hook(functools.partial(_watch_grad, row))
    return None


def _watch_grad(row: Tensor, grad: Tensor) -> None:
    with torch.no_grad():
        _record(row, slice(2, 3), torch.linalg.vector_norm(grad, math.inf).float().reshape(1))


# --------------------------------------------------------------------------------------------- everything together
class TorchAOFloat8:
    """FP8 training of one model through torchao's float8: checks, layer swap, compiled layers, state.

    Example::

        fp8 = TorchAOFloat8({"backend": "torchao", "recipe": "tensorwise"})
        report = fp8.convert(model, device="cuda")
        with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
            loss = model(x)

    The :class:`~lightning_mp.fp8.backend.FP8Backend` for ``fp8={"backend": "torchao"}``, with
    :class:`~lightning_mp.fp8.runtime.FP8Training`'s public surface (see the module docstring for what it decides).

    Args:
        config: an :class:`FP8Config` (``backend="torchao"``), a dict of its fields, or ``None`` for the defaults.
        compile_layers: compile each ``Float8Linear``'s forward: ``None`` (the default) when the device is CUDA and
            the model is not compiled already, ``True`` always, ``False`` never.
    """

    name = "torchao"

    def __init__(
        self, config: Union[FP8Config, dict[str, Any], None] = None, *, compile_layers: Optional[bool] = None
    ) -> None:
        self.config = FP8Config.from_value(config if config is not None else {"backend": "torchao"})
        if self.config.backend != "torchao":
            raise ValueError(
                f"TorchAOFloat8 runs fp8 backend='torchao', got backend={self.config.backend!r}: use"
                " lightning_mp.fp8.backend.make_backend(config), which picks the backend the config names."
            )
        if self.config.weights == "fp8" and self.config.recipe != "tensorwise":
            raise ValueError(_FP8_WEIGHTS_TENSORWISE_ONLY)
        #: the dtype the model's weights are kept in ("auto" used alone: bf16; the plugins settle it per strategy and
        #: master weights, :func:`lightning_mp.fp8.config.settle_weights`)
        self.weights = "bf16" if self.config.weights == "auto" else str(self.config.weights)
        self.compile_layers = compile_layers
        #: the torch.compile backend of the layers' forwards (tests use "eager" or "aot_eager")
        self.compile_backend = "inductor"
        self.report: Optional[TorchAOConversionReport] = None
        #: finds inf/NaN reaching the FP8 casts (see :class:`Float8Watch`)
        self.sentinel = Float8Watch()
        self._route = ForwardRoute()
        self._model: Optional[nn.Module] = None
        self._layers: dict[str, nn.Module] = {}
        self._optimizers: list[Any] = []
        #: the FP8 layers whose weights FSDP2 gathers in FP8 (``weights="fp8"``, set at :meth:`connect_optimizers`):
        #: their scales are computed after each optimizer step
        self._fp8_gathered: Optional[nn.ModuleList] = None
        self._released = False

    # ------------------------------------------------------------------ set-up
    @property
    def model(self) -> Optional[nn.Module]:
        """The model :meth:`convert` swapped (or :meth:`adopt` took), if any."""
        return self._model

    @property
    def layers(self) -> dict[str, nn.Module]:
        """``{fqn: Float8Linear}`` of the model taken."""
        return dict(self._layers)

    def check(self, device: Union[str, torch.device]) -> None:
        """Raise :class:`FP8UnavailableError` saying why this recipe cannot run on ``device``, and what to use.

        Example::

            TorchAOFloat8({"backend": "torchao"}).check("cpu")   # FP8UnavailableError: ... Use precision='fp32'
        """
        problem = torchao_support_problem(**torchao_support_facts(device, str(self.config.recipe)))
        if problem:
            raise FP8UnavailableError(problem)

    def linear_config(self) -> Any:
        """torchao's ``Float8LinearConfig`` for this run (the recipe; ``weights="fp8"``: FSDP2's FP8 all-gather)."""
        self._check_weights()
        return float8_linear_config(str(self.config.recipe), fsdp_float8_all_gather=self.weights == "fp8")

    def _check_weights(self) -> None:
        if self.weights not in _WEIGHTS:
            raise ValueError(
                f"fp8 weights={self.weights!r} is invalid. Accepted values: {', '.join(map(repr, _WEIGHTS))}."
            )
        if self.weights == "fp8" and self.config.recipe != "tensorwise":
            raise ValueError(_FP8_WEIGHTS_TENSORWISE_ONLY)

    def convert(
        self,
        model: nn.Module,
        device: Union[str, torch.device, None] = None,
        *,
        module_filter_fn: Optional[ModuleFilterFn] = None,
        announce: Optional[Callable[[str], None]] = None,
        cast_weights: bool = True,
    ) -> TorchAOConversionReport:
        """Check the hardware, swap the layers, set the weights dtype, route the layers' forwards.

        Args:
            model: converted in place (the parameters stay the same objects).
            device: the device training runs on (``None``: the current CUDA device); checked first.
            module_filter_fn: an extra ``(module, fqn) -> bool`` rule (torchao style).
            announce: where the one-line summary goes (e.g. Lightning's ``rank_zero_info``); ``None`` logs it
                at INFO on the ``lightning_mp.fp8`` logger. The module-by-module list is logged at DEBUG.
            cast_weights: with ``weights="bf16"``, cast the model's weights (outside FP32 guards) to bf16 here;
                ``False``: the caller casts (the plugins do, keeping the exact fp32 values for the master weights).
        """
        device = torch.device(device) if device is not None else torch.device("cuda")
        self.check(device)
        linear_config = self.linear_config()
        compiled = self._decide_compile(model, device)
        report = convert_to_torchao(
            model, config=self.config, linear_config=linear_config, module_filter_fn=module_filter_fn,
            weights=self.weights, compiled=compiled, announce=announce,
        )  # fmt: skip
        if cast_weights:
            apply_weights_dtype(model, self.weights)
        self.report = report
        if not report.converted and not report.already_te:
            warnings.warn(
                "precision='fp8' (backend='torchao') converted no nn.Linear layer, so nothing runs in FP8 and the run"
                f" is bf16 with FP8's overhead ({report.summary()}). Use precision='bf16', or relax the fp8 layer"
                " filter (size_rule='off', keep_last=0, include/exclude).",
                stacklevel=2,
            )
        self._take(model, compiled)
        return report

    def _decide_compile(self, model: nn.Module, device: torch.device) -> bool:
        if self.compile_layers is not None:
            return bool(self.compile_layers)
        return device.type == "cuda" and not model_is_compiled(model)

    def adopt(self, model: nn.Module, device: Union[str, torch.device, None] = None) -> int:
        """Take ``model`` as the FP8 model without swapping anything: its layers are ``Float8Linear`` already
        (converted by :meth:`convert` on a part of it, e.g. in ``configure_model`` before FSDP2 shards it, or built
        so). Checks the hardware, routes the layers' forwards; returns how many ``Float8Linear`` it has.
        """
        where = torch.device(device) if device is not None else torch.device("cuda")
        self.check(where)
        self._check_weights()
        compiled = self._route.compile if self._model is not None else self._decide_compile(model, where)
        self._take(model, compiled)
        return len(self._layers)

    def _take(self, model: nn.Module, compiled: bool) -> None:
        """``model`` is the FP8 model from now on: its layers' forwards go through the route."""
        watching = self.sentinel.attached
        self.sentinel.detach()
        self._route.compile, self._route.backend = compiled, self.compile_backend
        self._route.fp8 = True
        self._layers = float8_linears(model)
        self._model = model
        self._route_layers()
        if watching:
            self.sentinel.attach(self._layers)

    def _route_layers(self) -> None:
        """Each layer's forward through the route (again after :meth:`release`: the next fit of the same model)."""
        for module in self._layers.values():
            module.forward = functools.partial(_float8_forward, self._route, module)
        self._released = False

    def is_converted(self, module: nn.Module) -> bool:
        """Whether ``module`` holds torchao ``Float8Linear`` layers (swapped earlier, or built so)."""
        return any(is_float8_linear(m) for m in module.modules())

    def connect_optimizers(self, optimizers: list[Any]) -> int:
        """Nothing to seed (the optimizers step the model's own parameters): returns 0. With ``weights="fp8"``,
        checks that the FP8 layers are sharded by FSDP2, whose all-gather is what FP8 weights change, and finds the
        layers whose scales :meth:`weights_updated` computes (scales kept from an earlier fit are dropped: the
        weights may have been loaded since).

        Raises ``ValueError`` for ``weights="fp8"`` without FSDP2.
        """
        self._optimizers = list(optimizers)
        if self._released:
            self._route_layers()
        self._drop_fp8_gather_scales()
        self._fp8_gathered = None
        if self.weights == "fp8" and self._layers:
            sharded = any(type(m.weight).__name__ == "DTensor" for m in self._layers.values())
            if not sharded:
                raise ValueError(
                    "fp8 weights='fp8' with backend='torchao' is FSDP2's float8 all-gather (fp32 shards gathered in"
                    " FP8), but the model's FP8 layers are not sharded by FSDP2. Use ModelParallelStrategy (call"
                    " lightning_mp.prepare_fp8(self) in configure_model before fully_shard), or weights='auto'."
                )
            gathered = [m for m in self._layers.values() if _fp8_gather_weight(m) is not None]
            self._fp8_gathered = nn.ModuleList(gathered) if gathered else None
        return 0

    def _drop_fp8_gather_scales(self) -> None:
        """Forget the FP8 gathers' precomputed scales: the next gather computes each weight's from its values."""
        for module in self._layers.values():
            weight = _fp8_gather_weight(module)
            if weight is not None:
                weight._precomputed_scale = None

    def prepare_fsdp(self, fsdp_root: nn.Module) -> None:
        """FSDP (1) wrapped the model: ``Float8Linear`` keeps plain parameters, which FSDP gathers in their own dtype;
        nothing to do. ``weights="fp8"`` (FSDP2's FP8 all-gather) is refused.

        Raises ``ValueError`` for ``weights="fp8"``.
        """
        if self.weights == "fp8":
            raise ValueError(
                "fp8 weights='fp8' with backend='torchao' is FSDP2's float8 all-gather, which FSDP (1) does not run."
                " Use ModelParallelStrategy (FSDP2), or weights='auto'."
            )

    def configure_weight_cache(self, *, accumulate_grad_batches: int = 1, automatic_optimization: bool = True) -> bool:
        """No cache: torchao casts the weights in each forward (compiled, the cast fuses with the amax). False."""
        return False

    # ------------------------------------------------------------------ per step
    def autocast(self, training: bool = True) -> Any:
        """The FP8 region for one step: the layers run FP8 in training, and in evaluation with ``fp8_in_eval``;
        otherwise ``F.linear`` in the surrounding autocast dtype (bf16). torchao needs no autocast of its own.

        Example::

            with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=False):
                val_loss = model(x)        # bf16 unless fp8_in_eval=True
        """
        if self._released:  # a later fit, validate or predict of the model released at the last teardown
            self._route_layers()
        on = training or self.config.fp8_in_eval or self.weights == "fp8"
        return _Region(self._route, on)

    def weights_updated(self) -> None:
        """After each optimizer step. FSDP2's FP8 all-gather (``weights="fp8"``): every gathered FP8 weight's scale
        for the next gathers, from the weights the step wrote, in one all-reduce for all of them (torchao's
        ``precompute_float8_dynamic_scale_for_fsdp``; on the device, no host sync). Otherwise nothing to expire:
        torchao scales the weights from their current values in every forward."""
        if self._fp8_gathered is not None:
            import_float8().precompute_float8_dynamic_scale_for_fsdp(self._fp8_gathered)

    def watch_saturation(self, on: bool = True) -> Optional[str]:
        """Start (or stop) the saturation watch on the converted layers; returns its mode (``"hooks"``) or ``None``.

        Example::

            fp8.watch_saturation()
            ...backward...
            flag = fp8.sentinel.take()              # > 0: an FP8 operand held inf/NaN: skip this step
        """
        self.sentinel.detach()
        if not on or not self.config.check_saturation or not self._layers:
            return None
        if self._model is not None and model_is_compiled(self._model) and torch.cuda.is_available():
            # Inductor (torch 2.11, CUDA) fails to compile a whole model whose FP8 layers carry the watch's forward
            # hooks (measured on an H200: "Argument ... was used before it has been defined"); per-layer compiling
            # and eager models take them. The gradients' inf/NaN check still runs.
            warnings.warn(
                "MPPlugin('fp8', fp8={'backend': 'torchao'}): the model is compiled, and torch.compile cannot compile"
                " the saturation watch's hooks inside it, so steps whose FP8 casts clamp an inf are not detected"
                " (inf/NaN gradients still skip the step). Pass fp8={'check_saturation': False} to say so, or leave"
                " the model uncompiled (the plugin then compiles each FP8 layer itself, with the watch).",
                stacklevel=2,
            )
            return None
        return self.sentinel.attach(self._layers)

    def layer_stats(self) -> dict[str, dict[str, float]]:
        """Per FP8 layer, the last amaxes the saturation watch read: ``input_amax``, ``weight_amax`` (training
        forwards) and ``grad_amax`` (the output gradient). ``{}`` while the watch is off.

        Dynamic scaling maps each tensor's (rowwise: each row's) amax onto the FP8 maximum, so no finite value
        saturates; the share of values that underflow would need one more pass over every tensor and is not
        computed. One host read per call.
        """
        if not self.sentinel.attached:
            return {}
        return self.sentinel.amaxes()

    # ------------------------------------------------------------------ checkpoints
    def recipe_settings(self) -> dict[str, Any]:
        """The recipe as plain values: its name, torchao's FP8 formats (input, weight, output gradient) and the
        precision of the weight-gradient GEMM (``"fp8"``, or ``"high"`` for ``rowwise_with_gw_hp``).

        Example::

            TorchAOFloat8({"backend": "torchao", "recipe": "rowwise_with_gw_hp"}).recipe_settings()
            # {'recipe': 'rowwise_with_gw_hp', 'input': 'e4m3fn', 'weight': 'e4m3fn', 'grad_output': 'e4m3fn',
            #  'grad_weight_gemm': 'high'}
        """
        recipe = str(self.config.recipe)
        i, w, g = RECIPE_FORMATS[recipe]
        gemm = "high" if recipe in HIGH_PRECISION_GRAD_WEIGHT else "fp8"
        return {"recipe": recipe, "input": i, "weight": w, "grad_output": g, "grad_weight_gemm": gemm}

    def state_dict(self) -> dict[str, Any]:
        """The recipe and torchao's version: dynamic scaling keeps no state. Plain strings and numbers."""
        return {
            "format": STATE_FORMAT,
            "backend": "torchao",
            "recipe": self.recipe_settings(),
            "torchao_version": torchao_version(),
        }

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Check :meth:`state_dict`'s output; warns when the checkpoint was written with another recipe or backend
        (nothing to restore either way: dynamic scaling recomputes every scale; FP8 gathers' precomputed scales are
        dropped, as the checkpoint's weights come with it)."""
        self._drop_fp8_gather_scales()
        if not state:
            return
        if not isinstance(state, dict) or not isinstance(state.get("recipe"), dict):
            raise ValueError(
                f"The checkpoint's FP8 state is corrupted: expected a dict with 'recipe', got {state!r:.200}."
            )
        backend = state.get("backend", "transformer_engine")
        was, now = state["recipe"].get("recipe"), self.config.recipe
        if backend != "torchao":
            warnings.warn(
                f"MPPlugin: the checkpoint's FP8 state was written by backend={backend!r} (recipe={was!r}) and training"
                f" resumes with backend='torchao' (recipe={now!r}): its scaling state does not apply and is dropped;"
                " torchao computes every scale from the current tensors.",
                stacklevel=2,
            )
            return
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"The checkpoint's torchao FP8 state has format={state.get('format')!r}; this version reads"
                f" format={STATE_FORMAT}."
            )
        if was != now:
            warnings.warn(
                f"MPPlugin: the checkpoint's FP8 state was written with recipe={was!r} and training resumes with"
                f" recipe={now!r}: torchao's recipes keep no state, so nothing is restored; the FP8 numerics change"
                " from here.",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ teardown
    def release(self) -> None:
        """Undo what the run installed on the model: the saturation watch's hooks and the layers' forward route
        (the layers stay ``Float8Linear``, running torchao's own forward). The route comes back at the next
        :meth:`connect_optimizers` or :meth:`autocast` (the same model in a later ``fit``/``validate``)."""
        self.sentinel.detach()
        self._drop_fp8_gather_scales()
        self._fp8_gathered = None
        for module in self._layers.values():
            module.__dict__.pop("forward", None)
        self._route.fp8 = True
        self._released = bool(self._layers)
