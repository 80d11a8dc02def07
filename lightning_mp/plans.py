"""The plans of an optimizer's steps: one class per plan, made once per optimizer by ``OptimizerSteps._plan`` and kept
in that optimizer's state until the scaler or the optimizers change.

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

Each plan runs stages 1–7 (up to the optimizer's step) and hands back what ``optimizer.step`` returned and an
:class:`Outcome`; the one routine that finishes every step (``OptimizerSteps._finish``) writes back, restores, counts
and moves the scale (stage 8), and stops a diverging run (:func:`divergence_error`). A plan chooses its verdict
source when it is made (e.g. a fused optimizer's verdict on the device or the host's read), never per step. Plans
reach the steps object that made them through :class:`Steps` (this module does not import :mod:`lightning_mp.step`,
which imports it).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, cast

import torch
from lightning.pytorch.core.optimizer import do_nothing_closure
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.amp.grad_scaler import OptState
from torch.optim import LBFGS, Optimizer

import lightning_mp.verdict as checks
from lightning_mp.host import Host
from lightning_mp.master import MasterWeights, StepRecords, wrapped_optimizers
from lightning_mp.nonfinite import StepGuard
from lightning_mp.overlap import OverlappedCheck
from lightning_mp.spike import SpikeGuard, all_ranks_agree, total_grad_norm
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.stats import NonFiniteTrainingError, OptimizerStats

log = logging.getLogger(__name__)

#: the kinds of plans (a plan's ``kind``; see ``OptimizerSteps._plan``)
_CHECK_ONLY, _CHECK_ONLY_FUSED, _CLOSURE, _GENERAL = "check-only", "check-only fused", "closure", "general"


class Stage(enum.Enum):
    READY = "ready"
    PREPARED = "prepared"  # gathered and unscaled: hooks and clipping may run
    STEPPED = "stepped"


@dataclass
class OptimizerState:
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
    #: the plan of its steps, made at its first step and kept (``None``: not made yet; see ``OptimizerSteps._plan``)
    plan: Optional[Plan] = None
    #: prepared before the step was asked for (by clipping): what the loop did since (read, wrote ``.grad``) is
    #: taken at the step
    early: bool = False
    #: stepped since the last backward (its gradients, shared ones too, unscaled already where the loss is scaled)
    stepped: bool = False


@dataclass
class Outcome:
    """What one optimizer step did, as the plan that ran it found out: the value every plan hands to the one routine
    that finishes a step (``OptimizerSteps._finish``)."""

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


class Steps(Protocol):
    """What a plan uses of the ``OptimizerSteps`` that made it."""

    masters: Optional[MasterWeights]
    saturation: Optional[Callable[[], Optional[Tensor]]]
    spike: Optional[SpikeGuard]
    #: what backward ran on since the last step taken; the loss of this batch's last judged step (the spike guard's)
    loss: Optional[Tensor]
    last_loss: Optional[Tensor]
    flags: checks.ZeroFlags
    overlap: OverlappedCheck
    host: Host

    @property
    def scaler(self) -> Optional[StepGuard]: ...

    def prepare(self, optimizer: Optimizer, state: Optional[OptimizerState] = None) -> None: ...

    def abandon(self, state: OptimizerState) -> None: ...

    def check(self, optimizer: Optimizer, state: OptimizerState) -> None: ...

    def standing_in(self, state: OptimizerState) -> Any: ...


class Plan(Protocol):
    #: which plan (``_CHECK_ONLY``, ``_CHECK_ONLY_FUSED``, ``_CLOSURE``, ``_GENERAL``)
    kind: str

    def run(
        self, optimizer: Optimizer, closure: Callable[[], Any], hooks_and_clipping: Callable[[], None],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Outcome]: ...


class CheckOnlyPlan:
    """One process in a check-only mode (fp32, tf32, bf16) with fp32 weights, no spike guard, FP8 or large-model early
    check: stages 1–7 with nothing to gather, unscale, reduce or join. The read-only check is planned from the
    parameters (:func:`lightning_mp.verdict.check_grads_`); its verdict is the host's one answer (``fused=False``),
    or, for a fused optimizer that skips on the device, its ``found_inf`` (no host sync)."""

    def __init__(self, steps: Steps, state: OptimizerState, scaler: StepGuard, fused: bool) -> None:
        self.kind = _CHECK_ONLY_FUSED if fused else _CHECK_ONLY
        self.steps, self.state, self.scaler, self.flags = steps, state, scaler, steps.flags
        if fused:
            self._step = self._step_fused  # type: ignore[method-assign]  # (chosen once: no branch a step)
        else:
            say_host_sync(state.optimizer, scaler)

    @staticmethod
    def fits(steps: Steps, scaler: Optional[StepGuard], automatic: bool) -> bool:
        """Whether this plan runs the steps: one process in a check-only mode with fp32 weights and nothing to join."""
        return (
            scaler is not None
            and scaler.is_enabled()
            and not scaler.scaling
            and not scaler.sharded
            and not scaler.sync_across_ranks
            and steps.masters is None
            and steps.spike is None
            and steps.saturation is None
            and not steps.overlap.installed
            and automatic
        )

    def _found(self, optimizer: Optimizer) -> dict[Any, Tensor]:
        """Stage 6, after the hooks and clipping: the planned check, unless clipping's norm gave the verdict."""
        state, scaler = self.state, self.scaler
        if scaler.verdicts.stage(optimizer) is OptState.READY:
            # (the check planned once from the parameters, again after add_param_group: verdict.check_grads_)
            return checks.check_grads_(optimizer, self.flags.take(scaler.scale_device))  # (flags zeroed 64 at a time)
        if state.dirty:  # a configure_gradient_clipping override wrote after the norm was taken
            self.steps.check(optimizer, state)
        return scaler.verdicts.found(optimizer)

    def run(
        self, optimizer: Optimizer, closure: Callable[[], Any], hooks_and_clipping: Callable[[], None],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Outcome]:
        closure()
        state = self.state
        try:
            state.stage, state.dirty = Stage.PREPARED, True
            hooks_and_clipping()  # clipping by norm may give the verdict (record_norm); by value checks first
            out, outcome = self._step(optimizer, kwargs)
            state.stage = Stage.STEPPED
        finally:
            if state.stage is Stage.PREPARED:
                self.steps.abandon(state)  # an error inside the step
        return out, outcome

    def _step(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> tuple[Any, Outcome]:
        # torch's GradScaler pays this one host sync too; its answer decides the step, counted as known
        skipped = any(flag.item() for flag in self._found(optimizer).values())
        out = None if skipped else optimizer.step(**kwargs)
        return out, Outcome(skipped, None, skipped)

    def _step_fused(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> tuple[Any, Outcome]:
        flags = list(self._found(optimizer).values())
        # the kernel skips on found_inf == 1: no host sync
        verdict = checks.one_flag(flags, flags[0].device if flags else self.scaler.scale_device)
        optimizer.found_inf = verdict  # type: ignore[attr-defined]
        try:
            out = optimizer.step(**kwargs)
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        # (the scale moves on the flag itself: a 0-dim fp32 flag is its own ``one_flag``)
        return out, Outcome(None, verdict, verdict)


class ClosurePlan:
    """An optimizer that evaluates the closure itself (LBFGS, SAM; see :func:`evaluates_closure`): every evaluation is
    checked, and if any was inf/NaN everything goes back to its value before the step.

    The step runs as the optimizer wants it; every gradient it computes is checked after the hooks ran, and if any was
    inf/NaN the parameters (and masters), the optimizer state and the buffers go back to their values before the step.
    With master weights the optimizer steps the fp32 stand-ins; before each evaluation the model's half weights take
    the stand-ins' values (e.g. SAM's perturbed point), after it the stand-ins take the half gradients in fp32.
    """

    kind = _CLOSURE

    def __init__(self, steps: Steps, state: OptimizerState) -> None:
        self.steps, self.state = steps, state
        self.checked = steps.scaler is not None  # (unchecked: nothing is saved, nothing put back)

    def run(
        self, optimizer: Optimizer, closure: Callable[[], Any], hooks_and_clipping: Callable[[], None],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Outcome]:
        scaler, masters = self.steps.scaler, self.steps.masters
        static_one = not getattr(scaler, "dynamic", True) and getattr(scaler, "_init_scale", None) == 1.0
        if scaler is not None and scaler.scaling and not static_one:  # (a static scale of 1: an unscaled loss)
            raise MisconfigurationException(
                f"{self.steps.host.plugin}: {type(optimizer).__name__} evaluates its closure inside step(), which"
                " cannot be combined"
                " with a loss scale (fp16 and fp16-true), as torch's GradScaler cannot. Use precision 'fp32', 'tf32',"
                " 'bf16' or 'bf16-true' with closure-taking optimizers, or loss_scale=1.0 (an unscaled loss)."
            )
        # (every half parameter stands in, also one without a gradient yet: the optimizer makes them in its step)
        records = masters.gather(optimizer, every=True) if masters is not None else None
        standin = {id(r.param): r.standin for r in records.records} if records is not None else {}
        model_params = [p for g in optimizer.param_groups for p in g["params"]]
        stepped = [standin.get(id(p), p) for p in model_params]  # what the optimizer holds during the step
        saved = self._save(optimizer, (*stepped, *model_params)) if self.checked else None
        bad: list[Tensor] = []

        def evaluate() -> Any:
            self._to_model(records)
            result = closure()
            hooks_and_clipping()
            self._to_standins(records)
            grads = [t.grad for t in stepped if t.grad is not None]
            if self.checked and grads:
                bad.append(~torch.isfinite(torch.stack(torch._foreach_norm(grads, math.inf)).max()))
            return result

        with standing_in(masters, records):
            out = optimizer.step(closure=evaluate, **kwargs)
        skipped = bool(torch.stack(bad).any().item()) if bad else False  # one sync, as GradScaler pays
        if skipped and saved is not None:
            self._restore(records, (*stepped, *model_params), saved)
        return out, Outcome(skipped, None, skipped if self.checked else None, records)

    @staticmethod
    def _save(optimizer: Optimizer, tensors: tuple[Tensor, ...]) -> tuple[list[Tensor], list[Any], list[Any]]:
        """What a skip restores: the tensors' values, and the state of the optimizer (and of one it wraps: SAM's
        base_optimizer keeps the moments there)."""
        owners = [optimizer, *wrapped_optimizers(optimizer)]
        return [t.detach().clone() for t in tensors], owners, [copy.deepcopy(o.state_dict()["state"]) for o in owners]

    def _restore(self, records: Optional[StepRecords], tensors: tuple[Tensor, ...], saved: Any) -> None:
        values, owners, saved_states = saved
        with torch.no_grad():
            for t, v in zip(tensors, values):
                t.copy_(v)
        for owner, saved_state in zip(owners, saved_states):
            full = owner.state_dict()
            full["state"] = saved_state
            with standing_in(self.steps.masters, records):
                owner.load_state_dict(full)

    def _to_model(self, records: Optional[StepRecords]) -> None:
        """Before an evaluation: the model's half weights take the stand-ins' values, its own parameters return."""
        if records is None:
            return
        with torch.no_grad():
            for r in records.records:
                r.param.copy_(r.standin)  # the closure evaluates the model where the optimizer stands
        cast(MasterWeights, self.steps.masters).swap_out(records)  # zero_grad, backward: the model's own parameters

    def _to_standins(self, records: Optional[StepRecords]) -> None:
        """After an evaluation: the stand-ins return and take the half gradients in fp32."""
        if records is None:
            return
        cast(MasterWeights, self.steps.masters).swap_in(records)
        for r in records.records:
            r.standin.grad = None if r.param.grad is None else r.param.grad.float()


class GeneralPlan:
    """Everything else: stages 1–7 in full (``OptimizerSteps.prepare``, the hooks, the step with every verdict source:
    the check, FP8 saturation, the spike guard). Manual optimization's ``opt.step(closure)`` evaluates the closure
    inside the step, as Lightning does (the closure plan)."""

    kind = _GENERAL

    def __init__(self, steps: Steps, state: OptimizerState, manual: bool) -> None:
        self.steps, self.state, self.scaler = steps, state, steps.scaler
        self.with_closure = ClosurePlan(steps, state) if manual else None
        self._step = self._step_unchecked if self.scaler is None else self._step_checked
        if self.scaler is not None and not checks.takes_device_verdict(
            state.optimizer, scaling=self.scaler.scaling, device=self.scaler.scale_device
        ):
            say_host_sync(state.optimizer, self.scaler)

    def run(
        self, optimizer: Optimizer, closure: Callable[[], Any], hooks_and_clipping: Callable[[], None],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Outcome]:
        if self.with_closure is not None and closure is not do_nothing_closure:
            return self.with_closure.run(optimizer, closure, hooks_and_clipping, kwargs)
        state = self.state
        closure()  # (a training_step that returned None still steps with the gradients there are, as Lightning does)
        try:
            self.steps.prepare(optimizer, state)
            hooks_and_clipping()  # reports through hooks_ran
            return self._step(optimizer, kwargs)
        finally:
            if state.stage is Stage.PREPARED:
                self.steps.abandon(state)  # an error inside the step

    def _step_unchecked(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> tuple[Any, Outcome]:
        state = self.state
        with self.steps.standing_in(state):
            out = optimizer.step(**kwargs)
        state.stage = Stage.STEPPED
        return out, Outcome(False, None, None, state.records)

    def _step_checked(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> tuple[Any, Outcome]:
        steps, state, scaler = self.steps, self.state, cast(StepGuard, self.scaler)
        records = state.records
        # one swap for the check and the step (no context manager: this runs every step)
        if records is not None:
            MasterWeights.swap_in(records)
        try:
            if state.dirty:
                steps.check(optimizer, state)
            if steps.saturation is not None:
                saturated = steps.saturation()  # an inf an FP8 cast made finite: skip the step too
                if saturated is not None:
                    scaler.verdicts.add_(optimizer, saturated)  # (one rank's: reduced where the verdict was)
            spike = self._spike_verdict(optimizer, scaler) if steps.spike is not None else None
            out, skipped = scaler.step_outcome(optimizer, **kwargs)
        finally:
            if records is not None:
                MasterWeights.swap_out(records)
        verdict = scaler.verdicts.of(optimizer) if skipped is None else None  # (the host knows: no device flag)
        state.stage = Stage.STEPPED
        if spike is None:  # the host's answer where it has one: a batch of host-known outcomes costs no kernel
            known = skipped if skipped is not None else _as_flag(verdict, scaler)
            return out, Outcome(skipped, verdict, known, records)
        loss, norm = spike[3], spike[2]
        if loss is not None or norm is not None:
            # (the host has no answer only where the scaler stepped on a device verdict)
            cast(SpikeGuard, steps.spike).observe(
                loss, norm, spike[0], skipped if skipped is not None else cast(Tensor, verdict), index=state.index
            )
        # the loss scale moves on the inf/NaN verdict alone: a spike is no overflow
        return out, Outcome(skipped, verdict, spike[1], records)

    def _spike_verdict(
        self, optimizer: Optimizer, scaler: StepGuard
    ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """Inside the stand-ins' swap, after every other verdict source: whether this step is a loss or gradient-norm
        spike against this optimizer's own window; it joins the skip verdict. Returns (spike, the inf/NaN verdict
        alone, the gradient norm, the loss judged: what backward ran on since the last step, or, where no backward
        ran since (two optimizers stepped from one backward), that backward's loss)."""
        steps, state = self.steps, self.state
        guard = cast(SpikeGuard, steps.spike)  # called with one
        inf_only = scaler.verdicts.of(optimizer)
        if inf_only is None:
            inf_only = checks.zero_flag(scaler.scale_device)
        else:
            inf_only = inf_only.reshape(()).float().clone()
        norm = state.norm if state.norm is not None else total_grad_norm(optimizer, sharded=scaler.sharded)
        loss = steps.loss if steps.loss is not None else steps.last_loss
        if loss is None and norm is None:  # nothing to judge (no backward, no gradient)
            spike = torch.zeros((), dtype=torch.bool, device=scaler.scale_device)
        else:
            spike = all_ranks_agree(guard.decide(loss, norm, index=state.index))
        scaler.verdicts.add_(optimizer, spike, agreed=True)
        return spike, inf_only, norm, loss


def say_host_sync(optimizer: Optimizer, scaler: StepGuard) -> None:
    """Log once (CUDA) that ``optimizer``'s steps read their verdict on the host, and how to spare it."""
    if scaler.scale_device.type != "cuda" or getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    fusable = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))
    log.info(
        "lightning_mp: %s is not fused: each step reads its inf/NaN verdict on the host before the update (one sync"
        " a step, as torch's GradScaler pays; on a small model the GPU then waits for the update's launches)%s.",
        type(optimizer).__name__, "; made with fused=True it skips on the device instead" if fusable else "",
    )


def first_verdict(steps: Steps, optimizer: Optimizer, state: OptimizerState, scaler: Optional[StepGuard]) -> None:
    """The verdict sources of ``OptimizerSteps.prepare``, after the gather (stages 2–3): the unscale (fp16), the
    gather's own pass (true-half, check-only modes), the spike guard's total norm, or the maxima taken during
    backward; ``state.dirty`` says whether the verdict must still look (stage 6)."""
    check_only = scaler is not None and not scaler.scaling
    # the figures taken during backward (large models), where they hold for the gradients the step applies
    overlapped = steps.overlap.installed and (state.records is None or state.records.plain)
    if steps.overlap.installed and not overlapped:
        steps.overlap.forget()
    if scaler is not None and scaler.scaling:
        with steps.standing_in(state):
            scaler.unscale_(optimizer)
        state.dirty = False
    elif state.records is not None and state.records.found is not None:
        assert scaler is not None  # found: check_only
        state.dirty = not scaler.verdicts.take_(optimizer, state.records.found)
    elif check_only and steps.spike is not None:
        assert scaler is not None  # check_only
        # the spike guard needs the total gradient norm, which is inf/NaN when a gradient is: one pass for both
        # (taken during backward for large models)
        norm = steps.overlap.verdict(optimizer) if overlapped else None
        if norm is None:
            with steps.standing_in(state):
                norm = total_grad_norm(optimizer, sharded=scaler.sharded)
        state.norm = norm
        state.dirty = norm is None or not scaler.verdicts.take_total_(optimizer, norm)
    else:
        # the maxima taken during backward, where every gradient has one (large models, check-only modes)
        early = steps.overlap.verdict(optimizer) if check_only and overlapped else None
        state.dirty = early is None or not cast(StepGuard, scaler).verdicts.take_total_(optimizer, early)


def divergence_error(
    steps: Steps, state: OptimizerState, streak: tuple[int, int], *, several: bool
) -> NonFiniteTrainingError:
    """The divergence stop's error, after ``streak`` = (skipped steps in a row, ``max_consecutive_skips``): why the
    steps were skipped, and what to do."""
    consecutive, limit = streak
    step = steps.host.global_step()
    scaler = steps.scaler
    scale = scaler.get_scale() if scaler is not None and scaler.scaling else None
    advice = (
        "the loss scale is at its floor: check the model for values that overflow fp16, or use precision='bf16'"
        if scale is not None and scale <= cast(DynamicLossScaler, scaler).min_scale
        else "look for a NaN/inf in the data or the loss, lower the learning rate, or add gradient clipping"
    )
    which = f" of optimizer {state.index}" if several else ""
    spikes = steps.spike.spikes_in_a_row(state.index) if steps.spike is not None else 0
    if spikes:
        assert steps.spike is not None  # spikes: counted by the guard
        advice = (
            f"{spikes} of them were loss or gradient-norm spikes (spike_sigma={steps.spike.sigma:g}, spike_window="
            f"{steps.spike.window}): the loss has moved away from its recent history for good (a data shift, a"
            " learning rate too high); raise spike_sigma, lower the learning rate, or resume from an earlier"
            " checkpoint and skip the batches around the spike"
        )
        return NonFiniteTrainingError(
            f"{consecutive} optimizer steps{which} in a row were skipped (limit max_consecutive_skips={limit}),"
            f" at global step {step}. Training stopped: {advice}."
        )
    return NonFiniteTrainingError(
        f"{consecutive} optimizer steps{which} in a row had inf/NaN gradients and were skipped (limit"
        f" max_consecutive_skips={limit}), at global step {step}"
        + (f", loss scale {scale:g}" if scale is not None else "")
        + f". Training stopped: {advice}. NonFiniteDetector names the module that produced it."
    )


def standing_in(masters: Optional[MasterWeights], records: Optional[StepRecords]) -> Any:
    """Inside: the fp32 stand-ins hold the half parameters' places (and state) in the param groups."""
    # (records: gathered by the masters)
    return cast(MasterWeights, masters).stepping(records) if records is not None else contextlib.nullcontext()


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


def _as_flag(verdict: Optional[Tensor], scaler: StepGuard) -> Tensor:
    if verdict is None:
        return checks.zero_flag(scaler.scale_device)
    return checks.one_flag([verdict], verdict.device)  # (a fused optimizer's found_inf: itself, no dispatcher call)


def release_grads(optimizer: Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` without its profiler record and per-group bookkeeping (a host cost
    that counts on small models); an optimizer with its own ``zero_grad`` gets that."""
    if type(optimizer).zero_grad is not Optimizer.zero_grad:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
