"""Reading small device tensors on the host without stalling the device."""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional, cast

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


class _Batch:
    """Pinned host memory for one batch of flags, read through ``ctypes`` (no torch call a read)."""

    __slots__ = ("host", "first", "values", "held", "sent", "left")

    def __init__(self, size: int, pinned: bool) -> None:
        self.host = torch.full((size,), math.nan, dtype=torch.float32, pin_memory=pinned)
        self.first = self.host[0]  # (a batch of one copies into this 0-dim view: no slicing a step)
        self.values = (ctypes.c_float * size).from_address(self.host.data_ptr())  # (kept alive by ``host``)
        self.held: list[Tensor] = []  # the device flags pushed, not sent yet
        self.sent = False
        self.left = 0  # values sent and not taken yet


class HostBatches:
    """One-element fp32 CUDA tensors (verdict flags) copied to the host ``size`` at a time, without an event.

    ``push`` holds the tensor (no device call); every ``size`` pushes, one stack and one copy take the batch into
    pinned memory prefilled with NaN, so that the host reads a value without waiting and tells a landed one (a verdict
    is 0 or 1) from one on its way. ``ready`` says whether a value has landed (never before its batch was sent);
    ``take`` returns it, sending its batch early where it has not gone yet and waiting for the device where the copy
    has not landed (a NaN on the device itself is waited out, then returned). Values are taken in the order they were
    pushed. A batch of one copies each flag as it comes. What a flag holds when its batch goes is what is read: the
    flags pushed are final (a step's verdict, recorded after its step). (On the CPU the copies are immediate: the
    counters' tests run the same logic there.)
    """

    def __init__(self, device: torch.device, size: int) -> None:
        if size < 1:
            raise ValueError(f"HostBatches size={size!r} is invalid: use an integer >= 1.")
        self.device, self.size = device, size
        self._open: Optional[_Batch] = None
        self._spare: list[_Batch] = []

    def accepts(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` can travel this way (else :class:`HostCopy`): a 0-dim fp32 tensor on this device."""
        return tensor.dtype == torch.float32 and tensor.dim() == 0 and tensor.device == self.device

    def push(self, tensor: Tensor) -> tuple[_Batch, int]:
        """Hold ``tensor`` (see :meth:`accepts`) for its batch's copy; returns where its value will be."""
        batch = self._open
        if batch is None:
            batch = self._open = self._spare.pop() if self._spare else _Batch(self.size, self.device.type == "cuda")
        held = batch.held
        held.append(tensor)
        if len(held) == self.size:
            self._send()
        return batch, len(held) - 1

    def _send(self) -> None:
        batch = cast(_Batch, self._open)
        self._open = None
        held, batch.held = batch.held, []
        if len(held) == 1:
            batch.first.copy_(held[0], non_blocking=True)
        else:  # (the stacked copy is freed after the copy is enqueued: the stream's order keeps it until then)
            batch.host[: len(held)].copy_(torch.stack(held), non_blocking=True)
        batch.sent, batch.left = True, len(held)

    def ready(self, entry: tuple[_Batch, int]) -> bool:
        batch, i = entry
        return batch.sent and not math.isnan(batch.values[i])

    def take(self, entry: tuple[_Batch, int]) -> float:
        batch, i = entry
        if not batch.sent:  # (the open batch: the ones before it have gone)
            self._send()
        value = batch.values[i]
        if math.isnan(value) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # not landed yet (or NaN on the device): the copy is done after this
            value = batch.values[i]
        batch.left -= 1
        if batch.left == 0:  # every value read: the copy has landed; the buffer is free again
            batch.host.fill_(math.nan)
            batch.sent = False
            self._spare.append(batch)
        return value

