"""The captured step: the check, the skip and the optimizer's own update, recorded once in a CUDA graph and replayed.

An eager step of a check-only mode (``fp32``, ``tf32``, ``bf16``: fp32 weights, no loss scale) reads every gradient
for inf/NaN and then either steps or does not. With a foreach optimizer the host must wait for that answer (one sync
a step, as torch's GradScaler pays) before it can launch the optimizer's kernels; with any optimizer the launches
themselves are host time on a small model. Captured, the whole of it after backward is one graph launch: the check
writes a flag on the device, and the optimizer's update sits in a conditional node of the graph (CUDA 12.4+, torch
2.12+) that runs only where the flag is zero; a fused optimizer (``fused=True``) takes the flag as its ``found_inf``
and skips on it by itself, so its step is captured on any torch. The verdict never reaches the host during the
step; a skipped step runs no kernel of the optimizer (a fused one: none that writes), so parameters, moments and
step counts are exactly as the eager skip leaves them; the step counters, the buffers' restore and the schedulers'
hold take the device flag as they do for a fused optimizer's device skip.

Where it applies (:func:`why_not`; the reason is logged once where it does not): a CUDA device, one process, a
check-only mode without master weights, a spike guard, FP8 or the in-backward check (the check-only plan of
:mod:`lightning_mp.plans`), automatic optimization, and a ``torch.optim`` ``Adam``, ``AdamW`` or ``SGD`` (exactly those
classes: a subclass's ``step`` may keep Python state that a replay would not run) made with ``capturable=True``, with
no step hooks, whose parameters are dense tensors on that device. Learning rates and other hyperparameters may be
tensors (a scheduler writes them in place: the graph reads the new value); a float that changes is seen before the
replay and the step is captured again (a float that changes at every step, after the first few: captured no more,
with the reason). The first steps run eagerly (the optimizer makes its state at its first step); a step where a
parameter has no gradient, the parameters' storages or the optimizer's state changed (a resume loads new state) is
eager or captured again. Gradients are copied into the graph's own buffers before each replay (one multi-tensor
copy): Lightning and Fabric set them to ``None`` between steps.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

import lightning_mp.verdict as checks
from lightning_mp.nonfinite import StepGuard
from lightning_mp.plans import CheckOnlyPlan, OptimizerState, Outcome

log = logging.getLogger(__name__)

#: the optimizer classes a step is captured for (their ``step`` keeps no Python state beyond the tensors)
CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
#: eager steps before the first capture (the optimizer's state is made at its first step)
EAGER_STEPS = 2
#: captures again after hyperparameters changed, within this many steps, before the capture is given up
RECAPTURES, RECAPTURE_WINDOW = 3, 20


def conditional_nodes() -> bool:
    """Whether this torch can put ops in a CUDA graph's conditional node (``CUDAGraph.begin_capture_to_if_node``)."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    return graph is not None and hasattr(graph, "begin_capture_to_if_node")


