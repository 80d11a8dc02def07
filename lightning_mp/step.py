"""One optimizer step, owned in one place: its order, its skip verdict, and what a skipped step leaves untouched.

The order of one step of one optimizer (stages in capitals; misuse is a clear error, not a wrong number):

    READY
      1. the closure: forward and backward (automatic optimization); nothing in manual optimization
      2. gather: in true-half modes, fp32 stand-ins of the half parameters (the masters), with fp32 gradients
         (the half gradient plus the fp32 sum of earlier micro-batches); they stand in the param groups only while
         torch's scaler reads the gradients and while the optimizer steps, so hooks and callbacks see the model's
         own parameters there
      3. unscale (fp16): the gradients are divided by the loss scale, inf/NaN found in the same fused kernel;
         the true gradients are written into the half ones that hooks read
    PREPARED
      4. hooks: ``on_before_optimizer_step`` (callbacks, then the LightningModule); half gradients a hook rewrote
         become the fp32 ones
      5. clipping (``configure_gradient_clipping``): by norm, the norm's finiteness is a verdict source; by value,
         the gradients are checked before clamping hides an inf
      6. the verdict: a read-only check of the gradients the optimizer will apply, unless a source above already
         saw them after the last hook that could write them; the FP8 saturation flag is added; under DDP every
         rank takes the worst
      7. step, or skip: the optimizer steps the stand-ins (fused optimizers skip on the device); the half weights
         are written back; on a skip the buffers the window's forward passes changed are restored
    STEPPED
      8. the loss scale moves once per training batch, after every optimizer of that batch has stepped
         (automatic optimization: right away; manual: when ``training_step`` returns)

Nothing outside this module sets the verdict; callbacks read :class:`lightning_mp.stats.StepStats`.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.core.optimizer import do_nothing_closure
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.optim import LBFGS, Optimizer

from lightning_mp.buffers import BufferSnapshot
from lightning_mp.distributed import FP32SumReduction, grads_synced
from lightning_mp.master import MasterWeights, StepRecords, wrapped_optimizers
from lightning_mp.overlap import OverlappedCheck
from lightning_mp.spike import SpikeGuard, all_ranks_agree, total_grad_norm
import lightning_mp.verdict as checks
from lightning_mp.nonfinite import StepGuard
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.stats import NonFiniteTrainingError, OptimizerStats, StepStats


#: the plans of an optimizer's steps (see ``OptimizerSteps._plan``)
_CHECK_ONLY, _CHECK_ONLY_FUSED, _CLOSURE, _GENERAL = "check-only", "check-only fused", "closure", "general"
#: a fused optimizer's device verdicts sent to the step counters in one copy (see ``OptimizerStats``)
_VERDICT_BATCH = 8


class Stage(enum.Enum):
    READY = "ready"
    PREPARED = "prepared"  # gathered and unscaled: hooks and clipping may run
    STEPPED = "stepped"


@dataclass
class _OptimizerState:
    """One optimizer's place in the step, and what outlives the step (skip streak, scheduler record)."""

    index: int
    optimizer: Any = None
    stage: Stage = Stage.READY
    records: Optional[StepRecords] = None
    #: no verdict source has seen the gradients since something may have written them
    dirty: bool = True
    #: the total gradient norm clipping computed this step (the spike guard's figure; ``None``: not computed)
    norm: Optional[Tensor] = None
    stats: OptimizerStats = field(default_factory=OptimizerStats)
    #: the plan of its steps, decided at its first step and kept (``None``: not decided yet; see ``_plan``)
    plan: Optional[str] = None
    #: the check-only plans' inf/NaN check, planned from the parameters (``None``: the general check)
    check: Optional[checks.PlannedCheck] = None


@dataclass
class Outcome:
    """What one optimizer step did, as the plan that ran it found out: the value every plan hands to the one routine
    that finishes a step (:meth:`OptimizerSteps._finish`)."""

    #: skipped or not, where the host knows (the step paid torch's one sync, or nothing was checked); ``None``: only
    #: the device knows (a fused optimizer skipped on ``flag``)
    skipped: Optional[bool]
    #: the device verdict (non-zero: skipped) where the host does not know
    flag: Optional[Tensor] = None
    #: what the loss scale moves on (``None``: no scaler): the outcome, or the inf/NaN verdict alone where a loss
    #: spike joined the skip (a spike is no overflow)
    scale_verdict: Tensor | bool | None = None
    #: the master weights' records of the step, written back by the finish (true-half)
    records: Optional[StepRecords] = None


