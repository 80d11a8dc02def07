"""Inf/NaN that an FP8 cast would hide: the saturation sentinel.

Transformer Engine casts to FP8 with saturation (``satfinite``): an inf entering an FP8 GEMM (an activation, or
a gradient flowing back into one) becomes the largest FP8 value times the scale. The GEMM's output, the loss and
every gradient then stay finite, so a check of the gradients alone lets the optimizer step on a poisoned batch.
NaN is not saturated and reaches the gradients, but an inf does not.

The sentinel watches what goes into the FP8 casts and keeps a device flag (no host sync) that the plugin adds to
the step's inf/NaN verdict, so such a step is skipped like any other:

* **delayed scaling** (``"amax"``): TE records the absolute maximum of every tensor it casts (inputs, weights,
  output gradients) in its amax buffers, and reduces them once per forward and once per backward. The sentinel
  reads those buffers just before each reduction, in one fused kernel: nothing is read twice.
* **other recipes** (``"hooks"``: current, block, mxfp8 keep no amax between casts): the input of every FP8
  module and the gradient of its output are checked with one max-reduction each (a read of the tensor; the
  cost is measured in benchmarks/RESULTS.md).

Example (a plain loop; ``MPPlugin("fp8")`` does this itself)::

    sentinel = SaturationSentinel()
    sentinel.attach(model, delayed=True)
    loss = model(x); loss.backward()
    flag = sentinel.take()          # a device tensor, > 0 when an FP8 operand held inf/NaN; reset
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn

# sentinels watching TE's delayed-scaling reductions, and the original method they wrap
_AMAX_WATCHERS: "weakref.WeakSet[SaturationSentinel]" = weakref.WeakSet()
_ORIGINAL_REDUCE: dict[int, Any] = {}


def _amax_buffers(manager: Any, forward: bool) -> list[Tensor]:
    """The amax rows TE is about to reduce (forward or backward), from its global buffer; [] if unknown."""
    state = getattr(manager, "quantization_state", None)
    buffers = getattr(state, "global_amax_buffer", None) if state is not None else None
    if buffers is None:
        buffers = getattr(manager, "global_amax_buffer", None)  # older TE: a class attribute
    if not isinstance(buffers, dict):
        return []
    split = getattr(manager, "split_key_in_buffer", None)
    out: list[Tensor] = []
    for key, tensors in buffers.items():
        if callable(split):
            try:
                is_forward = bool(split(key)[0])
            except Exception:  # an unexpected key layout: check it anyway (a check never changes training)
                is_forward = forward
        else:
            is_forward = forward
        if is_forward == forward:
            out.extend(t for t in tensors if isinstance(t, Tensor) and t.numel())
    return out


def install_amax_watch(manager: Any) -> bool:
    """Wrap ``manager.reduce_and_update_fp8_tensors`` (TE's ``FP8GlobalStateManager``) once; returns success.

    The wrapper hands the amax rows to every attached sentinel, then calls TE's own method unchanged.
    """
    if id(manager) in _ORIGINAL_REDUCE:
        return True
    original = manager.__dict__.get("reduce_and_update_fp8_tensors")
    if not isinstance(original, classmethod):
        return False

    def reduce_and_update_fp8_tensors(cls: Any, forward: bool = True, *args: Any, **kwargs: Any) -> Any:
        watchers = list(_AMAX_WATCHERS)
        if watchers:
            amaxes = _amax_buffers(cls, forward)
            for sentinel in watchers:
                sentinel.observe(amaxes, scrub=True)
        return original.__func__(cls, forward, *args, **kwargs)

    reduce_and_update_fp8_tensors.__doc__ = original.__func__.__doc__
    manager.reduce_and_update_fp8_tensors = classmethod(reduce_and_update_fp8_tensors)
    _ORIGINAL_REDUCE[id(manager)] = (manager, original)
    return True


def uninstall_amax_watch() -> None:
    """Put TE's own methods back (when no sentinel watches any more)."""
    for manager, original in list(_ORIGINAL_REDUCE.values()):
        manager.reduce_and_update_fp8_tensors = original
    _ORIGINAL_REDUCE.clear()


def _te_manager() -> Any:
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # TE >= 2.9
    except ImportError:
        try:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        except ImportError:
            return None
    return FP8GlobalStateManager


def _first_tensor(args: tuple, kwargs: dict) -> Optional[Tensor]:
    if args and isinstance(args[0], Tensor):
        return args[0]
    for value in kwargs.values():
        if isinstance(value, Tensor):
            return value
    return None


class SaturationSentinel:
    """A device flag raised when a tensor going into an FP8 cast holds inf/NaN (see the module docstring).

    Args:
        manager: TE's ``FP8GlobalStateManager`` (``None``: imported from Transformer Engine when needed); tests
            pass a stand-in.
    """

    def __init__(self, manager: Any = None) -> None:
        self._manager = manager
        self.mode: Optional[str] = None
        self._flag: Optional[Tensor] = None
        self._handles: list[Any] = []
        self._root: Optional[weakref.ref] = None

    # ------------------------------------------------------------------ set-up
    def attach(self, modules: list[nn.Module], *, delayed: bool, root: Optional[nn.Module] = None) -> str:
        """Watch ``modules`` (the FP8 modules); ``delayed``: the recipe is delayed scaling. Returns the mode.

        ``root``: the model; while it is in eval mode (validation with ``fp8_in_eval`` and grad enabled) TE's
        reductions are not watched, as no optimizer step follows them.
        """
        self.detach()
        self._root = weakref.ref(root) if root is not None else None
        if delayed:
            manager = self._manager if self._manager is not None else _te_manager()
            if manager is not None and install_amax_watch(manager):
                _AMAX_WATCHERS.add(self)
                self.mode = "amax"
                return self.mode
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._check_input, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._watch_output_grad))
        self.mode = "hooks"
        return self.mode

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _AMAX_WATCHERS.discard(self)
        if not _AMAX_WATCHERS:
            uninstall_amax_watch()
        self.mode = None

    # ------------------------------------------------------------------ watching
    def _raise(self, worst: Tensor) -> None:
        """Add 1 to the flag when ``worst`` (a 0-dim max of magnitudes) is inf or NaN."""
        bad = ~torch.isfinite(worst)
        if self._flag is None or self._flag.device != worst.device:
            self._flag = torch.zeros((), dtype=torch.float32, device=worst.device)
        self._flag.add_(bad)

    def observe(self, tensors: list[Tensor], *, scrub: bool = False) -> None:
        """Check ``tensors`` (amaxes, or any tensors): one fused max-reduction, no host sync.

        ``scrub`` (TE's amax rows, just before TE folds them into its history): once the flag is up, zero them
        in place. TE keeps a scale whose amax is 0, so the poisoned step leaves no inf in the amax history
        (which would otherwise hold the scales still for ``amax_history_len`` steps) and the scales stay where
        they were, as the skipped step leaves the weights.
        """
        if not tensors:
            return
        root = self._root() if self._root is not None else None
        if root is not None and not root.training:
            return
        with torch.no_grad():
            tensors = [t.detach() for t in tensors]
            norms = torch._foreach_norm(tensors, math.inf)
            self._raise(torch.stack([n.float() for n in norms]).max())
            if scrub:
                assert self._flag is not None
                torch._foreach_clamp_max_(tensors, torch.finfo(torch.float32).max)  # inf * 0 would be NaN
                torch._foreach_mul_(tensors, (self._flag == 0).to(tensors[0].dtype))

    def _check_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        x = _first_tensor(args, kwargs)
        if x is not None and x.is_floating_point() and x.numel():
            with torch.no_grad():
                self._raise(torch.linalg.vector_norm(x.detach(), math.inf))
        return None

    def _watch_output_grad(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(self._check_grad)
        return None

    def _check_grad(self, grad: Tensor) -> None:
        if grad.numel():
            with torch.no_grad():
                self._raise(torch.linalg.vector_norm(grad, math.inf))

    # ------------------------------------------------------------------ reading
    def take(self) -> Optional[Tensor]:
        """The flag since the last ``take`` (a new tensor, 0 or more), and reset it; ``None`` if nothing ran."""
        flag = self._flag
        if flag is not None:
            self._flag = torch.zeros_like(flag)  # one fill; the caller keeps the tensor it got
        return flag
