"""One optimizer step, owned in one place: its order, its skip verdict, and what a skipped step leaves untouched.

The order of one step of one optimizer, stage by stage: see :mod:`lightning_mp.plans`, whose plans run stages
1–7; this module runs stage 8 and what every step ends with (``OptimizerSteps._finish``). Nothing outside this
module sets the verdict; callbacks read :class:`lightning_mp.stats.StepStats`; the host is :mod:`lightning_mp.host`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Callable, Optional, cast

import torch
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from lightning_mp.buffers import BufferSnapshot
from lightning_mp.capture import CapturedPlan, not_captured
from lightning_mp.distributed import FP32SumReduction, grads_synced
from lightning_mp.host import Host, host_of
from lightning_mp.master import MasterWeights
from lightning_mp.overlap import OverlappedCheck
from lightning_mp.plans import (
    CheckOnlyPlan, ClosurePlan, GeneralPlan, OptimizerState, Outcome, Plan, Stage, divergence_error, evaluates_closure,
    first_verdict, release_grads, standing_in,
)
from lightning_mp.scaling import DynamicLossScaler, SharedGradients, abandon_step, scale_in_use
from lightning_mp.spike import SpikeGuard
import lightning_mp.verdict as checks
from lightning_mp.nonfinite import StepGuard
from lightning_mp.stats import StepStats


#: a fused optimizer's device verdicts sent to the step counters in one copy (see ``OptimizerStats``)
_VERDICT_BATCH = 8


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
        capture: bool = False,
    ) -> None:
        self._scaler, self.masters, self.stats = scaler, masters, stats
        self.max_consecutive_skips, self.saturation, self.spike = max_consecutive_skips, saturation, spike
        self.loss: Optional[Tensor] = None  # what backward ran on since the last step (the spike guard's figure)
        self.last_loss: Optional[Tensor] = None  # manual optimization: the loss of this batch's last judged step
        self.release_grads, self.capture = release_grads, capture  # capture: the check-only steps (capture.py)
        self.buffers = BufferSnapshot()
        self._optimizers: dict[int, OptimizerState] = {}
        self._batch_verdicts: list[Tensor | bool] = []  # this batch's verdicts, for the one scale update
        self._carry_sums = self.backward_ran = False  # backward_ran: since the last step (automatic optimization)
        self._sums = FP32SumReduction()
        self._shared = SharedGradients()  # parameters several optimizers hold (a loss scale unscaled once)
        self.host: Host = host_of(None)
        self.overlap = OverlappedCheck()
        self.flags = checks.ZeroFlags()  # the check-only plans' verdict flags

    def __getstate__(self) -> dict[str, Any]:
        """A copy (a plugin pickled or deep-copied mid-run) keeps the counters, plans and records, not the run's
        module, trainer or gradient hooks: the next run's :meth:`connect` binds its own."""
        state = self.__dict__.copy()
        state.update(host=host_of(None), overlap=OverlappedCheck(), _shared=SharedGradients())
        return state

    @property
    def scaler(self) -> Optional[StepGuard]:
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: Optional[StepGuard]) -> None:
        self._scaler = scaler  # (a mode switch between steps: the plans are decided again)
        for state in self._optimizers.values():
            state.plan = None

    # ------------------------------------------------------------------ set-up
    def connect(self, host: Any, optimizers: list[Optimizer]) -> None:
        """Start a run with these optimizers, driven by ``host`` (:mod:`lightning_mp.host`; a ``LightningModule``:
        the Trainer's). A new ``fit``: earlier records are dropped, the step counters are the plugin's and go on
        (see :meth:`StepStats.optimizer`)."""
        self._optimizers = {id(opt): self._new_state(i, opt) for i, opt in enumerate(optimizers)}
        self._shared.find(optimizers)
        self._batch_verdicts, self.host = [], host_of(host)
        self.buffers.drop()
        self.buffers.forget_plan()
        self._sums.reset()
        # fp32 sums of micro-batches: only where the host owns zero_grad (automatic optimization)
        self._carry_sums = self.masters is not None and self.host.owns_accumulation
        self.overlap.remove()
        scaler = self._scaler
        if scaler is not None and not scaler.scaling and not scaler.sharded:
            # a large model's check runs beside its backward (the L2 norm: the spike guard's figure too; with master
            # weights the half gradients' figures hold for the fp32 ones where those are copies: StepRecords.plain)
            self.overlap.install(optimizers, norm=2.0 if self.spike is not None else math.inf)

    def close(self) -> None:
        """The run is over: the last batch ends, the gradient hooks go, the buffers' watch ends."""
        self.end_batch()
        self.overlap.remove()
        self.buffers.close()

    def _new_state(self, index: int, optimizer: Optimizer) -> OptimizerState:
        state = OptimizerState(index, optimizer, stats=self.stats.optimizer(index))
        self.stats.bind_optimizer(optimizer, index)  # (stats.skipped_for(optimizer): held weakly)
        # device verdicts reach the counters a batch at a time (one copy a batch): the stop may fire up to a batch
        limit = self.max_consecutive_skips  # late, so the batch is a quarter of its limit at most
        state.stats.verdict_batch = _VERDICT_BATCH if limit is None else max(1, min(_VERDICT_BATCH, limit // 4))
        return state

    def _state(self, optimizer: Optimizer) -> OptimizerState:
        state = self._optimizers.get(id(optimizer))
        if state is None:  # an optimizer made outside configure_optimizers: give it a record too
            state = self._optimizers[id(optimizer)] = self._new_state(len(self._optimizers), optimizer)
            scaler = self._scaler if self._scaler is not None and self._scaler.scaling else None
            unscaled = [s.optimizer for s in self._optimizers.values() if s.stepped or s.stage is Stage.PREPARED]
            self._shared.join([s.optimizer for s in self._optimizers.values()], unscaled, cast(Any, scaler))
        return state

    # ------------------------------------------------------------------ around forward and backward
    def begin_batch(self, module: Optional[nn.Module], optimizers: Iterable[Optimizer]) -> None:
        """A training step starts: snapshot the buffers its forward passes may change (once per window).

        At the first batch of an accumulation window, where Lightning zeroes the gradients, what an earlier window
        left behind goes too: a window cut short (``on_train_batch_start`` returning -1, the epoch's end) never
        stepped, and its fp32 gradient sums, loss sum and buffer snapshot must not reach the next step."""
        if self.host.window_starts():
            if self.masters is not None:
                self.masters.drop_sums()
                self._sums.reset()
            self.loss = None
            self.buffers.drop()
        if self._scaler is not None and module is not None and not self.buffers.taken:
            self.buffers.take(module, optimizers)

    def end_batch(self) -> None:
        """A training batch ended (manual optimization: ``training_step`` returned): one scale update. A loss whose
        step has not run yet (manual accumulation over batches) is kept for that step."""
        self.last_loss = None
        for state in self._optimizers.values():
            if state.stage is Stage.PREPARED:
                self.abandon(state)  # prepared (e.g. clipped) but never stepped
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
        if self.abandon_prepared(backward=True):
            self.loss = None  # (the spike guard judges what backward ran on since the last step taken)
        if self.spike is not None and isinstance(loss, Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(()).float()
            self.loss = loss if self.loss is None else self.loss + loss
        self.overlap.arm()
        self.backward_ran = True
        if self._carry_sums and self.host.accumulate() > 1:
            assert self.masters is not None  # _carry_sums: there are masters
            self.masters.carry_grads_(module.parameters())
            if grads_synced(module):
                self._sums.start(self.masters.pending_sums())

    def after_backward(self, module: nn.Module) -> None:
        if self._carry_sums and self._sums.started and grads_synced(module):
            self._sums.wait()

    # ------------------------------------------------------------------ the step
    def run(
        self, optimizer: Optimizer, closure: Callable[[], Any], hooks_and_clipping: Callable[[], None], **kwargs: Any
    ) -> Any:
        """One optimizer step (stages 1–8). ``hooks_and_clipping``: what the host runs between backward and the step
        (the Trainer: ``on_before_optimizer_step`` and clipping; a Fabric loop: nothing, it did its part already)."""
        state = self._state(optimizer)
        plan = state.plan or self._plan(state)
        out, outcome = plan.run(optimizer, closure, hooks_and_clipping, kwargs)
        self._finish(optimizer, state, outcome)
        return out

    def _finish(self, optimizer: Optimizer, state: OptimizerState, outcome: Outcome) -> None:
        """Stage 8 and what every step ends with, whichever plan ran it: the half weights written back (skipped:
        as they were), the buffers put back on a skip, the outcome counted, the gradients released, the loss scale
        moved once the batch is over, the divergence stop."""
        if outcome.records is not None:
            assert self.masters is not None  # records: gathered by the masters
            self.masters.write_back(outcome.records, skipped=outcome.skipped, found_inf=outcome.flag)
            state.records = None  # (others prepared with it follow what it wrote: a weight both hold)
            pending = [s.records for s in self._optimizers.values() if s.records is not None]
            if pending:
                self.masters.follow_written(pending, outcome.records)
        if outcome.skipped is not False:
            self.buffers.restore(optimizer, outcome.skipped, outcome.flag)
        scaler = self._scaler
        if scaler is not None:
            scaler.verdicts.forget(optimizer)
            if self.backward_ran or not self.host.owns_accumulation:  # (else training_step returned None: as
                self._batch_verdicts.append(cast("Tensor | bool", outcome.scale_verdict))  # GradScaler, no update)
        state.stats.record(outcome.skipped, outcome.flag)
        state.norm, state.early, state.stepped = None, False, True
        if self.host.whole_steps:
            if self.release_grads:
                release_grads(optimizer)
            state.stage = Stage.READY
            self.loss, self.last_loss, self.backward_ran = None, None, False
            # the batch is over, unless another optimizer's step was prepared with it (a loop that clipped both
            # first): its gradients were unscaled by this scale, so the scale moves once both have stepped
            if not any(other.stage is Stage.PREPARED for other in self._optimizers.values()):
                self._update_scale()
                self.buffers.drop()
        else:
            state.stage = Stage.STEPPED
            if self.loss is not None:  # the next step judges the losses of the backward calls after this one
                self.last_loss, self.loss = self.loss, None
        self._check_divergence(state)

    def _plan(self, state: OptimizerState) -> Plan:
        """Make once the plan of this optimizer's steps (kept until the scaler or the optimizers change; see
        :mod:`lightning_mp.plans`): closure-taking optimizers', check-only (captured where it can be: the common case
        of one process in fp32/tf32/bf16 with fp32 weights), or the general plan."""
        optimizer, scaler = state.optimizer, self._scaler
        plan: Plan
        if evaluates_closure(optimizer):
            plan = ClosurePlan(self, state)
        elif CheckOnlyPlan.fits(self, scaler, self.host.whole_steps):
            scaler = cast(StepGuard, scaler)  # (fits: there is one)
            fused = checks.takes_device_verdict(optimizer, scaling=False, device=scaler.scale_device)
            plan = (CapturedPlan.make if self.capture else CheckOnlyPlan)(self, state, scaler, fused)
        else:
            plan = GeneralPlan(self, state, manual=not self.host.whole_steps)
        if self.capture and not isinstance(plan, CheckOnlyPlan):
            not_captured(self, plan, optimizer)
        state.plan = plan
        return plan

    def prepare(self, optimizer: Optimizer, state: Optional[OptimizerState] = None) -> None:
        """READY → PREPARED: gather fp32 gradients (true-half), unscale them (fp16). Idempotent."""
        early = state is None  # (a host's clipping, before the step; the general plan hands its own state)
        state = state or self._state(optimizer)
        if state.stage is Stage.PREPARED:
            return
        state.early = early
        # (STEPPED: manual optimization steps this optimizer again in one training step; the loss scale still
        # moves once, when the batch ends, so both steps unscale by the scale their backward used)
        scaler = self._scaler
        shared = scaler is not None and scaler.scaling and id(optimizer) in self._shared.of
        if shared:
            self._shared.restore_(optimizer)  # a gradient another optimizer's step unscaled: its scale back first
        if self.masters is not None:  # check-only modes: the gather's pass finds inf/NaN too (but for a spike guard)
            check = scaler is not None and not scaler.scaling and self.spike is None
            state.records = self.masters.gather(optimizer, check=check, taken=self.overlap.installed)
        first_verdict(self, optimizer, state, scaler)
        if state.records is not None and ((scaler is not None and scaler.scaling) or self.host.accumulate() > 1):
            MasterWeights.expose(state.records)  # hooks read the true gradient in the half .grad
        if shared:
            self._shared.note(optimizer, scale_in_use(cast(DynamicLossScaler, scaler)))
        state.stage = Stage.PREPARED

    def hooks_ran(self, optimizer: Optimizer, *, clipping: bool = False) -> None:
        """After ``on_before_optimizer_step`` (``clipping``: after ``configure_gradient_clipping``): take what the
        hooks wrote into the half gradients; the verdict must look again if they could have written."""
        state = self._state(optimizer)
        writes = self.host.hooks_write()[1 if clipping else 0]
        # (manual optimization: user code between an early clip_gradients and opt.step() may write them too)
        may_write = writes or not self.host.whole_steps
        if state.records is not None and may_write and MasterWeights.take_rewritten(state.records):
            state.dirty = True
        if writes:
            state.dirty = True

    def loop_ran(self, optimizer: Optimizer) -> None:
        """A loop's step (Fabric): where the step was prepared early (by clipping), what the loop read or wrote in the
        gradients since is what the step applies, as after hooks."""
        if self._state(optimizer).early:
            self.hooks_ran(optimizer)

    def check_before_clamp(self, optimizer: Optimizer) -> None:
        """Clipping by value is about to clamp: an inf must be seen before it becomes a finite number."""
        self.prepare(optimizer)
        state = self._state(optimizer)
        if state.dirty and self._scaler is not None:
            with self.standing_in(state):
                self.check(optimizer, state)

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

    def check(self, optimizer: Optimizer, state: OptimizerState) -> None:
        """The read-only pass over the gradients the optimizer will apply (inside :meth:`standing_in`)."""
        scaler = self._scaler
        assert scaler is not None  # every caller has one
        if scaler.verdicts.stage(optimizer) is OptState.READY:
            scaler.unscale_(optimizer)  # the guard's read-only check (a loss scaler unscaled in prepare already)
        else:
            flag = checks.zero_flag(scaler.scale_device)  # (not the default dtype: half in manual true-half)
            for found in checks.check_grads_(optimizer, flag).values():
                scaler.verdicts.add_(optimizer, found)
        state.dirty = False

    def standing_in(self, state: OptimizerState) -> Any:
        """Inside: the fp32 stand-ins hold the half parameters' places (and state) in the param groups."""
        return standing_in(self.masters, state.records)

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:
        """What clipping works on: the optimizer's parameters, with fp32 stand-ins for the half ones (true-half)."""
        state = self._optimizers.get(id(optimizer))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if state is None or state.records is None:
            return params
        standin = {id(r.param): r.standin for r in state.records.records}
        return [standin.get(id(p), p) for p in params]

    def abandon(self, state: OptimizerState) -> None:
        """PREPARED -> READY for a step that is not taken (an error inside it; clipped, then left out by the loop),
        as if it had never been prepared: the stand-ins and their gradients go (the parameters keep their values),
        the verdict goes, unscaled gradients get the loss scale back, an FP8 saturation flag of its forward goes."""
        if state.records is not None:
            assert self.masters is not None  # records: gathered by the masters
            self.masters.write_back(state.records, skipped=True)  # (the stand-ins stand in only inside a `with`)
            state.records = None
        if self.scaler is not None:
            abandon_step(self.scaler, state.optimizer)
        if self.saturation is not None:
            self.saturation()  # (taken and dropped: the next step's forward sets its own)
        state.stage, state.dirty, state.norm, state.early = Stage.READY, True, None, False

    def abandon_prepared(self, backward: bool = False) -> bool:
        """Undo every step prepared and not taken (a loop that clipped, then went on without ``optimizer.step()``),
        before a backward would mix it into the next step (a forward alone may come between clipping and the step).
        The buffer snapshot stays: a skip of the next step puts back what the left-out batch's forward changed too.
        ``backward``: one starts (what it adds is scaled: no gradient is unscaled any more). Returns whether there
        was a prepared step."""
        abandoned = False
        if backward:
            self._shared.forget()
        for state in self._optimizers.values():
            state.stepped = state.stepped and not backward
            if state.stage is Stage.PREPARED:
                self.abandon(state)
                abandoned = True
        if abandoned and self.host.whole_steps and self._batch_verdicts:  # others of its batch stepped: it is over
            self._update_scale()
            self.buffers.drop()
        return abandoned

    # ------------------------------------------------------------------ after the step
    def _update_scale(self) -> None:
        verdicts, self._batch_verdicts = self._batch_verdicts, []
        if self._scaler is not None and verdicts:
            self._scaler.update_from(verdicts)

    def skipped_for(self, optimizer: Optional[Optimizer]) -> bool:
        """Whether ``optimizer``'s last step was skipped (reads the device only when the host does not know)."""
        state = self._optimizers.get(id(optimizer)) if optimizer is not None else None
        return False if state is None else state.stats.last_skipped

    def _check_divergence(self, state: OptimizerState) -> None:
        limit = self.max_consecutive_skips
        consecutive = state.stats.consecutive_known() if limit is not None else None
        if limit is None or consecutive is None or consecutive < limit:
            return
        raise divergence_error(self, state, (consecutive, limit), several=len(self._optimizers) > 1)
