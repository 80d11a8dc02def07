"""The precision a run uses right now: its mode, the loss scaler that goes with it, TF32 flags and FP8 machinery.

``MPPlugin`` holds one; ``PrecisionSchedule`` switches it between optimizer steps through
:meth:`MPPlugin.set_precision`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mp.distributed import sharded_before_setup
from lightning_mp.fp8.backend import FP8Backend, make_backend
from lightning_mp.fp8.config import BACKEND_TITLES, settle_weights
from lightning_mp.modes import (
    AUTO,
    MODES,
    PrecisionMode,
    auto_choice,
    parse_precision,
    provisional_lightning_precision,
    resolve_mode,
    warn_if_slow_on_device,
)
from lightning_mp.patches import Patches
from lightning_mp.nonfinite import NonfiniteGuard, StepGuard
from lightning_mp.scaling import DynamicLossScaler, ShardedDynamicLossScaler, adopt_scaler
from lightning_mp.settings import LossScaleSettings, MPSettings
from lightning_mp.true_half import HALF_FP8_LAYOUTS, MasterWeightsSetup, cast_half_weights_, fp8_layer_names


class RunPrecision:
    """Mode, scaler, TF32 and FP8 of one plugin; the scaler's state carries over when the mode changes.

    The settings were checked when they were built (for a named mode, against that mode); a mode chosen later
    (``auto`` at set-up, a switch between steps) is checked with :meth:`MPSettings.check_mode` before it is set.

    Example::

        run = RunPrecision(MPSettings.from_arguments(precision="fp16"), device="cpu", weights=MasterWeightsSetup(None))
        run.mode.name, run.scaler.get_scale()
    """

    def __init__(
        self, settings: MPSettings, *, device: str, weights: MasterWeightsSetup, patches: Optional[Patches] = None
    ) -> None:
        self.settings = settings
        self.requested = settings.precision
        self.patches = patches if patches is not None else Patches()  # TF32 flags, FP8 hooks: undone here
        self.device = device
        self.weights = weights  # the master weights (true-half modes, and fp8 with bf16 weights)
        self.mode: Optional[PrecisionMode] = None
        #: the loss scaler (fp16 modes), the inf/NaN step guard (other modes), or ``None`` (``skip_nonfinite=False``)
        self.scaler: Optional[StepGuard] = None
        #: told of every new scaler (the run's one owner of it: the counters and the step follow from here)
        self.on_scaler: Optional[Callable[[Optional[StepGuard]], None]] = None
        self.fp8: Optional[FP8Backend] = None  # the FP8 backend (lightning_mp.fp8.backend)
        self.sharded = False  # under Lightning's FSDP strategy (picks the scaler class)
        self._tf32_saved: Optional[tuple[bool, bool]] = None
        if self.requested != AUTO:
            self.set_mode(MODES[self.requested])  # the hardware check waits for set-up, on the real device

    @property
    def lightning_precision(self) -> str:
        return (
            self.mode.lightning_precision if self.mode is not None else provisional_lightning_precision(self.requested)
        )

    @property
    def name(self) -> str:
        return self.mode.name if self.mode is not None else self.requested

    @property
    def active(self) -> PrecisionMode:
        """The mode in force: a named mode from the start, ``auto``'s choice once set-up settled it."""
        if self.mode is None:
            raise RuntimeError(
                f"{self.settings.host}(precision='auto') has not chosen its mode yet: that happens at set-up."
            )
        return self.mode

    def set_mode(self, mode: PrecisionMode) -> None:
        """Run in ``mode`` from now on (checked already), with a scaler of its own that keeps the last one's state."""
        if mode.fp8 and self.fp8 is None:
            self.fp8 = make_backend(self.settings.fp8)
        previous, self.mode = self.scaler, mode
        self.scaler = self._build_scaler(mode, previous)
        if self.on_scaler is not None:
            self.on_scaler(self.scaler)

    def use_scaler(self, given: Any, *, started: bool) -> None:
        """``plugin.scaler = given``: train with ``given`` from now on, as if the plugin had been built with it (and
        checked as there: a mode that does not scale the loss takes none, the plugin's own loss-scale arguments
        would be ignored). A ``torch.amp.GradScaler`` trains through a ``DynamicLossScaler`` that starts from its
        state and shares its scale; a stand-in with GradScaler's methods is used as it is. ``None`` is no change
        where the loss is not scaled; a mode that scales the loss needs a scaler. ``started``: training has begun
        (the scaler goes to the run's device and, under DDP, agrees across ranks as the one it replaces did)."""
        if given is None and self.mode is not None and self.mode.needs_scaler:
            raise ValueError(
                f"{self.settings.host}(precision={self.mode.name!r}) scales the loss, so its scaler cannot be None."
                " Set a torch.amp.GradScaler (or a lightning_mp.DynamicLossScaler), or build the plugin with"
                " loss_scale=1.0 to train with an unscaled loss."
            )
        if given is None and self.settings.scaler is None:
            return
        self.settings = dataclasses.replace(self.settings, scaler=given)  # (checked as the constructor's arguments)
        if self.mode is None:
            return  # auto: the mode settles at set-up, which checks it with the scaler and builds the scaler
        previous = self.scaler
        self.set_mode(self.mode)  # the scaler built again: the given one
        scaler = self.scaler
        if started and isinstance(scaler, DynamicLossScaler):
            scaler.ensure_initialized(torch.device(self.device))
            scaler.sync_across_ranks = bool(getattr(previous, "sync_across_ranks", False))

    def set_sharded(self, sharded: bool) -> None:
        if sharded != self.sharded:
            self.sharded = sharded
            if self.mode is not None:
                self.set_mode(self.mode)  # the scaler's class changes, its state carries over

    def _build_scaler(self, mode: PrecisionMode, previous: Optional[StepGuard]) -> Optional[StepGuard]:
        if self.settings.scaler is not None:  # (a mode that does not scale the loss was refused by check_mode)
            return adopt_scaler(self.settings.scaler, sharded=self.sharded, host=self.settings.host)
        if not mode.needs_scaler:
            return NonfiniteGuard(self.device, sharded=self.sharded) if self.settings.skips.skip_nonfinite else None
        scaler = make_scaler(self.settings.scaling, self.device, sharded=self.sharded)
        if isinstance(previous, DynamicLossScaler) and previous.initialized:
            scaler.load_state_dict(previous.state_dict())  # (the scale carries over; the counts are the plugin's)
        return scaler

    def connect(self, device: torch.device) -> None:
        """The Trainer's device is known: settle ``auto``, check the hardware, put the scaler there."""
        self.device = device.type
        if self.requested == AUTO:
            name, reason = auto_choice(self.device)
            if self.mode is None or self.mode.name != name:
                mode = resolve_mode(name, self.device)
                self.settings.check_mode(mode)
                self.set_mode(mode)
        else:
            mode = self.active
            resolve_mode(mode.name, self.device)  # a mode the device cannot run fails before the first step
            if self.scaler is not None and self.scaler.device_type != self.device:
                self.set_mode(mode)  # rebuilt for the real device, state kept
        warn_if_slow_on_device(self.active, self.device)  # slow on this CPU: one warning at set-up, naming its mode
        if self.scaler is not None:
            self.scaler.ensure_initialized(device)
        self.apply_tf32()

    def convert_fp8(self, module: Any, device: torch.device, *, sharded: bool = False) -> None:
        """fp8: swap the linear layers for the backend's FP8 layers (checks the GPU and the library first; logs what
        it did), and keep the weights in the dtype ``fp8={"weights": ...}`` settles on: ``"auto"`` keeps the FP8
        layers' weights fp32 and the others bf16 with fp32 master weights in the step (``"mixed"``), or, where the
        model is sharded (``sharded``, FSDP, FSDP2), fp32 shards (the masters) gathered for compute.

        A model whose layers were swapped already (by :func:`lightning_mp.prepare_fp8` in ``configure_model``) is
        adopted as it is; a model sharded in ``configure_model`` needs that, or FP8 layers built in.
        """
        fp8 = self.fp8
        if self.mode is None or not self.mode.fp8 or fp8 is None or fp8.model is module:
            return
        sharded = sharded or self.sharded or sharded_before_setup(module)
        if fp8.model is None:  # (a part converted in configure_model settled it then)
            fp8.weights = settle_weights(fp8.config, sharded=sharded, master_weights=self.weights.asked)
            self.weights.fp8_weights = fp8.weights
        if fp8.model is not None and any(m is fp8.model for m in module.modules()):
            fp8.adopt(module, device)  # a part converted in configure_model: state names are the whole module's
        elif sharded_before_setup(module):
            if not fp8.is_converted(module):
                raise MisconfigurationException(
                    f"{self.settings.host}(precision='fp8'): the model's parameters were sharded (FSDP2's fully_shard,"
                    " or FSDP units wrapped in configure_model) before this plugin could swap its linear layers for"
                    f" {BACKEND_TITLES.get(fp8.name, fp8.name)}'s FP8 layers. Call lightning_mp.prepare_fp8(self) at"
                    " the top of configure_model,"
                    " before fully_shard or the wrapping (it swaps them with this plugin's fp8 settings and does"
                    " nothing under other precisions), or build the model from FP8 layers."
                )
            fp8.adopt(module, device)
            return
        else:
            fp8.convert(module, device=device, announce=rank_zero_info, cast_weights=False)
        if fp8.weights in HALF_FP8_LAYOUTS:  # (after the swap: the exact fp32 values stay known for the masters)
            keep = fp8_layer_names(module, fp8.is_converted) if fp8.weights == "mixed" else ()
            cast_half_weights_(module, torch.bfloat16, keep_fp32=keep)

    def connect_fp8(self, module: Any, device: torch.device, *, watch: bool, optimizers: list) -> None:
        if self.fp8 is None or not self.active.fp8:
            return
        self.fp8.check(device)  # recipe-specific: e.g. mxfp8 needs Blackwell
        try:
            seeded = self.fp8.connect_optimizers(optimizers)  # FP8 primary weights: masters in the optimizer
        except ValueError as err:
            raise MisconfigurationException(f"{self.settings.host}(precision='fp8'): {err}") from None
        if seeded:
            rank_zero_info(
                f"{self.settings.host}: {seeded} FP8 weights' optimizer-held masters start from the exact fp32 weights."
            )
        trainer = getattr(module, "_trainer", None)
        self.fp8.configure_weight_cache(
            accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1),
            automatic_optimization=module.automatic_optimization if module is not None else True,
        )
        if self.fp8.watch_saturation(watch) is not None:  # infs that FP8 casts saturate join the step's verdict
            fp8 = self.fp8
            self.patches.add(f"{fp8.name}'s FP8 hooks (saturation checks)", lambda: fp8.watch_saturation(False))

    def switch(self, precision: str, *, started: bool) -> PrecisionMode:
        """Another mode between two optimizer steps (``started``: weights and layers are already converted)."""
        name = parse_precision(precision)
        mode = resolve_mode(auto_choice(self.device)[0] if name == AUTO else name, self.device)
        if self.mode is not None and mode.name == self.mode.name:
            return mode
        if started:
            self.check_switch(precision)
        self.settings.check_mode(mode, switch=True)
        self.set_mode(mode)
        if self.scaler is not None:
            self.scaler.ensure_initialized(torch.device(self.device))
        self.apply_tf32()
        return mode

    def check_switch(self, precision: str) -> None:
        """Raise ``ValueError`` now if training could not switch to ``precision`` from the mode it starts in:
        weights' dtypes, FP8 layers and master weights are fixed when training starts."""
        name = parse_precision(precision)
        mode = MODES[auto_choice(self.device)[0] if name == AUTO else name]
        if self.mode is not None and mode.name == self.mode.name:
            return
        current = self.mode if self.mode is not None else MODES[auto_choice(self.device)[0]]  # auto: an autocast mode
        if mode.fp8 or mode.true_half or current.true_half or current.fp8:
            raise ValueError(
                f"set_precision({precision!r}): cannot switch from precision={self.name!r} to {mode.name!r} during"
                " training: weights' dtypes, FP8 layers and master weights are fixed when training starts. Switch"
                " among 'fp32', 'tf32', 'bf16' and 'fp16', or save a checkpoint and resume it in the other mode."
            )

    def apply_tf32(self) -> None:
        tf32 = self.settings.tf32
        wanted = tf32 if tf32 is not None else self.active.tf32
        if wanted is None:
            self.restore_tf32()  # a switch away from fp32/tf32 gives the flags back
            return
        if self._tf32_saved is None:
            self._tf32_saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            self.patches.add("TF32 flags (torch.backends)", self.restore_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = wanted

    def restore_tf32(self) -> None:
        if self._tf32_saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32_saved
            self._tf32_saved = None



def make_scaler(settings: LossScaleSettings, device: str, *, sharded: bool) -> DynamicLossScaler:
    """The loss scaler the settings describe (``sharded``: FSDP's)."""
    cls = ShardedDynamicLossScaler if sharded else DynamicLossScaler
    return cls(device, **settings.scaler_arguments(), dynamic=settings.dynamic)
