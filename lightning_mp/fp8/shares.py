"""Per FP8 layer, the share of values its FP8 casts saturate or flush to zero, measured in the steps asked for.

Example::

    from lightning_mp.fp8.shares import FP8ShareProbe

    probe = FP8ShareProbe(fp8)        # fp8: an FP8Backend that converted the model
    probe.arm()                       # hooks on every FP8 layer, for the next training step
    with fp8.autocast(training=True):
        model(x).sum().backward()
    probe.read()   # {"blocks.0.fc1": {"saturated_input": 0.0, "underflow_input": 0.013, ..., "underflow_grad": 0.2}}

``MPPlugin("fp8")`` hands a probe to :class:`~lightning_mp.stats.StepStats` (``arm_fp8_shares`` /
``fp8_shares``), and ``PrecisionMonitor(fp8_layers=True)`` arms it on the steps it logs only.

What is measured, per FP8 layer and tensor (``input``: the layer's input, ``weight``, ``grad``: the output gradient):
each tensor is scaled as the backend scales it for its cast: with Transformer Engine's delayed scaling by the
module's own ``fp8_meta`` scale (read when the tensor reaches the layer: the scale the cast uses); with dynamic
scaling (Transformer Engine's ``current``, torchao's tensorwise and rowwise) by the format's maximum over the
tensor's (rowwise: each row's) amax, rounded down to a power of two where torchao's config says so. Then

- ``saturated_<tensor>``: the share of its elements whose scaled magnitude exceeds the format's maximum (clipped to
  it), inf and NaN included (dynamic scaling maps the amax onto the maximum: it saturates nothing else);
- ``underflow_<tensor>``: the share of its non-zero elements whose scaled magnitude is at most half the format's
  smallest subnormal: the cast rounds them to zero.

Formats: E4M3 (max 448, smallest subnormal 2**-9) for inputs and weights, E5M2 (57344, 2**-16) for gradients where
the recipe says HYBRID (Transformer Engine) or torchao's config casts them to E5M2 (tensorwise); E4M3 everywhere else.
Transformer Engine's block and mxfp8 recipes scale each block of 32 or 128 values from itself: not measured (no
figures). A ``LayerNorm*`` module's input is normalized before its cast: its ``input`` figures are left out.

Cost: nothing until :meth:`FP8ShareProbe.arm`; in the armed step, per FP8 layer and tensor, one pass of a few
element-wise kernels on the device (a float32 copy of the tensor and two masks at a time), counts kept on the
device; one host read in :meth:`FP8ShareProbe.read`, which takes the hooks off. The figures are this process's (a
rank's own batch, a sharded weight's local shard). Nothing here imports Transformer Engine or torchao.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

#: the tensors of an FP8 layer that are cast, in the order of the counts
TENSORS = ("input", "weight", "grad")
#: torchao's smallest amax (``torchao.float8.float8_utils.EPS``): the scale of an all-zero tensor stays finite
_AMAX_FLOOR = 1e-12
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class TensorCast(NamedTuple):
    """How one tensor of a layer is cast to FP8.

    ``kept``: the backend's own scale (a device scalar or a number, read when the tensor arrives: delayed scaling);
    ``None``: dynamic scaling, the format's maximum over the tensor's amax (``rowwise``: each row's, over the last
    dimension), rounded down to a power of two with ``pow2``.
    """

    dtype: torch.dtype
    rowwise: bool = False
    pow2: bool = False
    kept: Optional[Callable[[], Union[Tensor, float]]] = None

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def flush(self) -> float:
        """Half the format's smallest subnormal: a scaled magnitude at most this becomes zero."""
        info = torch.finfo(self.dtype)
        return float(info.smallest_normal * info.eps) / 2


#: a layer's casts, one per name in ``TENSORS`` (``None``: that tensor is not cast, or not measured)
LayerCasts = tuple[Optional[TensorCast], Optional[TensorCast], Optional[TensorCast]]


def lost_counts(x: Tensor, cast: TensorCast) -> Tensor:
    """``[saturated, flushed to zero, non-zero]`` element counts of ``x`` cast as ``cast`` says (int64, on ``x``'s
    device; no host sync)."""
    with torch.no_grad():
        a = _local(x).detach().abs().float()  # (a copy: scaled in place below)
        n = a.numel()
        nonzero = torch.count_nonzero(a)  # (counts without writing a mask)
        if cast.kept is not None:
            scale: Union[Tensor, float] = cast.kept()
            scale = scale.detach().float() if isinstance(scale, Tensor) else float(scale)
        else:
            # (a dynamic scale maps the amax onto the maximum: only inf and NaN go beyond it, and a float32 rounding)
            saturated = n - torch.count_nonzero(torch.isfinite(a))
            amax = a.amax(dim=-1, keepdim=True) if cast.rowwise and a.dim() > 0 else a.amax()
            scale = (cast.max / amax.double().clamp(min=_AMAX_FLOOR)).float()  # (as torchao: in float64)
            if cast.pow2:
                scale = torch.exp2(torch.floor(torch.log2(scale)))
        y = a.mul_(scale)
        if cast.kept is not None:  # beyond the maximum, inf and NaN included
            saturated = n - torch.count_nonzero(y <= cast.max)
        # at most half the smallest subnormal, zeros left out (a NaN scale: none, and a negative difference)
        flushed = (torch.count_nonzero(y <= cast.flush) - (n - nonzero)).clamp_(min=0)
        return torch.stack([saturated, flushed, nonzero])


