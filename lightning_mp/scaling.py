"""Dynamic loss scaling with hysteresis, a floor and a cap, and the non-finite step guard used in every mode.

:class:`DynamicLossScaler` is a drop-in ``torch.amp.GradScaler``: the same arguments (``enabled`` included), the
same protocol (``scale``/``unscale_``/``step``/``update``; fused optimizers get ``grad_scale`` and ``found_inf``) and
a state dict torch's scaler reads. When the scale moves is :class:`ScalePolicy`'s business (hysteresis, floor,
cap); the scaler adds skip counters, a check-only mode and a verdict shared across ranks.

The scaler keeps ``torch.amp.GradScaler``'s fused kernels and its one host sync per step
(none with fused optimizers): the inf/NaN check is ``torch._amp_foreach_non_finite_check_and_unscale_``,
the scale update is ``torch._amp_update_scale_`` plus a few device-side tensor ops, and the skip
counters live on the device.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_mp.settings import (
    DEFAULTS,
    check_factors,
    check_growth_interval,
    check_int,
    check_scale,
    check_scaler_arguments,
)


_DTensor: Optional[type]
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


# ---------------------------------------------------------------------- values the device tensors can hold
_F32 = torch.finfo(torch.float32)  # the scale is a float32 tensor
_INT32 = torch.iinfo(torch.int32)  # the growth and hysteresis trackers are int32 tensors
_INT64_MAX = torch.iinfo(torch.int64).max  # the skip counters are int64
_COUNTERS = ("steps", "skipped_steps", "consecutive_skips", "last_skipped")
#: up to this many gradient elements on a device, the check-only pass is torch's fused check-and-unscale kernel with
#: a scale of 1 (one launch, and it rewrites each gradient with itself); above it, the read-only inf-norm pass,
#: which reads the gradients without writing them (half the memory traffic: what counts on large models, whose
#: step is bound by the GPU; above this size their check runs during backward, see lightning_mp.overlap). Below it
#: a step is mostly bound by the host, where one launch beats five and a stack of every gradient's maximum
#: (measured on a 46 M-parameter GPT on an H100: benchmarks/RESULTS.md)
FUSED_CHECK_MAX_NUMEL = 1 << 27
_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


# ---------------------------------------------------------------------- the policy: when the scale moves
@dataclass(frozen=True)
class ScalePolicy:
    """When the loss scale moves: Megatron-LM's ``DynamicGradScaler.update(found_inf)``, on device tensors.

    An overflow spends one unit of the hysteresis budget and restarts the growth count; once the budget is spent
    the scale backs off by ``backoff_factor``. ``growth_interval`` clean steps in a row grow it by
    ``growth_factor`` (torch's rule, with its guard against growing to inf). The budget refills when the scale
    grows, and with ``consecutive_hysteresis`` on every clean step (then N overflows *in a row* back off).
    The scale stays in ``[min_scale, max_scale]``. ``hysteresis=1`` without bounds is torch's GradScaler.
    """

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int = 1
    consecutive_hysteresis: bool = True
    min_scale: float = _F32.tiny
    max_scale: float = _F32.max

    def update_(
        self, scale: torch.Tensor, growth_tracker: torch.Tensor, budget: torch.Tensor, found_inf: torch.Tensor
    ) -> None:
        """One step: move ``scale`` (float32), ``growth_tracker`` and ``budget`` (int32) in place; ``found_inf`` is
        a 0-dim bool tensor. Device ops only: no host sync."""
        budget_left = budget - found_inf.int()
        backoff = found_inf & (budget_left <= 0)
        previous = scale.clone()
        # torch's kernel: back off (restarting the growth count), or count a clean step and grow every interval
        torch._amp_update_scale_(
            scale, growth_tracker, backoff.float(), self.growth_factor, self.backoff_factor, self.growth_interval
        )
        scale.copy_(torch.where(found_inf & ~backoff, previous, scale))  # an overflow hysteresis absorbs keeps it
        growth_tracker.masked_fill_(found_inf, 0)  # any overflow restarts the growth count
        refill = scale > previous
        if self.consecutive_hysteresis:
            refill = refill | ~found_inf
        budget.copy_(torch.where(refill, torch.full_like(budget, self.hysteresis), budget_left))
        scale.clamp_(self.min_scale, self.max_scale)


# ---------------------------------------------------------------------- the scaler
class DynamicLossScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` that adds hysteresis, a min/max scale, skip counters and a check-only mode.

    Example::

        scaler = DynamicLossScaler("cpu", init_scale=2.0**10, hysteresis=2)
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)           # grads are now true gradients; clip here
        scaler.step(optimizer)               # skipped if any gradient is inf/NaN
        scaler.update()                      # backoff only after ``hysteresis`` overflows in a row
        scaler.skipped_steps                 # how many steps were skipped so far

    The first six arguments are ``torch.amp.GradScaler``'s, with the same meaning: ``enabled=False`` gives torch's
    disabled scaler (inputs pass through, ``step`` always steps, ``update`` does nothing, ``get_scale()`` is 1.0,
    ``state_dict()`` is empty; its settings are ignored, not checked, as torch's are), and so does ``"cuda"``
    without CUDA (torch warns). Optimizers with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD) get
    ``grad_scale`` and ``found_inf`` as torch hands them over, and skip on the device.

    Args:
        device: device type of the gradients (``"cuda"`` or ``"cpu"``).
        init_scale: the first loss scale.
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiply the scale by this on a backoff (0 < f < 1).
        growth_interval: clean steps between two growths.
        enabled: ``False`` turns scaling and step skipping off (torch's ``enabled``).
        hysteresis: overflowing steps needed before the scale backs off (1 = at once, as torch).
        consecutive_hysteresis: ``True`` refills the hysteresis budget on every clean step (N overflows in a
            row back off, as DeepSpeed's ``consecutive_hysteresis``); ``False`` refills it only when the scale
            grows (Megatron-LM's behaviour).
        min_scale: the scale never falls below this.
        max_scale: the scale never grows above this.
        dynamic: ``False`` keeps the scale at ``init_scale`` (a static loss scale); steps are still skipped.
        scaling: ``False`` runs only the non-finite step guard: the loss is not scaled (scale stays 1) but
            inf/NaN gradients are still found and the step skipped; this is how bf16/fp32 skip steps.

    Scales and bounds must fit a float32 tensor (``[1.18e-38, 3.40e38]``), ``growth_interval`` and ``hysteresis``
    an int32 one; anything else raises ``ValueError`` here rather than failing in training.
    """

    #: whether this scaler's own checks already give every rank the same verdict (then no extra all-reduce)
    verdict_agrees_across_ranks = False
    #: whether this scaler's class is the sharded one (FSDP)
    sharded = False

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = DEFAULTS["init_scale"],
        growth_factor: float = DEFAULTS["growth_factor"],
        backoff_factor: float = DEFAULTS["backoff_factor"],
        growth_interval: int = DEFAULTS["growth_interval"],
        enabled: bool = True,
        *,
        hysteresis: int = DEFAULTS["hysteresis"],
        consecutive_hysteresis: bool = DEFAULTS["consecutive_hysteresis"],
        min_scale: float = DEFAULTS["min_scale"],
        max_scale: float = DEFAULTS["max_scale"],
        dynamic: bool = True,
        scaling: bool = True,
    ) -> None:
        if enabled:  # a disabled scaler ignores its settings, as torch's does
            checked = check_scaler_arguments(
                init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
                scaling=scaling,
            )  # fmt: skip
            init_scale, min_scale, max_scale = checked["init_scale"], checked["min_scale"], checked["max_scale"]
            growth_factor, backoff_factor = checked["growth_factor"], checked["backoff_factor"]
            growth_interval, hysteresis = checked["growth_interval"], checked["hysteresis"]
        super().__init__(
            device,
            init_scale=init_scale if scaling else 1.0,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.dynamic = dynamic
        self.scaling = scaling
        # device-side state, created with the scale (lazily, on the loss's device)
        self._hysteresis_tracker: Optional[torch.Tensor] = None
        self._counters: Optional[torch.Tensor] = None  # int64 [steps, skipped_steps, consecutive_skips, last_skipped]
        self._init_counters = [0, 0, 0, 0]
        #: outcomes the host knows that the device counters do not hold yet: [steps, skipped, trailing skips,
        #: all skipped (0/1), last skipped]; see :meth:`update_from`
        self._host_tail: Optional[list[int]] = None
        #: check-only device verdicts not yet in the counters (folded in a batch of a few kernels; see _defer)
        self._deferred: list[torch.Tensor] = []
        self._init_hysteresis_tracker = hysteresis
        #: whether the last step was skipped, when known on the host without a sync (``None`` otherwise)
        self.last_skipped_host: Optional[bool] = None
        #: with several processes, agree on the inf/NaN verdict (all-reduce MAX) so every rank takes the same step
        self.sync_across_ranks = False
        if not self._enabled:  # torch keeps nothing; the empty slots let the reads below work unguarded
            self._scale = self._growth_tracker = None
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    @property
    def policy(self) -> ScalePolicy:
        """The scale policy in force (``set_growth_factor`` and friends, and checkpoints, change it)."""
        return ScalePolicy(
            self._growth_factor, self._backoff_factor, self._growth_interval, self.hysteresis,
            self.consecutive_hysteresis, self.min_scale, self.max_scale,
        )

    # ------------------------------------------------------------------ state on the device
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._counters = torch.tensor(self._init_counters, dtype=torch.int64, device=dev)

    def ensure_initialized(self, device: torch.device) -> None:
        """Create the device-side state now (normally done by the first ``scale()``)."""
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(device)

    @property
    def initialized(self) -> bool:
        return self._scale is not None

    # ------------------------------------------------------------------ the training-step API
    def scale(self, outputs: Any) -> Any:
        if self.scaling or not self._enabled:
            return super().scale(outputs)
        tensor = outputs if isinstance(outputs, torch.Tensor) else next(iter(outputs), None)
        if isinstance(tensor, torch.Tensor):
            self.ensure_initialized(tensor.device)
        return outputs  # check-only: multiplying by 1 would cost a kernel and change nothing

    def record_check_from_(self, optimizer: torch.optim.Optimizer, total: torch.Tensor) -> bool:
        """Check-only mode: take this step's inf/NaN verdict from a value computed over every gradient.

        Gradient clipping by norm already reads every gradient, and the total norm is inf/NaN when any gradient
        is (or when finite gradients are so large, beyond ~1e19, that their norm overflows: such a step is
        skipped too). Reusing it spares the separate check pass. Returns whether the verdict was taken.
        """
        ready = self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY
        if not self._enabled or self.scaling or not ready:
            return False  # (checked first: no flag kernel for a verdict that would not be taken)
        return self.record_verdict_(optimizer, (~torch.isfinite(total.detach())).float())

    def add_found_inf_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor, *, agreed: bool = False) -> None:
        """Fold another inf/NaN finding (a device tensor, > 0 when found) into this step's verdict, after the check.

        For what the gradients cannot show, e.g. an inf that an FP8 cast saturated into a finite value. The verdict
        stays 0 or 1 (fused optimizers skip on ``found_inf == 1``); no host sync. A disabled scaler skips nothing.
        Where the verdict was reduced over the ranks already (the sharded scaler's ``unscale_``), a flag that is one
        rank's (``agreed=False``) is reduced too, so every rank skips together; ``agreed=True`` for one that is the
        same on every rank (a total norm over all shards, a decision already reduced).
        """
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            raise RuntimeError("add_found_inf_() must follow unscale_() (or the check) for this optimizer.")
        bad = (flag.detach().reshape(()) > 0).float()
        if not agreed and self.sync_across_ranks and self.verdict_agrees_across_ranks:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # enqueued on the device
        found = state["found_inf_per_device"]
        if not found:
            found[bad.device] = bad
            return
        for device, value in found.items():
            value.copy_(torch.maximum(value, bad.to(device, non_blocking=True)).reshape(value.shape))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_``; in check-only mode (no loss scale) the check alone, without torch's reciprocal of a
        scale of 1 (the sharded scaler keeps torch's path: it reduces the verdict over the process group there)."""
        if self.scaling or not self._enabled or self.sharded:
            return super().unscale_(optimizer)
        scale = self._check_scale_growth_tracker("unscale_")[0]
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._check_grads_(optimizer, found_inf)
        state["stage"] = OptState.UNSCALED

    def unscale_once_(self, optimizer: torch.optim.Optimizer) -> None:
        """``unscale_`` unless it already ran for this optimizer since the last ``update()``."""
        if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):  # (ShardedGradScaler's default)
        if not self.scaling:
            return self._check_grads_(optimizer, found_inf)
        # fp16 gradients are legal here: half-precision weights keep half gradients;
        # torch only refuses them because unscaling could underflow them.
        source = _RealGradients(optimizer) if _has_complex_grads(optimizer) else optimizer
        return super()._unscale_grads_(source, inv_scale, found_inf, True)

    @staticmethod
    def _check_grads_(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """Check-only mode: find inf/NaN gradients, dividing nothing.

        Large gradients (above :data:`FUSED_CHECK_MAX_NUMEL` elements on a device): ``torch._foreach_norm(grads,
        inf)`` (the fused multi-tensor kernel that gradient clipping uses) gives each gradient's largest magnitude,
        and propagates NaN and inf; unlike ``_amp_foreach_non_finite_check_and_unscale_`` with scale 1 it writes
        nothing back, which halves the memory traffic of the check (measured in benchmarks/RESULTS.md). Small
        ones: that fused kernel with scale 1, one launch instead of five, which is what counts on a model whose
        step is bound by the host (``x * 1`` is ``x`` for every float, so the gradients keep their values).
        """
        plain = torch.Tensor
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return {}
        first = grads[0]
        if all(type(g) is plain for g in grads) and not any(g.is_sparse for g in grads):
            device, dtype = first.device, first.dtype
            if all(g.device == device and g.dtype == dtype for g in grads):  # one list: the common case
                nonempty = [g for g in grads if g.numel()]
                if not nonempty:
                    return {}
                flag = found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)
                check_tensors_({dtype: nonempty}, sum(g.numel() for g in nonempty), flag)
                return {device: flag}
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        numel: dict[torch.device, int] = defaultdict(int)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if type(grad) is not plain or grad.is_sparse:  # (a plain dense gradient, the common case, skips these)
                    grad = grad._values() if grad.is_sparse else grad
                    if _is_dtensor(grad):
                        grad = grad.to_local()  # a rank checks its own shard; the verdict is then all-reduced
                n = grad.numel()
                if n == 0:
                    continue  # an empty shard holds nothing to check (and the inf-norm of nothing is undefined)
                grouped[grad.device][grad.dtype].append(grad)
                numel[grad.device] += n
        found: dict[torch.device, torch.Tensor] = {}
        for device, per_dtype in grouped.items():
            flag = found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)
            check_tensors_(per_dtype, numel[device], flag)
            found[device] = flag
        return found

    def record_verdict_(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> bool:
        """Check-only mode: take this step's verdict (a 0/1 float flag) from a check made elsewhere over every gradient
        the optimizer will apply (the master weights' gather). Returns whether it was taken."""
        if not self._enabled or self.scaling:
            return False
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            return False
        self._check_scale_growth_tracker("record_verdict_")
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.UNSCALED
        return True

    def _check_for_fused_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a fused optimizer's step: find inf/NaN without unscaling (its kernel unscales), as torch does."""
        self._check_inf_per_device(optimizer)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args: Any, **kwargs: Any):
        # torch pays its one host sync here; keep its answer so the step's outcome is known without another.
        found = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self.last_skipped_host = found if self.last_skipped_host is None else (self.last_skipped_host or found)
        return None if found else optimizer.step(*args, **kwargs)

    def _fused_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        """Hand the optimizer ``grad_scale`` and ``found_inf`` for its fused kernel, as ``GradScaler.step`` does."""
        scale = cast(torch.Tensor, self._scale)  # step() checked that it is set
        found = [f.to(scale.device, non_blocking=True) for f in optimizer_state["found_inf_per_device"].values()]
        # one 0/1 flag (fused kernels skip on exactly 1; torch sums the devices' flags)
        many = len(found) > 1
        optimizer.found_inf = (  # type: ignore[attr-defined]  # fused steps' protocol, set as torch's GradScaler does
            torch.stack([f.reshape(()) for f in found]).amax() if many else found[0].reshape(())
        )
        # gradients unscale_ already divided, or never scaled (check-only), need no scale; else the scale, times any
        # the user set
        user = getattr(optimizer, "grad_scale", None)
        optimizer.grad_scale = (  # type: ignore[attr-defined]  # as found_inf
            user
            if optimizer_state["stage"] is OptState.UNSCALED or not self.scaling
            else scale * (1 if user is None else user)
        )
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]  # as found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``GradScaler.step``: unscale unless done, then step unless a gradient is inf/NaN.

        A fused optimizer (``_step_supports_amp_scaling``) is not unscaled first: it gets ``grad_scale`` and
        ``found_inf``, unscales in its kernel and skips on the device, exactly as torch's scaler has it.
        """
        if not self._enabled:
            self.last_skipped_host = False
            return optimizer.step(*args, **kwargs)
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and "grad_scaler" in inspect.signature(optimizer.step).parameters:
            return super().step(optimizer, *args, **kwargs)  # torch's deprecated contract: it passes itself
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale = self._check_scale_growth_tracker("step")[0]
        if not any(s["stage"] is OptState.STEPPED for s in self._per_optimizer_states.values()):
            self.last_skipped_host = None  # the first step since update(): a fresh verdict
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            if fused:
                self._check_for_fused_step(optimizer)
            else:
                self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            # no parameter of this optimizer has a gradient: nothing to check and nothing would change
            state["found_inf_per_device"] = {scale.device: torch.zeros((), device=scale.device)}
        if self.sync_across_ranks and not self.verdict_agrees_across_ranks:
            # a gradient poisoned after DDP's all-reduce exists on one rank only: every rank must skip with it.
            # The collective is enqueued on the device (no host sync).
            for found in state["found_inf_per_device"].values():
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        step = self._fused_step if fused else self._maybe_opt_step
        retval = step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        """Update counters and the scale from this step's inf checks, on the device (no host sync)."""
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            super().update(new_scale)
            scale.clamp_(self.min_scale, self.max_scale)
            return
        found_infs = [
            found_inf.to(device=scale.device, non_blocking=True).reshape(())
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update().")
        overflow = (found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()) > 0
        self._fold_deferred()
        self._flush_host_tail()
        counters = self._counters
        assert counters is not None and self._hysteresis_tracker is not None
        # [steps, skipped_steps, consecutive_skips, last_skipped] = [s + 1, k + x, (c + 1) * x, x] for x = skipped,
        # as counters * [1, 1, x, 0] + [1, x, x, x]: four kernels
        keep_mask, keep_base, add_mask, add_base = _counter_masks(counters.device)
        skipped = overflow.long().expand(4)
        counters.mul_(torch.where(keep_mask, skipped, keep_base)).add_(torch.where(add_mask, skipped, add_base))
        if self.scaling and self.dynamic:
            self.policy.update_(scale, growth_tracker, self._hysteresis_tracker, overflow)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
        """This step's inf/NaN verdict for ``optimizer`` as a device tensor (no sync; valid until ``update()``)."""
        state = self._per_optimizer_states.get(id(optimizer))
        found = list(state["found_inf_per_device"].values()) if state is not None else []
        if not found:
            return None
        return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device) for f in found]).sum()

    def begin_step(self) -> None:
        """Forget the host-side outcome of the previous step (called before each optimizer step)."""
        self.last_skipped_host = None

    # ------------------------------------------------------------------ reading (each read syncs)
    def _counter(self, i: int) -> int:
        self._fold_deferred()
        self._flush_host_tail()
        return int(self._counters[i].item()) if self._counters is not None else self._init_counters[i]

    def _count_on_host(self, skipped: bool) -> None:
        """A step whose outcome the host knows, counted without touching the device (see :meth:`update_from`)."""
        if self._deferred:
            self._fold_deferred()  # (the order of outcomes matters for the streak)
        tail = self._host_tail
        if tail is None:
            tail = self._host_tail = [0, 0, 0, 1, 0]
        x = int(skipped)
        tail[0] += 1
        tail[1] += x
        tail[2] = tail[2] + 1 if x else 0
        tail[3] &= x
        tail[4] = x

    def _defer(self, flag: torch.Tensor) -> None:
        """A check-only step's outcome known on the device only: kept, and folded into the counters every
        ``_DEFER_LIMIT`` steps or when they are read (a few kernels for many steps instead of several a step)."""
        if self._host_tail is not None:
            self._flush_host_tail()
        self._deferred.append(flag.reshape(()))
        if len(self._deferred) >= _DEFER_LIMIT:
            self._fold_deferred()

    def _fold_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        counters = self._counters
        if not deferred or counters is None:
            return
        skipped = (torch.stack([f.to(counters.device) for f in deferred]) > 0).long()
        n = len(deferred)
        trailing = skipped.flip(0).cumprod(0).sum()  # skips at the end, in a row
        # [steps, skipped_steps, consecutive_skips, last_skipped]
        counters[0].add_(n)
        counters[1].add_(skipped.sum())
        counters[2].copy_(torch.where(trailing == n, counters[2] + n, trailing))
        counters[3].copy_(skipped[-1])

    def _flush_host_tail(self) -> None:
        """Fold the host-known outcomes into the device counters (no sync)."""
        tail, self._host_tail = self._host_tail, None
        if tail is None:
            return
        n, m, trailing, all_skipped, last = tail
        counters = self._counters
        if counters is None:
            s, k, c, _ = self._init_counters
            self._init_counters = [s + n, k + m, c + n if all_skipped else trailing, last]
            return
        counters.add_(torch.tensor([n, m, n if all_skipped else 0, 0], dtype=torch.int64).to(counters.device))
        if not all_skipped:
            counters[2].fill_(trailing)
        counters[3].fill_(last)

    @property
    def steps(self) -> int:
        return self._counter(0)

    @property
    def skipped_steps(self) -> int:
        return self._counter(1)

    @property
    def consecutive_skips(self) -> int:
        return self._counter(2)

    @property
    def last_skipped(self) -> bool:
        if self.last_skipped_host is not None:
            return self.last_skipped_host
        return bool(self._counter(3))

    def counters_tensor(self) -> Optional[torch.Tensor]:
        """The device tensor ``[steps, skipped_steps, consecutive_skips, last_skipped]`` (no sync)."""
        self._fold_deferred()
        self._flush_host_tail()
        return self._counters

    def get_scale(self) -> float:
        return super().get_scale() if self.scaling else 1.0

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state plus hysteresis, bounds and counters: plain numbers only (``{}`` when disabled)."""
        if not self._enabled:
            return {}
        state = super().state_dict()
        state.update(
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            _hysteresis_tracker=(
                int(self._hysteresis_tracker.item())
                if self._hysteresis_tracker is not None
                else self._init_hysteresis_tracker
            ),
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            dynamic=self.dynamic,
            scaling=self.scaling,
            steps=self.steps,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            last_skipped=int(self._counter(3)),
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict or a plain ``torch.amp.GradScaler`` one (its extras keep their values).

        Every value is checked before anything is loaded: a scale that is not a positive float32 number, or a
        counter that is not a whole number in range, raises ``ValueError`` naming the field and its value.
        A disabled scaler loads nothing, as torch's.
        """
        if not self._enabled:
            return
        if not state_dict:
            raise KeyError("The loss-scaler state is empty, possibly because it was saved from a disabled GradScaler.")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise KeyError(
                f"Loss-scaler state is missing {sorted(missing)}; it is not a GradScaler/DynamicLossScaler state dict."
            )
        torch_state = self._checked_torch_state(state_dict)
        counters = [
            check_int(key, state_dict.get(key, now), 0, high, "a count of steps", allow_bool=True)
            for key, now, high in zip(_COUNTERS, self._counters_now(), (_INT64_MAX,) * 3 + (1,))
        ]
        tracker = check_int(
            "_hysteresis_tracker", state_dict.get("_hysteresis_tracker", self.hysteresis), _INT32.min, _INT32.max,
            "an int32 tensor; below 0 after overflows past the budget is normal",
        )
        if self.scaling and state_dict.get("scaling", True):
            super().load_state_dict(torch_state)
        self._init_counters = counters
        self._host_tail, self._deferred = None, []
        if self._counters is not None:
            self._counters.copy_(torch.tensor(counters, dtype=torch.int64))
        self._init_hysteresis_tracker = tracker
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(tracker)

    @staticmethod
    def _checked_torch_state(state_dict: dict[str, Any]) -> dict[str, Any]:
        """GradScaler's five entries, checked, as plain floats and ints."""
        growth_factor, backoff_factor = check_factors(state_dict["growth_factor"], state_dict["backoff_factor"])
        return {
            "scale": check_scale("scale", state_dict["scale"], smallest=0.0),
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": check_growth_interval(state_dict["growth_interval"]),
            "_growth_tracker": check_int(
                "_growth_tracker", state_dict["_growth_tracker"], 0, _INT32.max,
                "clean steps since the last growth, in an int32 tensor",
            ),
        }

    def _counters_now(self) -> list[int]:
        return [self._counter(i) for i in range(4)]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_init_counters"] = self._counters_now()
        state["_counters"] = state["_host_tail"] = None
        state["_deferred"] = []
        if self._hysteresis_tracker is not None:
            state["_init_hysteresis_tracker"] = int(self._hysteresis_tracker.item())
        state["_hysteresis_tracker"] = None
        return state

    # ------------------------------------------------------------------ what lightning_mp.step uses
    @classmethod
    def adopt(cls, given: torch.amp.GradScaler, *, sharded: bool = False) -> "DynamicLossScaler":
        """The scaler a user handed to ``MPPlugin(scaler=...)``: ours as it is; torch's settings and state
        carried over.
        """
        if isinstance(given, DynamicLossScaler):
            return given
        if not isinstance(given, torch.amp.GradScaler):
            if all(callable(getattr(given, m, None)) for m in ("scale", "unscale_", "step", "update")):
                return given  # a stand-in with GradScaler's methods (a test double): used as it is, as Lightning does
            raise TypeError(
                f"MPPlugin(scaler=...) takes a torch.amp.GradScaler or a lightning_mp.DynamicLossScaler, not"
                f" {type(given).__name__}."
            )
        target = ShardedDynamicLossScaler if sharded else DynamicLossScaler
        floor, cap = float(torch.finfo(torch.float32).tiny), float(torch.finfo(torch.float32).max)  # torch has none
        if type(given) is torch.amp.GradScaler and not sharded:
            # used as given (``trainer.scaler is scaler``, as with Lightning's MixedPrecision): the object becomes a
            # DynamicLossScaler in place (still a torch.amp.GradScaler), its settings and state kept, no floor or cap
            given.__class__ = DynamicLossScaler
            cast(DynamicLossScaler, given)._adopted(floor, cap)
            return cast(DynamicLossScaler, given)
        if not given.is_enabled():  # a disabled GradScaler keeps no settings: ours is disabled too
            return target(given._device, enabled=False)
        scale = given._init_scale if given._scale is None else float(given.get_scale())
        scaler = target(
            given._device,
            init_scale=scale,
            growth_factor=given._growth_factor,
            backoff_factor=given._backoff_factor,
            growth_interval=given._growth_interval,
            min_scale=floor,
            max_scale=cap,
        )
        if given._scale is not None:
            scaler.load_state_dict(given.state_dict())
        return scaler

    def _adopted(self, min_scale: float, max_scale: float) -> None:
        """What ``__init__`` adds to a ``torch.amp.GradScaler`` made a DynamicLossScaler in place (:meth:`adopt`)."""
        self.hysteresis, self.consecutive_hysteresis = 1, True
        self.min_scale, self.max_scale = min_scale, max_scale
        self.dynamic = self.scaling = True
        self._init_counters, self._init_hysteresis_tracker = [0, 0, 0, 0], 1
        self._hysteresis_tracker = self._counters = self._host_tail = None
        self._deferred = []
        self.last_skipped_host, self.sync_across_ranks = None, False
        if not self._enabled:
            self._scale = self._growth_tracker = None
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        elif self._scale is not None:  # already scaled a loss: the device state joins it
            self._hysteresis_tracker = torch.ones((), dtype=torch.int32, device=self._scale.device)
            self._counters = torch.zeros(4, dtype=torch.int64, device=self._scale.device)

    @property
    def device_type(self) -> str:
        return self._device

    @property
    def scale_device(self) -> torch.device:
        """Where the scale and the verdicts live."""
        return self._scale.device if self._scale is not None else torch.device(self._device)

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """This optimizer's place in torch's protocol since its last step (READY, UNSCALED, STEPPED)."""
        state = self._per_optimizer_states.get(id(optimizer))
        return OptState.READY if state is None else state["stage"]

    def forget(self, optimizer: torch.optim.Optimizer) -> None:
        """This optimizer's step is over (or abandoned); the scale moves once per batch, in :meth:`update_from`."""
        self._per_optimizer_states.pop(id(optimizer), None)

    def update_from(self, verdicts: list[torch.Tensor | bool]) -> None:
        """One update for a training batch, from the verdicts of every optimizer that stepped in it: device flags, or
        ``True``/``False`` where the host knows the outcome (a non-fused optimizer's step, which paid torch's sync).

        With no loss scale to move (check-only, or a static scale) and every outcome known on the host, the step is
        counted on the host: no kernel at all.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("update")
        if not self.scaling and not any(v is True for v in verdicts):
            flags = [v for v in verdicts if not isinstance(v, bool)]
            if flags:  # check-only: no scale to move, the device outcome is counted later with others (_defer)
                self._defer(flags[0] if len(flags) == 1 else torch.stack([f.reshape(()).float() for f in flags]).amax())
                self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
                return
        if all(isinstance(v, bool) for v in verdicts):
            if not (self.scaling and self.dynamic):
                self._count_on_host(any(verdicts))
                self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
                return
            found = torch.full((), float(any(verdicts)), device=scale.device)
        else:
            flags = [
                torch.full((), float(v), device=scale.device) if isinstance(v, bool) else v.to(scale.device).reshape(())
                for v in verdicts
            ]
            found = flags[0].float() if len(flags) == 1 else torch.stack([f.float() for f in flags]).amax()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._per_optimizer_states[0]["found_inf_per_device"] = {scale.device: found}
        self.update()


class PlannedCheck:
    """The read-only inf/NaN check of one optimizer's gradients, planned from its parameters once.

    Where every parameter is a plain dense tensor on one device in one dtype (the common case), what the check
    needs to know (the device, the dtype, the kernel for their size) is found here, not on every step; the step
    then lists the gradients and runs one fused kernel. ``None`` from :meth:`of`: the general
    :meth:`DynamicLossScaler._check_grads_` applies (several devices or dtypes, sharded or complex parameters).
    The plan is kept while the optimizer's parameter count is unchanged (``add_param_group`` makes a new one).
    """

    __slots__ = ("params", "dtype", "numel", "count")

    def __init__(self, params: list[torch.Tensor], dtype: torch.dtype, numel: int, count: int) -> None:
        self.params, self.dtype, self.numel, self.count = params, dtype, numel, count

    @staticmethod
    def count_of(optimizer: torch.optim.Optimizer) -> int:
        return sum(len(group["params"]) for group in optimizer.param_groups)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> Optional["PlannedCheck"]:
        every = [p for group in optimizer.param_groups for p in group["params"]]
        params = [p for p in every if p.numel()]  # an empty tensor holds nothing to check
        if not params:
            return None
        device, dtype = params[0].device, params[0].dtype
        if not dtype.is_floating_point:  # (complex is not floating point: complex parameters take the general check)
            return None
        for p in params:
            if p.device != device or p.dtype != dtype or p.layout is not torch.strided or _is_dtensor(p):
                return None
        return cls(params, dtype, sum(p.numel() for p in params), len(every))

    def found_inf(self, flag: torch.Tensor) -> Optional[dict[torch.device, torch.Tensor]]:
        """Set ``flag`` where a gradient is inf/NaN; ``None`` where a gradient is not what the plan expected (a sparse
        gradient of an ``nn.Embedding(sparse=True)``): the caller takes the general check."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return {}
        first = grads[0]
        if (
            first.layout is not torch.strided or first.dtype != self.dtype or type(first) is not torch.Tensor
            or first.device != flag.device
        ):
            return None
        check_tensors_({self.dtype: grads}, self.numel, flag)
        return {flag.device: flag}


