"""The loss-spike guard: skip a step whose loss or gradient norm is far above its recent history.

Large runs diverge through finite spikes as often as through inf/NaN. With ``MPPlugin(..., spike_sigma=k)`` a step
whose loss or total gradient norm exceeds ``mean + k * std`` of the last ``spike_window`` steps that were not skipped
is skipped exactly as an inf/NaN step is (parameters, master weights, optimizer state, schedulers and buffers keep
their values), once at least ``spike_window // 4`` steps are in the window, and provided the rise above the mean is
also at least 1 % of the largest value of that figure in the run's clean steps (``PEAK_FRACTION``). This is what
OLMo-core's ``SkipStepOptimizer`` and levanter do (without the floor); PaLM skipped the batches around its spikes by
hand.

Everything stays on the device: each optimizer's window is a ``(2, spike_window)`` tensor ring of (loss, gradient
norm), the decision a 0-dim flag that joins the step's inf/NaN verdict, so no host sync is added. Under DDP/FSDP
each rank keeps the window of its own losses and the flag is all-reduced (MAX): every rank skips the same steps. A
spike does not count as an overflow: the loss scale (fp16) moves on the inf/NaN verdict alone.

The loss of a step is the sum of what backward was called on since the last optimizer step: with gradient
accumulation, Lightning's loss already divided by ``accumulate_grad_batches``, so the mean over the micro-batches; in
manual optimization with several optimizers, each step's own loss (a step after no new backward, e.g. two
optimizers stepped from one backward, is judged on the loss of that backward).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

#: the smallest ``spike_window`` (``MPPlugin``'s options are checked in :mod:`lightning_mp.settings`): the standard
#: deviation of fewer values says little
MIN_WINDOW = 8
#: a spike must also rise above the window's mean by this fraction of the largest value of its figure in the run's
#: clean steps: once a model has converged (a loss near 0, quantized by half-precision outputs), the window's standard
#: deviation is near 0 and steps that move by a rounding step would otherwise be "spikes" (and, since a skipped step
#: changes nothing, the same step again and again, until the divergence stop)
PEAK_FRACTION = 0.01


class SpikeGuard:
    """The windows of recent (loss, gradient norm), one per optimizer, and the per-step decision, on the device.

    Each optimizer is judged against its own history (a GAN's generator and discriminator have losses and gradient
    norms of their own scales); ``index`` is the optimizer's position in ``trainer.optimizers``.

    Example::

        guard = SpikeGuard(sigma=6.0, window=128)
        spike = guard.decide(loss, grad_norm)      # 0-dim bool tensor, no sync
        guard.observe(loss, grad_norm, spike, skipped)  # the step's outcome (a device flag): clean steps join
    """

    def __init__(self, sigma: float, window: int) -> None:
        self.sigma = float(sigma)
        self.window = int(window)
        self.warmup = max(self.window // 4, 2)
        self._values: Optional[Tensor] = None  # (optimizers, 2, window) float32: losses, gradient norms
        self._count: Optional[Tensor] = None  # (optimizers,) int64: clean steps observed (the rings' write positions)
        self._peak: Optional[Tensor] = None  # (optimizers, 2) float32: the largest clean loss and gradient norm
        self._total: Optional[Tensor] = None  # int64 (): spike skips of the run
        self._streak: Optional[Tensor] = None  # (optimizers,) int64: each optimizer's spike skips in a row
        self._loaded: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------ state
    def _ensure(self, device: torch.device, index: int = 0) -> None:
        if self._values is None:
            self._values = torch.zeros(1, 2, self.window, dtype=torch.float32, device=device)
            self._count = torch.zeros(1, dtype=torch.int64, device=device)
            self._peak = torch.zeros(1, 2, dtype=torch.float32, device=device)
            self._total = torch.zeros((), dtype=torch.int64, device=device)
            self._streak = torch.zeros(1, dtype=torch.int64, device=device)
            if self._loaded is not None:
                loaded, self._loaded = self._loaded, None
                self._values = loaded["values"].to(device)
                self._count = torch.tensor(loaded["count"], dtype=torch.int64, device=device)
                self._peak = loaded["peak"].to(device)
                self._total.fill_(loaded["spike_skips"])
                self._streak = torch.tensor(loaded["spikes_in_a_row"], dtype=torch.int64, device=device)
        elif self._values.device != device:  # (moved to another device: the state follows)
            assert self._count is not None and self._peak is not None and self._total is not None  # set with _values
            assert self._streak is not None
            self._values, self._count, self._peak, self._total, self._streak = (
                t.to(device) for t in (self._values, self._count, self._peak, self._total, self._streak)
            )
        assert self._count is not None and self._peak is not None and self._streak is not None  # set with _values
        if index >= self._values.shape[0]:  # an optimizer not seen yet: its own empty window
            more = index + 1 - self._values.shape[0]
            self._values = torch.cat([self._values, self._values.new_zeros(more, 2, self.window)])
            self._count = torch.cat([self._count, self._count.new_zeros(more)])
            self._peak = torch.cat([self._peak, self._peak.new_zeros(more, 2)])
            self._streak = torch.cat([self._streak, self._streak.new_zeros(more)])

    def decide(self, loss: Optional[Tensor], grad_norm: Optional[Tensor], index: int = 0) -> Tensor:
        """Whether this step of optimizer ``index`` is a spike (a 0-dim bool tensor on the device). A figure that is
        ``None`` or not finite does not decide (an inf/NaN is the inf/NaN check's)."""
        ref = loss if loss is not None else grad_norm
        assert ref is not None
        self._ensure(ref.device, index)
        assert self._values is not None and self._count is not None and self._peak is not None  # set by _ensure
        values, count = self._values[index], self._count[index]
        now = torch.stack([_figure(loss, ref), _figure(grad_norm, ref)])  # (2,), NaN where unknown
        n = count.clamp(max=self.window)
        filled = torch.arange(self.window, device=ref.device) < n
        counted = n.clamp(min=1).float()
        mean = torch.where(filled, values, 0.0).sum(1) / counted
        var = torch.where(filled, (values - mean[:, None]) ** 2, 0.0).sum(1) / (counted - 1).clamp(min=1)
        # (the floor: a rise of 1 % of the run's largest clean figure at least; see PEAK_FRACTION)
        limit = mean + torch.maximum(self.sigma * var.sqrt(), PEAK_FRACTION * self._peak[index])
        above = ((now > limit) & torch.isfinite(now)).any()  # an inf/NaN figure is the inf/NaN check's to judge
        return above & (count >= self.warmup)

    def observe(
        self,
        loss: Optional[Tensor],
        grad_norm: Optional[Tensor],
        spike: Tensor,
        skipped: Union[Tensor, bool],
        index: int = 0,
    ) -> None:
        """After the step of optimizer ``index``: a clean step's figures join its window (``skipped``: the step's
        outcome, a device flag or the host's answer); the spike counters move."""
        ref = loss if loss is not None else grad_norm
        assert ref is not None  # a step with neither is not observed
        self._ensure(ref.device, index)
        assert self._values is not None and self._count is not None and self._peak is not None  # set by _ensure
        assert self._total is not None and self._streak is not None
        now = torch.stack([_figure(loss, ref), _figure(grad_norm, ref)])
        if isinstance(skipped, bool):
            clean = torch.isfinite(now).all() & (not skipped)
        else:
            clean = ~skipped.reshape(()).to(ref.device).bool() & torch.isfinite(now).all()
        now = torch.nan_to_num(now)  # (only a clean step's figures are taken, and those are finite)
        values, count, peak = self._values[index], self._count[index], self._peak[index]  # views: written in place
        at = (count % self.window).reshape(1)
        column = values.index_select(1, at)
        values.index_copy_(1, at, torch.where(clean, now[:, None], column))
        count.add_(clean.long())
        peak.copy_(torch.where(clean, torch.maximum(peak, now), peak))
        spike = spike.reshape(()).long()
        self._total.add_(spike)
        streak = self._streak[index]
        streak.copy_((streak + 1) * spike)

    # ------------------------------------------------------------------ reading (syncs)
    @property
    def spike_skips(self) -> int:
        """Steps the guard skipped in the run (every optimizer's)."""
        if self._total is None:
            return 0 if self._loaded is None else int(self._loaded["spike_skips"])
        return int(self._total.item())

    def spikes_in_a_row(self, index: int = 0) -> int:
        """The spike skips in a row of optimizer ``index`` (its latest steps)."""
        streaks = self._streak.tolist() if self._streak is not None else (self._loaded or {}).get("spikes_in_a_row", [])
        return int(streaks[index]) if index < len(streaks) else 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and ints (``torch.load(weights_only=True)`` reads them). One optimizer: ``values`` of shape
        ``(2, window)``, an int ``count`` and ``peak`` of shape ``(2,)`` (the largest clean loss and gradient norm);
        several: ``(optimizers, 2, window)``, a list of counts and ``(optimizers, 2)``. ``spike_skips``: the run's
        total; ``spikes_in_a_row``: an int, or a list with one per optimizer."""
        if self._values is None:
            if self._loaded is None:
                return {"window": self.window, "values": torch.zeros(2, self.window), "count": 0,
                        "peak": torch.zeros(2), "spike_skips": 0, "spikes_in_a_row": 0}  # fmt: skip
            values, counts, peak = self._loaded["values"], list(self._loaded["count"]), self._loaded["peak"]
            total, streaks = self._loaded["spike_skips"], list(self._loaded["spikes_in_a_row"])
        else:
            assert self._count is not None and self._peak is not None and self._total is not None  # set with _values
            assert self._streak is not None
            values, counts = self._values.detach().cpu().clone(), self._count.tolist()
            peak = self._peak.detach().cpu().clone()
            total, streaks = int(self._total.item()), self._streak.tolist()
        single = values.shape[0] == 1
        return {
            "window": self.window,
            "values": values[0] if single else values,
            "count": counts[0] if single else counts,
            "peak": peak[0] if single else peak,
            "spike_skips": int(total),
            "spikes_in_a_row": streaks[0] if single else streaks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validated before anything is taken; malformed entries raise ``ValueError`` naming the field, a window of
        another length names the ``spike_window`` to resume with."""
        if not isinstance(state, dict):
            raise ValueError(f"The checkpoint's spike-guard state must be a dict, not {type(state).__name__}.")
        values = _checked_values(state)
        per_window = _checked_counters(state, values.shape[0])
        counts = per_window["count"]
        total = _checked_total(state)
        self._check_window_length(values)
        values = values.detach().float().cpu().clone()
        peak = _checked_peak(state, values, counts)
        streaks = per_window["spikes_in_a_row"]
        loaded = {"window": self.window, "values": values, "count": counts, "peak": peak, "spike_skips": total,
                  "spikes_in_a_row": streaks}  # fmt: skip
        if self._values is None:
            self._loaded = loaded
        else:
            self._take(values, counts, peak, total, streaks)

    def _check_window_length(self, values: Tensor) -> None:
        """A window of another length than ``spike_window`` cannot be resumed: name the one to resume with."""
        if values.shape[2] != self.window:
            raise ValueError(
                f"The checkpoint's spike window holds {values.shape[2]} steps, but spike_window={self.window}: resume"
                f" with spike_window={values.shape[2]}, or drop the plugin state's 'spike' entry to start a new window."
            )

    def _take(self, values: Tensor, counts: list[int], peak: Tensor, total: int, streaks: list[int]) -> None:
        """Replace the live (device) window with a validated checkpoint's."""
        assert self._values is not None and self._total is not None  # set with _values
        device = self._values.device
        self._values = values.to(device)
        self._count = torch.tensor(counts, dtype=torch.int64, device=device)
        self._peak = peak.to(device)
        self._total.fill_(total)
        self._streak = torch.tensor(streaks, dtype=torch.int64, device=device)


def _checked_values(state: dict[str, Any]) -> Tensor:
    """The checkpoint's windows as ``(optimizers, 2, window)``: a float tensor of finite values."""
    values: Any = state.get("values")  # checked below
    if isinstance(values, Tensor) and values.dim() == 2:
        values = values.unsqueeze(0)  # one optimizer's window
    shaped = isinstance(values, Tensor) and values.dim() == 3 and values.shape[0] >= 1 and values.shape[1] == 2
    if not shaped or not values.is_floating_point():
        raise ValueError(
            "The checkpoint's spike-guard window 'values' must be a float tensor of shape (2, window) or"
            " (optimizers, 2, window)."
        )
    if not bool(torch.isfinite(values).all()):
        raise ValueError("The checkpoint's spike-guard window holds inf/NaN values: it is corrupted.")
    return values


def _checked_counters(state: dict[str, Any], windows: int) -> dict[str, list[Any]]:
    """``count`` and ``spikes_in_a_row``, each as a list of one integer >= 0 per window."""
    per_window = {}
    for key in ("count", "spikes_in_a_row"):
        given = state.get(key)
        listed = [given] if not isinstance(given, (list, tuple)) else list(given)
        bad = any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in listed)
        if bad or len(listed) != windows:
            raise ValueError(
                f"The checkpoint's spike-guard counter {key}={given!r} must be an integer >= 0 for each of its"
                f" {windows} window(s)."
            )
        per_window[key] = listed
    return per_window


