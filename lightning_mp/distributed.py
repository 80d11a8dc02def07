"""DDP, FSDP and FSDP2 specifics: which strategy runs, what FSDP gathers and reduces, gradient compression, and
the fp32 sums of accumulated true-half gradients reduced across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_mp.modes import PrecisionMode
from lightning_mp.verdict import _is_dtensor
from lightning_mp.settings import REDUCE_DTYPES, MasterKind

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_fsdp(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FullyShardedDataParallel)


def is_strategy(strategy: Any, name: str) -> bool:
    """Whether ``strategy`` is Lightning's strategy class ``name`` (``False`` where this Lightning has none)."""
    from lightning.pytorch import strategies

    cls = getattr(strategies, name, None)
    return cls is not None and isinstance(strategy, cls)


def unwrap_lightning_module(model: Any) -> Optional[LightningModule]:
    seen = 0
    while not isinstance(model, LightningModule) and hasattr(model, "module") and seen < 8:
        model = model.module
        seen += 1
    return model if isinstance(model, LightningModule) else None


def strategy_of(module: Any) -> Any:
    lightning_module = unwrap_lightning_module(module)
    trainer = getattr(lightning_module, "_trainer", None) if lightning_module is not None else None
    return getattr(trainer, "strategy", None)


def root_device(module: Optional[LightningModule], model: Any) -> torch.device:
    trainer = getattr(module, "_trainer", None) if module is not None else None
    if trainer is not None:
        return trainer.strategy.root_device
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param.device if param is not None else torch.device("cpu")


def grads_synced(module: Any) -> bool:
    """False inside DDP's ``no_sync`` (accumulation): DDP still has to all-reduce the parameters' own gradients."""
    trainer = getattr(module, "_trainer", None)
    model = trainer.strategy.model if trainer is not None else None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return bool(model.require_backward_grad_sync)
    return True


def check_strategy(
    strategy: Any, mode: Optional[PrecisionMode], master_weights: Optional[str], fp8_config: Any = None
) -> bool:
    """Refuse what a strategy cannot run; returns whether it is Lightning's FSDP strategy (sharded scaler)."""
    if is_strategy(strategy, "DeepSpeedStrategy"):
        raise MisconfigurationException(
            "MPPlugin does not drive DeepSpeed: DeepSpeed runs its own loss scaling and precision from its config"
            " (Lightning hands them to it through its DeepSpeedPrecision plugin). Use Trainer(precision='bf16-mixed'"
            " or '16-mixed') with DeepSpeedStrategy, or MPPlugin with strategy='ddp', 'fsdp' or ModelParallelStrategy."
        )
    sharded = is_strategy(strategy, "FSDPStrategy")
    if mode is None:
        return sharded
    if mode.true_half and is_strategy(strategy, "ModelParallelStrategy"):
        raise MisconfigurationException(
            f"MPPlugin(precision={mode.name!r}) does not run under ModelParallelStrategy: its FSDP2 shards"
            " are set up in configure_model, before this plugin could cast weights. There, set"
            " FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) in"
            " configure_model (the fp32 shards are then the master weights) and use MPPlugin('bf16') for step"
            " skipping and guards."
        )
    if mode.fp8 and getattr(fp8_config, "weights", None) == "fp8":
        _check_fp8_weights_strategy(strategy)
    shards = sharded or is_strategy(strategy, "ModelParallelStrategy")
    kind = MasterKind.of(master_weights)
    if shards and mode.fp8 and kind is not None and not kind.fp32_copy:
        raise MisconfigurationException(
            f"MPPlugin('fp8', master_weights={master_weights!r}) does not run under FSDP or FSDP2: there the fp32"
            " shards are the master weights (fp8={'weights': 'auto'} keeps them fp32 and gathers them for compute)."
            " Leave master_weights unset, or use this option with strategy='ddp' or one device."
        )
    if sharded and mode.true_half and (kind is None or not kind.fp32_copy):
        raise MisconfigurationException(
            f"MPPlugin(precision={mode.name!r}, master_weights={master_weights!r}) does not run under FSDP:"
            " there the fp32 shards are the master weights and FSDP gathers half-precision weights for compute,"
            " which is master_weights='fp32'. Use master_weights='fp32' (the default) with FSDP, or this option"
            " with strategy='ddp'."
        )
    return sharded