class OptimizerSteps:
    """Runs every optimizer step of a training run (see the module docstring for the order).

    Args:
        scaler: the loss scaler (fp16 modes) or the inf/NaN step guard of the other modes (``NonfiniteGuard``);
            ``None``: steps are not checked (``skip_nonfinite=False``).
        masters: master weights of half-precision parameters (``None``: the optimizer steps the parameters).
        stats: where the outcome of each step is published (read by callbacks).
        max_consecutive_skips: stop after this many skipped steps in a row of one optimizer (``None``: never).
        saturation: a callable returning a device flag (> 0: an FP8 cast saturated an inf) or ``None``.
    """

    def __init__(
        self,
        scaler: Optional[StepGuard],
        masters: Optional[MasterWeights],
        stats: StepStats,
        *,
        max_consecutive_skips: Optional[int],
        saturation: Optional[Callable[[], Optional[Tensor]]] = None,
        spike: Optional[SpikeGuard] = None,
        release_grads: bool = False,
    ) -> None:
        self._scaler = scaler
        self.masters = masters
        self.stats = stats
        self.max_consecutive_skips = max_consecutive_skips
        self.saturation = saturation
        self.spike = spike
        self._loss: Optional[Tensor] = None  # what backward ran on since the last step (the spike guard's figure)
        self._last_loss: Optional[Tensor] = None  # manual optimization: the loss of this batch's last judged step
        self.release_grads = release_grads
        self.buffers = BufferSnapshot()
        self._optimizers: dict[int, _OptimizerState] = {}
        self._batch_verdicts: list[Tensor | bool] = []  # this batch's verdicts, for the one scale update
        self._carry_sums = False
        self._sums = FP32SumReduction()
        self._hooks_write: Optional[tuple[bool, bool]] = None
        self._module: Optional[LightningModule] = None
        self._trainer: Any = None
        self._overlap = OverlappedCheck()
        self._flags = checks.ZeroFlags()  # the check-only plans' verdict flags

    @property
    def scaler(self) -> Optional[StepGuard]:
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: Optional[StepGuard]) -> None:
        self._scaler = scaler  # (a mode switch between steps: the plans are decided again)
        for state in self._optimizers.values():
            state.plan = None

    # ------------------------------------------------------------------ set-up
    def connect(self, module: Optional[LightningModule], optimizers: list[Optimizer]) -> None:
        """Start a run with these optimizers (a new ``fit``; earlier records are dropped, the step counters are the
        plugin's and go on: see :meth:`StepStats.optimizer`)."""
        self._optimizers = {id(opt): self._new_state(i, opt) for i, opt in enumerate(optimizers)}
        self._batch_verdicts = []
        self.buffers.drop()
        self.buffers.forget_plan()
        self._sums.reset()
        self._hooks_write = None
        self._module = module
        self._trainer = getattr(module, "_trainer", None) if module is not None else None
        # fp32 sums of micro-batches: only where Lightning owns zero_grad (automatic optimization)
        self._carry_sums = self.masters is not None and module is not None and module.automatic_optimization
        self._overlap.remove()
        scaler = self._scaler
        if scaler is not None and not scaler.scaling and not scaler.sharded and self.masters is None:
            # a large model's check runs beside its backward (the L2 norm: the spike guard's figure too)
            self._overlap.install(optimizers, norm=2.0 if self.spike is not None else math.inf)

    def close(self) -> None:
        """The run is over: the last batch ends, the gradient hooks go."""
        self.end_batch()
        self._overlap.remove()

    def _window_starts(self) -> bool:
        """Whether this training batch is the first of an accumulation window (automatic optimization): Lightning
        zeroes the gradients there (``batch_idx % accumulate_grad_batches == 0``)."""
        trainer, module = self._trainer, self._module
        if trainer is None or module is None or not module.automatic_optimization:
            return False
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        batch_idx = getattr(loop, "batch_idx", None)
        return isinstance(batch_idx, int) and batch_idx % max(1, self._accumulate()) == 0

    def _accumulate(self) -> int:
        # read each time: GradientAccumulationScheduler changes it during training
        return getattr(self._trainer, "accumulate_grad_batches", 1)

    def _accumulating(self) -> bool:
        return self._accumulate() > 1

    def _new_state(self, index: int, optimizer: Optimizer) -> _OptimizerState:
        state = _OptimizerState(index, optimizer, stats=self.stats.optimizer(index))
        # device verdicts reach the counters a batch at a time (one copy a batch): the divergence stop then fires up
        # to a batch late, so the batch is a quarter of its limit at most (none: the stop fires as it did)
        limit = self.max_consecutive_skips
        state.stats.verdict_batch = _VERDICT_BATCH if limit is None else max(1, min(_VERDICT_BATCH, limit // 4))
        return state

    def _state(self, optimizer: Optimizer) -> _OptimizerState:
        state = self._optimizers.get(id(optimizer))
        if state is None:  # an optimizer made outside configure_optimizers: give it a record too
            state = self._optimizers[id(optimizer)] = self._new_state(len(self._optimizers), optimizer)
        return state

    # ------------------------------------------------------------------ around forward and backward
    def begin_batch(self, module: Optional[nn.Module], optimizers: Iterable[Optimizer]) -> None:
        """A training step starts: snapshot the buffers its forward passes may change (once per window).

        At the first batch of an accumulation window, where Lightning zeroes the gradients, what an earlier window
        left behind goes too: a window cut short (``on_train_batch_start`` returning -1, the epoch's end) never
        stepped, and its fp32 gradient sums, loss sum and buffer snapshot must not reach the next step."""
        if self._window_starts():
            if self.masters is not None:
                self.masters.drop_sums()
                self._sums.reset()
            self._loss = None
            self.buffers.drop()
        if self._scaler is not None and module is not None and not self.buffers.taken:
            self.buffers.take(module, optimizers)


    def end_batch(self) -> None:
        """A training batch ended (manual optimization: ``training_step`` returned): one scale update. A loss whose
        step has not run yet (manual accumulation over batches) is kept for that step."""
        self._last_loss = None
        for state in self._optimizers.values():
            if state.stage is Stage.PREPARED:
                self._abandon(state)  # prepared (e.g. clipped) but never stepped
        if self._batch_verdicts:
            self._update_scale()
            self.buffers.drop()
        for state in self._optimizers.values():
            state.stage = Stage.READY

    def before_backward(self, module: nn.Module, loss: Optional[Tensor] = None) -> None:
        """Backward is about to run on ``loss`` (unscaled). The spike guard sums the losses until the step (with
        accumulation, Lightning's loss divided by ``accumulate_grad_batches``: the micro-batches' mean).

        Micro-batch gradients of true-half parameters sum in fp32: the half ones move there first. Under DDP's
        ``no_sync`` the sums are this rank's: they are reduced (in fp32) while the window's last backward runs,
        whose half gradients DDP reduces as usual.
        """
        if self.spike is not None and isinstance(loss, Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(()).float()
            self._loss = loss if self._loss is None else self._loss + loss
        self._overlap.arm()
        if self._carry_sums and self._accumulating():
            assert self.masters is not None  # _carry_sums: there are masters
            self.masters.carry_grads_(module.parameters())
            if grads_synced(module):
                self._sums.start(self.masters.pending_sums())

    def after_backward(self, module: nn.Module) -> None:
        if self._carry_sums and self._sums.started and grads_synced(module):
            self._sums.wait()

    # ------------------------------------------------------------------ the step
    def run(
        self,
        optimizer: Optimizer,
        model: LightningModule,
        closure: Callable[[], Any],
        hooks_and_clipping: Callable[[], None],
        **kwargs: Any,
    ) -> Any:
        """One optimizer step (stages 1–8). ``hooks_and_clipping`` runs ``on_before_optimizer_step`` and clipping."""
        state = self._state(optimizer)
        plan = state.plan or self._plan(state, model)
        if plan is _CHECK_ONLY or plan is _CHECK_ONLY_FUSED:
            out, outcome = self._run_check_only(optimizer, state, closure, hooks_and_clipping, kwargs)
        # (manual optimization: a closure given to opt.step() is evaluated inside the step, as Lightning does)
        elif plan is _CLOSURE or (not model.automatic_optimization and closure is not do_nothing_closure):
            out, outcome = self._run_with_closure(optimizer, state, closure, hooks_and_clipping, kwargs)
        else:
            out, outcome = self._run_general(optimizer, state, closure, hooks_and_clipping, kwargs)
        self._finish(optimizer, state, model, outcome)
        return out

    def _run_general(
        self,
        optimizer: Optimizer,
        state: _OptimizerState,
        closure: Callable[[], Any],
        hooks_and_clipping: Callable[[], None],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Outcome]:
        """The general plan: stages 1–7 in full (:meth:`prepare`, the hooks, :meth:`_step`)."""
        closure()  # (a training_step that returned None still steps with the gradients there are, as Lightning does)
        try:
            self.prepare(optimizer)
            hooks_and_clipping()  # reports through hooks_ran
            return self._step(optimizer, state, **kwargs)
        finally:
            if state.stage is Stage.PREPARED:
                self._abandon(state)  # an error inside the step

    def _finish(self, optimizer: Optimizer, state: _OptimizerState, model: Any, outcome: Outcome) -> None:
        """Stage 8 and what every step ends with, whichever plan ran it: the half weights written back (skipped:
        as they were), the buffers put back on a skip, the outcome counted, the gradients released, the loss scale
        moved once the batch is over, the divergence stop."""
        if outcome.records is not None:
            assert self.masters is not None  # records: gathered by the masters
            self.masters.write_back(outcome.records, skipped=outcome.skipped, found_inf=outcome.flag)
            state.records = None
        if outcome.skipped is not False:
            self.buffers.restore(optimizer, outcome.skipped, outcome.flag)
        scaler = self._scaler
        if scaler is not None:
            scaler.verdicts.forget(optimizer)
            self._batch_verdicts.append(cast("Tensor | bool", outcome.scale_verdict))
        state.stats.record(outcome.skipped, outcome.flag)
        state.norm = None
        automatic = model.automatic_optimization
        if automatic:
            if self.release_grads:
                _release_grads(optimizer)
            self._update_scale()  # one optimizer per batch: the batch is over
            self.buffers.drop()
            state.stage = Stage.READY
            self._loss = self._last_loss = None
        else:
            state.stage = Stage.STEPPED
            if self._loss is not None:  # the next step judges the losses of the backward calls after this one
                self._last_loss, self._loss = self._loss, None
        self._check_divergence(model, state)

    def _plan(self, state: _OptimizerState, model: LightningModule) -> str:
        """Decide once what this optimizer's steps do (kept until the scaler or the optimizers change).

        ``_CLOSURE``: the optimizer evaluates the closure itself (see :func:`evaluates_closure`), as Lightning hands
        it over. ``_CHECK_ONLY``: the common case of a single process in a check-only mode (fp32, tf32, bf16) with fp32
        weights, no spike guard, FP8 or large-model early check: the read-only check, the host's one answer, the
        step or not (:meth:`_run_check_only`); ``_CHECK_ONLY_FUSED``: the same with a fused optimizer, which gets the
        verdict as ``found_inf`` and skips on the device (no host sync). ``_GENERAL``: everything else
        (:meth:`prepare` and :meth:`_step`).
        """
        optimizer, scaler = state.optimizer, self._scaler
        if evaluates_closure(optimizer):
            plan = _CLOSURE
        elif (
            scaler is not None
            and scaler.is_enabled()
            and not scaler.scaling
            and not scaler.sharded
            and not scaler.sync_across_ranks
            and self.masters is None
            and self.spike is None
            and self.saturation is None
            and not self._overlap.installed
            and model.automatic_optimization
        ):
            fused = checks.takes_device_verdict(optimizer, scaling=False, device=scaler.scale_device)
            plan = _CHECK_ONLY_FUSED if fused else _CHECK_ONLY
            state.check = checks.PlannedCheck.of(optimizer)
        else:
            plan = _GENERAL
        state.plan = plan
        return plan

    def _run_check_only(
        self,
        optimizer: Optimizer,
        state: _OptimizerState,
        closure: Callable[[], Any],
        hooks_and_clipping: Callable[[], None],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Outcome]:
        """The check-only plans: stages 1–7 with nothing to gather, unscale, reduce or join."""
        closure()
        scaler = self._scaler
        assert scaler is not None  # the check-only plans have one (_plan)
        state.stage, state.dirty = Stage.PREPARED, True
        try:
            hooks_and_clipping()  # clipping by norm may give the verdict (record_norm); by value checks first
            if scaler.verdicts.stage(optimizer) is OptState.READY:
                flag = self._flags.take(scaler.scale_device)  # (zeroed 64 at a time: no allocation a step)
                check = state.check
                if check is not None and check.count != checks.PlannedCheck.count_of(optimizer):  # add_param_group
                    check = state.check = checks.PlannedCheck.of(optimizer)
                found = check.found_inf(flag) if check is not None else None
                if found is None:
                    found = checks.check_grads_(optimizer, flag)
            else:
                if state.dirty:  # a configure_gradient_clipping override wrote after the norm was taken
                    self._check(optimizer, state)
                found = scaler.verdicts.found(optimizer)
            if state.plan is _CHECK_ONLY_FUSED:  # the kernel skips on found_inf == 1: no host sync
                flags = list(found.values())
                verdict: Optional[Tensor] = checks.one_flag(flags, flags[0].device if flags else scaler.scale_device)
                skipped: Optional[bool] = None
                optimizer.found_inf = verdict  # type: ignore[attr-defined]
                try:
                    out = optimizer.step(**kwargs)
                finally:
                    del optimizer.found_inf  # type: ignore[attr-defined]
            else:
                # torch's GradScaler pays this one host sync too; its answer decides the step, counted as known
                verdict, skipped = None, any(flag.item() for flag in found.values())
                out = None if skipped else optimizer.step(**kwargs)
            state.stage = Stage.STEPPED
        finally:
            if state.stage is Stage.PREPARED:
                self._abandon(state)  # an error inside the step
        return out, Outcome(skipped, verdict, skipped if skipped is not None else _as_flag(verdict, scaler))

    def prepare(self, optimizer: Optimizer) -> None:
        """READY → PREPARED: gather fp32 gradients (true-half), unscale them (fp16). Idempotent."""
        state = self._state(optimizer)
        if state.stage is Stage.PREPARED:
            return
        # (STEPPED: manual optimization steps this optimizer again in one training step; the loss scale still
        # moves once, when the batch ends, so both steps unscale by the scale their backward used)
        scaler = self._scaler
        check_only = scaler is not None and not scaler.scaling
        if self.masters is not None:
            # check-only modes: the gather's one pass over the gradients also finds inf/NaN (unless the spike guard's
            # gradient norm is to be the check, below)
            records = self.masters.gather(optimizer, check=check_only and self.spike is None)
            state.records = records
        if scaler is not None and scaler.scaling:
            with self._standing_in(state):
                scaler.unscale_(optimizer)
            state.dirty = False
        elif state.records is not None and state.records.found is not None:
            assert scaler is not None  # found: check_only
            state.dirty = not scaler.verdicts.take_(optimizer, state.records.found)
        elif check_only and self.spike is not None:
            assert scaler is not None  # check_only
            # the spike guard needs the total gradient norm, which is inf/NaN when a gradient is: one pass for both
            # (taken during backward for large models)
            norm = self._overlap.verdict(optimizer) if self._overlap.installed else None
            if norm is None:
                with self._standing_in(state):
                    norm = total_grad_norm(optimizer, sharded=scaler.sharded)
            state.norm = norm
            state.dirty = norm is None or not scaler.verdicts.take_total_(optimizer, norm)
        else:
            # the maxima taken during backward, where every gradient has one (large models, check-only modes)
            early = self._overlap.verdict(optimizer) if check_only and self._overlap.installed else None
            state.dirty = early is None or not cast(StepGuard, scaler).verdicts.take_total_(optimizer, early)
        if state.records is not None and ((scaler is not None and scaler.scaling) or self._accumulating()):
            MasterWeights.expose(state.records)  # hooks read the true gradient in the half .grad
        state.stage = Stage.PREPARED

    def hooks_ran(self, optimizer: Optimizer, *, clipping: bool = False) -> None:
        """After ``on_before_optimizer_step`` (``clipping``: after ``configure_gradient_clipping``): take what the
        hooks wrote into the half gradients; the verdict must look again if they could have written."""
        state = self._state(optimizer)
        writes = self._writing_hooks()[1 if clipping else 0]
        module = self._module
        # (manual optimization: user code between an early clip_gradients and opt.step() may write them too)
        may_write = writes or module is None or not module.automatic_optimization
        if state.records is not None and may_write and MasterWeights.take_rewritten(state.records):
            state.dirty = True
        if writes:
            state.dirty = True

    def check_before_clamp(self, optimizer: Optimizer) -> None:
        """Clipping by value is about to clamp: an inf must be seen before it becomes a finite number."""
        self.prepare(optimizer)
        state = self._state(optimizer)
        if state.dirty and self._scaler is not None:
            with self._standing_in(state):
                self._check(optimizer, state)

    def clipped(self, optimizer: Optimizer) -> None:
        """After clipping the fp32 gradients (true-half): the half ones that hooks and user code read follow."""
        state = self._state(optimizer)
        if state.records is not None:
            MasterWeights.expose(state.records)

    def record_norm(self, optimizer: Optimizer, norm: Tensor) -> None:
        """Clipping by norm read every gradient: a non-finite total norm is the verdict (no second pass)."""
        state = self._state(optimizer)
        self.stats.record_grad_norm(norm)
        state.norm = norm.detach()
        if self.scaler is None:
            return
        if not self.scaler.verdicts.take_total_(optimizer, norm):
            self.scaler.verdicts.add_(optimizer, ~torch.isfinite(norm.detach()), agreed=True)  # the norm of all shards
        state.dirty = False

    def _check(self, optimizer: Optimizer, state: _OptimizerState) -> None:
        """The read-only pass over the gradients the optimizer will apply (inside :meth:`_standing_in`)."""
        scaler = self._scaler
        assert scaler is not None  # every caller has one
        if scaler.verdicts.stage(optimizer) is OptState.READY:
            scaler.unscale_(optimizer)  # the guard's read-only check (a loss scaler unscaled in prepare already)
        else:
            flag = checks.zero_flag(scaler.scale_device)  # (not the default dtype: half in manual true-half)
            for found in checks.check_grads_(optimizer, flag).values():
                scaler.verdicts.add_(optimizer, found)
        state.dirty = False

    def _standing_in(self, state: _OptimizerState) -> Any:
        """Inside: the fp32 stand-ins hold the half parameters' places (and state) in the param groups."""
        return self._standing_in_records(state.records)

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:
        """What clipping works on: the optimizer's parameters, with fp32 stand-ins for the half ones (true-half)."""
        state = self._optimizers.get(id(optimizer))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if state is None or state.records is None:
            return params
        standin = {id(r.param): r.standin for r in state.records.records}
        return [standin.get(id(p), p) for p in params]

    def _writing_hooks(self) -> tuple[bool, bool]:
        """Whether ``on_before_optimizer_step`` hooks, and a ``configure_gradient_clipping`` override, may write
        gradients (found once per run; callbacks that only read say so with ``reads_gradients_only``)."""
        if self._hooks_write is None:
            module = self._module
            trainer = getattr(module, "_trainer", None) if module is not None else None
            if module is None or trainer is None:
                self._hooks_write = (True, True)
            else:
                hooks = is_overridden("on_before_optimizer_step", module, LightningModule) or any(
                    type(cb).on_before_optimizer_step is not Callback.on_before_optimizer_step
                    and not getattr(cb, "reads_gradients_only", False)
                    for cb in trainer.callbacks
                )
                self._hooks_write = (hooks, is_overridden("configure_gradient_clipping", module, LightningModule))
        return self._hooks_write

    def _step(self, optimizer: Optimizer, state: _OptimizerState, **kwargs: Any) -> tuple[Any, Outcome]:
        scaler = self._scaler
        records = state.records
        spike = None
        if scaler is None:
            with self._standing_in(state):
                out = optimizer.step(**kwargs)
            skipped: Optional[bool] = False
            verdict = None
        else:
            # one swap for the check and the step (no context manager: this runs every step)
            if records is not None:
                MasterWeights.swap_in(records)
            try:
                if state.dirty:
                    self._check(optimizer, state)
                if self.saturation is not None:
                    saturated = self.saturation()  # an inf an FP8 cast made finite: skip the step too
                    if saturated is not None:
                        scaler.verdicts.add_(optimizer, saturated)  # (one rank's: reduced where the verdict was)
                spike = self._spike_verdict(optimizer, state) if self.spike is not None else None
                out, skipped = scaler.step_outcome(optimizer, **kwargs)
            finally:
                if records is not None:
                    MasterWeights.swap_out(records)
            verdict = scaler.verdicts.of(optimizer) if skipped is None else None  # (the host knows: no device flag)
        state.stage = Stage.STEPPED
        if scaler is None:
            return out, Outcome(skipped, None, None, records)
        if spike is None:  # the host's answer where it has one: a batch of host-known outcomes costs no kernel
            known = skipped if skipped is not None else _as_flag(verdict, scaler)
            return out, Outcome(skipped, verdict, known, records)
        assert self.spike is not None  # spike: from the guard
        loss, norm = spike[3], spike[2]
        if loss is not None or norm is not None:
            # (the host has no answer only where the scaler stepped on a device verdict)
            self.spike.observe(loss, norm, spike[0], skipped if skipped is not None else cast(Tensor, verdict),
                               index=state.index)
        # the loss scale moves on the inf/NaN verdict alone: a spike is no overflow
        return out, Outcome(skipped, verdict, spike[1], records)

    def _spike_verdict(
        self, optimizer: Optimizer, state: _OptimizerState
    ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """Inside the stand-ins' swap, after every other verdict source: whether this step is a loss or gradient-norm
        spike against this optimizer's own window; it joins the skip verdict. Returns (spike, the inf/NaN verdict
        alone, the gradient norm, the loss judged: what backward ran on since the last step, or, where no backward
        ran since (two optimizers stepped from one backward), that backward's loss)."""
        scaler = self._scaler
        assert scaler is not None and self.spike is not None  # called from _step with both
        inf_only = scaler.verdicts.of(optimizer)
        if inf_only is None:
            inf_only = checks.zero_flag(scaler.scale_device)
        else:
            inf_only = inf_only.reshape(()).float().clone()
        norm = state.norm if state.norm is not None else total_grad_norm(optimizer, sharded=scaler.sharded)
        loss = self._loss if self._loss is not None else self._last_loss
        if loss is None and norm is None:  # nothing to judge (no backward, no gradient)
            spike = torch.zeros((), dtype=torch.bool, device=scaler.scale_device)
        else:
            spike = all_ranks_agree(self.spike.decide(loss, norm, index=state.index))
        scaler.verdicts.add_(optimizer, spike, agreed=True)
        return spike, inf_only, norm, loss

    def _abandon(self, state: _OptimizerState) -> None:
        """Drop a prepared step that never ran (an error inside it, or clipped in manual optimization and not
        stepped): the stand-ins' gradients go, the parameters keep their values, the scaler forgets it."""
        if state.records is not None:
            assert self.masters is not None  # records: gathered by the masters
            self.masters.write_back(state.records, skipped=True)  # (the stand-ins stand in only inside a `with`)
            state.records = None
        if self.scaler is not None:
            self.scaler.verdicts.forget(state.optimizer)
        state.stage = Stage.READY

    # ------------------------------------------------------------------ closure-taking optimizers
    def _run_with_closure(
        self,
        optimizer: Optimizer,
        state: _OptimizerState,
        closure: Callable[[], Any],
        hooks_and_clipping: Callable[[], None],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Outcome]:
        """An optimizer that evaluates the closure itself (LBFGS, SAM): check every evaluation, undo if any failed.

        The step runs as the optimizer wants it; every gradient it computes is checked after the hooks ran, and if
        any was inf/NaN the parameters (and masters), the optimizer state and the buffers go back to their values
        before the step. With master weights the optimizer steps the fp32 stand-ins; before each evaluation the
        model's half weights take the stand-ins' values (e.g. SAM's perturbed point), after it the stand-ins take the
        half gradients in fp32.
        """
        scaler = self._scaler
        if scaler is not None and scaler.scaling:
            raise MisconfigurationException(
                f"MPPlugin: {type(optimizer).__name__} evaluates its closure inside step(), which cannot be combined"
                " with a loss scale (fp16 and fp16-true), as torch's GradScaler cannot. Use precision 'fp32', 'tf32',"
                " 'bf16' or 'bf16-true' with closure-taking optimizers."
            )
        # (every half parameter stands in, also one without a gradient yet: the optimizer makes them in its step)
        records = self.masters.gather(optimizer, every=True) if self.masters is not None else None
        standin = {id(r.param): r.standin for r in records.records} if records is not None else {}
        model_params = [p for g in optimizer.param_groups for p in g["params"]]
        stepped = [standin.get(id(p), p) for p in model_params]  # what the optimizer holds during the step
        if scaler is not None:  # what a skip restores
            saved = [t.detach().clone() for t in (*stepped, *model_params)]
            # (an optimizer that wraps another, SAM's base_optimizer, keeps the moments there)
            owners = [optimizer, *wrapped_optimizers(optimizer)]
            saved_states = [copy.deepcopy(owner.state_dict()["state"]) for owner in owners]
        bad: list[Tensor] = []

        def evaluate() -> Any:
            if records is not None:
                with torch.no_grad():
                    for r in records.records:
                        r.param.copy_(r.standin)  # the closure evaluates the model where the optimizer stands
                assert self.masters is not None  # records: gathered by the masters
                self.masters.swap_out(records)  # its zero_grad and backward act on the model's own parameters
            result = closure()
            hooks_and_clipping()
            if records is not None:
                assert self.masters is not None  # records: gathered by the masters
                self.masters.swap_in(records)
                for r in records.records:
                    r.standin.grad = None if r.param.grad is None else r.param.grad.float()
            grads = [t.grad for t in stepped if t.grad is not None]
            if scaler is not None and grads:
                bad.append(~torch.isfinite(torch.stack(torch._foreach_norm(grads, math.inf)).max()))
            return result

        with self._standing_in_records(records):
            out = optimizer.step(closure=evaluate, **kwargs)
        skipped = bool(torch.stack(bad).any().item()) if bad else False  # one sync, as GradScaler pays
        if skipped:
            with torch.no_grad():
                for t, v in zip((*stepped, *model_params), saved):
                    t.copy_(v)
            for owner, saved_state in zip(owners, saved_states):
                full = owner.state_dict()
                full["state"] = saved_state
                with self._standing_in_records(records):
                    owner.load_state_dict(full)
        return out, Outcome(skipped, None, skipped if scaler is not None else None, records)

    def _standing_in_records(self, records: Optional[StepRecords]) -> Any:
        # (records: gathered by the masters)
        return cast(MasterWeights, self.masters).stepping(records) if records is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ after the step
    def _update_scale(self) -> None:
        verdicts, self._batch_verdicts = self._batch_verdicts, []
        if self._scaler is not None and verdicts:
            self._scaler.update_from(verdicts)

    def skipped_for(self, optimizer: Optional[Optimizer]) -> bool:
        """Whether ``optimizer``'s last step was skipped (reads the device only when the host does not know)."""
        state = self._optimizers.get(id(optimizer)) if optimizer is not None else None
        return False if state is None else state.stats.last_skipped

    def _check_divergence(self, model: LightningModule, state: _OptimizerState) -> None:
        limit = self.max_consecutive_skips
        if limit is None:
            return
        consecutive = state.stats.consecutive_known()
        if consecutive is None or consecutive < limit:
            return
        trainer = getattr(model, "_trainer", None)
        step = trainer.global_step if trainer is not None else "?"
        scaler = self._scaler
        scale = scaler.get_scale() if scaler is not None and scaler.scaling else None
        advice = (
            "the loss scale is at its floor: check the model for values that overflow fp16, or use precision='bf16'"
            if scale is not None and scale <= cast(DynamicLossScaler, scaler).min_scale
            else "look for a NaN/inf in the data or the loss, lower the learning rate, or add gradient clipping"
        )
        which = f" of optimizer {state.index}" if len(self._optimizers) > 1 else ""
        spikes = self.spike.spikes_in_a_row(state.index) if self.spike is not None else 0
        if spikes:
            assert self.spike is not None  # spikes: counted by the guard
            advice = (
                f"{spikes} of them were loss or gradient-norm spikes (spike_sigma={self.spike.sigma:g}, spike_window="
                f"{self.spike.window}): the loss has moved away from its recent history for good (a data shift, a"
                " learning rate too high); raise spike_sigma, lower the learning rate, or resume from an earlier"
                " checkpoint and skip the batches around the spike"
            )
            raise NonFiniteTrainingError(
                f"{consecutive} optimizer steps{which} in a row were skipped (limit max_consecutive_skips={limit}),"
                f" at global step {step}. Training stopped: {advice}."
            )
        raise NonFiniteTrainingError(
            f"{consecutive} optimizer steps{which} in a row had inf/NaN gradients and were skipped (limit"
            f" max_consecutive_skips={limit}), at global step {step}"
            + (f", loss scale {scale:g}" if scale is not None else "")
            + f". Training stopped: {advice}. NonFiniteDetector names the module that produced it."
        )


def evaluates_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` evaluates the closure inside ``step`` itself, so it must be handed the closure as Lightning
    hands it over: ``LBFGS``, an optimizer whose ``step`` requires a ``closure`` argument (SAM and its kin:
    ``def step(self, closure)``), and the sharpness-aware family that wraps a ``base_optimizer`` with its
    ``first_step``/``second_step``. torch's other
    optimizers evaluate the closure once, first, which is the same as evaluating it before the step."""
    if isinstance(optimizer, LBFGS):
        return True
    if hasattr(optimizer, "base_optimizer") and (hasattr(optimizer, "first_step") or hasattr(optimizer, "second_step")):
        return True  # (a Lookahead that keeps its base under that name steps it once: an ordinary optimizer)
    try:
        parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _release_grads(optimizer: Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` without its profiler record and per-group bookkeeping (a host cost
    that counts on small models); an optimizer with its own ``zero_grad`` gets that."""
    if type(optimizer).zero_grad is not Optimizer.zero_grad:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def _as_flag(verdict: Optional[Tensor], scaler: StepGuard) -> Tensor:
    if verdict is None:
        return checks.zero_flag(scaler.scale_device)
    return checks.one_flag([verdict], verdict.device)  # (a fused optimizer's found_inf: itself, no dispatcher call)