def _checked_total(state: dict[str, Any]) -> int:
    """The run's total of spike skips: an integer >= 0."""
    total = state.get("spike_skips")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"The checkpoint's spike-guard counter spike_skips={total!r} must be an integer >= 0.")
    return total


def _checked_peak(state: dict[str, Any], values: Tensor, counts: list[int]) -> Tensor:
    """The largest clean (loss, gradient norm) of each window, ``(optimizers, 2)``; a checkpoint written before the
    peak was kept gets its window's largest values."""
    peak = state.get("peak")
    if peak is None:  # (written before the peak was kept: the window's largest values stand in)
        filled = torch.arange(values.shape[2]) < torch.tensor(counts).clamp(max=values.shape[2])[:, None]
        peak = torch.where(filled[:, None, :], values, 0.0).amax(2)
    elif not isinstance(peak, Tensor) or not peak.is_floating_point() or peak.numel() != 2 * values.shape[0]:
        raise ValueError(
            f"The checkpoint's spike-guard 'peak' must be a float tensor of {2 * values.shape[0]} values (the"
            " largest clean loss and gradient norm of each window)."
        )
    elif not bool(torch.isfinite(peak).all()):
        raise ValueError("The checkpoint's spike-guard 'peak' holds inf/NaN values: it is corrupted.")
    return peak.detach().float().cpu().reshape(values.shape[0], 2).clone()


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


def _l2_norm(tensors: list[Tensor]) -> Tensor:
    """torch's ``get_total_norm(tensors, 2.0)`` (torch >= 2.6); before it, the same from the per-tensor norms."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(tensors, 2.0, foreach=None).float()
    with torch.no_grad():
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t).float() for t in tensors]))


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
    norm = _l2_norm(grads)
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        squares = norm.square()
        torch.distributed.all_reduce(squares, op=torch.distributed.ReduceOp.SUM)
        return squares.sqrt()
    return norm
