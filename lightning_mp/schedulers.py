"""Holding step-interval LR schedulers on skipped optimizer steps.

Lightning steps a step-interval scheduler after every optimizer step, skipped or not (Lightning issues #5558,
#16228). The one extension point it offers is ``LightningModule.lr_scheduler_step``; this module wraps it on the
module instance while training runs (the user's override, if any, stays in charge) and removes the wrapper at
teardown (listed in :mod:`lightning_mp.patches`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch import LightningModule
from torch.optim import Optimizer


class SchedulerHold:
    """Skips ``lr_scheduler_step`` for step-interval schedulers whose optimizer's last step was skipped.

    Example::

        hold = SchedulerHold()
        hold.install(module, trainer.lr_scheduler_configs, skipped_for=steps.skipped_for)
        ...
        hold.remove()
    """

    def __init__(self) -> None:
        self._skipped_for: Optional[Callable[[Optional[Optimizer]], bool]] = None
        self._module: Optional[LightningModule] = None
        self._step_schedulers: set[int] = set()

    def install(
        self, module: Optional[LightningModule], configs: list, skipped_for: Callable[[Optional[Optimizer]], bool]
    ) -> bool:
        """Wrap ``module.lr_scheduler_step`` if a step-interval scheduler is among ``configs``; whether it was
        wrapped now (to be undone with :meth:`remove`)."""
        self._skipped_for = skipped_for
        self._step_schedulers = {
            id(c.scheduler) for c in configs if getattr(c, "interval", "epoch") == "step" and hasattr(c, "scheduler")
        }
        if module is None or not self._step_schedulers or self._module is module:
            return False
        self.remove()
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            skipped_for = self._skipped_for
            assert skipped_for is not None  # set by install() before wrapping, never unset
            if id(scheduler) in self._step_schedulers and skipped_for(getattr(scheduler, "optimizer", None)):
                return
            original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
        self._module = module
        return True

    def remove(self) -> None:
        if self._module is not None:
            self._module.__dict__.pop("lr_scheduler_step", None)
            self._module = None
