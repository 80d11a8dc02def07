"""FP8 primary weights (``MPPlugin("fp8", fp8={"weights": "fp8"})``): weights stored in FP8, masters in the optimizer.

Transformer Engine builds a module under ``te.quantized_model_init`` with FP8 parameters (``Float8Tensor``): its
forward uses them as they are, and FSDP2 gathers their FP8 bytes (``fsdp_pre_all_gather``), half of a bf16
gather. The fp32 master weights then live in the optimizer: Transformer Engine's
``FusedAdam(master_weights=True)`` steps them and writes each parameter quantized (DTensor shards included).

This module adds what a Lightning run needs around that:

* the masters start from the exact fp32 weights the layer swap replaced (:func:`remember_original`, kept on the
  host until :func:`seed_masters` writes them, sliced to each rank's FSDP2 shard), not from their FP8 rounding;
* checkpoints hold plain tensors (:func:`install_primary_hooks`: the dequantized weights; ``torch.load(...,
  weights_only=True)`` reads them), and a loaded weight is quantized with a scale that fits it;
* after a checkpoint is restored, :func:`requantize_from_masters` writes every FP8 weight from its master with the
  restored scales, so a resumed run computes with the same bytes as the uninterrupted one.

Nothing here imports Transformer Engine: its tensors are recognised by class name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_ORIGINALS = "_mp_fp8_originals"
_HOOKED = "_mp_fp8_primary_hooks"


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself: the shard object itself (not ``to_local()``'s view,
    as the callbacks' helper takes), since FP8 weights are written and their caches reset in place."""
    return getattr(t, "_local_tensor", t)


def is_quantized(t: Any) -> bool:
    """Whether ``t`` (or its FSDP2 shard) is a Transformer Engine ``QuantizedTensor`` (an FP8 primary weight)."""
    return isinstance(t, Tensor) and any(c.__name__ == "QuantizedTensor" for c in type(_local(t)).__mro__)