def why_not(optimizer: Optimizer, device: torch.device) -> Optional[str]:
    """Why steps of ``optimizer`` on ``device`` cannot be captured (``None``: they can)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if device.index is None and torch.cuda.is_available():  # ("cuda": the current one, as tensors name it)
        device = torch.device("cuda", torch.cuda.current_device())
    if type(optimizer) not in CAPTURABLE:
        return f"{type(optimizer).__name__} is not one of torch's Adam, AdamW or SGD"
    groups = optimizer.param_groups
    if not conditional_nodes() and not all(g.get("fused") for g in groups):
        return (f"torch {torch.__version__} has no CUDA graph conditional nodes (torch 2.12+), which skip a foreach"
                f" step on the device: make {type(optimizer).__name__} with fused=True (it skips on the flag itself)")
    if type(optimizer) is torch.optim.SGD:  # (SGD has no capturable flag: its foreach step reads a tensor lr)
        if any(isinstance(g["lr"], Tensor) and not g.get("fused") for g in groups):
            return "SGD reads a tensor learning rate on the host in its step: give it a float, or fused=True"
    elif not all(group.get("capturable", False) for group in groups):
        return f"{type(optimizer).__name__} was made without capturable=True"
    if any(isinstance(v, Tensor) and v.device != device for g in groups for k, v in g.items() if k != "params"):
        return f"a hyperparameter is a tensor off {device} (the graph would read it once): create it on {device}"
    if any(group.get("differentiable", False) for group in optimizer.param_groups):
        return f"{type(optimizer).__name__} is differentiable"
    hooks = [*optimizer._optimizer_step_pre_hooks.values(), *optimizer._optimizer_step_post_hooks.values()]
    if any(type(getattr(h, "__self__", None)).__module__ == "lightning_mp.optim_states" for h in hooks):
        return "optimizer_states='bf16' rounds its moments in step hooks, which a replay would not run"
    if hooks or _global_step_hooks():
        return "the optimizer has step hooks, which a replay would not run"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or any(type(p.data) is not Tensor or p.is_sparse or p.device != device for p in params):
        return f"its parameters are not all dense tensors on {device}"
    return None


def _global_step_hooks() -> bool:
    from torch.optim import optimizer as module

    return bool(module._global_optimizer_pre_hooks or module._global_optimizer_post_hooks)


def _hyperparameters(optimizer: Optimizer) -> list[tuple[str, Any]]:
    """What a replay reads of the param groups besides the parameters: floats by value, tensors by identity."""
    return [
        (key, id(value) if isinstance(value, Tensor) else value)
        for group in optimizer.param_groups for key, value in group.items() if key != "params"
    ]


class CapturedStep:
    """One optimizer's captured step (see the module docstring). :meth:`run` returns the device flag of the step
    (1.0: skipped), or ``None`` where this step must run eagerly."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.seen = 0  # steps run through this object
        self.graph: Optional[Any] = None
        self.reason: Optional[str] = None  # why it gave up (``None``: it has not)
        self.recaptured: list[int] = []
        self._key: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (the plugin pickled mid-run) keeps no graph: it captures its own at its next step."""
        state = self.__dict__.copy()
        for name in ("graph", "static_grads", "flag", "flag_in"):
            state.pop(name, None)
        state.update(graph=None, _key=None)
        return state

    def _now(self) -> tuple[Any, ...]:
        opt = self.optimizer
        return (id(opt.state), len(opt.state), [p.data_ptr() for p in self.params], _hyperparameters(opt))

    def run(self, flag_in: Optional[Tensor]) -> Optional[Tensor]:
        """The step on the gradients there are (``flag_in``: a verdict found before, e.g. by clipping's norm, which
        the graph's check joins). ``None``: not replayed, run the step eagerly."""
        self.seen += 1
        if self.reason is not None or self.seen <= EAGER_STEPS:
            return None
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):  # (a parameter this step did not use: eager, as the check-only plan)
            return None
        key = self._now()
        if self.graph is None or key != self._key:
            if self.graph is not None and not self._recapture_allowed():
                return None
            self._capture(grads)
            self._key = key
        graph = self.graph
        if graph is None:  # (the capture failed: given up)
            return None
        torch._foreach_copy_(self.static_grads, grads)
        if flag_in is None:
            self.flag_in.zero_()
        else:
            self.flag_in.copy_(flag_in.detach().reshape(()))
        graph.replay()
        return self.flag.clone()  # (the graph writes the same flag next step; the counters keep this one)

    def _recapture_allowed(self) -> bool:
        self.recaptured = [s for s in self.recaptured if s > self.seen - RECAPTURE_WINDOW] + [self.seen]
        if len(self.recaptured) <= RECAPTURES:
            return True
        self.give_up(
            f"its param groups' floats change every step (a scheduler on a float learning rate); pass the learning"
            f" rate as a tensor, torch.optim.{type(self.optimizer).__name__}(..., lr=torch.tensor(...),"
            " capturable=True), to capture it"
        )
        return False

    def _fused_step(self) -> None:
        self.optimizer.found_inf = self.flag  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]

    def give_up(self, reason: str) -> None:
        self.reason, self.graph = reason, None
        log.info("lightning_mp: the optimizer step is eager from now on: %s.", reason)

    def _capture(self, grads: list[Tensor]) -> None:
        device = self.params[0].device
        self.graph = None
        self.static_grads = [torch.empty_like(g) for g in grads]
        self.flag_in = torch.zeros((), dtype=torch.float32, device=device)
        self.flag = torch.zeros((), dtype=torch.float32, device=device)
        per_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in self.static_grads:
            per_dtype.setdefault(g.dtype, []).append(g)
        numel = sum(g.numel() for g in self.static_grads)
        checks.constant(1.0, device)  # (the check's constant made outside the graph's memory pool)
        held = [p.grad for p in self.params]
        for p, static in zip(self.params, self.static_grads):
            p.grad = static
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.current_stream(device).synchronize()
            with torch.cuda.graph(graph):
                self.flag.copy_(self.flag_in)
                checks.check_tensors_(per_dtype, numel, self.flag)  # (the eager step's check, its kernels chosen alike)
                self.flag.clamp_(max=1.0)  # (a fused kernel skips on exactly 1: the check may add to a 1 handed in)
                if all(g.get("fused") for g in self.optimizer.param_groups):
                    self._fused_step()  # (the fused kernel skips on the flag: no conditional node needed)
                else:
                    graph.begin_capture_to_if_node(self.flag == 0)
                    try:
                        self.optimizer.step()
                    finally:
                        graph.end_capture_to_conditional_node()
        except Exception as err:  # a capture that fails must not stop training: the eager step does the same
            self.give_up(f"capturing it failed ({type(err).__name__}: {str(err)[:200]})")
            return
        finally:
            for p, g in zip(self.params, held):
                p.grad = g
        self.graph = graph
        log.info(
            "lightning_mp: the optimizer step of %s is captured in a CUDA graph (the check, the skip and the update"
            " replayed as one launch).", type(self.optimizer).__name__,
        )


