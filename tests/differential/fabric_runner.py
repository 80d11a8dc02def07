"""Runs a :class:`~fabric_programs.FabricProgram` through a real Lightning ``Fabric`` on the CPU and collects its
final state.

The data: micro-batch ``m`` of the ``j``-th clean step (the ``j``-th step of the program without its poisoned and
given-up steps) is a fixed function of the program's seed, ``j`` and ``m``; the ``k``-th poisoned or given-up step
draws other data (from ``EXTRA + k``), so a program and its control see the same batches in their clean steps, and
a program and the same program without its save and load the same batches everywhere. A resume builds a fresh
model (from other initial weights: the checkpoint must bring them), optimizers, plugin and Fabric, and loads the
checkpoint into them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision
from torch import nn

from lightning_mp import MPFabricPrecision

from .fabric_programs import SCALED, FabricProgram, Step

FEATURES = 8
HIDDEN = 16
BATCH = 4
EXTRA = 10**6  # the data keys of poisoned and given-up steps: no clean step's
INIT_SCALE = 2.0**8  # fp16 modes, ours and Fabric's GradScaler: clean steps of these tiny models never overflow
LR = {"sgd": 0.05, "adam": 0.01}
CLIP = {"norm": 0.1, "value": 0.02}  # small enough that clipping acts on most steps
#: Fabric's own precision of each mode (fp16: its MixedPrecision plugin with a GradScaler from INIT_SCALE: on the CPU
#: ``Fabric(precision="16-mixed")`` would run bf16)
FABRIC_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                    "fp16-true": "16-true"}


# ---------------------------------------------------------------------------------------------- model and data
class FabricNet(nn.Module):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.l1 = nn.Linear(FEATURES, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN) if batchnorm else None
        self.l2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if self.bn is not None:
            h = self.bn(h)
        return self.head(torch.tanh(self.l2(h)))


def make_model(program: FabricProgram, init: int) -> FabricNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 * init + program.seed)
        return FabricNet(program.batchnorm)


def micro_batch(program: FabricProgram, key: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(hash((program.seed, key, micro)) & 0x7FFF_FFFF_FFFF)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = x[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=g)
    return x, y


def param_groups(program: FabricProgram, model: FabricNet) -> list[list[nn.Parameter]]:
    """The parameters of each optimizer: all; l1 (and the norm) | l2 and head; l1, (norm,) l2.weight | l2, head."""
    first = [*model.l1.parameters(), *(model.bn.parameters() if model.bn is not None else ())]
    if program.layout == "one":
        return [list(model.parameters())]
    if program.layout == "disjoint":
        return [first, [*model.l2.parameters(), *model.head.parameters()]]
    return [[*first, model.l2.weight], [model.l2.weight, model.l2.bias, *model.head.parameters()]]


def make_optimizer(program: FabricProgram, kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    eps = 1e-4 if program.mode == "fp16-true" else 1e-8  # Adam's 1e-8 is 0 in fp16 (fp16 state without masters)
    return torch.optim.Adam(params, lr=LR["adam"], eps=eps)


# ---------------------------------------------------------------------------------------------- the precision
@dataclasses.dataclass(frozen=True)
class FabricSide:
    """Our plugin (``plugin``: MPFabricPrecision's arguments beyond the mode) or Fabric's own ``precision``."""

    fabric: Optional[str] = None  # Fabric's precision flag; None: ours
    plugin: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def ours(program: FabricProgram, **overrides: Any) -> "FabricSide":
        kwargs: dict[str, Any] = {}
        if program.master_weights is not None:
            kwargs["master_weights"] = program.master_weights
        if program.mode in SCALED and "loss_scale" not in overrides:
            kwargs["init_scale"] = INIT_SCALE
        kwargs.update(overrides)
        return FabricSide(plugin=tuple(sorted(kwargs.items())))

    def fabric_kwargs(self, program: FabricProgram) -> dict[str, Any]:
        if self.fabric is None:
            return {"plugins": [MPFabricPrecision(program.mode, **dict(self.plugin))]}
        if self.fabric == "16-mixed":
            scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
            return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
        return {"precision": self.fabric}


# ---------------------------------------------------------------------------------------------- one run
@dataclasses.dataclass
class FabricFinal:
    """What a run ends with."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizers: list[dict]
    norms: list[float]  # what clip_gradients by norm returned in the clean steps, each optimizer in order
    given_up: list[int]  # the clean steps the loop gave up (none: their gradients are finite)
    extra_steps: int = 0  # optimizer.step() calls in the poisoned and given-up steps (those the loop did not give up)
    steps: Optional[int] = None  # plugin.stats (ours)
    skipped: Optional[int] = None
    masters: Optional[dict] = None  # the master weights in plugin.state_dict() (ours, true-half)
    scale: Optional[float] = None  # the loss scale (ours and Fabric's GradScaler)
    plugin_state: Optional[dict] = None  # plugin.state_dict() (ours)
    error: Optional[str] = None  # an exception the run raised (a finding of its own)


class _Loop:
    """One Fabric, model and optimizers, set up as the user's loop does."""

    def __init__(self, program: FabricProgram, side: FabricSide, init: int) -> None:
        self.program = program
        self.fabric = Fabric(accelerator="cpu", devices=1, **side.fabric_kwargs(program))
        self.raw = make_model(program, init)
        kinds = (program.optimizer, program.second)
        raw_optimizers = [make_optimizer(program, kind, params)
                          for kind, params in zip(kinds, param_groups(program, self.raw))]
        model, *optimizers = self.fabric.setup(self.raw, *raw_optimizers)
        self.model, self.optimizers = model, optimizers
        self.raw_optimizers = raw_optimizers
        self.plugin = self.fabric.strategy.precision
        self.ours = isinstance(self.plugin, MPFabricPrecision)

    def announce(self) -> None:
        if self.ours:
            self.plugin.setup_optimizers(*self.optimizers)

    def checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model}
        state.update({f"optimizer{i}": opt for i, opt in enumerate(self.optimizers)})
        state["precision"] = self.plugin
        return state

    def _clip(self, step: Step, optimizer: Any) -> Optional[torch.Tensor]:
        if step.clip == "norm":
            return self.fabric.clip_gradients(self.model, optimizer, max_norm=CLIP["norm"],
                                              error_if_nonfinite=step.abandon == "error")
        if step.clip == "value":
            self.fabric.clip_gradients(self.model, optimizer, clip_val=CLIP["value"])
        return None

    def train(self, step: Step, key: int) -> tuple[Optional[list[torch.Tensor]], int]:
        """One step of the loop: ``(the norms clipping returned, or None where the loop gave the step up, the
        optimizer.step() calls made)``. The optimizers clip, then step, all together (or, ``program.interleave``,
        one after the other: clip, step, clip, step); the loop gives up right after a clipping."""
        fabric, model = self.fabric, self.model
        finite_loss = True
        for m in range(step.micro):
            x, y = micro_batch(self.program, key, m)
            with fabric.no_backward_sync(model, enabled=m < step.micro - 1):
                loss = F.mse_loss(model(x), y) / step.micro
                if step.poison == m:
                    loss = loss * math.inf
                finite_loss = finite_loss and bool(torch.isfinite(loss.detach()))
                fabric.backward(loss)
        norms: list[torch.Tensor] = []
        calls = 0
        turns = [[opt] for opt in self.optimizers] if self.program.interleave else [self.optimizers]
        for turn in turns:
            if self._clip_and_give_up(step, turn, norms, finite_loss):
                for optimizer in self.optimizers:
                    optimizer.zero_grad()
                return None, calls
            if step.halve_grads:
                with torch.no_grad():
                    for p in _params(turn):
                        if p.grad is not None:
                            p.grad.mul_(0.5)
            for optimizer in turn:
                optimizer.step()
                calls += 1
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        return norms, calls

    def _clip_and_give_up(self, step: Step, turn: list[Any], norms: list[torch.Tensor], finite_loss: bool) -> bool:
        """Clip the gradients of the optimizers of ``turn`` (their norms added to ``norms``); whether the loop
        gives the step up now."""
        try:
            for optimizer in turn:
                norm = self._clip(step, optimizer)
                if norm is not None:
                    norms.append(norm)
        except RuntimeError as err:
            if step.abandon != "error" or "non-finite" not in str(err):
                raise
            return True
        if step.abandon == "always":
            return True
        if step.abandon == "norm":
            return not all(bool(torch.isfinite(n)) for n in norms)
        if step.abandon == "loss":
            return not finite_loss
        if step.abandon == "grads":
            return not all(bool(torch.isfinite(p.grad).all()) for p in _params(turn) if p.grad is not None)
        return False


