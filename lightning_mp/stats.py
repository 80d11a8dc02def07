"""StepStats: what the precision machinery did on the last optimizer step — the one interface callbacks read."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_mp.scaling import DynamicLossScaler


class NonFiniteTrainingError(RuntimeError):
    """Raised when too many optimizer steps in a row had inf/NaN gradients and were skipped."""


class StepStats:
    """Read-only view of the plugin's step accounting, available as ``plugin.stats``.

    Example::

        plugin = MPPlugin("fp16")
        trainer = Trainer(plugins=[plugin], max_steps=100)
        trainer.fit(model)
        plugin.stats.skipped_steps, plugin.stats.loss_scale

    The values live on the device while training runs; each read of a property copies one number to
    the host (a sync on CUDA), so read them on logging steps, not on every step. ``as_dict()`` reads
    everything with a single copy.
    """

    def __init__(self, scaler: Optional[DynamicLossScaler]) -> None:
        self._scaler = scaler
        self._grad_norm: Optional[torch.Tensor] = None

    def record_grad_norm(self, norm: torch.Tensor) -> None:
        """Keep the (unscaled) gradient norm computed by clipping; stays on the device."""
        self._grad_norm = norm.detach()

    @property
    def skipped(self) -> bool:
        """Whether the last optimizer step was skipped because of inf/NaN gradients."""
        return self._scaler.last_skipped if self._scaler is not None else False

    @property
    def skipped_steps(self) -> int:
        """Total optimizer steps skipped so far (restored from checkpoints)."""
        return self._scaler.skipped_steps if self._scaler is not None else 0

    @property
    def consecutive_skips(self) -> int:
        """Skipped steps in a row up to the last step (0 after a clean step)."""
        return self._scaler.consecutive_skips if self._scaler is not None else 0

    @property
    def steps(self) -> int:
        """Optimizer steps attempted, skipped ones included."""
        return self._scaler.steps if self._scaler is not None else 0

    @property
    def loss_scale(self) -> Optional[float]:
        """The current loss scale, or ``None`` when the mode does not scale the loss."""
        if self._scaler is None or not self._scaler.scaling:
            return None
        return self._scaler.get_scale()

    @property
    def grad_norm(self) -> Optional[float]:
        """The unscaled gradient norm of the last step, when gradient clipping by norm computed it."""
        return None if self._grad_norm is None else self._grad_norm.item()

    def as_dict(self) -> dict[str, Any]:
        """All figures at once (one host copy)."""
        scaler = self._scaler
        counters = scaler.counters_tensor() if scaler is not None else None
        if counters is None:
            steps, skipped_steps, consecutive, last = (scaler._counters_now() if scaler is not None else [0, 0, 0, 0])
            scale = None if scaler is None or not scaler.scaling else scaler.get_scale()
            grad_norm = self.grad_norm
        else:
            parts = [counters.double()]
            if scaler.scaling:
                parts.append(scaler._get_scale_async().double().reshape(1))
            norm = self._grad_norm
            norm_along = norm is not None and norm.device == counters.device
            if norm_along:  # the same host copy
                parts.append(norm.detach().double().reshape(1))
            values = torch.cat(parts).tolist()
            steps, skipped_steps, consecutive, last = (int(v) for v in values[:4])
            scale = values[4] if scaler.scaling else None
            grad_norm = values[-1] if norm_along else self.grad_norm
        return {
            "steps": steps,
            "skipped_steps": skipped_steps,
            "consecutive_skips": consecutive,
            "skipped": bool(scaler.last_skipped_host) if scaler is not None and scaler.last_skipped_host is not None else bool(last),
            "loss_scale": scale,
            "grad_norm": grad_norm,
        }

    def __repr__(self) -> str:
        return f"StepStats({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"