def check_tensors_(per_dtype: dict[torch.dtype, list[torch.Tensor]], numel: int, flag: torch.Tensor) -> None:
    """Set ``flag`` (a 0-dim float tensor on the tensors' device) to 1 if any tensor holds an inf or NaN.

    Up to :data:`FUSED_CHECK_MAX_NUMEL` elements in all: torch's fused check-and-unscale kernel with a scale of 1
    (one launch; it rewrites each tensor with itself, bumping its version counter); above: the read-only inf-norm.
    """
    with torch.no_grad():
        rest = []
        for dtype, tensors in _real_views(per_dtype).items():
            # (torch's CUDA kernel takes fp32 and fp16 only; bf16 gradients take the inf-norm there)
            if numel <= FUSED_CHECK_MAX_NUMEL and (dtype is not torch.bfloat16 or flag.device.type != "cuda"):
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, _one(flag.device))
            else:
                rest.append(tensors)
        if rest:
            worst = [torch.stack(torch._foreach_norm(t, math.inf)).max().float() for t in rest]
            flag.add_(~torch.isfinite(worst[0] if len(worst) == 1 else torch.stack(worst).max()))


def _real_views(per_dtype: dict[torch.dtype, list[torch.Tensor]]) -> dict[torch.dtype, list[torch.Tensor]]:
    """Complex tensors (spectral and FFT models) as real views of the same storage: torch's fused kernels take real
    dtypes only, and a complex number is inf/NaN where a part of it is."""
    if not any(dtype.is_complex for dtype in per_dtype):
        return per_dtype
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype, tensors in per_dtype.items():
        if dtype.is_complex:
            tensors = [torch.view_as_real(t) for t in tensors]
            dtype = tensors[0].dtype
        out.setdefault(dtype, []).extend(tensors)
    return out