def _params(optimizers: list[Any]) -> list[torch.Tensor]:
    """The parameters the optimizers hold, each once."""
    seen: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())

def run(program: FabricProgram, side: FabricSide) -> FabricFinal:
    loop = _Loop(program, side, init=0)
    if program.announce:
        loop.announce()
    norms: list[float] = []
    given_up: list[int] = []
    extra_steps = clean = extra = 0
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Fabric's notes about the CPU, seeds, ...
        for i, step in enumerate(program.steps):
            if step.kind == "resume":
                path = Path(tmp) / f"resume-{i}.pt"
                loop.fabric.save(path, loop.checkpoint_state())
                loop = _Loop(program, side, init=i + 1)
                loop.announce()  # (before fabric.load: the optimizer state stays fp32 for half parameters)
                left = loop.fabric.load(path, loop.checkpoint_state())
                assert not left, f"fabric.load left {sorted(left)} over"
                continue
            if step.extra:
                _, calls = loop.train(step, EXTRA + extra)
                extra, extra_steps = extra + 1, extra_steps + calls
                continue
            stepped, _ = loop.train(step, clean)
            if stepped is None:
                given_up.append(clean)
            else:
                norms += [float(n) for n in stepped]
            clean += 1
    final = collect(loop)
    final.norms, final.given_up, final.extra_steps = norms, given_up, extra_steps
    return final


def collect(loop: _Loop) -> FabricFinal:
    final = FabricFinal(
        params={n: p.detach().clone() for n, p in loop.raw.named_parameters()},
        buffers={n: b.detach().clone() for n, b in loop.raw.named_buffers()},
        optimizers=[copy.deepcopy(opt.state_dict()) for opt in loop.raw_optimizers],
        norms=[],
        given_up=[],
    )
    plugin = loop.plugin
    if loop.ours:
        final.steps, final.skipped = plugin.stats.steps, plugin.stats.skipped_steps
        # (the master weights through the checkpoint's view: a loaded checkpoint's masters are applied at the next
        # step, and plugin.masters shows them only from there)
        final.plugin_state = copy.deepcopy(plugin.state_dict())
        final.masters = final.plugin_state.get("master_weights")
        scaler = final.plugin_state.get("scaler")
        final.scale = None if scaler is None else float(scaler["scale"])
    elif isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        final.scale = float(plugin.scaler.get_scale())
    return final


def safe_run(program: FabricProgram, side: FabricSide) -> FabricFinal:
    try:
        return run(program, side)
    except Exception as exc:  # noqa: BLE001 (an exception is a finding: report it beside the other's outcome)
        return FabricFinal({}, {}, [], [], [], error=f"{type(exc).__name__}: {exc}")