class CapturedPlan(CheckOnlyPlan):
    """The check-only plan with its step captured (:class:`CapturedStep`): the hooks and clipping run eagerly as
    before, then one graph launch checks, skips or steps; a step the graph cannot take runs as the check-only plan's."""

    kind = "captured"

    def __init__(self, steps: Any, state: OptimizerState, scaler: StepGuard, fused: bool) -> None:
        super().__init__(steps, state, scaler, fused)
        self.eager = self._step  # (the check-only plan's own: with one host sync, or a fused device skip)
        self.captured = CapturedStep(state.optimizer)
        self._step = self._step_captured  # type: ignore[method-assign]

    @classmethod
    def make(cls, steps: Any, state: OptimizerState, scaler: StepGuard, fused: bool) -> CheckOnlyPlan:
        """This plan where the optimizer's steps can be captured, else the check-only plan (the reason logged)."""
        reason = why_not(state.optimizer, scaler.scale_device)
        if reason is None:
            return cls(steps, state, scaler, fused)
        (log.info if scaler.scale_device.type == "cuda" else log.debug)(
            "lightning_mp: the optimizer step is not captured: %s.", reason
        )
        return CheckOnlyPlan(steps, state, scaler, fused)

    def _step_captured(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> tuple[Any, Outcome]:
        verdicts = self.scaler.verdicts
        flag_in = None
        if verdicts.stage(optimizer) is not OptState.READY:  # clipping's norm gave a verdict: the graph joins it
            flags = list(verdicts.found(optimizer).values())
            flag_in = checks.one_flag(flags, flags[0].device) if flags else None
        flag = None if kwargs else self.captured.run(flag_in)
        if flag is None:
            return self.eager(optimizer, kwargs)
        return None, Outcome(None, flag, flag)


def not_captured(steps: Any, plan: Any, optimizer: Optimizer) -> None:
    """Log once why the steps of ``optimizer``, run by ``plan`` (not the check-only plan), are not captured."""
    scaler = steps.scaler
    if plan.kind == "closure":
        reason = f"{type(optimizer).__name__} evaluates its closure inside step()"
    elif not steps.host.whole_steps:
        reason = "manual optimization steps it (the loop's code between backward and the step is not captured)"
    elif scaler is None:
        reason = "steps are not checked (skip_nonfinite=False): the optimizer's own step runs as it is"
    elif scaler.scaling:
        reason = "the mode scales the loss (fp16): its steps are not captured yet"
    elif steps.masters is not None:
        reason = "the mode keeps master weights (true-half): its steps are not captured yet"
    elif scaler.sync_across_ranks or scaler.sharded:
        reason = "several processes agree on each verdict (DDP, FSDP)"
    else:
        reason = "a spike guard, FP8 or the in-backward check joins the verdict"
    device = getattr(scaler, "scale_device", torch.device("cpu")) if scaler is not None else torch.device("cpu")
    (log.info if device.type == "cuda" else log.debug)("lightning_mp: the optimizer step is not captured: %s.", reason)
