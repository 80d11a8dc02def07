"""The inf/NaN check of a large model, run while backward is still running.

In the modes without a loss scale (``fp32``, ``tf32``, ``bf16``) the verdict needs one read of every gradient. After
backward that read is on the step's critical path (about 2.7 ms of a 345 ms step on the 1.89 B GPT of
benchmarks/RESULTS.md, H200). Here each gradient's largest magnitude is taken as soon as autograd has accumulated it
(``register_post_accumulate_grad_hook``), on a side CUDA stream, so the reads run beside the rest of backward; after
backward the verdict is one small reduction of those maxima.

A maximum counts only for the gradient tensor it was taken from, at the version it had: anything that replaces or
writes a gradient afterwards (DDP's all-reduce, a hook, an earlier micro-batch's gradient of a parameter the last
one did not use) leaves the check to the usual pass after backward; under several processes (DDP reduces, and a
communication hook may compress, the gradients after these hooks) the usual pass runs. Only models large enough for
backward to be bound by the GPU get the hooks (:data:`MIN_NUMEL`, :data:`MIN_NUMEL_PER_GRAD`): on a small model, or
on one of many small gradients, a launch per gradient would cost host time the GPU cannot hide.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

#: a model needs at least this many trainable elements on one device for the overlapped check
MIN_NUMEL = 1 << 27
#: and at least this many a gradient on average: each hook costs tens to hundreds of µs of host time (a launch on a
#: side stream, two stream events), which only a gradient whose backward takes longer on the GPU hides. A LitGPT
#: 12 x 768 model (163 M elements in 148 gradients, 1.1 M each) ran 28 % slower under Fabric with the hooks (H200);
#: the 1.89 B GPT of benchmarks/RESULTS.md (about 19 M a gradient) gains 2.7 ms a step with them
MIN_NUMEL_PER_GRAD = 1 << 22
#: device types it runs on (on the CPU there is nothing to overlap with; tests add it to check the logic)
DEVICE_TYPES: tuple[str, ...] = ("cuda",)


class OverlappedCheck:
    """Per-gradient maxima taken during backward on a side stream; :meth:`verdict` turns them into the step's flag."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._maxima: dict[int, tuple[Tensor, int, Tensor]] = {}  # id(param) -> (grad, its version, max |grad|)
        self._stream: Optional[torch.cuda.Stream] = None
        self._armed = False
        self.norm = float("inf")

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self, optimizers: list[Optimizer], norm: float = float("inf")) -> bool:
        """Hook the dense CUDA parameters of ``optimizers`` if they are many enough; returns whether it did.

        ``norm``: ``inf`` (each gradient's largest magnitude; :meth:`verdict` gives the largest) or ``2.0`` (each
        gradient's L2 norm; :meth:`verdict` gives the total L2 norm, inf/NaN as well when a gradient holds one).
        """
        self.remove()
        self.norm = norm
        params = [
            p for opt in optimizers for group in opt.param_groups for p in group["params"]
            if isinstance(p, Tensor) and p.requires_grad and type(p.data) is Tensor and not p.is_sparse
        ]
        unique = list({id(p): p for p in params}.values())
        numel = sum(p.numel() for p in unique)
        if not unique or numel < MIN_NUMEL or numel < MIN_NUMEL_PER_GRAD * len(unique):
            return False  # (a small model, or many small gradients: launch-bound, the hooks would cost host time)
        if len({p.device for p in unique}) != 1:
            return False
        device = params[0].device
        if device.type not in DEVICE_TYPES:
            return False
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # DDP reduces (and a comm hook may compress) the gradients after these hooks: the check after backward
            # sees what the step applies
            return False
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in unique]
        return True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._maxima, self._armed = [], {}, False

    def arm(self) -> None:
        """A training backward is about to run: take the maxima of the gradients it leaves."""
        self._maxima = {}
        self._armed = self.installed

    def _hook(self, param: Tensor) -> None:
        grad = param.grad
        if not self._armed or grad is None or grad.is_sparse or type(grad) is not Tensor:
            return
        side = self._stream
        if side is None:  # (no stream to overlap on: the same figures, in line)
            with torch.no_grad():
                biggest = torch.linalg.vector_norm(grad, self.norm) if grad.numel() else grad.new_zeros(())
        else:
            side.wait_stream(torch.cuda.current_stream(grad.device))  # the gradient is complete on the main stream
            with torch.cuda.stream(side), torch.no_grad():
                biggest = torch.linalg.vector_norm(grad, self.norm) if grad.numel() else grad.new_zeros(())
            grad.record_stream(side)  # freed on the main stream while the side one may still read it: kept till done
        self._maxima[id(param)] = (grad, grad._version, biggest)

    def forget(self) -> None:
        """The figures taken are of no use this step (the step applies other gradients): let them and their
        gradients go."""
        self._maxima, self._armed = {}, False

    def verdict(self, optimizer: Optimizer) -> Optional[Tensor]:
        """The largest magnitude (or the total L2 norm) over ``optimizer``'s gradients as backward left them, or
        ``None`` where a gradient has no figure taken from it as it is now (the caller checks the usual way)."""
        self._armed = False
        if not self._maxima:
            return None
        maxima = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                seen = self._maxima.get(id(param))
                if seen is None or seen[0] is not grad or seen[1] != grad._version:
                    self._maxima = {}
                    return None
                maxima.append(seen[2])
        if not maxima:
            return None
        self._maxima = {}  # (the gradients themselves are not kept past the step: the step may release them)
        if self._stream is not None:
            torch.cuda.current_stream(maxima[0].device).wait_stream(self._stream)
        figures = torch.stack(maxima).float()
        return figures.amax() if self.norm == float("inf") else figures.square().sum().sqrt()
