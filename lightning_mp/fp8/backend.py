"""The seam between the precision plugins and an FP8 library: what the core calls, and which backend answers.

The plugins (``MPPlugin``, ``MPFabricPrecision``) and the rest of the package speak to FP8 only through an
:class:`FP8Backend`; only the backend's own modules under :mod:`lightning_mp.fp8` import or name its library:

========================  =============================================  ==========================================
``fp8={"backend": ...}``  module                                         recipes (first: default)
========================  =============================================  ==========================================
``"transformer_engine"``  :mod:`lightning_mp.fp8.runtime`                delayed, current, block, mxfp8
``"torchao"``             :mod:`lightning_mp.fp8.torchao_backend`        tensorwise, rowwise, rowwise_with_gw_hp
========================  =============================================  ==========================================

Example::

    from lightning_mp.fp8.backend import make_backend

    fp8 = make_backend({"backend": "torchao", "recipe": "rowwise"})
    fp8.convert(model, device="cuda")            # checks the GPU and the library first, then swaps the layers
    with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
        loss = model(x)

A backend's life in a run (the order the plugins call it in):

1. ``check(device)`` where the run learns its device: raises :class:`~lightning_mp.fp8.FP8UnavailableError` naming
   what is missing (the library, an FP8-capable GPU, the recipe) and what to use instead, before training starts.
2. ``convert(module, device, announce=...)`` at ``convert_module`` (before the optimizers exist): swaps the layers the
   filter selects, in place; ``adopt(module, device)`` takes a module converted earlier (``prepare_fp8`` in
   ``configure_model``, before FSDP2 shards it). ``weights`` (set before ``convert``) is the dtype the model's weights
   are kept in: ``"bf16"`` (the default: fp32 master weights in the step), ``"fp32"`` or ``"fp8"``
   (:func:`lightning_mp.fp8.config.settle_weights`).
3. ``connect_optimizers(optimizers)``, ``configure_weight_cache(...)`` and ``watch_saturation(on)`` at ``connect``.
4. Every step: ``autocast(training)`` around the forward (inside bf16 autocast), ``sentinel.take()`` (a device flag:
   an inf/NaN an FP8 cast saturated, joins the step's verdict; ``None`` where the backend cannot see one), and
   ``weights_updated()`` after each optimizer step.
5. ``state_dict()`` / ``load_state_dict(state)`` with the plugin's checkpoint entry: plain tensors, numbers, strings.
6. ``layer_stats()`` for monitoring: per FP8 layer, what the backend keeps of its scaling (scale, amax) and the share
   of values that saturate or underflow where it can be read (see :mod:`lightning_mp.callbacks`).
7. ``release()`` at teardown: every hook and patch the backend installed is undone.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Protocol, Union, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_mp.fp8.config import FP8Config


@runtime_checkable
class SaturationSource(Protocol):
    def take(self) -> Optional[Tensor]: ...


@runtime_checkable
class FP8Backend(Protocol):
    """What the core calls on an FP8 library (see the module docstring for when)."""

    #: the dtype the model's weights are kept in during the run: "bf16", "fp32" or "fp8" (``config.weights``, with
    #: "auto" settled by the run: "fp32" under FSDP/FSDP2, whose fp32 shards are the master weights, else "bf16")
    weights: str
    @property
    def config(self) -> FP8Config: ...

    @property
    def sentinel(self) -> SaturationSource: ...

    @property
    def report(self) -> Any: ...

    @property
    def model(self) -> Optional[nn.Module]: ...

    @property
    def name(self) -> str:
        """The backend's name (``"transformer_engine"``, ``"torchao"``), in messages and checkpoints."""

    def check(self, device: Union[str, torch.device]) -> None: ...

    def convert(
        self,
        model: nn.Module,
        device: Union[str, torch.device, None] = None,
        *,
        module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
        announce: Optional[Callable[[str], None]] = None,
        cast_weights: bool = True,
    ) -> Any: ...

    def adopt(self, model: nn.Module, device: Union[str, torch.device, None] = None) -> int: ...

    def is_converted(self, module: nn.Module) -> bool: ...

    def connect_optimizers(self, optimizers: list[Any]) -> int: ...

    def configure_weight_cache(self, *, accumulate_grad_batches: int = 1, automatic_optimization: bool = True) -> bool:
        ...

    def watch_saturation(self, on: bool = True) -> Optional[str]: ...

    def autocast(self, training: bool = True) -> ContextManager[Any]: ...

    def weights_updated(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None: ...

    def layer_stats(self) -> dict[str, dict[str, float]]: ...

    def prepare_fsdp(self, fsdp_root: nn.Module) -> None:
        """FSDP (1) wrapped the model (Lightning's FSDP strategy): what the library needs done to its layers."""

    def release(self) -> None: ...


def make_backend(config: Union[FP8Config, dict[str, Any], None] = None) -> FP8Backend:
    """The backend ``config.backend`` names, for ``config``."""
    config = FP8Config.from_value(config)
    if config.backend == "torchao":
        from lightning_mp.fp8.torchao_backend import TorchAOFloat8

        return TorchAOFloat8(config)
    from lightning_mp.fp8.runtime import FP8Training

    return FP8Training(config)
