"""Dynamic loss scaling with hysteresis, a floor and a cap, and the non-finite step guard used in every mode.

The scaler keeps ``torch.amp.GradScaler``'s fused kernels and its one host sync per step
(none with fused optimizers): the inf/NaN check is ``torch._amp_foreach_non_finite_check_and_unscale_``,
the scale update is ``torch._amp_update_scale_`` plus a few device-side tensor ops, and the skip
counters live on the device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Optional

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


def _check_positive_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number > 0.")


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

    Args:
        device: device type of the gradients (``"cuda"`` or ``"cpu"``).
        init_scale: the first loss scale.
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiply the scale by this on a backoff (0 < f < 1).
        growth_interval: clean steps between two growths.
        hysteresis: overflowing steps needed before the scale backs off (1 = at once, as torch).
        consecutive_hysteresis: ``True`` refills the hysteresis budget on every clean step (N overflows in a
            row back off, as DeepSpeed's ``consecutive_hysteresis``); ``False`` refills it only when the scale
            grows (Megatron-LM's behaviour).
        min_scale: the scale never falls below this.
        max_scale: the scale never grows above this.
        dynamic: ``False`` keeps the scale at ``init_scale`` (a static loss scale); steps are still skipped.
        scaling: ``False`` runs only the non-finite step guard: the loss is not scaled (scale stays 1) but
            inf/NaN gradients are still found and the step skipped; this is how bf16/fp32 skip steps.
    """

    #: whether this scaler's own checks already give every rank the same verdict (then no extra all-reduce)
    verdict_agrees_across_ranks = False

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = True,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        dynamic: bool = True,
        scaling: bool = True,
    ) -> None:
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale)):
            _check_positive_finite(name, value)
        if not isinstance(growth_factor, (int, float)) or not math.isfinite(growth_factor) or growth_factor <= 1:
            raise ValueError(f"growth_factor={growth_factor!r} is invalid: it must be a finite number > 1 (e.g. 2.0).")
        if not isinstance(backoff_factor, (int, float)) or not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor={backoff_factor!r} is invalid: it must lie in (0, 1) (e.g. 0.5).")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} is invalid: it must be an integer >= 1 (e.g. 2000).")
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(
                f"hysteresis={hysteresis!r} is invalid: it must be an integer >= 1 (1 backs off on every overflow)."
            )
        if min_scale > max_scale:
            raise ValueError(f"min_scale={min_scale!r} is larger than max_scale={max_scale!r}; use min_scale <= max_scale.")
        if scaling and not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale={init_scale!r} lies outside [min_scale={min_scale!r}, max_scale={max_scale!r}];"
                " choose an init_scale between them."
            )
        super().__init__(
            device,
            init_scale=float(init_scale) if scaling else 1.0,
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=growth_interval,
            enabled=True,
        )
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = dynamic
        self.scaling = scaling
        # device-side state, created with the scale (lazily, on the loss's device)
        self._hysteresis_tracker: Optional[torch.Tensor] = None
        self._counters: Optional[torch.Tensor] = None  # int64 [steps, skipped_steps, consecutive_skips, last_skipped]
        self._init_counters = [0, 0, 0, 0]
        self._init_hysteresis_tracker = hysteresis
        #: whether the last step was skipped, when known on the host without a sync (``None`` otherwise)
        self.last_skipped_host: Optional[bool] = None
        #: with several processes, agree on the inf/NaN verdict (all-reduce MAX) so every rank takes the same step
        self.sync_across_ranks = False

    # ------------------------------------------------------------------ state on the device
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._counters = torch.tensor(self._init_counters, dtype=torch.int64, device=dev)

    def ensure_initialized(self, device: torch.device) -> None:
        """Create the device-side state now (normally done by the first ``scale()``)."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)

    @property
    def initialized(self) -> bool:
        return self._scale is not None

    # ------------------------------------------------------------------ the training-step API
    def scale(self, outputs: Any) -> Any:
        if self.scaling:
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
        state = self._per_optimizer_states[id(optimizer)]
        if self.scaling or state["stage"] is not OptState.READY:
            return False
        self._check_scale_growth_tracker("record_check_from_")
        state["found_inf_per_device"] = {total.device: (~torch.isfinite(total.detach())).float()}
        state["stage"] = OptState.UNSCALED
        return True

    def add_found_inf_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        """Fold another inf/NaN finding (a device tensor, > 0 when found) into this step's verdict, after the check.

        For what the gradients cannot show, e.g. an inf that an FP8 cast saturated into a finite value. The verdict
        stays 0 or 1 (fused optimizers skip on ``found_inf == 1``); no host sync.
        """
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            raise RuntimeError("add_found_inf_() must follow unscale_() (or the check) for this optimizer.")
        bad = (flag.detach().reshape(()) > 0).float()
        found = state["found_inf_per_device"]
        if not found:
            found[bad.device] = bad
            return
        for device, value in found.items():
            value.copy_(torch.maximum(value, bad.to(device, non_blocking=True)).reshape(value.shape))

    def unscale_once_(self, optimizer: torch.optim.Optimizer) -> None:
        """``unscale_`` unless it already ran for this optimizer since the last ``update()``."""
        if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[override]
        if not self.scaling:
            return self._check_grads_(optimizer, found_inf)
        # fp16 gradients are legal here: half-precision weights keep half gradients;
        # torch only refuses them because unscaling could underflow them.
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    @staticmethod
    def _check_grads_(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """Check-only mode: find inf/NaN gradients with one read-only pass, dividing nothing.

        ``torch._foreach_norm(grads, inf)`` (the fused multi-tensor kernel that gradient clipping uses) gives
        each gradient's largest magnitude, and propagates NaN and inf. Unlike
        ``_amp_foreach_non_finite_check_and_unscale_`` with scale 1, it writes nothing back, which halves the
        memory traffic of the check (measured in benchmarks/RESULTS.md).
        """
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                grad = grad._values() if grad.is_sparse else grad
                if _is_dtensor(grad):
                    grad = grad.to_local()  # a rank checks its own shard; the verdict is then all-reduced
                if grad.numel() == 0:
                    continue  # an empty shard holds nothing to check (and the inf-norm of nothing is undefined)
                grouped[grad.device][grad.dtype].append(grad)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for device, per_dtype in grouped.items():
                worst = [torch.stack(torch._foreach_norm(grads, math.inf)).max().float() for grads in per_dtype.values()]
                worst_all = worst[0] if len(worst) == 1 else torch.stack(worst).max()
                flag = found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)
                flag.add_(~torch.isfinite(worst_all))
                found[device] = flag
        return found

    def _maybe_opt_step(self, optimizer, optimizer_state, *args: Any, **kwargs: Any):  # type: ignore[override]
        # torch pays its one host sync here; keep its answer so the step's outcome is known without another.
        found = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self.last_skipped_host = found if self.last_skipped_host is None else (self.last_skipped_host or found)
        return None if found else optimizer.step(*args, **kwargs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            # no parameter of this optimizer has a gradient: nothing to check and nothing would change
            self._check_scale_growth_tracker("step")
            state["found_inf_per_device"] = {self._scale.device: torch.zeros((), device=self._scale.device)}
        if self.sync_across_ranks and not self.verdict_agrees_across_ranks:
            # a gradient poisoned after DDP's all-reduce exists on one rank only: every rank must skip with it.
            # The collective is enqueued on the device (no host sync).
            for found in state["found_inf_per_device"].values():
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        """Update counters and the scale from this step's inf checks, on the device (no host sync)."""
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            super().update(new_scale)
            scale.clamp_(self.min_scale, self.max_scale)
            return
        found_infs = [
            found_inf.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update().")
        overflow = torch.stack(found_infs).sum() > 0
        skipped = overflow.long()
        counters = self._counters
        assert counters is not None and self._hysteresis_tracker is not None
        # [steps, skipped_steps, consecutive_skips, last_skipped]
        counters.copy_(torch.stack((counters[0] + 1, counters[1] + skipped, (counters[2] + 1) * skipped, skipped)))

        if self.scaling and self.dynamic:
            tracker = self._hysteresis_tracker
            tracker_after = tracker - overflow.int()
            backoff = overflow & (tracker_after <= 0)
            previous = scale.clone()
            torch._amp_update_scale_(
                scale, growth_tracker, backoff.float(), self._growth_factor, self._backoff_factor, self._growth_interval
            )
            # an overflow absorbed by hysteresis keeps the scale and restarts the growth count
            held = overflow & ~backoff
            scale.copy_(torch.where(held, previous, scale))
            growth_tracker.masked_fill_(overflow, 0)
            refill = scale > previous
            if self.consecutive_hysteresis:
                refill = refill | ~overflow
            tracker.copy_(torch.where(refill, torch.full_like(tracker, self.hysteresis), tracker_after))
            scale.clamp_(self.min_scale, self.max_scale)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
        """This step's inf/NaN verdict for ``optimizer`` as a device tensor (no sync; valid until ``update()``)."""
        found = list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        if not found:
            return None
        return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device) for f in found]).sum()

    def begin_step(self) -> None:
        """Forget the host-side outcome of the previous step (called before each optimizer step)."""
        self.last_skipped_host = None

    # ------------------------------------------------------------------ reading (each read syncs)
    def _counter(self, i: int) -> int:
        return int(self._counters[i].item()) if self._counters is not None else self._init_counters[i]

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
        return self._counters

    def get_scale(self) -> float:
        return super().get_scale() if self.scaling else 1.0

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state plus hysteresis, bounds and counters: plain numbers only."""
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
        """Load our own state dict or a plain ``torch.amp.GradScaler`` one (its extras keep their values)."""
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise KeyError(
                f"Loss-scaler state is missing {sorted(missing)}; it is not a GradScaler/DynamicLossScaler state dict."
            )
        if self.scaling and state_dict.get("scaling", True):
            super().load_state_dict(state_dict)
        counters = [
            int(state_dict.get(key, default))
            for key, default in zip(("steps", "skipped_steps", "consecutive_skips", "last_skipped"), self._counters_now())
        ]
        self._init_counters = counters
        if self._counters is not None:
            self._counters.copy_(torch.tensor(counters, dtype=torch.int64))
        tracker = int(state_dict.get("_hysteresis_tracker", self.hysteresis))
        self._init_hysteresis_tracker = tracker
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(tracker)

    def _counters_now(self) -> list[int]:
        return [self._counter(i) for i in range(4)]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_init_counters"] = self._counters_now()
        state["_counters"] = None
        if self._hysteresis_tracker is not None:
            state["_init_hysteresis_tracker"] = int(self._hysteresis_tracker.item())
        state["_hysteresis_tracker"] = None
        return state


class ShardedDynamicLossScaler(DynamicLossScaler, ShardedGradScaler):
    """:class:`DynamicLossScaler` on top of torch's ``ShardedGradScaler``, for FSDP.

    ``ShardedGradScaler`` unscales gradient shards wherever they live (CPU offload included) and sums the
    inf/NaN verdict over the process group inside ``unscale_``; hysteresis, min/max scale, counters and the
    check-only mode are :class:`DynamicLossScaler`'s. MPPlugin picks it under Lightning's FSDP strategy.
    """

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

