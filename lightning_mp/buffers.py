"""Module buffers a skipped step must leave as they were (BatchNorm running statistics, its batch counter, ...).

The forward passes of a training step update buffers before anyone knows whether the step will be skipped: an
inf in one input element makes BatchNorm's running mean and variance non-finite for good. So the buffers are
copied when a training step (the first micro-batch of an accumulation window) begins, and copied back when the
step is skipped. A buffer belongs to the optimizers that hold its module's own parameters (a BatchNorm's
weight); a buffer of a module without parameters belongs to every optimizer.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Optional, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


class _Registrations:
    """Counts buffer slots and submodules registered anywhere in the process (torch's global registration hooks),
    while a snapshot watches: a plan made before a new one appeared (a buffer registered during training, a
    submodule added or swapped) is found again. A buffer re-assigned in its own slot is no new slot."""

    generation = 0
    watchers = 0
    handles: list = []

    @classmethod
    def watch(cls) -> None:
        if cls.watchers == 0:
            from torch.nn.modules import module as torch_module

            cls.handles = [
                torch_module.register_module_buffer_registration_hook(cls._buffer),
                torch_module.register_module_module_registration_hook(cls._submodule),
            ]
        cls.watchers += 1

    @classmethod
    def unwatch(cls) -> None:
        cls.watchers = max(cls.watchers - 1, 0)
        if cls.watchers == 0:
            for handle in cls.handles:
                handle.remove()
            cls.handles = []

    @classmethod
    def _buffer(cls, module: nn.Module, name: str, tensor: Optional[Tensor]) -> None:
        if name not in module._buffers:  # (called before the slot is written)
            cls.generation += 1

    @classmethod
    def _submodule(cls, module: nn.Module, name: str, submodule: Optional[nn.Module]) -> None:
        if module._modules.get(name) is not submodule:
            cls.generation += 1


class BufferSnapshot:
    """Copies of a module's buffers taken before a step's forward passes, put back if the step is skipped.

    What is put back is found by slot (a module's ``_buffers`` entry), not by tensor object: a buffer updated in place
    (BatchNorm's running statistics) gets its values back, and one the forward pass re-assigned
    (``self.ema = 0.9 * self.ema + 0.1 * h.mean(0)``, ``self.calls = self.calls + 1``) gets its slot back, holding
    the tensor it held before with the values it had.

    Example::

        snap = BufferSnapshot()
        snap.take(model, [optimizer])
        loss = model(x).sum(); loss.backward()
        snap.restore(optimizer, skipped=True, found_inf=None)   # running statistics as before the forward
    """

    def __init__(self) -> None:
        self._slots: list[tuple[dict, str]] = []  # where each buffer sits: its module's ``_buffers`` and key
        self._buffers: list[Tensor] = []  # the tensors the slots held when the snapshot was taken
        self._copies: list[Tensor] = []
        self._owners: list[Optional[frozenset[int]]] = []  # ids of the optimizers a buffer belongs to (None: all)
        # the slots and their owners, found once and checked each step (a host walk per step costs more than the
        # copy itself on small models)
        self._plan: Optional[tuple[int, list[tuple[dict, str]], list[Optional[frozenset[int]]]]] = None
        self._generation = -1  # the registrations' generation the plan was made at
        #: while this snapshot counts among the registrations' watchers: what ends that (alive until called, or until
        #: the snapshot is collected)
        self._unwatch: Optional[weakref.finalize] = None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (a plugin copied mid-run) watches nothing and makes its plan again."""
        return {**self.__dict__, "_plan": None, "_unwatch": None}

    @property
    def taken(self) -> bool:
        return bool(self._buffers)

    def forget_plan(self) -> None:
        """The model or the optimizers changed (a new ``fit``): find the buffers and their owners again."""
        self._plan = None

    def close(self) -> None:
        """The run is over: stop watching registrations (the next :meth:`take` watches again)."""
        if self._unwatch is not None:
            self._unwatch()  # (a spent finalizer does nothing)
            self._unwatch = None
        self._plan = None

    def take(self, module: nn.Module, optimizers: Iterable[Optimizer]) -> None:
        if self._unwatch is None:
            _Registrations.watch()
            # (a snapshot dropped without close, e.g. a run that never tore down, stops watching when collected)
            self._unwatch = weakref.finalize(self, _Registrations.unwatch)
            self._plan = None  # (registrations before the watch were not counted)
        plan = self._plan
        current = plan is not None and plan[0] == id(module) and self._generation == _Registrations.generation
        held = [slots.get(key) for slots, key in plan[1]] if plan is not None and current else None
        if plan is None or held is None or any(buf is None or buf.is_inference() for buf in held):
            # (a new module, a buffer slot or submodule registered, or a slot emptied or holding an inference tensor
            # since: found again)
            self._generation = _Registrations.generation
            plan = self._plan = (id(module), *_find(module, optimizers))
            held = [slots[key] for slots, key in plan[1]]
        buffers = cast(list[Tensor], held)
        if not buffers:
            return
        if len(self._copies) != len(buffers) or any(
            c.shape != b.shape or c.dtype != b.dtype or c.device != b.device for c, b in zip(self._copies, buffers)
        ):
            self._copies = [torch.empty_like(b) for b in buffers]  # reused from step to step
        with torch.no_grad():
            torch._foreach_copy_(self._copies, buffers)
        self._slots, self._buffers, self._owners = plan[1], buffers, plan[2]

    def restore(self, optimizer: Optimizer, skipped: Optional[bool], found_inf: Optional[Tensor]) -> None:
        """``optimizer``'s step was skipped (``skipped=True``), or maybe (``None``: ``found_inf`` says, on the
        device)."""
        if not self._buffers or skipped is False:
            return
        mine = [i for i, owners in enumerate(self._owners) if owners is None or id(optimizer) in owners]
        if not mine:
            return
        with torch.no_grad():
            if skipped:
                torch._foreach_copy_([self._buffers[i] for i in mine], [self._copies[i] for i in mine])
                for i in mine:  # a re-assigned buffer: its slot gets the tensor it held back
                    slots, key = self._slots[i]
                    if slots.get(key) is not self._buffers[i]:
                        slots[key] = self._buffers[i]
                return
            assert found_inf is not None
            skip = found_inf.reshape(()).ne(0)
            for i in mine:
                slots, key = self._slots[i]
                buf, copy = slots.get(key), self._copies[i]
                if buf is None or buf.shape != copy.shape or buf.dtype != copy.dtype or buf.device != copy.device:
                    # re-assigned with another shape or kind: which tensor the slot holds is the host's to decide
                    if bool(skip):
                        self._buffers[i].copy_(copy)
                        slots[key] = self._buffers[i]
                    continue
                buf.copy_(torch.where(skip.to(buf.device), copy, buf))

    def drop(self) -> None:
        """The step is done: the next training step takes a new snapshot."""
        self._slots, self._buffers, self._owners = [], [], []


def _find(
    module: nn.Module, optimizers: Iterable[Optimizer]
) -> tuple[list[tuple[dict, str]], list[Optional[frozenset[int]]]]:
    """Every buffer slot of ``module`` (its module's ``_buffers`` and key) and the optimizers it belongs to."""
    # (a buffer tensor two modules share sits in two slots: each gets it back)
    found = [
        (sub, sub._buffers, key)
        for sub in module.modules()
        for key, buf in sub._buffers.items()
        if buf is not None and not buf.is_inference()
    ]
    if not found:
        return [], []
    owner_of: dict[int, set[int]] = {}
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []):
            for p in group["params"]:
                owner_of.setdefault(id(p), set()).add(id(opt))
    owners: list[Optional[frozenset[int]]] = []
    for sub, _, _ in found:
        own = set().union(*(owner_of.get(id(p), set()) for p in sub.parameters(recurse=False)))
        owners.append(frozenset(own) if own else None)
    return [(slots, key) for _, slots, key in found], owners
