"""The inf/NaN step guard of the modes without a loss scale (fp32, tf32, bf16, bf16-true, fp8).

:class:`NonfiniteGuard` finds inf/NaN among the gradients an optimizer is about to apply and skips that step. It has
no loss scale, so nothing to scale, unscale or move: it is not a loss scaler in a special mode but the part of one
that modes without a scale need. It speaks the part of ``torch.amp.GradScaler``'s protocol the step uses (the
check, ``step``, the update at the end of a batch) and keeps each step's verdict in
:class:`~lightning_mp.verdict.Verdicts`, where the step adds its other sources (a gradient norm, the master weights'
gather, FP8 saturation, the spike guard). It counts nothing: skips are counted once, per optimizer, in
:class:`~lightning_mp.stats.StepStats`.

Under DDP the verdict is all-reduced (MAX) before the step, so every rank skips together; the sharded guard (FSDP)
reduces it inside the check, since each rank checks only its own shards.
"""

from __future__ import annotations

from typing import Any, Optional, Union, cast

import torch
from torch.amp.grad_scaler import OptState

import lightning_mp.verdict as verdict
from lightning_mp.scaling import DynamicLossScaler, ProtocolStates, checked_torch_state
from lightning_mp.verdict import SKIPPED, Verdicts


class NonfiniteGuard(ProtocolStates):
    """Skip the optimizer steps whose gradients hold an inf or NaN; no loss scale.

    Example (what :class:`~lightning_mp.MPPlugin` does in bf16; in a plain loop)::

        guard = NonfiniteGuard("cuda")
        loss.backward()
        guard.check_(optimizer)              # one fused kernel over the gradients (no host sync)
        _, skipped = guard.step_outcome(optimizer)   # skipped if a gradient was inf/NaN (None: on the device)
        guard.update_from([skipped])         # the batch is over

    A fused optimizer (``_step_supports_amp_scaling``) on CUDA gets the verdict as ``found_inf`` and skips on the
    device (no host sync); otherwise the host reads the flag, as ``torch.amp.GradScaler`` does.
    """

    #: the loss is not scaled (a loss scaler's is ``True``): the step and callbacks ask this
    scaling = False

    def __init__(self, device: str = "cuda", *, sharded: bool = False) -> None:
        self._device = device
        #: FSDP: each rank checks its own shards and the verdict is reduced over the process group in the check
        self.sharded = sharded
        self._scale_device: Optional[torch.device] = None
        self.forget_all()  # (per optimizer, torch's protocol state, where the verdicts live: ProtocolStates)
        self.verdicts = Verdicts(self)
        #: with several processes, agree on the verdict (all-reduce MAX) so every rank takes the same step
        self.sync_across_ranks = False
        #: whether the last step was skipped, when known on the host without a sync (``None`` otherwise)

    def __repr__(self) -> str:
        return f"NonfiniteGuard({self._device!r}{', sharded=True' if self.sharded else ''})"

    # ------------------------------------------------------------------ where the verdicts live
    def is_enabled(self) -> bool:
        return True

    def ensure_initialized(self, device: torch.device) -> None:
        """Keep the verdicts on ``device`` (the Trainer's)."""
        if self._scale_device is None:
            self._scale_device = torch.device(device)

    #: whether the check already gives every rank the same verdict (the sharded one reduces it)
    @property
    def verdict_agrees_across_ranks(self) -> bool:
        return self.sharded

    @property
    def device_type(self) -> str:
        return self._device

    @property
    def scale_device(self) -> torch.device:
        """Where the verdicts live."""
        return self._scale_device if self._scale_device is not None else torch.device(self._device)

    def get_scale(self) -> float:
        return 1.0

    def scale(self, outputs: Any) -> Any:
        """The loss as it is (nothing is scaled); the first one tells where the verdicts live."""
        tensor = outputs if isinstance(outputs, torch.Tensor) else next(iter(outputs), None)
        if isinstance(tensor, torch.Tensor):
            self.ensure_initialized(tensor.device)
        return outputs

    # ------------------------------------------------------------------ the check and the step
    def check_(self, optimizer: torch.optim.Optimizer) -> None:
        """Find inf/NaN among ``optimizer``'s gradients (read-only): this step's verdict. Sharded: over every rank."""
        state = cast(dict, self.optimizer_state(optimizer, make=True))
        if state["stage"] is not OptState.READY:
            stepped = state["stage"] is OptState.STEPPED
            raise RuntimeError("The inf/NaN check ran after step()." if stepped else
                               "The inf/NaN check already ran on this optimizer since the last update.")
        found = verdict.check_grads_(optimizer, verdict.zero_flag(self.scale_device))
        if self.sharded:
            found = self._reduce(found)
        state["found_inf_per_device"] = found
        state["stage"] = OptState.UNSCALED

    unscale_ = check_  # (torch's name for the protocol's check: nothing to divide here)

    def _reduce(self, found: dict[torch.device, torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """One flag over every rank's shards. Each rank makes exactly one all-reduce, also a rank that holds no shard
        with a gradient, and flags of CPU-offloaded shards travel through the device (NCCL reduces device tensors)."""
        device = self.scale_device
        flag = verdict.one_flag(list(found.values()), device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # enqueued on the device
        return {device: flag}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless this step's verdict (checked now if no source set it) says a gradient is inf/NaN.

        A fused optimizer on CUDA gets the verdict as ``found_inf`` and skips on the device (no host sync;
        :meth:`step_outcome` says ``None``); otherwise the host reads it (torch's scaler pays this sync too).
        """
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported by the inf/NaN step guard (nor by torch's GradScaler).")
        state = cast(dict, self.optimizer_state(optimizer, make=True))
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update.")
        if state["stage"] is OptState.READY:
            self.check_(optimizer)
        found = state["found_inf_per_device"]
        if not found:  # no parameter of this optimizer has a gradient: nothing to check, nothing would change
            found = state["found_inf_per_device"] = {self.scale_device: verdict.zero_flag(self.scale_device)}
        if self.sync_across_ranks and not self.verdict_agrees_across_ranks:
            # a gradient poisoned after DDP's all-reduce exists on one rank only: every rank must skip with it
            for flag in found.values():
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        state["stage"] = OptState.STEPPED
        if verdict.takes_device_verdict(optimizer, scaling=False, device=self.scale_device):
            # the flag where the optimizer's kernel runs (FSDP's CPU offload steps shards on the CPU)
            params = optimizer.param_groups[0]["params"]
            where = params[0].device if params else self.scale_device
            # torch's fused protocol: skips on exactly 1
            optimizer.found_inf = verdict.one_flag(list(found.values()), where)  # type: ignore[attr-defined]
            try:
                return optimizer.step(*args, **kwargs)
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        skipped = any(bool(flag.item()) for flag in found.values())
        state[SKIPPED] = skipped
        return None if skipped else optimizer.step(*args, **kwargs)

    def step_outcome(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> tuple[Any, Optional[bool]]:
        """:meth:`step`, and whether it skipped where the host knows (``None``: decided on the device)."""
        out = self.step(optimizer, **kwargs)
        return out, cast(dict, self.optimizer_state(optimizer, make=True)).get(SKIPPED)

    def update(self) -> None:
        """The training batch is over: forget its verdicts (nothing moves; the step counts the outcomes)."""
        self.forget_all()

    def update_from(self, verdicts: list[torch.Tensor | bool]) -> None:
        self.update()

    # ------------------------------------------------------------------ checkpoints: nothing of its own
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load; a loss scaler's state (an fp16 checkpoint, or an older bf16 one) is checked, not used."""
        if state_dict:
            checked_torch_state(state_dict)


#: what decides a step's skip: a loss scaler (fp16 modes) or the guard of the modes without a scale
StepGuard = Union[DynamicLossScaler, NonfiniteGuard]
