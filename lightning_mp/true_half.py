"""Which master weights a true-half run (``bf16-true``/``fp16-true``) gets, made for the run's optimizers."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.distributed import world_size
from lightning_mp.guards import fp32_guard_of
from lightning_mp.fp8.primary import is_quantized
from lightning_mp.master import (
    FP32MasterWeights,
    MasterWeights,
    cast_module_,
    downcast_kept_,
    keeps_own_masters,
    make_master_weights,
    seed_optimizer_masters,
    upcast_kept_,
)
from lightning_mp.modes import PrecisionMode
from lightning_mp.settings import MasterKind


def cast_weights_(module: nn.Module, mode: Optional[PrecisionMode], guarded: list[str]) -> Callable[[], object]:
    """True-half modes: the weights outside the FP32 guards become half precision (in place). In every mode the
    guarded modules' weights are fp32 (a model the user cast to half included). Returns what the run's end does:
    in true-half modes the guarded modules' weights become half too, as Lightning's plugin leaves the module."""
    if mode is not None and mode.true_half:
        assert mode.param_dtype is not None  # true_half: a half param_dtype
        cast_module_(module, mode.param_dtype, keep_fp32=guarded)
        return functools.partial(downcast_kept_, module, mode.param_dtype, guarded)
    upcast_kept_(module, guarded)
    return _nothing


def _nothing() -> None:
    pass


#: the settled ``fp8={"weights": ...}`` layouts that keep half-precision weights (and so get master weights)
HALF_FP8_LAYOUTS = ("bf16", "mixed")


def cast_half_weights_(module: nn.Module, dtype: torch.dtype, keep_fp32: Iterable[str] = ()) -> int:
    """The weights outside the FP32 guards installed on ``module`` and outside the submodules ``keep_fp32`` names
    become ``dtype`` (in place, the fp32 values kept for master weights made later, as :func:`cast_weights_` in
    true-half modes); returns how many tensors."""
    guarded = [name for name, sub in module.named_modules() if name and fp32_guard_of(sub) is not None]
    return cast_module_(module, dtype, keep_fp32=[*guarded, *keep_fp32])


def fp8_layer_names(module: nn.Module, holds_fp8: Callable[[nn.Module], bool]) -> list[str]:
    """The names of ``module``'s FP8 layers: the submodules that hold FP8 GEMMs (``holds_fp8``, the backend's
    ``is_converted``) while none of their children does."""
    return [
        name for name, sub in module.named_modules()
        if name and holds_fp8(sub) and not any(holds_fp8(child) for child in sub.children())
    ]


class MasterWeightsSetup:
    """The ``master_weights`` option (checked in :mod:`lightning_mp.settings`) and the master weights it made (kept
    across ``fit`` calls of one plugin)."""

    def __init__(self, asked: Optional[str], fp8_weights: str = "bf16", host: str = "MPPlugin") -> None:
        self.asked = asked
        self.host = host  # the plugin class its messages name
        #: the dtype fp8 keeps the model's weights in (settled at set-up): bf16 gets master weights as true-half does
        self.fp8_weights = fp8_weights
        self.found: Optional[str] = None  # "optimizer" when unset and every optimizer keeps its own masters
        self.masters: Optional[MasterWeights] = None

    def half_weights(self, mode: Optional[PrecisionMode]) -> bool:
        """Whether ``mode`` trains half-precision weights (true-half modes; fp8 with bf16 weights, all or outside
        the FP8 layers)."""
        return mode is not None and (mode.true_half or (mode.fp8 and self.fp8_weights in HALF_FP8_LAYOUTS))

    def kind(self, mode: Optional[PrecisionMode]) -> Optional[str]:
        if not self.half_weights(mode):
            return None
        return self.asked or self.found or "fp32"

    def connect(
        self,
        mode: PrecisionMode,
        model: nn.Module,
        optimizers: list[Optimizer],
        *,
        fsdp: bool,
        device: Optional[torch.device] = None,
    ) -> Optional[MasterWeights]:
        """The master weights for this run's optimizers (``None``: the optimizers step the parameters), on
        ``device`` (masters kept from an earlier fit waited on the CPU)."""
        _warn_redundant_optimizer_masters(mode, optimizers, self.host)
        if not self.half_weights(mode) or fsdp:
            return None  # (under FSDP the fp32 shards are the master weights)
        if self._optimizer_keeps_masters(mode, optimizers):
            return None
        kind = MasterKind.of(self.kind(mode))
        assert kind is not None  # half weights
        if not kind.ours:  # ("none": the optimizer steps the half weights; "optimizer" returned above)
            if mode.needs_scaler:
                _warn_eps_underflow(optimizers, self.host)
            return None
        if self.masters is None or self.masters.kind != kind.name:
            self.masters = make_master_weights(kind.name)
        masters = self.masters
        assert masters is not None  # "none" and "optimizer" (no masters of ours) returned above
        if device is not None:
            masters.to_(device)  # (before they are compared with the weights, and broadcast under DDP)
        masters.name_parameters(model)
        for opt in optimizers:
            masters.attach(opt)
        if optimizers:  # (validate/test/predict connect no optimizer: the masters of the trained model are kept)
            masters.forget_others(p for opt in optimizers for g in opt.param_groups for p in g["params"])
        if isinstance(masters, FP32MasterWeights) and world_size() > 1:
            masters.broadcast_(src=0)  # ranks initialised differently: rank 0's weights, as DDP's, in fp32
        return masters

    def _optimizer_keeps_masters(self, mode: PrecisionMode, optimizers: list[Optimizer]) -> bool:
        self.found = None
        own = [keeps_own_masters(opt) for opt in optimizers]
        names = ", ".join(sorted({type(opt).__name__ for opt in optimizers}))
        if self.asked == "optimizer":
            if not all(own):
                raise MisconfigurationException(
                    f"{self.host}(precision={mode.name!r}, master_weights='optimizer') needs optimizers that keep fp32"
                    f" master weights themselves, but {names} does not (no master_weights=True). Use Transformer"
                    " Engine's FusedAdam(params, master_weights=True), or master_weights='fp32' (the default) with"
                    " any optimizer."
                )
        elif self.asked is None and own and all(own):
            self.found = "optimizer"
            rank_zero_info(
                f"{self.host}({mode.name!r}): {names} keeps fp32 master weights itself (master_weights=True):"
                " master_weights='optimizer', no second copy."
            )
        elif any(own):
            raise MisconfigurationException(
                f"{self.host}(precision={mode.name!r}, master_weights={self.kind(mode)!r}) with {names}, which keeps"
                " fp32 master weights itself (master_weights=True): there would be two sets of masters"
                + (" or none where the optimizer steps half weights" if not all(own) else "")
                + ". Use master_weights='optimizer' (or leave it unset) with such an optimizer, or master_weights=False"
                " in the optimizer."
            )
        else:
            return False
        seeded = sum(seed_optimizer_masters(opt) for opt in optimizers)
        if seeded:
            rank_zero_debug(f"{self.host}: {seeded} optimizer-held master weights start from the exact fp32 weights.")
        return True

    def namer(self, model: Any) -> Callable[[Tensor], Optional[str]]:
        """Names of what the optimizer steps: a model parameter, or the fp32 stand-in of a half one."""
        names = {id(p): n for n, p in model.named_parameters()} if hasattr(model, "named_parameters") else {}
        return _Namer(names, self.masters)


class _Namer:
    """Picklable: the plugin travels to spawned processes (``ddp_spawn``)."""

    def __init__(self, names: dict[int, str], masters: Optional[MasterWeights]) -> None:
        self.names, self.masters = names, masters

    def __call__(self, tensor: Tensor) -> Optional[str]:
        name = self.names.get(id(tensor))
        if name is None and self.masters is not None:
            param = self.masters.param_of(tensor)
            name = self.names.get(id(param)) if param is not None else None
        return name


def _warn_eps_underflow(optimizers: list[Optimizer], host: str) -> None:
    """fp16 weights without masters: an optimizer ``eps`` below fp16's smallest value is 0 in its fp16 state."""
    tiny = torch.finfo(torch.float16).smallest_normal * 2.0**-10  # the smallest fp16 subnormal, ~6e-8
    for opt in optimizers:
        for group in opt.param_groups:
            eps = group.get("eps")
            if isinstance(eps, float) and 0 < eps < tiny:
                rank_zero_warn(
                    f"{host}(precision='fp16-true', master_weights='none'): the optimizer's eps={eps:g} is 0 in the"
                    " fp16 optimizer state, so a parameter whose gradient is 0 gets 0/0 = NaN on the first step."
                    " Use master_weights='fp32' (the default), or eps >= 1e-7 (e.g. 1e-4)."
                )
                return


def _warn_redundant_optimizer_masters(mode: PrecisionMode, optimizers: list[Optimizer], host: str) -> None:
    """An optimizer that keeps fp32 masters of parameters that are fp32 already holds a second fp32 copy."""
    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"]]
        plain = all(p.dtype == torch.float32 and not is_quantized(p) for p in params)  # (FP8 weights: fp32 nominal)
        if keeps_own_masters(opt) and params and plain:
            way = (
                "fp8={'weights': 'bf16'} (the optimizer's masters are then the fp32 copy)"
                if mode.fp8
                else "precision='bf16-true' (its masters are then the fp32 copy)"
            )
            rank_zero_warn(
                f"{host}({mode.name!r}): {type(opt).__name__} keeps fp32 master weights itself (master_weights=True),"
                " but the parameters it steps are fp32 already, so it holds a second fp32 copy of every weight"
                f" (4 bytes a parameter for nothing). Use {way}, or master_weights=False in the optimizer."
            )
            return