def quantized_parameters(model: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """``(module, name, parameter)`` of every FP8 primary weight of ``model``."""
    return [(m, n, p) for m in model.modules() for n, p in m.named_parameters(recurse=False) if is_quantized(p)]


def remember_original(module: nn.Module, name: str, value: Tensor) -> None:
    """Keep the fp32 value a quantized parameter was made from (on the host) until :func:`seed_masters`."""
    module.__dict__.setdefault(_ORIGINALS, {})[name] = value.detach().to("cpu", torch.float32, copy=True)


def _dequantized(t: Tensor) -> Tensor:
    local = _local(t)
    if not is_quantized(local):
        return t
    plain = local.dequantize()
    if local is t:
        return plain
    from torch.distributed.tensor import DTensor

    sharded = cast(DTensor, t)  # a tensor that is not its own local shard: an FSDP2 DTensor
    return DTensor.from_local(plain, sharded.device_mesh, sharded.placements, shape=t.shape, stride=t.stride())


def _shard_like(value: Tensor, param: Tensor) -> Tensor:
    """``value`` (the whole fp32 weight) cut to this rank's part of ``param`` (an FSDP2 DTensor), else as is."""
    if getattr(param, "device_mesh", None) is None:
        return value.to(param.device)
    from torch.distributed.tensor import distribute_tensor

    device = _local(param).device
    sharded = cast("DTensor", param)
    return distribute_tensor(value.to(device), sharded.device_mesh, sharded.placements, src_data_rank=None).to_local()


def seed_masters(model: nn.Module, optimizers: list[Any]) -> int:
    """Check that every optimizer stepping an FP8 primary weight keeps fp32 masters, and start those masters from
    the exact fp32 weights (:func:`remember_original`); returns how many were seeded.

    Raises ``ValueError`` naming the optimizer when one does not keep its own masters.
    """
    from lightning_mp.master import keeps_own_masters

    where = {id(p): (m, n) for m, n, p in quantized_parameters(model)}
    seeded = 0
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        params = [p for g in opt.param_groups for p in g["params"] if id(p) in where]
        if not params:
            continue
        if not keeps_own_masters(opt) or not callable(getattr(opt, "set_scaled_state", None)):
            raise ValueError(
                f"fp8={{'weights': 'fp8'}} stores {len(params)} weight(s) in FP8, so their fp32 master weights must"
                f" live in the optimizer, but {type(opt).__name__} keeps none. Use Transformer Engine's"
                " FusedAdam(params, master_weights=True) (transformer_engine.pytorch.optimizers), or"
                " fp8={'weights': 'fp32'} (the default) with any optimizer."
            )
        for param in params:
            module, name = where[id(param)]
            original = module.__dict__.get(_ORIGINALS, {}).pop(name, None)
            if original is None:
                continue  # adopted as built, or seeded by an earlier fit: the optimizer's own value stands
            if not opt.state.get(param):
                opt.initialize_state(param, False)
            opt.set_scaled_state(param, "master_param", _shard_like(original, param))
            seeded += 1
        # every parameter's state now, as the first step would make it (masters from the FP8 values where no exact
        # original is left): torch's distributed checkpoint fills the state an optimizer has, and makes it itself
        # only for an optimizer that has none
        for param in (p for g in opt.param_groups for p in g["params"]):
            if not opt.state.get(param):
                opt.initialize_state(param, False)
        _start_step_counts(opt)
    return seeded


def _start_step_counts(opt: Optimizer) -> None:
    """Give each param group the step count Transformer Engine's ``FusedAdam`` makes at its first step (0, so the
    first step counts 1). A distributed checkpoint restores only the entries the optimizer has: without it a
    resumed run would restart Adam's bias correction at step 1 while its moments carry on."""
    for group in opt.param_groups:
        if "step" not in group:
            if getattr(opt, "capturable", False):
                device = group["params"][0].device if group["params"] else None
                group["step"] = torch.zeros(1, dtype=torch.int, device=device)
            else:
                group["step"] = 0


def refresh_transposes(params: list[Tensor]) -> None:
    """Mark the cached FP8 transposes of FP8 primary weights stale after they were written in place (an optimizer
    step quantizes the masters into them): the next backward transposes the new bytes instead of reusing the old.

    Transformer Engine's ``_reset_caches`` ("should be called after any in-place operation"); FSDP2 builds each
    gathered weight anew, so there this only touches the local shards.
    """
    for param in params:
        reset = getattr(_local(param), "_reset_caches", None)
        if reset is not None:
            reset()


def requantize_from_masters(optimizers: list[Optimizer]) -> int:
    """Write every FP8 primary weight from its optimizer's fp32 master with the current scales (after a restore)."""
    done = 0
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        get = getattr(opt, "get_unscaled_state", None)
        if get is None:  # (an optimizer without masters of its own: seed_masters refused it for FP8 weights)
            continue
        for group in opt.param_groups:
            for param in group["params"]:
                if not is_quantized(param) or "master_param" not in opt.state.get(param, {}):
                    continue
                master = _local(get(param, "master_param"))
                quantized: Any = _local(param)  # Transformer Engine's QuantizedTensor
                with torch.no_grad():
                    quantized.quantize_(master)
                refresh_transposes([param])
                done += 1
    return done


def install_primary_hooks(model: nn.Module) -> int:
    """On modules with FP8 primary weights: ``state_dict()`` gives their dequantized values (plain tensors), and
    ``load_state_dict`` quantizes a loaded weight with a delayed-scaling scale fitted to its largest value."""
    count = 0
    for module in {id(m): m for m, _, _ in quantized_parameters(model)}.values():
        if module.__dict__.get(_HOOKED):
            continue
        module.register_state_dict_post_hook(_plain_weights)
        module.register_load_state_dict_pre_hook(_fit_delayed_scales)
        module.__dict__[_HOOKED] = True
        count += 1
    return count


def _plain_weights(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        if key in state_dict and is_quantized(state_dict[key]):
            state_dict[key] = _dequantized(state_dict[key].detach())


def _fit_delayed_scales(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if value is not None and is_quantized(param) and not is_quantized(value):
            fit_delayed_scale(param, value)


def fit_delayed_scale(param: Tensor, value: Tensor) -> None:
    """Before ``value`` is quantized into the FP8 weight ``param``: with delayed scaling, set the weight's scale so
    that ``value``'s largest magnitude (over the FSDP2 shards) maps to the format's largest (current scaling and
    block recipes fit their scales when they quantize: nothing to do)."""
    quantizer = getattr(_local(param), "_quantizer", None)
    scale = getattr(quantizer, "scale", None)
    if type(quantizer).__name__ != "Float8Quantizer" or not isinstance(scale, Tensor):
        return
    amax = _local(value).detach().abs().amax().float().to(scale.device)
    if getattr(value, "device_mesh", None) is not None:
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=cast("DTensor", value).device_mesh.get_group())
    fmt = torch.float8_e5m2 if "E5M2" in str(getattr(quantizer, "dtype", "")) else torch.float8_e4m3fn
    top = torch.finfo(fmt).max  # 57344 / 448
    with torch.no_grad():
        scale.copy_(torch.where(amax > 0, top / amax, torch.ones_like(amax)).expand_as(scale))