class FP8ShareProbe:
    """Measures, in the step it is armed for, the shares of each FP8 layer's values that saturate or underflow
    (see the module docstring).

    Args:
        layers: ``{layer name: (module, its casts)}`` of the run, asked at each :meth:`arm` (the model may be
            converted after the probe is made); or an FP8 backend (``FP8Backend``), whose layers
            :func:`backend_layers` finds.
    """

    def __init__(self, layers: Union[Callable[[], dict[str, tuple[nn.Module, LayerCasts]]], Any]) -> None:
        self._layers = layers if callable(layers) else functools.partial(backend_layers, layers)
        self._names: list[str] = []
        self._casts: list[LayerCasts] = []
        self._handles: list[Any] = []
        self._counts: Optional[Tensor] = None  # (layers, tensors, [saturated, flushed, non-zero]) on the device
        self._numel: list[list[int]] = []  # elements seen, per layer and tensor (the host knows them)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # (a copy is not armed: its hooks would be the original's)
        state.update(_names=[], _casts=[], _handles=[], _counts=None, _numel=[])
        return state

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> bool:
        """Hook every FP8 layer for the next training step (again while armed: the counts go on); returns whether
        there is a layer to measure."""
        if self._handles:
            return True
        layers = self._layers()
        if not layers:
            return False
        first = next(iter(layers.values()))[0]
        device = next((p.device for p in first.parameters()), torch.device("cpu"))
        self._names, self._casts = list(layers), [casts for _, casts in layers.values()]
        self._counts = torch.zeros(len(layers), len(TENSORS), 3, dtype=torch.int64, device=device)
        self._numel = [[0] * len(TENSORS) for _ in layers]
        for index, (module, _) in enumerate(layers.values()):
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._before, index)))
            self._handles.append(module.register_forward_hook(functools.partial(self._after, index)))
        return True

    def disarm(self) -> None:
        """Take the hooks off and forget the counts."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._counts, self._numel = [], None, []

    def read(self) -> dict[str, dict[str, float]]:
        """The shares since :meth:`arm`, per layer ``{"saturated_<tensor>": ..., "underflow_<tensor>": ...}`` for
        each tensor seen (one host read), and :meth:`disarm`. ``{}`` when not armed."""
        counts, numel, names = self._counts, self._numel, self._names
        self.disarm()
        if counts is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for name, per_tensor, seen in zip(names, counts.tolist(), numel):
            figures = {}
            for tensor, (saturated, flushed, nonzero), n in zip(TENSORS, per_tensor, seen):
                if n:
                    figures[f"saturated_{tensor}"] = saturated / n
                    figures[f"underflow_{tensor}"] = flushed / nonzero if nonzero else 0.0
            if figures:
                out[name] = figures
        return out

    # ------------------------------------------------------------------ hooks (the armed step only)
    def _count(self, index: int, slot: int, x: Tensor) -> None:
        cast, x = self._casts[index][slot], _local(x)
        if cast is None or self._counts is None or not x.is_floating_point() or x.numel() == 0:
            return
        self._counts[index, slot].add_(lost_counts(x, cast).to(self._counts.device))
        self._numel[index][slot] += x.numel()

    def _before(self, index: int, module: nn.Module, args: tuple) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if args and isinstance(args[0], Tensor):
            self._count(index, 0, args[0])
        weight = getattr(module, "weight", None)
        # (an FP8 weight, e.g. FSDP2's FP8 all-gather or FP8 primary weights, is cast already)
        if isinstance(weight, Tensor) and (type(weight) in (Tensor, nn.Parameter) or hasattr(weight, "to_local")):
            self._count(index, 1, weight)

    def _after(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if module.training and isinstance(out, Tensor) and out.requires_grad and self._casts[index][2] is not None:
            out.register_hook(functools.partial(self._grad, index))

    def _grad(self, index: int, grad: Tensor) -> None:
        if self._counts is not None:  # (a gradient arriving after read: not this step's)
            self._count(index, 2, grad)


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallelism): the counts stay local, no collective."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


# --------------------------------------------------------------------------------------------- the backends' layers
def backend_layers(backend: Any) -> dict[str, tuple[nn.Module, LayerCasts]]:
    """The FP8 layers of ``backend``'s model and how each casts its tensors, from the backend's own state (duck-typed:
    torchao's ``Float8Linear.config``; Transformer Engine's ``fp8_meta`` and the run's recipe)."""
    if getattr(backend, "model", None) is None:
        return {}
    if getattr(backend, "name", None) == "torchao":
        return torchao_layers(getattr(backend, "layers", {}))
    config = backend.config
    return te_layers(backend.model, recipe=str(config.recipe), fp8_format=str(config.effective_format))


def torchao_layers(layers: dict[str, nn.Module]) -> dict[str, tuple[nn.Module, LayerCasts]]:
    """``{fqn: Float8Linear}`` with each layer's casts read from its ``config`` (``Float8LinearConfig``): the
    target dtype and granularity of ``cast_config_input``, ``_weight`` and ``_grad_output``, and
    ``round_scales_to_power_of_2``. The casts of the forward and the input gradient's GEMM (rowwise: along the
    last dimension of the input, the weight and the output gradient)."""
    out: dict[str, tuple[nn.Module, LayerCasts]] = {}
    for fqn, module in layers.items():
        config = getattr(module, "config", None)
        if config is None:
            continue
        pow2 = bool(getattr(config, "round_scales_to_power_of_2", False))
        cast_in, cast_w, cast_g = (_torchao_cast(getattr(config, f"cast_config_{name}", None), pow2)
                                   for name in ("input", "weight", "grad_output"))  # fmt: skip
        out[fqn] = (module, (cast_in, cast_w, cast_g))
    return out


def _torchao_cast(cast_config: Any, pow2: bool) -> Optional[TensorCast]:
    if cast_config is None or _enum_name(getattr(cast_config, "scaling_type", None)) == "DISABLED":
        return None
    dtype = getattr(cast_config, "target_dtype", None)
    rowwise = _enum_name(getattr(cast_config, "scaling_granularity", None)) == "AXISWISE"
    return TensorCast(dtype if isinstance(dtype, torch.dtype) else _E4M3, rowwise=rowwise, pow2=pow2)


def _enum_name(value: Any) -> Optional[str]:
    return getattr(value, "name", None)


def te_layers(model: nn.Module, *, recipe: str, fp8_format: str) -> dict[str, tuple[nn.Module, LayerCasts]]:
    """Transformer Engine's FP8 GEMM modules of ``model`` (a dict ``fp8_meta`` and a ``weight``), by the unwrapped
    model's names, with their casts: ``recipe="delayed"``: each module's ``fp8_meta`` scales (forward: input 0, weight
    1; backward: output gradient 0; 1.0, TE's first scale, before the module's first FP8 forward); ``"current"``:
    dynamic, per tensor. ``block`` and ``mxfp8``: none (per-block scales are not measured)."""
    from lightning_mp.fp8.runtime import named_modules_unwrapped

    if recipe not in ("delayed", "current"):
        return {}
    grad_dtype = _E5M2 if fp8_format.upper() == "HYBRID" else _E4M3
    out: dict[str, tuple[nn.Module, LayerCasts]] = {}
    for fqn, module in named_modules_unwrapped(model).items():
        if not isinstance(getattr(module, "fp8_meta", None), dict) or not isinstance(getattr(module, "weight", None),
                                                                                     Tensor):
            continue
        if recipe == "delayed":
            cast_in, cast_w, cast_g = (
                TensorCast(dtype, kept=functools.partial(_te_scale, module, key, index))
                for dtype, key, index in ((_E4M3, "scaling_fwd", 0), (_E4M3, "scaling_fwd", 1),
                                          (grad_dtype, "scaling_bwd", 0))
            )  # fmt: skip
        else:
            cast_in, cast_w, cast_g = TensorCast(_E4M3), TensorCast(_E4M3), TensorCast(grad_dtype)
        normalized = type(module).__name__.startswith("LayerNorm")  # (its input is normalized before the cast)
        out[fqn] = (module, (None if normalized else cast_in, cast_w, cast_g))
    return out


def _te_scale(module: nn.Module, key: str, index: int) -> Union[Tensor, float]:
    """The scale Transformer Engine's delayed scaling casts tensor ``index`` of ``key`` with, now (a device scalar)."""
    meta = getattr(module, "fp8_meta", None)
    state = meta.get(key) if isinstance(meta, dict) else None
    scale = getattr(state, "scale", None)
    return scale[index] if isinstance(scale, Tensor) and scale.numel() > index else 1.0
