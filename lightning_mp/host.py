"""The host of a run: the little the step needs to know about the loop that drives it.

:class:`~lightning_mp.step.OptimizerSteps` runs the same step for every host; a host answers five questions, asked
where the step cannot know the answer itself. The Trainer's host reads them off the ``LightningModule`` and its
``Trainer``; a Fabric loop's host answers them once, for a loop that owns its forward, backward, ``zero_grad``,
clipping and accumulation::

    host                 whole_steps  owns_accumulation  window_starts   accumulate  hooks_write    global_step
    TrainerHost (auto)   True         True (fp32 sums)   batch_idx % n   Trainer's   overridden?    trainer's
    TrainerHost (manual) False        False              False           1           overridden?    trainer's
    LoopHost (Fabric)    True         False              False           1           (True, True)   steps taken

Nothing here imports the plugins or the step (``step.py`` imports this module).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden


class Host(Protocol):
    """What :class:`~lightning_mp.step.OptimizerSteps` asks of the loop that drives it."""

    @property
    def whole_steps(self) -> bool:
        """Each optimizer step is a whole training step: the loss scale moves and the buffer snapshot goes right
        after it (automatic optimization, a Fabric loop). ``False``: the batch ends when the host says so
        (:meth:`OptimizerSteps.end_batch`: manual optimization's ``training_step`` returned)."""

    @property
    def owns_accumulation(self) -> bool:
        """The host zeroes the gradients and knows the accumulation windows: micro-batch gradients of true-half
        parameters may sum in fp32 (automatic optimization)."""

    def window_starts(self) -> bool:
        """Whether the training batch starting now is the first of an accumulation window (where the host zeroes)."""

    def accumulate(self) -> int:
        """Micro-batches per optimizer step (read each time: it may change during training)."""

    def hooks_write(self) -> tuple[bool, bool]:
        """Whether the code that runs between backward and the step (hooks; clipping) may write the gradients."""

    def global_step(self) -> Any:
        """The step to name in a message (the divergence stop's)."""

    @property
    def plugin(self) -> str:
        """The plugin's class, named in messages."""


class TrainerHost:
    """The Trainer's: a ``LightningModule`` and the ``Trainer`` it is attached to."""

    __slots__ = ("module", "plugin", "_hooks_write")

    def __init__(self, module: Optional[LightningModule], plugin: str = "MPPlugin") -> None:
        self.module = module  # (``None``: a plain model without a Trainer; each step a whole step)
        self.plugin = plugin
        self._hooks_write: Optional[tuple[bool, bool]] = None

    def __getstate__(self) -> dict[str, Any]:
        # (a copy holds nothing of the run: the next run binds its own)
        return {"module": None, "plugin": self.plugin, "_hooks_write": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.module, self._hooks_write = state["module"], state["_hooks_write"]
        self.plugin = state.get("plugin", "MPPlugin")

    @property
    def _trainer(self) -> Any:
        return getattr(self.module, "_trainer", None)

    @property
    def whole_steps(self) -> bool:
        return self.module is None or bool(self.module.automatic_optimization)

    @property
    def owns_accumulation(self) -> bool:
        return self.module is not None and bool(self.module.automatic_optimization)

    def window_starts(self) -> bool:
        trainer = self._trainer
        if trainer is None or not self.owns_accumulation:
            return False
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        batch_idx = getattr(loop, "batch_idx", None)
        return isinstance(batch_idx, int) and batch_idx % max(1, self.accumulate()) == 0

    def accumulate(self) -> int:
        return getattr(self._trainer, "accumulate_grad_batches", 1)

    def hooks_write(self) -> tuple[bool, bool]:
        """Found once per run; callbacks that only read say so with ``reads_gradients_only``."""
        if self._hooks_write is None:
            module, trainer = self.module, self._trainer
            if module is None or trainer is None:
                return (True, True)
            hooks = is_overridden("on_before_optimizer_step", module, LightningModule) or any(
                type(cb).on_before_optimizer_step is not Callback.on_before_optimizer_step
                and not getattr(cb, "reads_gradients_only", False)
                for cb in trainer.callbacks
            )
            self._hooks_write = (hooks, is_overridden("configure_gradient_clipping", module, LightningModule))
        return self._hooks_write

    def global_step(self) -> Any:
        trainer = self._trainer
        return trainer.global_step if trainer is not None else "?"


class LoopHost:
    """A loop that owns everything between backward and the step (Lightning Fabric): each ``optimizer.step()`` is a
    whole step; whatever the loop did since backward (clipping, reading or writing ``.grad``) may have written the
    gradients; the steps taken so far name the step."""

    __slots__ = ("counts", "plugin")

    whole_steps = True
    owns_accumulation = False

    def __init__(self, counts: Any, plugin: str = "MPFabricPrecision") -> None:
        self.counts = counts  # (the run's StepStats: its ``steps``)
        self.plugin = plugin

    def window_starts(self) -> bool:
        return False

    def accumulate(self) -> int:
        return 1

    def hooks_write(self) -> tuple[bool, bool]:
        return (True, True)

    def global_step(self) -> Any:
        return getattr(self.counts, "steps", "?")


def host_of(module: Any) -> Host:
    """The host a step is connected with: a ``Host`` as it is, a ``LightningModule`` (or ``None``) the Trainer's."""
    if isinstance(module, (TrainerHost, LoopHost)):
        return module
    return TrainerHost(module)
