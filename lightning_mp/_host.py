"""Reading small device tensors on the host without stalling the device."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor


class HostCopy:
    """A one-element device tensor copied to the host without waiting.

    ``start`` enqueues the copy (into a reused pinned buffer on CUDA), ``ready`` says whether it has landed and
    ``value`` returns it, waiting for that copy alone, never for the whole device. Read a step later, the wait is
    long over. On the CPU the copy is immediate.
    """

    def __init__(self) -> None:
        self._host: Optional[Tensor] = None
        self._event: Optional[Any] = None  # set once a copy went the CUDA way (into the pinned buffer)

    @property
    def started(self) -> bool:
        return self._host is not None

    def start(self, tensor: Tensor) -> None:
        tensor = tensor.detach().reshape(())
        if tensor.device.type != "cuda":
            self._host, self._event = tensor.clone(), None
        else:
            if self._host is None or self._host.dtype != tensor.dtype or self._event is None:  # no pinned buffer yet
                self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def value(self) -> Any:
        assert self._host is not None, "HostCopy.value() before start()"
        if self._event is not None:
            self._event.synchronize()
        return self._host.item()


class HostRing:
    """One-element fp32 CUDA tensors copied to the host in order, without an event a copy.

    A ring of pinned slots, each holding NaN until its copy lands: ``push`` enqueues the copy into the next slot,
    ``ready`` reads the slot (a landed value is never NaN, except where the device value was NaN itself, which
    ``take`` then waits out), ``take`` returns the value (waiting for the device where it has not landed) and frees
    the slot. Slots are taken in the order they were pushed; at most ``size`` are outstanding.
    """

    def __init__(self, device: torch.device, size: int) -> None:
        self.device = device
        host = torch.full((size,), math.nan, dtype=torch.float32, pin_memory=True)
        self._slots = list(host.unbind())  # 0-dim views, made once
        self._next = 0
        self._outstanding = 0

    def accepts(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` can travel this way (else :class:`HostCopy`): a 0-dim fp32 tensor on this ring's device
        (a verdict flag: no autograd history), and a free slot."""
        return (
            tensor.dtype == torch.float32 and tensor.dim() == 0 and tensor.device == self.device
            and self._outstanding < len(self._slots)
        )

    def push(self, tensor: Tensor) -> int:
        """Enqueue the copy of ``tensor`` (see :meth:`accepts`); returns its slot."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        self._outstanding += 1
        self._slots[i].copy_(tensor, non_blocking=True)
        return i

    def ready(self, i: int) -> bool:
        return not math.isnan(self._slots[i].item())

    def take(self, i: int) -> float:
        slot = self._slots[i]
        value = slot.item()
        if math.isnan(value):
            torch.cuda.synchronize(self.device)  # not landed yet (or NaN on the device): the copy is done after this
            value = slot.item()
        slot.fill_(math.nan)
        self._outstanding -= 1
        return value
