"""Holding step-interval LR schedulers on skipped optimizer steps.

Lightning steps a step-interval scheduler after every optimizer step, skipped or not (Lightning issues #5558,
#16228). The one extension point it offers is ``LightningModule.lr_scheduler_step``; this module routes the trained
module's calls of it through the hold while training runs (the user's override, if any, stays in charge) and lets go
at teardown (listed in :mod:`lightning_mp.patches`).

The route is a descriptor on the module's class (:class:`_HeldSchedulerStep`), not an attribute of the instance: the
module's ``__dict__`` is left as it is, so ``torch.save(module)``, ``copy.deepcopy(module)`` and weight-averaging
callbacks' copies taken mid-fit work and give plain modules, and every other instance of the class, copies
included, calls its own ``lr_scheduler_step`` untouched.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch import LightningModule
from torch.optim import Optimizer

_NAME = "lr_scheduler_step"
_MISSING = object()  # (the class inherits the method: nothing of its own to put back)


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
        self.module: Optional[LightningModule] = None
        self._step_schedulers: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        """A copy holds nothing: the held module's class is the original's to release."""
        return {**self.__dict__, "module": None, "_skipped_for": None}

    def install(
        self, module: Optional[LightningModule], configs: list, skipped_for: Callable[[Optional[Optimizer]], bool]
    ) -> bool:
        """Hold ``module``'s ``lr_scheduler_step`` if a step-interval scheduler is among ``configs``; whether it was
        installed now (to be undone with :meth:`remove`)."""
        self._skipped_for = skipped_for
        self._step_schedulers = {
            id(c.scheduler) for c in configs if getattr(c, "interval", "epoch") == "step" and hasattr(c, "scheduler")
        }
        if module is None or not self._step_schedulers or self.module is module:
            return False
        self.remove()
        _HeldSchedulerStep.on(type(module)).hold(module, self)
        self.module = module
        return True

    def remove(self) -> None:
        module, self.module = self.module, None
        if module is not None:
            _HeldSchedulerStep.release(type(module), module)

    def call(self, step: Callable[..., Any], scheduler: Any, metric: Any = None) -> None:
        """``step(scheduler, metric)`` (the module's ``lr_scheduler_step``) unless the scheduler is held now."""
        skipped_for = self._skipped_for
        if skipped_for is not None and id(scheduler) in self._step_schedulers:
            if skipped_for(getattr(scheduler, "optimizer", None)):
                return
        step(scheduler, metric)


class _HeldCall:
    """The held module's ``lr_scheduler_step`` while its run lasts (``__wrapped__``: the method it calls, which
    Lightning's ``is_overridden`` reads)."""

    __slots__ = ("hold", "__wrapped__")

    def __init__(self, hold: SchedulerHold, step: Callable[..., Any]) -> None:
        self.hold, self.__wrapped__ = hold, step

    def __call__(self, scheduler: Any, metric: Any = None) -> None:
        self.hold.call(self.__wrapped__, scheduler, metric)


class _HeldSchedulerStep:
    """``lr_scheduler_step`` on a LightningModule class while instances of it train with a hold.

    A data descriptor: an instance's own ``lr_scheduler_step`` (set by the user on the instance) is still its own,
    read, written and deleted in its ``__dict__``, and held as the class's method would be. Instances with no hold
    (copies, other models) get their method unchanged; the class gets its own entry back when the last hold goes.
    """

    def __init__(self, owner: type, original: Any) -> None:
        self.owner = owner
        self.original = original  # the class's own entry, or _MISSING
        self.holds: dict[int, SchedulerHold] = {}  # id(module) -> its hold (the hold keeps the module alive)

    @classmethod
    def on(cls, owner: type) -> _HeldSchedulerStep:
        """The descriptor on ``owner`` (put there now if there is none)."""
        current = owner.__dict__.get(_NAME, _MISSING)
        if isinstance(current, cls) and current.owner is owner:
            return current
        descriptor = cls(owner, current)
        setattr(owner, _NAME, descriptor)
        return descriptor

    @classmethod
    def release(cls, owner: type, module: Any) -> None:
        """``module``'s hold goes; the class's own entry comes back once no instance is held."""
        descriptor = owner.__dict__.get(_NAME)
        if not isinstance(descriptor, cls):
            return
        descriptor.holds.pop(id(module), None)
        if not descriptor.holds:
            if descriptor.original is _MISSING:
                delattr(owner, _NAME)
            else:
                setattr(owner, _NAME, descriptor.original)

    def hold(self, module: Any, hold: SchedulerHold) -> None:
        self.holds[id(module)] = hold

    def _unheld(self, instance: Any, owner: Optional[type]) -> Any:
        """What ``lr_scheduler_step`` is without this descriptor."""
        if instance is not None and _NAME in instance.__dict__:
            return instance.__dict__[_NAME]
        if self.original is not _MISSING:
            get = getattr(self.original, "__get__", None)
            return get(instance, owner) if get is not None else self.original
        return getattr(super(self.owner, instance if instance is not None else owner), _NAME)

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        step = self._unheld(instance, owner)
        hold = self.holds.get(id(instance)) if instance is not None else None
        if hold is None or hold.module is not instance:
            return step
        return _HeldCall(hold, step)

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[_NAME] = value

    def __delete__(self, instance: Any) -> None:
        if _NAME not in instance.__dict__:
            raise AttributeError(_NAME)
        del instance.__dict__[_NAME]
