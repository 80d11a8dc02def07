"""Dynamic loss scaling with hysteresis, a floor and a cap: torch's ``GradScaler`` with Megatron-LM's scale policy.

:class:`DynamicLossScaler` is a drop-in ``torch.amp.GradScaler``: the same arguments (``enabled`` included), the
same protocol (``scale``/``unscale_``/``step``/``update``; fused optimizers get ``grad_scale`` and ``found_inf``) and
a state dict torch's scaler reads. It is composed of three parts, each its own: when the scale moves
(:class:`ScalePolicy`), the step verdicts (:class:`~lightning_mp.verdict.Verdicts`, with the checks that find
them) and the skip counts (:class:`~lightning_mp.stats.SkipCounters`). :func:`adopt_scaler` takes the scaler a user
hands to ``MPPlugin(scaler=...)``.

The scaler keeps ``torch.amp.GradScaler``'s fused kernels and its one host sync per step (none with fused
optimizers): the inf/NaN check is ``torch._amp_foreach_non_finite_check_and_unscale_``, the scale update is
``torch._amp_update_scale_`` plus a few device-side tensor ops, and the skip counters live on the device.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import lightning_mp.verdict as verdict
from lightning_mp.verdict import SKIPPED
from lightning_mp.settings import (
    DEFAULTS,
    check_factors,
    check_growth_interval,
    check_int,
    check_scale,
    check_scaler_arguments,
)
from lightning_mp.stats import SkipCounters, StatsCounts, StepStats
from lightning_mp.verdict import (  # noqa: F401  (the checks' names, re-exported where they used to live)
    FUSED_CHECK_MAX_NUMEL,
    PlannedCheck,
    Verdicts,
    check_tensors_,
    has_complex_grads,
)

# ---------------------------------------------------------------------- values the device tensors can hold
_F32 = torch.finfo(torch.float32)  # the scale is a float32 tensor
_INT32 = torch.iinfo(torch.int32)  # the growth and hysteresis trackers are int32 tensors
_INT64_MAX = torch.iinfo(torch.int64).max  # the skip counters are int64


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
        a 0-dim float32 (non-zero: an overflow) or bool tensor. Device ops only: no host sync."""
        if self.hysteresis == 1:  # every overflow backs off: torch's rule in its one kernel, and the bounds
            flag = found_inf if found_inf.dtype == torch.float32 else found_inf.float()
            torch._amp_update_scale_(
                scale, growth_tracker, flag, self.growth_factor, self.backoff_factor, self.growth_interval
            )
            scale.clamp_(self.min_scale, self.max_scale)
            return
        found_inf = found_inf if found_inf.dtype == torch.bool else found_inf > 0
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
class ProtocolStates:
    """The one door to torch's per-optimizer protocol state (``stage``, ``found_inf_per_device``; and the outcome the
    host knows, :data:`~lightning_mp.verdict.SKIPPED`), where a step's verdict lives: for the loss scaler, whose torch
    base keeps it, and for the step guard of the modes without a loss scale, which keeps the same layout."""

    _per_optimizer_states: dict[int, dict[str, Any]]

    def optimizer_state(self, optimizer: torch.optim.Optimizer, make: bool = False) -> Optional[dict]:
        """``optimizer``'s protocol state (made where ``make``; else ``None`` where it has none)."""
        states = self._per_optimizer_states
        return states[id(optimizer)] if make else states.get(id(optimizer))

    def optimizer_states(self) -> list[dict]:
        return list(self._per_optimizer_states.values())

    def forget_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._per_optimizer_states.pop(id(optimizer), None)

    def forget_all(self) -> None:
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


