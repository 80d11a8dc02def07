"""Module buffers a skipped step must leave as they were (BatchNorm running statistics, its batch counter, ...).

The forward passes of a training step update buffers before anyone knows whether the step will be skipped: an
inf in one input element makes BatchNorm's running mean and variance non-finite for good. So the buffers are
copied when a training step (the first micro-batch of an accumulation window) begins, and copied back when the
step is skipped. A buffer belongs to the optimizers that hold its module's own parameters (a BatchNorm's
weight); a buffer of a module without parameters belongs to every optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


class BufferSnapshot:
    """Copies of a module's buffers taken before a step's forward passes, put back if the step is skipped.

    Example::

        snap = BufferSnapshot()
        snap.take(model, [optimizer])
        loss = model(x).sum(); loss.backward()
        snap.restore(optimizer, skipped=True, found_inf=None)   # running statistics as before the forward
    """

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._copies: list[Tensor] = []
        self._owners: list[Optional[frozenset[int]]] = []  # ids of the optimizers a buffer belongs to (None: all)
        # where the buffers sit and whom they belong to, found once and checked each step (a host walk per step
        # costs more than the copy itself on small models)
        self._plan: Optional[tuple[int, list[tuple[dict, str, Tensor]], list[Optional[frozenset[int]]]]] = None

    @property
    def taken(self) -> bool:
        return bool(self._buffers)

    def forget_plan(self) -> None:
        """The model or the optimizers changed (a new ``fit``): find the buffers and their owners again."""
        self._plan = None

    def take(self, module: nn.Module, optimizers: Iterable[Optimizer]) -> None:
        plan = self._plan
        if plan is None or plan[0] != id(module) or any(slots.get(key) is not buf for slots, key, buf in plan[1]):
            plan = self._plan = (id(module), *_find(module, optimizers))
        slots, owners = plan[1], plan[2]
        if not slots:
            return
        buffers = [buf for _, _, buf in slots]
        if len(self._copies) != len(buffers) or any(
            c.shape != b.shape or c.dtype != b.dtype or c.device != b.device for c, b in zip(self._copies, buffers)
        ):
            self._copies = [torch.empty_like(b) for b in buffers]  # reused from step to step
        with torch.no_grad():
            torch._foreach_copy_(self._copies, buffers)
        self._buffers, self._owners = buffers, owners

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
                return
            assert found_inf is not None
            skip = found_inf.reshape(()).ne(0)
            for i in mine:
                buf = self._buffers[i]
                buf.copy_(torch.where(skip.to(buf.device), self._copies[i], buf))

    def drop(self) -> None:
        """The step is done: the next training step takes a new snapshot."""
        self._buffers, self._owners = [], []


def _find(
    module: nn.Module, optimizers: Iterable[Optimizer]
) -> tuple[list[tuple[dict, str, Tensor]], list[Optional[frozenset[int]]]]:
    """Every buffer of ``module`` (where it sits: its module's ``_buffers`` and key) and the optimizers it belongs
    to."""
    found: list[tuple[nn.Module, dict, str, Tensor]] = []
    seen: set[int] = set()
    for sub in module.modules():
        for key, buf in sub._buffers.items():
            if buf is not None and id(buf) not in seen and not buf.is_inference():
                seen.add(id(buf))
                found.append((sub, sub._buffers, key, buf))
    if not found:
        return [], []
    owner_of: dict[int, set[int]] = {}
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []):
            for p in group["params"]:
                owner_of.setdefault(id(p), set()).add(id(opt))
    owners: list[Optional[frozenset[int]]] = []
    for sub, _, _, _ in found:
        own = set().union(*(owner_of.get(id(p), set()) for p in sub.parameters(recurse=False)))
        owners.append(frozenset(own) if own else None)
    return [(slots, key, buf) for _, slots, key, buf in found], owners