def _check_fp8_weights_strategy(strategy: Any) -> None:
    if is_strategy(strategy, "FSDPStrategy"):
        raise MisconfigurationException(
            "MPPlugin('fp8', fp8={'weights': 'fp8'}) does not run under FSDPStrategy: FSDP (1) flattens parameters"
            " and cannot shard the FP8 backend's FP8 weights. Use ModelParallelStrategy (FSDP2: it gathers them in"
            " FP8), or fp8={'weights': 'fp32'} with fsdp_param_dtype='bf16' (bf16 gathers) under FSDPStrategy."
        )
    if is_strategy(strategy, "DDPStrategy"):
        raise MisconfigurationException(
            "MPPlugin('fp8', fp8={'weights': 'fp8'}) does not run under DDP: every GPU holds the whole model there,"
            " so nothing is gathered that FP8 weights could halve, and DDP's broadcast and gradient buckets take plain"
            " tensors. Use fp8={'weights': 'fp32'} (the default) or 'bf16' with DDP, or ModelParallelStrategy"
            " (FSDP2) for FP8 gathers."
        )


def sharded_before_setup(module: torch.nn.Module) -> bool:
    """Whether ``module`` was sharded in ``configure_model``: FSDP2 (``fully_shard``, DTensor parameters) or FSDP
    units wrapped there by hand (Lightning's FSDP strategy then wraps nothing more)."""
    return any(is_fsdp(m) for m in module.modules()) or any(_is_dtensor(p) for p in module.parameters())


def fsdp_gather_dtype(mode: Optional[PrecisionMode], fsdp_param_dtype: Optional[str]) -> Optional[torch.dtype]:
    """The dtype FSDP gathers weights in (``None``: fp32): the true-half mode's, or ``fsdp_param_dtype``."""
    if mode is not None and mode.true_half:
        return mode.param_dtype
    return None if fsdp_param_dtype in (None, "fp32") else REDUCE_DTYPES[fsdp_param_dtype]


def _gather_reason(mode: Optional[PrecisionMode], fsdp_param_dtype: Optional[str], short: bool = False) -> str:
    if mode is not None and mode.true_half:
        return mode.name.split("-")[0] if short else f"precision={mode.name!r}"
    return str(fsdp_param_dtype) if short else f"fsdp_param_dtype={fsdp_param_dtype!r}"


def fsdp_mixed_precision(
    mode: Optional[PrecisionMode],
    fsdp_param_dtype: Optional[str],
    reduce_dtype: Optional[str],
    guarded_classes: tuple[type, ...],
) -> Any:
    """The ``torch.distributed.fsdp.MixedPrecision`` that Lightning's FSDP strategy wraps the model with.

    Parameters (and buffers) stay fp32 in the shards and, unless a half dtype is gathered, when gathered; autocast
    casts per op, exactly as on one device. Gradients are reduced in ``reduce_dtype`` (fp32 unless set).
    """
    from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision

    reduce = None if reduce_dtype in (None, "fp32") else REDUCE_DTYPES[reduce_dtype]
    gather = fsdp_gather_dtype(mode, fsdp_param_dtype)
    if gather is None:
        return FSDPMixedPrecision(param_dtype=None, reduce_dtype=reduce, buffer_dtype=None)
    true_half = mode is not None and mode.true_half
    return FSDPMixedPrecision(
        param_dtype=gather,
        reduce_dtype=reduce if reduce is not None else torch.float32,
        buffer_dtype=gather if true_half else None,  # true-half: buffers in half, as on one device
        _module_classes_to_ignore=tuple({*guarded_classes, torch.nn.modules.batchnorm._BatchNorm}),
    )


def check_fsdp_wraps_guards(
    module: torch.nn.Module,
    guarded: list[str],
    mode: Optional[PrecisionMode],
    fsdp_param_dtype: Optional[str],
) -> None:
    """FSDP keeps modules in full precision by class: every module of a guarded class must be guarded, and wrapped."""
    classes = tuple({type(module.get_submodule(name)) for name in guarded})
    reason = _gather_reason(mode, fsdp_param_dtype)
    true_half = mode is not None and mode.true_half
    for name, sub in module.named_modules():
        if name and isinstance(sub, classes) and not any(name == g or name.startswith(g + ".") for g in guarded):
            twin = next((g for g in guarded if isinstance(sub, type(module.get_submodule(g)))), guarded[0])
            raise MisconfigurationException(
                f"MPPlugin({reason}) under FSDP keeps guarded modules in fp32 by their class, but the"
                f" guarded {twin!r} shares its class with the unguarded {name!r} ({type(sub).__name__}), which would"
                " then lose its half-precision compute. Guard by class (e.g. fp32_modules=['defaults',"
                f" '{type(sub).__name__}']), give the guarded modules a class of their own, or"
                + (" use strategy='ddp'." if true_half else " leave fsdp_param_dtype unset.")
            )
    strategy = strategy_of(module)
    if strategy is not None and strategy.kwargs.get("auto_wrap_policy") is None:
        raise MisconfigurationException(
            f"MPPlugin({reason}) keeps the FP32-guarded modules ({len(guarded)},"
            f" e.g. {guarded[0]!r}) in fp32 by having FSDP wrap them apart, which needs an auto_wrap_policy."
            " Pass FSDPStrategy(auto_wrap_policy={YourBlock}), or fp32_modules=[] to gather every weight in"
            f" {_gather_reason(mode, fsdp_param_dtype, short=True)}"
            + (", or leave fsdp_param_dtype unset (fp32 gathers)." if not true_half else ".")
        )


