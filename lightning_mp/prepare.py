"""``prepare_fp8``: FP8 layers swapped in ``configure_model``, before FSDP2's ``fully_shard`` (or FSDP units wrapped
there by hand) shards the model.

Lightning calls a precision plugin's ``convert_module`` after ``configure_model``: under ``ModelParallelStrategy``
the parameters are DTensor shards by then and a layer can no longer be replaced. The FP8 backend's layers
shard like any other module, so the swap has to come first, inside ``configure_model``::

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from lightning_mp import prepare_fp8

    def configure_model(self):
        prepare_fp8(self)                       # MPPlugin("fp8"): FP8 layers now; any other precision: nothing
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"], mp_policy=policy)
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"], mp_policy=policy)  # what training_step calls
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_mp.distributed as distributed


def prepare_fp8(pl_module: LightningModule, module: Optional[nn.Module] = None) -> nn.Module:
    """Swap ``module``'s linear layers (default: the whole ``pl_module``'s) for the FP8 backend's now, with the
    Trainer's ``MPPlugin("fp8")`` settings (layer filter, recipe, weights dtype); returns ``module``.

    Call it in ``configure_model`` before sharding. Under any other precision plugin or mode it does nothing,
    so the same LightningModule runs in bf16 or fp8 by the Trainer flag alone. The plugin then adopts the
    converted model at set-up (FP8 state, saturation sentinel and weight cache as on one device). A model that
    is sharded and has FP8 layers already (``configure_model`` runs again for ``validate`` after
    ``fit``) is left as it is.
    """
    from lightning_mp.plugin import MPPlugin

    target = pl_module if module is None else module
    trainer = getattr(pl_module, "_trainer", None)
    if trainer is None:
        raise MisconfigurationException(
            f"prepare_fp8({type(pl_module).__name__}) needs the Trainer's precision plugin: call it in"
            " configure_model (the Trainer is attached there), not in __init__."
        )
    plugin = trainer.precision_plugin
    if not isinstance(plugin, MPPlugin) or plugin.mode is None or not plugin.mode.fp8:
        return target
    if distributed.sharded_before_setup(target):
        if plugin._run.fp8 is not None and plugin._run.fp8.is_converted(target):
            return target  # prepared by an earlier configure_model (fit, then validate): the plugin adopts it
        raise MisconfigurationException(
            "prepare_fp8 found sharded parameters (DTensor, or FSDP units): fully_shard or FSDP wrapping already ran"
            " on this model, and a sharded layer cannot be replaced. Call prepare_fp8(self) first in"
            " configure_model, then fully_shard (or wrap)."
        )
    shards = distributed.is_strategy(trainer.strategy, "FSDPStrategy") or distributed.is_strategy(
        trainer.strategy, "ModelParallelStrategy"
    )  # (weights="auto": fp32 shards, the masters, gathered for compute)
    plugin._run.convert_fp8(target, trainer.strategy.root_device, sharded=shards)
    return target