class _RealGradients:
    """An optimizer's parameter groups as torch's ``_unscale_grads_`` reads them, with complex gradients replaced by
    real views of the same storage (unscaling the view unscales the gradient)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = []
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                grad = param.grad
                if grad is not None and grad.is_complex() and not grad.is_sparse:
                    real = torch.view_as_real(param.detach())
                    real.grad = torch.view_as_real(grad)
                    param = real
                params.append(param)
            groups.append({"params": params})
        self.param_groups = groups


#: optimizer -> (its parameter count, whether any parameter is complex): unscale_ asks on every fp16 step
_COMPLEX: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]]" = weakref.WeakKeyDictionary()


def _has_complex_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a parameter (so its gradient) is complex; found once per parameter set, not on every step."""
    count = PlannedCheck.count_of(optimizer)
    known = _COMPLEX.get(optimizer)
    if known is None or known[0] != count:
        known = _COMPLEX[optimizer] = (
            count, any(p.is_complex() for group in optimizer.param_groups for p in group["params"])
        )
    return known[1]


#: check-only device outcomes kept before they are folded into the counters
_DEFER_LIMIT = 64

_MASKS: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _counter_masks(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Constants of the counters' update: which entries take the skip flag, and the values of the others."""
    masks = _MASKS.get(device)
    if masks is None:
        masks = _MASKS[device] = (
            torch.tensor([False, False, True, False], device=device),
            torch.tensor([1, 1, 0, 0], dtype=torch.int64, device=device),
            torch.tensor([False, True, True, True], device=device),
            torch.tensor([1, 0, 0, 0], dtype=torch.int64, device=device),
        )
    return masks


class ShardedDynamicLossScaler(DynamicLossScaler, ShardedGradScaler):
    """:class:`DynamicLossScaler` on top of torch's ``ShardedGradScaler``, for FSDP.

    ``ShardedGradScaler`` unscales gradient shards wherever they live (CPU offload included) and sums the
    inf/NaN verdict over the process group inside ``unscale_``; hysteresis, min/max scale, counters and the
    check-only mode are :class:`DynamicLossScaler`'s. MPPlugin picks it under Lightning's FSDP strategy.
    """

    sharded = True
    # unscale_ sums the verdict over the process group, and one taken from FSDP's clip_grad_norm_ comes from the
    # norm of all shards: a second all-reduce would be redundant (and fail on CPU-offloaded flags under NCCL)
    verdict_agrees_across_ranks = True

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)  # sums the verdict over the process group (CPU-offloaded flags via the device)
        # ShardedGradScaler's verdicts have shape (1,); fused optimizers subtract found_inf from their 0-dim step
        # counts in place and skip only on exactly 1: a 0-dim 0/1 tensor, as torch.amp.GradScaler gives
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {
            dev: f.reshape(()).clamp_(max=1.0) for dev, f in state["found_inf_per_device"].items()
        }

    def _check_for_fused_step(self, optimizer: torch.optim.Optimizer) -> None:
        # torch's check-only pass would leave each rank with its own shards' verdict: unscale here instead (the
        # verdict is then the process group's), and the fused kernel gets grad_scale=None, as after any unscale_
        self.unscale_(optimizer)
