"""Reading small device tensors on the host without stalling the device."""

from __future__ import annotations

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
