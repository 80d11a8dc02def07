"""The optimizer step's Lightning hooks of :class:`~lightning_mp.MPPlugin`: backward, the step, the hooks before it,
clipping. Each hands over to :class:`~lightning_mp.step.OptimizerSteps`, which owns the order of a step.

A base of ``MPPlugin`` ahead of Lightning's plugins in its method order, so these are the overrides Lightning calls;
the set-up (``connect``) builds the ``OptimizerSteps`` they use.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning_mp.distributed as distributed
from lightning_mp.run_precision import RunPrecision
from lightning_mp.step import OptimizerSteps


class StepHooks(Precision):
    """Lightning's backward, optimizer-step and clipping hooks, forwarded to the run's :class:`OptimizerSteps`."""

    _steps: Optional[OptimizerSteps]  # set by MPPlugin.connect (None before: Lightning's own behaviour)
    _run: RunPrecision
    _fsdp_root: Optional[torch.nn.Module]

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        if self._steps is not None:
            self._steps.before_backward(module, tensor)  # the spike guard's loss; true-half sums in fp32
        if self._run.scaler is not None:
            tensor = self._run.scaler.scale(tensor)
        return Precision.pre_backward(self, tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        masters = self._steps.masters if self._steps is not None else None
        if self._steps is not None:
            self._steps.after_backward(module)
        if masters is None or not masters.carrying or not _reads_grads_after_backward(module):
            return Precision.post_backward(self, tensor, module)  # (on_after_backward runs in there)
        shown = masters.show_sums(module.parameters())  # the window's sum so far, as without master weights
        try:
            return Precision.post_backward(self, tensor, module)
        finally:
            masters.hide_sums(shown)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if self._steps is None or not isinstance(model, LightningModule):
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        out = self._steps.run(optimizer, closure, lambda: self._after_closure(model, optimizer), **kwargs)
        if self._run.fp8 is not None:
            self._run.fp8.weights_updated()  # FP8 weight casts cached across micro-batches expire
        return out

    @override
    def _after_closure(self, model: LightningModule, optimizer: Any) -> None:
        trainer, steps = model.trainer, self._steps
        assert steps is not None, "optimizer steps run after connect()"
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        steps.hooks_ran(optimizer)  # what hooks wrote is what the step applies
        clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        self._clip_gradients(model, optimizer, clip[0], gradient_clip_algorithm=clip[1])
        steps.hooks_ran(optimizer, clipping=True)  # a configure_gradient_clipping override may write too

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer in manual optimization
        if self._steps is not None:
            self._steps.prepare(optimizer)  # true gradients (unscaled, fp32 in true-half) before clipping
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        if self._steps is not None:
            self._steps.clipped(optimizer)  # the model's half gradients show the clipped ones

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self._steps is not None:
            self._steps.check_before_clamp(optimizer)  # an inf must be seen before clamping makes it finite
        torch.nn.utils.clip_grad_value_(self.main_params(optimizer), clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        norm = distributed.clip_grad_norm(self._fsdp_root, self.main_params(optimizer), clip_val)
        if self._steps is not None:
            self._steps.record_norm(optimizer, norm)  # the norm read every gradient: it is the verdict

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return self._steps.main_params(optimizer) if self._steps is not None else Precision.main_params(self, optimizer)


def _reads_grads_after_backward(module: LightningModule) -> bool:
    """Whether the module or a callback of its Trainer overrides ``on_after_backward``."""
    trainer = module._trainer
    callbacks: list = getattr(trainer, "callbacks", [])
    return is_overridden("on_after_backward", module, LightningModule) or any(
        is_overridden("on_after_backward", callback, Callback) for callback in callbacks
    )