class DynamicLossScaler(ProtocolStates, torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, a min/max scale and skip counters.

    Example::

        scaler = DynamicLossScaler("cpu", init_scale=2.0**10, hysteresis=2)
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
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: torch's.
        hysteresis: overflowing steps needed before the scale backs off (1 = at once, as torch).
        consecutive_hysteresis: ``True`` refills the hysteresis budget on every clean step (N overflows in a
            row back off, as DeepSpeed's); ``False`` only when the scale grows (Megatron-LM's behaviour).
        min_scale, max_scale: the scale stays in ``[min_scale, max_scale]``.
        dynamic: ``False`` keeps the scale at ``init_scale`` (a static loss scale); steps are still skipped.
        scaling: ``True`` only (``False`` was the check-only mode of earlier releases: see below).
    The modes without a loss scale skip steps with :class:`~lightning_mp.nonfinite.NonfiniteGuard` instead.
    Inside :class:`~lightning_mp.MPPlugin` the counts (``skipped_steps``...) are the plugin's ``stats``, summed over
    optimizers (:meth:`counts_from`): skips are counted in one place.
    Values a float32 (scales) or int32 tensor cannot hold raise ``ValueError`` here, not in training.
    """

    #: the loss is scaled (the step guard of the modes without a scale, ``NonfiniteGuard``, says ``False``)
    scaling = True
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
        if scaling is not True:  # (the check-only mode of earlier releases)
            raise TypeError(
                f"DynamicLossScaler(scaling={scaling!r}): a loss scaler always scales now; the inf/NaN step guard"
                " without a loss scale is lightning_mp.NonfiniteGuard(device)."
            )
        given: dict[str, Any] = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                                     growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
                                     max_scale=max_scale)  # (checked unless disabled: torch ignores them then)
        c: dict[str, Any] = check_scaler_arguments(**given) if enabled else given
        super().__init__(device, init_scale=c["init_scale"], growth_factor=c["growth_factor"],
                         backoff_factor=c["backoff_factor"], growth_interval=c["growth_interval"], enabled=enabled)
        self.hysteresis, self.consecutive_hysteresis = c["hysteresis"], consecutive_hysteresis
        self.min_scale, self.max_scale = c["min_scale"], c["max_scale"]
        self.dynamic = dynamic
        self._hysteresis_tracker: Optional[torch.Tensor] = None  # device-side, made with the scale
        self._init_hysteresis_tracker = c["hysteresis"]
        self.skips: SkipCounters | StatsCounts = SkipCounters()
        self.verdicts = Verdicts(self)
        #: the ``torch.amp.GradScaler`` a user gave (:func:`adopt_scaler`): it shares the scale and growth tensors
        self.twin: Optional[torch.amp.GradScaler] = None
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
        self.skips.start(dev)
        if self.twin is not None:  # the user's scaler shows the scale training uses
            self.twin._scale, self.twin._growth_tracker = self._scale, self._growth_tracker

    def ensure_initialized(self, device: torch.device) -> None:
        """Create the device-side state now (normally done by the first ``scale()``)."""
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(device)

    @property
    def initialized(self) -> bool:
        return self._scale is not None

    def counts_from(self, stats: StepStats) -> None:
        """Count nothing here: the counts are the plugin's ``stats`` (skips are counted in one place)."""
        self.skips = StatsCounts(stats)

    # ------------------------------------------------------------------ the training-step API
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):  # (ShardedGradScaler's default)
        # fp16 gradients are legal here: half-precision weights keep half gradients;
        # torch only refuses them because unscaling could underflow them.
        return super()._unscale_grads_(verdict.real_gradients(optimizer), inv_scale, found_inf, True)

    def _check_for_fused_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a fused optimizer's step: find inf/NaN without unscaling (its kernel unscales), as torch does."""
        self._check_inf_per_device(optimizer)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args: Any, **kwargs: Any):
        # torch pays its one host sync here; keep its answer so the step's outcome is known without another.
        found = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        optimizer_state[SKIPPED] = found
        return None if found else optimizer.step(*args, **kwargs)

    def _fused_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        """Hand the optimizer ``grad_scale`` and ``found_inf`` for its fused kernel, as ``GradScaler.step`` does."""
        scale = cast(torch.Tensor, self._scale)  # step() checked that it is set
        # one 0/1 flag (fused kernels skip on exactly 1; torch sums the devices' flags)
        found = list(optimizer_state["found_inf_per_device"].values())
        optimizer.found_inf = verdict.one_flag(found, scale.device)  # type: ignore[attr-defined]
        # gradients unscale_ already divided need no scale; else the scale, times any the user set
        user = getattr(optimizer, "grad_scale", None)
        unscaled = optimizer_state["stage"] is OptState.UNSCALED
        optimizer.grad_scale = user if unscaled else scale * (1 if user is None else user)  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]  # set above, as torch does

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``GradScaler.step``: unscale unless done, then step unless a gradient is inf/NaN.

        A fused optimizer (``_step_supports_amp_scaling``) is not unscaled first: it gets ``grad_scale`` and
        ``found_inf``, unscales in its kernel and skips on the device, exactly as torch's scaler has it.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        fused = verdict.takes_device_verdict(optimizer, True, self.scale_device)
        if fused and _takes_grad_scaler(type(optimizer)):
            return super().step(optimizer, *args, **kwargs)  # torch's deprecated contract: it passes itself
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale = self._check_scale_growth_tracker("step")[0]
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self._check_for_fused_step(optimizer) if fused else self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            # no parameter of this optimizer has a gradient: nothing to check and nothing would change
            state["found_inf_per_device"] = {scale.device: torch.zeros((), device=scale.device)}
        if self.sync_across_ranks and not self.verdict_agrees_across_ranks:
            # a gradient poisoned after DDP's all-reduce exists on one rank only: every rank must skip with it.
            # The collective is enqueued on the device (no host sync).
            for found in state["found_inf_per_device"].values():
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        retval = (self._fused_step if fused else self._maybe_opt_step)(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def step_outcome(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> tuple[Any, Optional[bool]]:
        """:meth:`step`, and whether it skipped where the host knows without another sync (``None``: a fused
        optimizer decided on the device, with the verdict :meth:`Verdicts.of` holds)."""
        if not self._enabled:
            return optimizer.step(**kwargs), False
        out = self.step(optimizer, **kwargs)
        return out, self._per_optimizer_states[id(optimizer)].get(SKIPPED)

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
        found = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()  # (> 0: an overflow)
        self.skips.defer(found)  # (counted with later ones: a few kernels for many steps)
        if self.dynamic:
            self.policy.update_(scale, growth_tracker, cast(torch.Tensor, self._hysteresis_tracker), found)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def update_from(self, verdicts: list[torch.Tensor | bool]) -> None:
        """One update for a training batch, from the verdicts of every optimizer that stepped in it: device flags, or
        ``True``/``False`` where the host knows the outcome (a non-fused optimizer's step, which paid torch's sync).
        Outcomes the host knows are counted without a kernel (the scale, if it moves, in one or two)."""
        if not self._enabled:
            return
        self._per_optimizer_states.clear()
        flags = [v for v in verdicts if not isinstance(v, bool)]
        scale, tracker = self._check_scale_growth_tracker("update")
        if not flags:
            self.skips.count_known(any(verdicts))
            if self.dynamic:  # (a static scale: nothing moves)
                budget = cast(torch.Tensor, self._hysteresis_tracker)  # (made with the scale)
                self.policy.update_(scale, tracker, budget, verdict.constant(float(any(verdicts)), scale.device))
            return
        found = [verdict.constant(float(v), scale.device) if isinstance(v, bool) else v for v in verdicts]
        self._per_optimizer_states[0]["found_inf_per_device"] = {scale.device: verdict.one_flag(found, scale.device)}
        self.update()

    # ------------------------------------------------------------------ counts (each read syncs)
    @property
    def steps(self) -> int:
        return self.skips.value(0)

    @property
    def skipped_steps(self) -> int:
        return self.skips.value(1)

    @property
    def consecutive_skips(self) -> int:
        return self.skips.value(2)

    @property
    def last_skipped(self) -> bool:
        return bool(self.skips.value(3))

    def counters_tensor(self) -> Optional[torch.Tensor]:
        """The device tensor ``[steps, skipped_steps, consecutive_skips, last_skipped]`` (no sync)."""
        return self.skips.tensor()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state plus hysteresis, bounds and counters: plain numbers only (``{}`` when disabled)."""
        if not self._enabled:
            return {}
        tracker = self._hysteresis_tracker
        return {
            **super().state_dict(),
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "_hysteresis_tracker": int(tracker.item()) if tracker is not None else self._init_hysteresis_tracker,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
            **dict(zip(SkipCounters.NAMES, self.skips.values())),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict or a plain ``torch.amp.GradScaler`` one (its extras keep their values).

        Every value is checked before anything is loaded: a scale that is not a positive float32 number, or a
        counter that is not a whole number in range, raises ``ValueError`` naming the field and its value.
        A disabled scaler loads nothing, as torch's.
        """
        if not self._enabled:
            return
        torch_state = checked_torch_state(state_dict)
        counters = [
            check_int(key, state_dict.get(key, now), 0, high, "a count of steps", allow_bool=True)
            for key, now, high in zip(SkipCounters.NAMES, self.skips.values(), (_INT64_MAX,) * 3 + (1,))
        ]
        tracker = check_int(
            "_hysteresis_tracker", state_dict.get("_hysteresis_tracker", self.hysteresis), _INT32.min, _INT32.max,
            "an int32 tensor; below 0 after overflows past the budget is normal",
        )
        if state_dict.get("scaling", True):  # (an older checkpoint's check-only state holds no loss scale)
            super().load_state_dict(torch_state)
        self.skips.load(counters)
        self._init_hysteresis_tracker = tracker
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(tracker)

    def __getstate__(self) -> dict[str, Any]:
        state, tracker = super().__getstate__(), self._hysteresis_tracker
        state["_init_hysteresis_tracker"] = self._init_hysteresis_tracker if tracker is None else int(tracker.item())
        return {**state, "_hysteresis_tracker": None}

    @property
    def device_type(self) -> str:
        return self._device

    @property
    def scale_device(self) -> torch.device:
        """Where the scale and the verdicts live."""
        return self._scale.device if self._scale is not None else torch.device(self._device)


_GRAD_SCALER_ARGUMENT: dict[type, bool] = {}


def _takes_grad_scaler(optimizer_class: type) -> bool:
    """torch's deprecated fused contract: ``step(..., grad_scaler=...)`` (read once per class, not every step)."""
    known = _GRAD_SCALER_ARGUMENT.get(optimizer_class)
    if known is None:
        step = getattr(optimizer_class, "step")
        known = _GRAD_SCALER_ARGUMENT[optimizer_class] = "grad_scaler" in inspect.signature(step).parameters
    return known


def checked_torch_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A GradScaler state dict's five entries, checked (``KeyError``/``ValueError`` naming what is wrong), as plain
    floats and ints."""
    if not state_dict:
        raise KeyError("The loss-scaler state is empty, possibly because it was saved from a disabled GradScaler.")
    missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
    if missing:
        raise KeyError(
            f"Loss-scaler state is missing {sorted(missing)}; it is not a GradScaler/DynamicLossScaler state dict."
        )
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


class SharedGradients:
    """Parameters that several optimizers hold (an encoder two heads' optimizers both step). A loss scaler unscales
    each optimizer's gradients in place, so a gradient two optimizers share would lose the scale twice from one
    backward. What one step unscaled is noted (the gradient tensor and the scale) until the next backward: it holds
    true values from then on, whatever the loop does to it in place (clipping, halving); before another optimizer's
    step unscales it again, it gets that scale back (powers of two: exact). A gradient the loop replaced by another
    tensor is taken as the loop gives it. Found once per set of optimizers; nothing runs per step where no parameter
    is shared."""

    def __init__(self) -> None:
        self.of: dict[int, list[torch.Tensor]] = {}  # optimizer id -> its parameters another optimizer holds too
        self._noted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # param id -> (the gradient, its scale)

    def find(self, optimizers: list[torch.optim.Optimizer]) -> None:
        seen: dict[int, int] = defaultdict(int)
        for optimizer in optimizers:
            for pid in {id(p) for group in optimizer.param_groups for p in group["params"]}:
                seen[pid] += 1
        self.of = {}
        for optimizer in optimizers:
            shared = [p for group in optimizer.param_groups for p in group["params"] if seen[id(p)] > 1]
            if shared:
                self.of[id(optimizer)] = shared
        self._noted.clear()

    def join(self, optimizers: list[Any], unscaled: list[Any], scaler: Optional["DynamicLossScaler"]) -> None:
        """An optimizer joined at its first contact (Fabric): the sharing is found again; the gradients of the
        optimizers that were unscaled since the last backward (prepared or stepped; ``scaler``: the loss is scaled)
        are noted as unscaled."""
        self.find(optimizers)
        if scaler is not None:
            for optimizer in unscaled:
                self.note(optimizer, scale_in_use(scaler))

    def restore_(self, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer``'s unscale: its shared gradients that another step unscaled get their scale back."""
        again = []
        for param in self.of.get(id(optimizer), ()):
            grad, noted = param.grad, self._noted.pop(id(param), None)
            if grad is not None and noted is not None and noted[0] is grad:
                again.append((grad, noted[1]))
        for grad, scale in again:
            scale_grads_([grad], scale)

    def note(self, optimizer: torch.optim.Optimizer, scale: Optional[torch.Tensor]) -> None:
        """After ``optimizer``'s unscale (and the true gradients written where hooks read them)."""
        if scale is None:
            return
        for param in self.of.get(id(optimizer), ()):
            grad = param.grad
            if grad is not None:
                self._noted[id(param)] = (grad, scale)

    def forget(self) -> None:
        """A backward runs: what it adds is scaled again; the notes (and the gradients they hold) go."""
        if self._noted:
            self._noted.clear()


def scale_in_use(scaler: DynamicLossScaler) -> Optional[torch.Tensor]:
    """The scale gradients are unscaled by now (a copy on the device: no sync; ``None`` before the first)."""
    return None if scaler._scale is None else scaler._scale.detach().clone()


def abandon_step(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """A step prepared and not taken: its verdict goes, and gradients a loss scaler unscaled (those the loop did not
    zero) get the scale back, so the next backward adds to them in the same units, as if never unscaled."""
    state = scaler.optimizer_state(optimizer)
    if scaler.scaling and state is not None and state["stage"] is OptState.UNSCALED and scaler._scale is not None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scale_grads_(grads, scaler._scale)
    scaler.verdicts.forget(optimizer)


def scale_grads_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply gradients by ``scale`` (a power of two: exact), computing half ones in fp32 (the scale may exceed
    fp16's range) and fp32 ones in one multi-tensor kernel per device. Sparse gradients are left alone."""
    per_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    with torch.no_grad():
        for grad in grads:
            if grad.is_sparse:
                continue
            if grad.dtype == torch.float32:
                per_device[grad.device].append(grad)
            else:
                grad.copy_(grad.float() * scale.to(grad.device))
        for device, fp32 in per_device.items():
            torch._foreach_mul_(fp32, scale.to(device))


def adopt_scaler(given: Any, *, sharded: bool = False, host: str = "MPPlugin") -> DynamicLossScaler:
    """The scaler to train with when a user hands ``MPPlugin(scaler=...)`` one: a :class:`DynamicLossScaler` as it
    is; a ``torch.amp.GradScaler`` by composition, not changed: ours, with its settings and state (torch's rules: no
    hysteresis, floor or cap), whose scale and growth-count tensors the given scaler shares from the first step on,
    so that ``given.get_scale()`` and ``given.state_dict()`` follow training (:attr:`DynamicLossScaler.twin`).
    """
    if isinstance(given, DynamicLossScaler):
        return given
    if not isinstance(given, torch.amp.GradScaler):
        if all(callable(getattr(given, m, None)) for m in ("scale", "unscale_", "step", "update")):
            return given  # a stand-in with GradScaler's methods (a test double): used as it is, as Lightning does
        raise TypeError(
            f"{host}(scaler=...) takes a torch.amp.GradScaler or a lightning_mp.DynamicLossScaler, not"
            f" {type(given).__name__}."
        )
    target = ShardedDynamicLossScaler if sharded else DynamicLossScaler
    if not given.is_enabled():  # a disabled GradScaler keeps no settings: ours is disabled too (and shows it)
        disabled = target(given._device, enabled=False)
        disabled.twin = given
        return disabled
    scaler = target(
        given._device,
        init_scale=given._init_scale if given._scale is None else float(given.get_scale()),
        growth_factor=given._growth_factor,
        backoff_factor=given._backoff_factor,
        growth_interval=given._growth_interval,
        min_scale=float(_F32.tiny),  # torch's scaler has no floor or cap
        max_scale=float(_F32.max),
    )
    if given._scale is not None:
        scaler.load_state_dict(given.state_dict())
    scaler.twin = given
    return scaler


class ShardedDynamicLossScaler(DynamicLossScaler, ShardedGradScaler):
    """:class:`DynamicLossScaler` on top of torch's ``ShardedGradScaler``, for FSDP.

    ``ShardedGradScaler`` unscales gradient shards wherever they live (CPU offload included) and sums the
    inf/NaN verdict over the process group inside ``unscale_``; hysteresis, min/max scale and counters are
    :class:`DynamicLossScaler`'s. MPPlugin picks it under Lightning's FSDP strategy.
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
