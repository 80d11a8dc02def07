"""The oracles of the Fabric programs: what a loop's final state under MPFabricPrecision must equal.

(1) :func:`check_against_fabric`, a program without poisoned or given-up steps: the same loop under Fabric's own
    precision of the mode, bit for bit where the design promises it (:func:`fabric_reference`); where it computes
    differently on purpose, or where Fabric's own plugin does not run the loop right, against Fabric's 32-true within
    the mode's rounding noise (the tolerance of the Trainer's oracles, ``oracles.NOISE_FACTOR`` and, with Adam,
    ``oracles.NOISE_FLOOR``; loops with SGD alone get the smaller :data:`SGD_FLOOR`).
(2) :func:`check_extra_steps`, a program with poisoned or given-up steps: the same program without them (the
    control), both ours, bit for bit: a skipped or given-up step changes nothing, neither the parameters, the master
    weights, the optimizer state (Adam's ``step`` included) nor the loss scale (fp16 modes: a hysteresis budget larger
    than the program's overflows), and the next clean step is the control's.
(3) :func:`check_resume`, a program with a ``fabric.save``/``fabric.load`` into a fresh run: the same program without
    it, both ours, bit for bit, the plugin's state dict included.

Each returns a list of problems (empty: the program passed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .fabric_programs import SCALED, FabricProgram
from .fabric_runner import FABRIC_PRECISION, FabricFinal, FabricSide, safe_run
from .oracles import NOISE_FACTOR, NOISE_FLOOR, _float, compare, distances

#: The floor of the tolerance for loops whose optimizers are all SGD. ``oracles.NOISE_FLOOR`` (0.05) is there for
#: Adam, which moves an element by about lr whatever its gradient (rounding that flips the sign of a gradient near 0
#: moves it by 2 lr); SGD moves an element in proportion to its gradient, so NOISE_FACTOR x the measured noise
#: covers it: over 400 drawn loops (70 compared within the noise) no SGD loop came past it at all, Adam's by 0.00076
#: at most. A floor of 0.05 would hide a whole lost SGD update of these models (0.005 to 0.05 an element).
SGD_FLOOR = 0.005


@dataclass(frozen=True)
class FabricReference:
    """The oracle run of a program without poisoned or given-up steps, and how our run compares with it."""

    side: FabricSide
    ours: FabricSide
    exact: bool = True
    why: str = "the same mode, bit for bit"
    noise: tuple[FabricSide, ...] = ()  # two runs whose distance is the mode's rounding noise (when not exact)


def fabric_16_mixed_runs(program: FabricProgram) -> bool:
    """Whether Fabric's own ``16-mixed`` runs the loop right. Its GradScaler unscales an optimizer's gradients at
    ``clip_gradients`` and again at ``optimizer.step()`` where an ``update()`` came in between, and Fabric updates
    after each optimizer's step: with two optimizers that both clip before either steps, the second one's gradients
    are unscaled twice; a weight that two optimizers share is unscaled by each."""
    if program.layout == "one":
        return True
    return program.layout == "disjoint" and (program.interleave or all(s.clip is None for s in program.steps))


def fabric_reference(program: FabricProgram) -> FabricReference:
    """Which Fabric run a program under MPFabricPrecision must match, and how closely.

    * fp32: Fabric's 32-true, bit for bit.
    * bf16/fp16 autocast: Fabric's bf16-mixed/16-mixed (a GradScaler from the same initial scale), bit for bit
      without BatchNorm; with it (our FP32 guard runs it in fp32, Fabric's autocast in 16 bits) within the noise.
    * bf16-true/fp16-true with ``master_weights="none"``: Fabric's bf16-true/16-true (ours with a static loss scale
      of 1 in fp16-true, as Fabric's 16-true scales no loss), the same rule for BatchNorm.
    * bf16-true/fp16-true with master weights (fp32, Kahan): Fabric keeps none by design: against 32-true within the
      noise of Fabric's autocast of the same 16-bit dtype (fp32 weights, 16-bit compute: what master weights give).
    * fp16 where Fabric's 16-mixed does not run the loop right (:func:`fabric_16_mixed_runs`): against 32-true; the
      noise is bf16-mixed's then (coarser than fp16's: the tolerance is wider, never narrower).
    """
    ours = FabricSide.ours(program)
    fp32 = FabricSide(fabric="32-true")
    sixteen = fabric_16_mixed_runs(program)
    if program.masters not in (None, "none"):
        autocast = "16-mixed" if program.mode == "fp16-true" and sixteen else "bf16-mixed"
        return FabricReference(fp32, ours, exact=False, why="32-true within the noise (master weights)",
                               noise=(FabricSide(fabric=autocast), fp32))
    if program.mode == "fp16" and not sixteen:
        return FabricReference(fp32, ours, exact=False,
                               why="32-true within the noise (Fabric's 16-mixed unscales some gradients twice)",
                               noise=(FabricSide(fabric="bf16-mixed"), fp32))
    theirs = FabricSide(fabric=FABRIC_PRECISION[program.mode])
    if program.mode == "fp16-true":
        ours = FabricSide.ours(program, loss_scale=1.0)
    if program.mode == "fp32" or not program.batchnorm:
        return FabricReference(theirs, ours)
    return FabricReference(theirs, ours, exact=False, why="the same mode within the noise (FP32 guards)",
                           noise=(theirs, fp32))


# ---------------------------------------------------------------------------------------------- comparisons
def _state(final: FabricFinal) -> dict[str, Any]:
    return {"params": final.params, "buffers": final.buffers, "optimizers": final.optimizers, "norms": final.norms,
            "given up": final.given_up}


def noise_group(where: str) -> str:
    """The tensors whose noise is measured together: all parameters, each optimizer's state entry over its
    parameters (``exp_avg``, ``momentum_buffer``, ...), each buffer, the norms (see ``oracles.noise_group``)."""
    if where.startswith("state.params."):
        return "state.params"
    state = re.fullmatch(r"(state\.optimizers\[\d+\]\.state)\.\d+\.(.+)", where)
    if state:
        return f"{state.group(1)}.{state.group(2)}"
    return re.sub(r"\[\d+\]$", "", where)


def _allowance(program: FabricProgram, noise: list[FabricFinal]) -> Callable[[str], float]:
    errors = [f.error for f in noise if f.error is not None]
    if len(noise) != 2 or errors:
        raise AssertionError(f"the noise runs of the oracle failed: {errors}")
    groups: dict[str, float] = {}
    for where, d in distances(_float(_state(noise[0])), _float(_state(noise[1])), "state", {}).items():
        group = noise_group(where)
        groups[group] = max(groups.get(group, 0.0), d)
    adam = "adam" in (program.optimizer, program.second if program.n_optimizers == 2 else "sgd")
    floor = NOISE_FLOOR if adam else SGD_FLOOR
    return lambda where: max(floor, NOISE_FACTOR * groups.get(noise_group(where), 0.0))


# ---------------------------------------------------------------------------------------------- (1) against Fabric
def check_against_fabric(program: FabricProgram) -> list[str]:
    assert not program.has_extra
    ref = fabric_reference(program)
    runs: dict[FabricSide, FabricFinal] = {}  # (the reference run is often one of the noise runs)

    def run_of(side: FabricSide) -> FabricFinal:
        if side not in runs:
            runs[side] = safe_run(program, side)
        return runs[side]

    ours, theirs = run_of(ref.ours), run_of(ref.side)
    return fabric_problems(program, ref, ours, theirs, [run_of(side) for side in ref.noise])


def fabric_problems(program: FabricProgram, ref: FabricReference, ours: FabricFinal, theirs: FabricFinal,
                    noise: Optional[list[FabricFinal]] = None) -> list[str]:
    """How our run of ``program`` differs from the reference run ``theirs`` (``noise``: the runs of ``ref.noise``)."""
    if theirs.error is not None or ours.error is not None:
        if theirs.error is not None and ours.error is not None:
            return []  # both refuse the program: nothing to compare
        return [f"error: ours {ours.error!r}, Fabric's {theirs.error!r}"]
    state_ours, state_theirs = _state(ours), _state(theirs)
    allow = None
    if not ref.exact:
        state_ours, state_theirs = _float(state_ours), _float(state_theirs)
        allow = _allowance(program, noise or [])
    problems = compare(state_ours, state_theirs, "state", allow)
    calls = sum(program.n_optimizers for s in program.steps if s.kind == "train")
    problems += compare((ours.steps, ours.skipped), (calls, 0), "plugin.stats (steps, skipped)")
    if ref.side.fabric == "16-mixed":
        problems += compare(ours.scale, theirs.scale, "loss scale")
    if problems:
        problems.append(f"(the oracle: Fabric's {ref.side.fabric}, {ref.why})")
    return problems


# ---------------------------------------------------------------------------------------------- (2) extra steps
def extra_side(program: FabricProgram, **overrides: Any) -> FabricSide:
    """Ours, for a program and its control: in fp16 modes a hysteresis budget larger than the overflows the
    program can see, so that the loss scale stays where the control's is (a scale that backed off computes the
    16-bit gradients at another scale: other low bits, by design)."""
    if program.mode in SCALED:
        overflows = sum(program.n_optimizers for s in program.steps if s.poison is not None)
        overrides.setdefault("hysteresis", overflows + 1)
    return FabricSide.ours(program, **overrides)


def check_extra_steps(program: FabricProgram, side: Optional[FabricSide] = None) -> list[str]:
    """The program against its control (without its poisoned and given-up steps), both ours (``side``: other
    plugin arguments, for the oracle's own tests)."""
    assert program.has_extra
    control = program.without_extra()
    side = side or extra_side(program)
    poisoned, clean = safe_run(program, side), safe_run(control, side)
    if poisoned.error is not None or clean.error is not None:
        return [f"error: with the extra steps {poisoned.error!r}, control {clean.error!r}"]
    state_poisoned, state_clean = _state(poisoned), _state(clean)
    if program.batchnorm and any(s.extra and s.abandon != "never" for s in program.steps):
        # a step the loop gives up ran its forward passes in training mode: BatchNorm's statistics moved, under any
        # plugin (the loop's doing, not a step's)
        del state_poisoned["buffers"], state_clean["buffers"]
    problems = compare(state_poisoned, state_clean, "state")
    problems += compare(poisoned.masters, clean.masters, "masters")
    problems += compare(poisoned.scale, clean.scale, "loss scale")
    problems += compare((clean.steps, clean.skipped), (sum(program.n_optimizers for s in control.steps
                                                           if s.kind == "train"), 0),
                        "control plugin.stats (steps, skipped)")
    problems += compare((poisoned.steps, poisoned.skipped), (clean.steps + poisoned.extra_steps, poisoned.extra_steps),
                        "plugin.stats (steps, skipped): the extra steps' optimizer.step() calls are skipped steps")
    return problems


# ---------------------------------------------------------------------------------------------- (3) a resume
def check_resume(program: FabricProgram) -> list[str]:
    """The program against the same program without its save/load, both ours."""
    assert program.has_resume
    side = extra_side(program) if program.has_extra else FabricSide.ours(program)
    resumed, whole = safe_run(program, side), safe_run(program.without_resume(), side)
    if resumed.error is not None or whole.error is not None:
        return [f"error: resumed {resumed.error!r}, uninterrupted {whole.error!r}"]
    problems = compare(_state(resumed), _state(whole), "state")
    problems += compare(resumed.masters, whole.masters, "masters")
    problems += compare(resumed.plugin_state, whole.plugin_state, "plugin.state_dict()")
    problems += compare((resumed.steps, resumed.skipped, resumed.extra_steps),
                        (whole.steps, whole.skipped, whole.extra_steps), "plugin.stats (steps, skipped, extra calls)")
    return problems