def clip_grad_norm(fsdp_root: Any, params: list[Tensor], clip_val: float) -> Tensor:
    """Clip by the total norm and return it: over every rank's shards (FSDP's root ``clip_grad_norm_``, or the
    DTensor norm of FSDP2), else torch's ``clip_grad_norm_``."""
    if fsdp_root is not None:
        return fsdp_root.clip_grad_norm_(clip_val)
    norm = torch.nn.utils.clip_grad_norm_(params, clip_val)
    return cast("DTensor", norm).full_tensor() if _is_dtensor(norm) else norm


def connect(
    model: Any,
    scaler: Any,
    reduce_dtype: Optional[str],
    fsdp_param_dtype: Optional[str],
    hooked: list,
    *,
    fp8: Any = None,
) -> Optional[torch.nn.Module]:
    """The strategy's model is known: gradient compression, rank agreement on skips, the FP8 backend's FSDP
    set-up (``fp8``: the backend, where the run trains in fp8); returns the root FSDP module."""
    fsdp_root = model if is_fsdp(model) else None
    if fsdp_root is not None and fp8 is not None:
        fp8.prepare_fsdp(fsdp_root)
    if fsdp_root is None and fsdp_param_dtype not in (None, "fp32"):
        rank_zero_warn(
            f"MPPlugin: fsdp_param_dtype={fsdp_param_dtype!r} is set, but the model is not wrapped by FSDP: it takes"
            " effect with strategy='fsdp' only."
        )
    device = next((p.device.type for p in model.parameters()), "cpu") if hasattr(model, "parameters") else "cpu"
    apply_reduce_dtype(model, reduce_dtype, device, hooked)
    if scaler is not None:
        scaler.sync_across_ranks = world_size() > 1  # a gradient poisoned after the all-reduce: every rank skips
    return fsdp_root


def apply_reduce_dtype(model: Any, reduce_dtype: Optional[str], device_type: str, hooked: list) -> None:
    """DDP: compress the gradient all-reduce to ``reduce_dtype`` with torch's bf16/fp16 communication hook."""
    if reduce_dtype in (None, "fp32") or is_fsdp(model):
        return  # (FSDP reduces in its mixed-precision config's reduce_dtype)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        rank_zero_warn(
            f"MPPlugin: reduce_dtype={reduce_dtype!r} is set, but the model is not wrapped by DDP or FSDP:"
            " there is no gradient reduction to compress. Use strategy='ddp' or 'fsdp', or leave reduce_dtype unset."
        )
        return
    if any(h is model for h in hooked):
        return
    if reduce_dtype == "bf16" and device_type != "cuda":
        raise MisconfigurationException(
            f"MPPlugin(reduce_dtype='bf16') under DDP on {device_type!r}: torch's bf16 gradient compression needs"
            " CUDA and NCCL. Use reduce_dtype='fp16' or leave it unset (fp32) on this device."
        )
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = default_hooks.bf16_compress_hook if reduce_dtype == "bf16" else default_hooks.fp16_compress_hook
    try:
        model.register_comm_hook(state=None, hook=hook)
    except RuntimeError as err:
        raise MisconfigurationException(
            f"MPPlugin(reduce_dtype={reduce_dtype!r}) registers a DDP communication hook, but the model"
            f" already has one ({err}). Pass either reduce_dtype or DDPStrategy(ddp_comm_hook=...), not both."
        ) from err
    hooked.append(model)


class FP32SumReduction:
    """Under DDP's ``no_sync``: the fp32 sums of earlier micro-batches, reduced while the last one's backward runs."""

    def __init__(self) -> None:
        self._pending: Optional[tuple[list[Tensor], list[Any]]] = None

    def start(self, sums: list[Tensor]) -> None:
        if sums and world_size() > 1:
            self._pending = (sums, [torch.distributed.all_reduce(s, async_op=True) for s in sums])

    @property
    def started(self) -> bool:
        """Whether a reduction is under way (:meth:`wait` has something to wait for)."""
        return self._pending is not None

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        sums, works = pending
        for work in works:
            work.wait()
        torch._foreach_div_(sums, float(world_size()))  # DDP averages: so do these

    def reset(self) -> None:
        self._pending = None
