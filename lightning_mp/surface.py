"""What a lightning_mp precision plugin holds and shows, written once for the Trainer's and Fabric's plugins
(:class:`~lightning_mp.MPPlugin`, :class:`~lightning_mp.MPFabricPrecision`): the checked settings, the mode in
force, its scaler, the master weights, the step counters, and the read-only view of them users (and their type
checkers) see.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch.optim import Optimizer

from lightning_mp.fp8 import FP8Config
from lightning_mp.fp8.config import settle_weights
from lightning_mp.guards import FP32GuardSpec
from lightning_mp.master import MasterWeights, release_fp32_state_loading
from lightning_mp.modes import PrecisionMode
from lightning_mp.optim_states import OptimizerStates
from lightning_mp.options import describe, plugin_compute_dtype
from lightning_mp.patches import Patches
from lightning_mp.run_precision import RunPrecision
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.settings import MasterKind, MPSettings
from lightning_mp.spike import SpikeGuard
from lightning_mp.stats import StepStats
from lightning_mp.step import OptimizerSteps
from lightning_mp.true_half import MasterWeightsSetup


class PrecisionRun:
    """The state of a lightning_mp plugin and its typed, read-only view (a base of both plugins).

    Example::

        plugin = MPPlugin("fp16", init_scale=1024.0)
        plugin.mode.name, plugin.settings.scale.init_scale, plugin.stats.skipped_steps
    """

    # The one constructor of both plugins (their arguments are documented on MPPlugin). The defaults are written out
    # for readers, type checkers and the API reference; a test keeps them equal to lightning_mp.settings.DEFAULTS.
    def __init__(
        self,
        precision: str = "bf16",
        device: Optional[str] = None,
        scaler: Optional[torch.amp.GradScaler] = None,
        *,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = True,
        min_scale: float = 1.0,
        max_scale: float = 16777216.0,
        loss_scale: Optional[float] = None,
        skip_nonfinite: bool = True,
        max_consecutive_skips: Optional[int] = 100,
        hold_schedulers_on_skip: bool = True,
        tf32: Optional[bool] = None,
        release_grads_after_step: bool = True,
        capture_step: bool = False,
        fp32_modules: Optional[list[str]] = None,
        master_weights: Optional[Union[str, bool]] = None,
        optimizer_states: str = "fp32",
        fp8: Optional[Union[FP8Config, dict]] = None,
        reduce_dtype: Optional[str] = None,
        fsdp_param_dtype: Optional[str] = None,
        spike_sigma: Optional[float] = None,
        spike_window: int = 128,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        # every bad value raises here, before training (its message naming the plugin's class)
        self._start(MPSettings.from_arguments(type(self).__name__, **arguments))

    def _start(self, settings: MPSettings) -> None:
        """Hold ``settings`` (checked) and what runs from them; each plugin adds its own state after this."""
        self._settings = settings
        skips = settings.skips
        self._spike = None if skips.spike_sigma is None else SpikeGuard(skips.spike_sigma, skips.spike_window)
        self._patches = Patches()  # every change to objects we do not own, undone at teardown (lightning_mp.patches)
        layout = settle_weights(settings.fp8, sharded=False, master_weights=settings.master_weights)
        self._weights = MasterWeightsSetup(settings.master_weights, layout, settings.host)
        self._states = OptimizerStates(settings.optimizer_states)  # Adam's moments between steps
        self._run = RunPrecision(
            settings, device=settings.device or ("cuda" if torch.cuda.is_available() else "cpu"),
            weights=self._weights, patches=self._patches,
        )  # fmt: skip
        #: the step counters: steps, skipped steps, the loss scale, ... (as long as the plugin lives)
        self.stats = StepStats(self._run.scaler, spike=self._spike)
        self._steps: Optional[OptimizerSteps] = None
        self._run.on_scaler = self._scaler_changed  # (a mode settled or switched, FSDP's class, a scaler set)

    def _scaler_changed(self, scaler: Any) -> None:
        """The run has a new scaler: the counters show it, the step's plans are made again for it."""
        self.stats.set_scaler(scaler)
        if self._steps is not None:
            self._steps.scaler = scaler

    # ------------------------------------------------------------------ what runs
    @property
    def mode(self) -> Optional[PrecisionMode]:
        """The precision mode in force (``None`` for ``auto`` until set-up)."""
        return self._run.mode

    @property
    def precision(self) -> str:
        """Lightning's name of the mode in force (``"bf16-mixed"``, ``"16-true"``, ...)."""
        return self._run.lightning_precision

    @property
    def scaler(self) -> Optional[torch.amp.GradScaler]:
        """The loss scaler (fp16 modes; ``None`` where the loss is not scaled, as Lightning's plugins): a
        ``torch.amp.GradScaler`` given (or set here, as on Lightning's ``MixedPrecision``) is this one. Steps are
        checked in every mode: see :attr:`skips_nonfinite`."""
        scaler = self._run.scaler
        if scaler is None or not getattr(scaler, "scaling", True):
            return None
        twin = scaler.twin if isinstance(scaler, DynamicLossScaler) else None  # (a stand-in is shown as it is)
        return twin or scaler  # type: ignore[return-value]

    @scaler.setter
    def scaler(self, scaler: Optional[torch.amp.GradScaler]) -> None:
        """Set the loss scaler, as on Lightning's ``MixedPrecision``: the plugin trains with it from now on, as if it
        had been given to the constructor (:meth:`~lightning_mp.run_precision.RunPrecision.use_scaler`)."""
        self._run.use_scaler(scaler, started=self._steps is not None)  # (the counters and the step follow it)
        self._settings = self._run.settings

    @property
    def skips_nonfinite(self) -> bool:
        """Whether steps with inf/NaN gradients are skipped (in the mode in force)."""
        scaler = self._run.scaler
        return scaler is not None and scaler.is_enabled()

    @property
    def device(self) -> str:
        """The device type the run uses (``"cuda"``, ``"cpu"``)."""
        return self._run.device

    @property
    def masters(self) -> Optional[MasterWeights]:
        """The master weights (``None`` before set-up, or where there are none)."""
        return self._weights.masters

    @property
    def requested_precision(self) -> str:
        """The precision as asked for (``"auto"`` kept)."""
        return self._run.requested

    @property
    def master_weights(self) -> Optional[str]:
        """The master-weights option in force (``None`` outside true-half modes)."""
        return self._weights.kind(self.mode)

    @property
    def optimizer_states(self) -> str:
        """The dtype Adam's moments are held in between steps: ``"fp32"`` (as the optimizer keeps them) or
        ``"bf16"`` (:mod:`lightning_mp.optim_states`)."""
        return self._states.name

    # ------------------------------------------------------------------ the settings (read-only)
    @property
    def settings(self) -> MPSettings:
        """What was asked for, checked: :class:`~lightning_mp.settings.MPSettings`."""
        return self._settings

    @property
    def fp32_guards(self) -> FP32GuardSpec:
        """The FP32 guards (``fp32_modules``, parsed)."""
        return self._settings.fp32_modules

    @property
    def fp8_config(self) -> FP8Config:
        """The fp8 settings (``fp8``)."""
        return self._settings.fp8

    @property
    def max_consecutive_skips(self) -> Optional[int]:
        return self._settings.skips.max_consecutive_skips

    @property
    def hold_schedulers_on_skip(self) -> bool:
        return self._settings.skips.hold_schedulers_on_skip

    @property
    def release_grads_after_step(self) -> bool:
        return self._settings.skips.release_grads_after_step

    @property
    def capture_step(self) -> bool:
        return self._settings.skips.capture_step

    @property
    def spike_sigma(self) -> Optional[float]:
        return self._settings.skips.spike_sigma

    @property
    def spike_window(self) -> int:
        return self._settings.skips.spike_window

    @property
    def reduce_dtype(self) -> Optional[str]:
        return self._settings.distributed.reduce_dtype

    @property
    def fsdp_param_dtype(self) -> Optional[str]:
        return self._settings.distributed.fsdp_param_dtype

    def _fp32_guard_spec(self, device_type: Optional[str]) -> FP32GuardSpec:
        """The FP32 guards this run installs: ``fp32_modules`` as the mode and device use it (``device_type``
        ``None``: the plugin's device, before the parameters are on theirs)."""
        spec, mode = self.fp32_guards, self.mode
        if mode is not None and not mode.true_half and (device_type or self.device) == "cuda":
            # fp32 weights: CUDA autocast (any mode a schedule switches to) and FP8 norms run these in fp32 already
            spec = spec.without_autocast_fp32()
        kind = MasterKind.of(self._weights.kind(mode))
        if mode is not None and mode.param_dtype is torch.bfloat16 and kind is not None and kind.keeps_precision:
            spec = spec.with_native_layer_norm()  # (the defaults: torch's LayerNorm on bf16, masters keep fp32 values)
        return spec

    def _open_steps(self, host: Any, container: torch.nn.Module, optimizers: list[Optimizer], *, device: torch.device,
                    fsdp: bool = False, release_grads: bool = False, module: Any = None) -> OptimizerSteps:
        """The run's step, set up the same for every host (``host``: :mod:`lightning_mp.host`): master weights for
        ``optimizers`` (their state loading kept fp32 while the run lasts, also for optimizers that join the list
        later), the :class:`~lightning_mp.step.OptimizerSteps` every step runs through, the counters' names and FP8
        figures, the FP8 backend's watch. ``container``: what the parameters are named after; ``module``: the
        ``LightningModule`` (the Trainer's host)."""
        run, mode = self._run, self._run.active
        masters = self._weights.connect(mode, container, optimizers, fsdp=fsdp, device=device)
        if masters is not None:
            self._patches.add(f"fp32 state loading of the run's optimizers ({len(optimizers)} at set-up)",
                              lambda: release_fp32_state_loading(optimizers))  # fmt: skip
        self._hold_states(optimizers)
        fp8 = run.fp8 if run.fp8 is not None and mode.fp8 else None
        steps = OptimizerSteps(
            run.scaler, masters, self.stats, max_consecutive_skips=self.max_consecutive_skips,
            saturation=fp8.sentinel.take if fp8 is not None else None, spike=self._spike, release_grads=release_grads,
            capture=self.capture_step,
        )  # fmt: skip
        steps.connect(host, optimizers)
        self._steps = steps
        self.stats.set_namer(self._weights.namer(container))
        self.stats.set_fp8(fp8)  # layer_stats, and the probe of saturated and underflowing shares
        run.connect_fp8(module, device, watch=run.scaler is not None, optimizers=optimizers)
        return steps

    def _hold_states(self, optimizers: list[Optimizer]) -> None:
        """``optimizer_states="bf16"``: hold the moments of ``optimizers`` in bf16 while the run lasts (refused, before
        training, for an optimizer other than Adam/AdamW)."""
        if not self._states.active:
            return
        for optimizer in optimizers:
            undo = self._states.hold(optimizer, type(self).__name__)
            self._patches.add(f"{self._states.name} moments of {type(optimizer).__name__}", undo)

    __repr__ = describe  # MPPlugin('fp16', init_scale=1024.0): the mode and the settings that differ from defaults
    compute_dtype = plugin_compute_dtype  # the dtype matmuls run in (lightning_mp.ThroughputMonitor reads it)
