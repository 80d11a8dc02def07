"""The oracles: what a program's final state under MPPlugin must equal.

(1) :func:`check_against_lightning`, a program without a poisoned step: the same program under Lightning's own
    plugin of the same mode. Bit-identical where the design promises it (:func:`reference`); where the design
    computes differently on purpose, close within a documented tolerance (:data:`TOLERANCE`).
(2) :func:`check_skip`, a program with a poisoned step: the same program without it (the control), bit-identical
    (fp16 modes with hysteresis=2: the loss scale stays through one skip; the scaler's trackers aside).
(3) :func:`check_same_value_writes`, a program whose writes leave every value as it was (a wide clamp through
    ``.data``, a copy or a ``load_state_dict`` of the same values): the same program without the writes, bit for
    bit, master weights and Kahan compensation included (the tolerance of (1) cannot see their low bits).

Each returns a list of problems (empty: the program passed); ``stream`` problems mean the generator itself went
wrong (the batches a run saw are not the ones the program meant), never the plugin.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .programs import SCALED, Program
from .runner import LIGHTNING_PRECISION, Final, Side, run

#: (atol, rtol) of the comparisons where the design computes differently from the oracle, measured over
#: thousands of drawn programs (the largest deviation seen, about 3x):
#:   "guards": bf16/fp16 autocast, or true-half without master weights, with FP32 guards on norms and the loss module
#:       (they run in fp32 where Lightning runs them in 16 bits) against Lightning's plugin of the same mode;
#:   "masters": bf16-true/fp16-true with fp32 or Kahan master weights against Lightning's 32-true (16-bit compute,
#:       updates kept in fp32).
#:   "autocast": bf16/fp16 autocast against Lightning's 32-true, where Lightning's own mixed plugin refuses the program
#:       (gradient clipping with a fused optimizer: Lightning raises, MPPlugin clips).
TOLERANCE = {"guards": (0.1, 0.1), "masters": (0.1, 0.1), "autocast": (0.1, 0.1)}


@dataclass(frozen=True)
class Reference:
    """The oracle run of a program without a poisoned step, and how it compares."""

    side: Side
    exact: bool
    tolerance: Optional[str] = None  # a TOLERANCE key when not exact
    ours: Side = Side()


def reference(program: Program) -> Reference:
    """Which Lightning run a program under MPPlugin must match, and how closely.

    * fp32: Lightning's 32-true, bit for bit (the guards run fp32 modules in fp32: nothing changes).
    * bf16/fp16 autocast: Lightning's bf16-mixed/16-mixed (same initial loss scale), bit for bit where no FP32
      guard hooks a module of the program (guards off, or no norm and no loss module); within a tolerance otherwise.
    * bf16-true/fp16-true with ``master_weights="none"``: Lightning's bf16-true/16-true, the same rule for guards.
      Lightning's 16-true scales no loss: ours starts its dynamic scale at 1 there (it would grow only after 2000
      clean steps), so that both compute the same 16-bit gradients (with a scale of 256 a gradient element that is
      subnormal in fp16 keeps bits that Lightning's loses: a difference of one fp16 ulp, by design).
    * bf16/fp16 autocast, gradient clipping with a fused optimizer: Lightning's mixed plugin refuses to clip
      gradients a fused optimizer unscales itself, MPPlugin unscales them first; against 32-true within a tolerance.
    * bf16-true/fp16-true with master weights (fp32, Kahan): Lightning keeps none by design, so against
      Lightning's 32-true within a tolerance.
    """
    ours = Side.ours(program)
    if program.mode in ("bf16", "fp16") and program.clip is not None and program.optimizer == "adamw-fused":
        return Reference(Side(lightning="32-true"), exact=False, tolerance="autocast", ours=ours)
    if program.masters not in (None, "none"):
        return Reference(Side(lightning="32-true"), exact=False, tolerance="masters", ours=ours)
    theirs = Side(lightning=LIGHTNING_PRECISION[program.mode])
    if program.mode == "fp16-true":
        ours = Side.ours(program, init_scale=1.0)
    if program.mode == "fp32" or program.guards == "off" or not program.guarded_modules:
        return Reference(theirs, exact=True, ours=ours)
    return Reference(theirs, exact=False, tolerance="guards", ours=ours)


# ---------------------------------------------------------------------------------------------- comparisons
def _tensor_problem(a: torch.Tensor, b: torch.Tensor, exact: bool, tol: tuple[float, float]) -> Optional[str]:
    if exact:
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if torch.equal(a, b):
            return None
        if a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()):
            return None
    else:
        if a.shape != b.shape:
            return f"shape {list(a.shape)} vs {list(b.shape)}"
        atol, rtol = tol
        x, y = a.double(), b.double()
        if torch.equal(x.isnan(), y.isnan()) and bool(((x - y).abs() <= atol + rtol * y.abs()).logical_or(
                x.isnan()).all()):
            return None
    diff = (a.double() - b.double()).abs()
    finite = diff[diff.isfinite()]
    worst = f"{finite.max().item():.3g}" if finite.numel() else "nan"
    return (f"{int((diff != 0).logical_or(diff.isnan()).sum())} of {a.numel()} elements differ (max |diff| {worst};"
            f" ours {a.flatten()[:3].tolist()} vs {b.flatten()[:3].tolist()})")


def compare(a: Any, b: Any, where: str, exact: bool = True, tol: tuple[float, float] = (0.0, 0.0)) -> list[str]:
    """Every difference between nested dicts/lists/tensors/numbers ``a`` (ours) and ``b`` (the oracle)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [p for k in a for p in compare(a[k], b[k], f"{where}.{k}", exact, tol)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in compare(x, y, f"{where}[{i}]", exact, tol)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        problem = _tensor_problem(a, b, exact, tol)
        return [] if problem is None else [f"{where}: {problem}"]
    if isinstance(a, float) and isinstance(b, float) and not exact:
        return [] if abs(a - b) <= tol[0] + tol[1] * abs(b) else [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def _stream_problems(program: Program, final: Final, what: str) -> list[str]:
    """The generator's own check: the run saw the logical batches in order, the poisoned window where meant."""
    expected = list(range(program.total_steps * program.accumulate))
    poison = program.poison
    if poison is not None:
        at = poison.window * program.accumulate
        expected[at:at] = [-1] * program.accumulate
    if final.tags != expected:
        return [f"stream ({what}): the run saw batches {final.tags}, the program meant {expected}"]
    return []


def _state(final: Final) -> dict[str, Any]:
    return {"params": final.params, "buffers": final.buffers, "optimizer": final.optimizer,
            "scheduler": final.scheduler, "validation losses": final.validations}


def _safe_run(program: Program, side: Side) -> Final:
    try:
        return run(program, side)
    except Exception as exc:  # noqa: BLE001 (an exception is a finding: report it beside the other's outcome)
        return Final({}, {}, {}, None, -1, [], error=f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------- (1) against Lightning
def check_against_lightning(program: Program) -> list[str]:
    assert program.poison is None
    ref = reference(program)
    return lightning_problems(program, ref, _safe_run(program, ref.ours), _safe_run(program, ref.side))


def lightning_problems(program: Program, ref: Reference, ours: Final, theirs: Final) -> list[str]:
    """How our run of ``program`` differs from the reference run ``theirs``."""
    if theirs.error is not None or ours.error is not None:
        if theirs.error is not None and ours.error is not None:
            return []  # both refuse the program (e.g. a combination Lightning does not run): nothing to compare
        return [f"error: ours {ours.error!r}, Lightning's {theirs.error!r}"]
    problems = _stream_problems(program, theirs, "Lightning") + _stream_problems(program, ours, "ours")
    if problems:
        return problems
    state_ours, state_theirs = _state(ours), _state(theirs)
    if not ref.exact:
        # 16-bit weights and state against Lightning's fp32 (or fp32 guarded pieces against 16-bit ones)
        state_ours, state_theirs = _float(state_ours), _float(state_theirs)
    tol = TOLERANCE.get(ref.tolerance or "", (0.0, 0.0))
    problems += compare(state_ours, state_theirs, "state", ref.exact, tol)
    problems += compare(ours.global_step, theirs.global_step, "global_step")
    problems += compare((ours.steps, ours.skipped), (ours.global_step, 0), "plugin.stats (steps, skipped)")
    return problems


def _float(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _float(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_float(v) for v in state)
    if isinstance(state, torch.Tensor) and state.is_floating_point():
        return state.float()
    return state


# ---------------------------------------------------------------------------------------------- (2) a skipped step
def check_skip(program: Program, side: Optional[Side] = None) -> list[str]:
    """The poisoned program against its control (the same program without the poisoned window), both ours
    (``side``: other plugin arguments, for the oracle's own tests)."""
    assert program.poison is not None
    control = program.without_poison()
    # fp16 modes: a skip halves the loss scale, after which the poisoned run computes its 16-bit gradients at
    # another scale than the control (a gradient element that is subnormal in fp16 then keeps other bits: one
    # element of a momentum buffer 5e-10 off, by design). With hysteresis=2 one skip leaves the scale where it was,
    # and the runs must agree to the bit, the scale included.
    side = side or Side.ours(program, **({"hysteresis": 2} if program.mode in SCALED else {}))
    poisoned, clean = _safe_run(program, side), _safe_run(control, side)
    if poisoned.error is not None or clean.error is not None:
        return [f"error: poisoned {poisoned.error!r}, control {clean.error!r}"]
    problems = _stream_problems(program, poisoned, "poisoned") + _stream_problems(control, clean, "control")
    if problems:
        return problems
    problems += compare(_state(poisoned), _state(clean), "state")
    problems += compare(poisoned.masters, clean.masters, "masters")
    scale = [None if f.scaler is None else f.scaler["scale"] for f in (poisoned, clean)]
    problems += compare(scale[0], scale[1], "loss scale")
    problems += compare((clean.steps, clean.skipped), (clean.global_step, 0), "control plugin.stats (steps, skipped)")
    problems += compare((poisoned.steps, poisoned.skipped), (clean.global_step + 1, 1),
                        "poisoned plugin.stats (steps, skipped)")
    return problems


# ---------------------------------------------------------------------------------------------- (3) same-value writes
def check_same_value_writes(program: Program) -> list[str]:
    """A program whose writes change no value against the same program without them, both ours."""
    assert program.poison is None and program.writes
    side = Side.ours(program)
    written, plain = _safe_run(program, side), _safe_run(dataclasses.replace(program, writes=()), side)
    if written.error is not None or plain.error is not None:
        return [f"error: with the writes {written.error!r}, without {plain.error!r}"]
    problems = _stream_problems(program, written, "with the writes") + _stream_problems(program, plain, "without")
    if problems:
        return problems
    problems += compare(_state(written), _state(plain), "state")
    problems += compare(written.masters, plain.masters, "masters")
    problems += compare((written.steps, written.skipped), (plain.steps, plain.skipped), "plugin.stats (steps, skipped)")
    return problems
