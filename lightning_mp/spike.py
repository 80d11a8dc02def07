"""The loss-spike guard: skip a step whose loss or gradient norm is far above its recent history.

Large runs diverge through finite spikes as often as through inf/NaN. With ``MPPlugin(..., spike_sigma=k)`` a step
whose loss or total gradient norm exceeds ``mean + k * std`` of the last ``spike_window`` steps that were not skipped
is skipped exactly as an inf/NaN step is (parameters, master weights, optimizer state, schedulers and buffers keep
their values), once at least ``spike_window // 4`` steps are in the window. This is what OLMo-core's
``SkipStepOptimizer`` and levanter do; PaLM skipped the batches around its spikes by hand.

Everything stays on the device: the window is a ``(2, spike_window)`` tensor ring of (loss, gradient norm), the
decision a 0-dim flag that joins the step's inf/NaN verdict, so no host sync is added. Under DDP/FSDP each rank keeps
the window of its own losses and the flag is all-reduced (MAX): every rank skips the same steps. A spike does not
count as an overflow: the loss scale (fp16) moves on the inf/NaN verdict alone.

The loss of a step is the sum of what backward was called on since the last step: with gradient accumulation,
Lightning's loss already divided by ``accumulate_grad_batches``, so the mean over the micro-batches.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

#: the smallest ``spike_window``: the standard deviation of fewer values says little
MIN_WINDOW = 8


def make_spike_guard(spike_sigma: Any, spike_window: Any, skip_nonfinite: bool) -> Optional["SpikeGuard"]:
    """``MPPlugin``'s spike options checked (``ValueError`` naming the bad value and what is accepted), and the guard
    they ask for (``None``: off)."""
    check_spike_options(spike_sigma, spike_window)
    if spike_sigma is None:
        return None
    if not skip_nonfinite:
        raise ValueError(
            f"spike_sigma={spike_sigma!r} skips steps as the inf/NaN check does: it needs skip_nonfinite=True."
        )
    return SpikeGuard(spike_sigma, spike_window)


def check_spike_options(spike_sigma: Any, spike_window: Any) -> None:
    """Raise ``ValueError`` naming the bad value and what is accepted."""
    if spike_sigma is not None and (
        isinstance(spike_sigma, bool)
        or not isinstance(spike_sigma, (int, float))
        or not math.isfinite(spike_sigma)
        or spike_sigma <= 0
    ):
        raise ValueError(
            f"spike_sigma={spike_sigma!r} is invalid: use a finite number > 0 (e.g. 6.0: skip steps whose loss or"
            " gradient norm is 6 standard deviations above the recent mean), or None to turn the guard off."
        )
    if isinstance(spike_window, bool) or not isinstance(spike_window, int) or spike_window < MIN_WINDOW:
        raise ValueError(
            f"spike_window={spike_window!r} is invalid: use an integer >= {MIN_WINDOW} (the number of recent"
            " non-skipped steps whose mean and standard deviation the guard compares with; default 128)."
        )


class SpikeGuard:
    """The window of recent (loss, gradient norm) and the per-step decision, on the device.

    Example::

        guard = SpikeGuard(sigma=6.0, window=128)
        spike = guard.decide(loss, grad_norm)      # 0-dim bool tensor, no sync
        guard.observe(loss, grad_norm, skipped)    # the step's outcome (a device flag): clean steps join the window
    """

    def __init__(self, sigma: float, window: int) -> None:
        self.sigma = float(sigma)
        self.window = int(window)
        self.warmup = max(self.window // 4, 2)
        self._values: Optional[Tensor] = None  # (2, window) float32: losses, gradient norms
        self._count: Optional[Tensor] = None  # int64: clean steps observed (the ring's write position too)
        self._spikes: Optional[Tensor] = None  # int64 [total spike skips, spike skips in a row]
        self._loaded: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------ state
    def _ensure(self, device: torch.device) -> None:
        if self._values is not None and self._values.device == device:
            return
        if self._values is not None:  # (moved to another device: the state follows)
            self._values, self._count, self._spikes = (t.to(device) for t in (self._values, self._count, self._spikes))
            return
        self._values = torch.zeros(2, self.window, dtype=torch.float32, device=device)
        self._count = torch.zeros((), dtype=torch.int64, device=device)
        self._spikes = torch.zeros(2, dtype=torch.int64, device=device)
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self._values.copy_(loaded["values"])
            self._count.fill_(loaded["count"])
            self._spikes.copy_(torch.tensor([loaded["spike_skips"], loaded["spikes_in_a_row"]]))

    def decide(self, loss: Optional[Tensor], grad_norm: Optional[Tensor]) -> Tensor:
        """Whether this step is a spike (a 0-dim bool tensor on the device). A figure that is ``None`` or not finite
        does not decide (an inf/NaN is the inf/NaN check's)."""
        ref = loss if loss is not None else grad_norm
        assert ref is not None
        self._ensure(ref.device)
        now = torch.stack([_figure(loss, ref), _figure(grad_norm, ref)])  # (2,), NaN where unknown
        n = self._count.clamp(max=self.window)
        filled = torch.arange(self.window, device=ref.device) < n
        counted = n.clamp(min=1).float()
        mean = torch.where(filled, self._values, 0.0).sum(1) / counted
        var = torch.where(filled, (self._values - mean[:, None]) ** 2, 0.0).sum(1) / (counted - 1).clamp(min=1)
        limit = mean + self.sigma * var.sqrt()
        above = ((now > limit) & torch.isfinite(now)).any()  # an inf/NaN figure is the inf/NaN check's to judge
        return above & (self._count >= self.warmup)

    def observe(
        self, loss: Optional[Tensor], grad_norm: Optional[Tensor], spike: Tensor, skipped: Union[Tensor, bool]
    ) -> None:
        """After the step: a clean step's figures join the window (``skipped``: the step's outcome, a device flag or
        the host's answer); the spike counters move."""
        ref = loss if loss is not None else grad_norm
        self._ensure(ref.device)
        now = torch.stack([_figure(loss, ref), _figure(grad_norm, ref)])
        if isinstance(skipped, bool):
            clean = torch.isfinite(now).all() & (not skipped)
        else:
            clean = ~skipped.reshape(()).to(ref.device).bool() & torch.isfinite(now).all()
        at = (self._count % self.window).reshape(1)
        column = self._values.index_select(1, at)
        self._values.index_copy_(1, at, torch.where(clean, torch.nan_to_num(now)[:, None], column))
        self._count.add_(clean.long())
        spike = spike.reshape(()).long()
        self._spikes.copy_(torch.stack([self._spikes[0] + spike, (self._spikes[1] + 1) * spike]))

    # ------------------------------------------------------------------ reading (syncs)
    @property
    def spike_skips(self) -> int:
        if self._spikes is None:
            return 0 if self._loaded is None else int(self._loaded["spike_skips"])
        return int(self._spikes[0].item())

    @property
    def spikes_in_a_row(self) -> int:
        if self._spikes is None:
            return 0 if self._loaded is None else int(self._loaded["spikes_in_a_row"])
        return int(self._spikes[1].item())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and ints (``torch.load(weights_only=True)`` reads them)."""
        if self._values is None:
            if self._loaded is not None:
                return dict(self._loaded)
            return {"window": self.window, "values": torch.zeros(2, self.window), "count": 0, "spike_skips": 0,
                    "spikes_in_a_row": 0}
        return {
            "window": self.window,
            "values": self._values.detach().cpu().clone(),
            "count": int(self._count.item()),
            "spike_skips": int(self._spikes[0].item()),
            "spikes_in_a_row": int(self._spikes[1].item()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validated before anything is taken: a window of another length starts empty (with a warning by the caller's
        choice); malformed entries raise ``ValueError`` naming the field."""
        if not isinstance(state, dict):
            raise ValueError(f"The checkpoint's spike-guard state must be a dict, not {type(state).__name__}.")
        values = state.get("values")
        shaped = isinstance(values, Tensor) and values.dim() == 2 and values.shape[0] == 2
        if not shaped or not values.is_floating_point():
            raise ValueError(
                "The checkpoint's spike-guard window 'values' must be a float tensor of shape (2, window)."
            )
        if not bool(torch.isfinite(values).all()):
            raise ValueError("The checkpoint's spike-guard window holds inf/NaN values: it is corrupted.")
        ints = {}
        for key in ("count", "spike_skips", "spikes_in_a_row"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"The checkpoint's spike-guard counter {key}={value!r} must be an integer >= 0.")
            ints[key] = value
        if values.shape[1] != self.window:
            raise ValueError(
                f"The checkpoint's spike window holds {values.shape[1]} steps, but spike_window={self.window}: resume"
                f" with spike_window={values.shape[1]}, or drop the plugin state's 'spike' entry to start a new window."
            )
        loaded = {"window": self.window, "values": values.detach().float().cpu().clone(), **ints}
        if self._values is None:
            self._loaded = loaded
        else:
            self._values.copy_(loaded["values"])
            self._count.fill_(ints["count"])
            self._spikes.copy_(torch.tensor([ints["spike_skips"], ints["spikes_in_a_row"]]))


def _figure(value: Optional[Tensor], ref: Tensor) -> Tensor:
    if value is None:
        return torch.full((), math.nan, device=ref.device)
    return value.detach().reshape(()).float()


def all_ranks_agree(flag: Tensor) -> Tensor:
    """Under torch.distributed, the MAX over ranks (enqueued on the device, no host sync)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.float()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return flag > 0
    return flag


def total_grad_norm(optimizer: Any, *, sharded: bool = False) -> Optional[Tensor]:
    """The L2 norm of every gradient ``optimizer`` holds (torch's ``get_total_norm``; shards summed over ranks when
    ``sharded``), on the device; ``None`` without gradients."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad = grad.coalesce()._values()
            if hasattr(grad, "to_local"):  # a DTensor shard (FSDP2)
                grad, sharded = grad.to_local(), True
            if grad.numel():
                grads.append(grad)
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=None).float()
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        squares = norm.square()
        torch.distributed.all_reduce(squares, op=torch.distributed.ReduceOp.SUM)
        return squares.sqrt()
    return norm
