"""The oracles: what a program's final state under MPPlugin must equal.

(1) :func:`check_against_lightning`, a program without a poisoned step: the same program under Lightning's own
    plugin of the same mode. Bit-identical where the design promises it (:func:`reference`); where the design
    computes differently on purpose, within the mode's own rounding noise (:data:`NOISE_FACTOR`, :data:`NOISE_FLOOR`).
(2) :func:`check_skip`, a program with a poisoned step: the same program without it (the control), bit-identical
    (fp16 modes with hysteresis=2: the loss scale stays through one skip; the scaler's trackers aside).
(3) :func:`check_same_value_writes`, a program whose writes leave every value as it was (a wide clamp through
    ``.data``, a copy or a ``load_state_dict`` of the same values): the same program without the writes, bit for
    bit, master weights and Kahan compensation included (the tolerance of (1) cannot see their low bits).
(4) :func:`check_entry_points`, a program with validate or resume entries: the same program without its validates
    and with each resume merged into the fit before it, bit for bit (a validate changes nothing, a resume goes on
    exactly), but for the buffers a checkpoint does not hold (non-persistent ones start afresh after a resume). A
    fit again on the same Trainer stays a boundary: Lightning calls ``configure_optimizers`` again there (a fresh
    optimizer and scheduler), under its own plugins too.

Each returns a list of problems (empty: the program passed); ``stream`` problems mean the generator itself went
wrong (the batches a run saw are not the ones the program meant), never the plugin.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .programs import SCALED, Entry, Program
from .runner import LIGHTNING_PRECISION, Final, Side, run

#: A comparison that cannot be bit for bit (the design computes differently from the oracle on purpose) allows each
#: floating tensor, and each float, to differ from the oracle's by the larger of
#:   NOISE_FLOOR: an Adam step moves an element by about lr (0.01 here) whatever its gradient, so rounding that flips
#:       the sign of a gradient near 0 moves the element by 2 lr (seen: 0.024 at most; twice would be 0.04);
#:   NOISE_FACTOR x the mode's rounding noise there: how far the same program moves between two Lightning runs, one
#:       at the mode's 16-bit precision and one in fp32 (``Reference.noise``), over the tensor's group
#:       (:func:`noise_group`). A fixed tolerance cannot serve alone: a BatchNorm over a batch of 4 behind a 16-bit
#:       matmul turns rounding into differences of 0.3 (in Lightning's bf16-mixed as much as in ours).
#: Over 550 drawn programs whose comparison is not exact, the largest deviation was half of what this allows; a write
#: the plugin loses (0.2 and more) is outside it (``test_the_lightning_oracle_sees_a_lost_write``).
NOISE_FLOOR = 0.05
NOISE_FACTOR = 6.0


@dataclass(frozen=True)
class Reference:
    """The oracle run of a program without a poisoned step, and how our run compares with it."""

    side: Side
    ours: Side
    exact: bool = True
    why: str = "the same mode, bit for bit"
    #: two runs whose distance is the mode's rounding noise (for comparisons that are not exact), of ``noise_program``
    #: (the program itself when None)
    noise: tuple[Side, ...] = ()
    noise_program: Optional[Program] = None


def reference(program: Program) -> Reference:
    """Which Lightning run a program under MPPlugin must match, and how closely.

    * fp32: Lightning's 32-true, bit for bit (the guards run fp32 modules in fp32: nothing changes).
    * bf16/fp16 autocast: Lightning's bf16-mixed/16-mixed (same initial loss scale), bit for bit where no FP32
      guard hooks a module of the program (guards off, or no norm and no loss module); otherwise (the guards run
      norms and the loss module in fp32 where Lightning runs them in 16 bits) within the mode's noise.
    * bf16-true/fp16-true with ``master_weights="none"``: Lightning's bf16-true/16-true, the same rule for guards.
      Lightning's 16-true scales no loss: ours starts its dynamic scale at 1 there (it would grow only after 2000
      clean steps), so that both compute the same 16-bit gradients (with a scale of 256 a gradient element that is
      subnormal in fp16 keeps bits that Lightning's loses: a difference of one fp16 ulp, by design).
    * bf16/fp16 autocast, gradient clipping with a fused optimizer: Lightning's mixed plugin refuses to clip
      gradients a fused optimizer unscales itself, MPPlugin unscales them first: against 32-true within the noise
      of the mode measured on the same program with a foreach AdamW (which Lightning clips).
    * bf16-true/fp16-true with master weights (fp32, Kahan): Lightning keeps none by design: against 32-true within
      the noise of Lightning's autocast of the same 16-bit dtype (fp32 weights, 16-bit compute: what master weights
      give; with foreach AdamW where the program clips a fused one).
    """
    ours = Side.ours(program)
    fp32 = Side(lightning="32-true")
    # Lightning's mixed plugin refuses to clip the gradients of a fused optimizer: its noise runs take foreach AdamW
    refused = program.clip is not None and program.optimizer == "adamw-fused"
    runnable = dataclasses.replace(program, optimizer="adamw-foreach") if refused else None
    if program.mode in ("bf16", "fp16") and refused:
        return Reference(fp32, ours, exact=False, why="32-true within the noise (Lightning refuses the program)",
                         noise=(Side(lightning=LIGHTNING_PRECISION[program.mode]), fp32), noise_program=runnable)
    if program.masters not in (None, "none"):
        autocast = LIGHTNING_PRECISION["bf16" if program.mode == "bf16-true" else "fp16"]
        return Reference(fp32, ours, exact=False, why="32-true within the noise (master weights)",
                         noise=(Side(lightning=autocast), fp32), noise_program=runnable)
    theirs = Side(lightning=LIGHTNING_PRECISION[program.mode])
    if program.mode == "fp16-true":
        ours = Side.ours(program, init_scale=1.0)
    if program.mode == "fp32" or program.guards == "off" or not program.guarded_modules:
        return Reference(theirs, ours)
    return Reference(theirs, ours, exact=False, why="the same mode within the noise (FP32 guards)",
                     noise=(theirs, fp32))


# ---------------------------------------------------------------------------------------------- comparisons
def _describe(a: torch.Tensor, b: torch.Tensor, note: str = "") -> str:
    diff = (a.double() - b.double()).abs()
    finite = diff[diff.isfinite()]
    worst = f"{finite.max().item():.3g}" if finite.numel() else "nan"
    return (f"{int((diff != 0).logical_or(diff.isnan()).sum())} of {a.numel()} elements differ (max |diff| {worst}"
            f"{note}; ours {a.flatten()[:3].tolist()} vs {b.flatten()[:3].tolist()})")


def _tensor_problem(a: torch.Tensor, b: torch.Tensor, allowed: Optional[float]) -> Optional[str]:
    if allowed is None:  # bit for bit
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if torch.equal(a, b):
            return None
        if a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()):
            return None
        return _describe(a, b)
    if a.shape != b.shape:
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    x, y = a.double(), b.double()
    if not torch.equal(x.isnan(), y.isnan()):
        return _describe(a, b, "; NaN in other places")
    if bool(((x - y).abs() <= allowed).logical_or(x.isnan()).all()):
        return None
    return _describe(a, b, f" > {allowed:.3g} allowed")


def compare(a: Any, b: Any, where: str, allow: Optional[Callable[[str], float]] = None) -> list[str]:
    """Every difference between nested dicts/lists/tensors/numbers ``a`` (ours) and ``b`` (the oracle): bit for bit,
    or, with ``allow``, within ``allow(where)`` of each other (floating tensors and floats)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [p for k in a for p in compare(a[k], b[k], f"{where}.{k}", allow)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in compare(x, y, f"{where}[{i}]", allow)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        floating = a.is_floating_point() and b.is_floating_point()
        problem = _tensor_problem(a, b, allow(where) if allow is not None and floating else None)
        return [] if problem is None else [f"{where}: {problem}"]
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return []
        if allow is not None:
            return [] if abs(a - b) <= allow(where) else [f"{where}: {a!r} vs {b!r} (> {allow(where):.3g} allowed)"]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def distances(a: Any, b: Any, where: str, out: dict[str, float]) -> dict[str, float]:
    """The largest difference of each floating tensor (and float) between ``a`` and ``b``, by path (as ``compare``
    names them); NaNs aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() & b.keys():
            distances(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            distances(x, y, f"{where}[{i}]", out)
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.is_floating_point():
        diff = (a.double() - b.double()).abs()
        diff = diff[diff.isfinite()]
        out[where] = float(diff.max()) if diff.numel() else 0.0
    elif isinstance(a, float) and isinstance(b, float) and math.isfinite(a - b):
        out[where] = abs(a - b)
    return out


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
    runs: dict[Side, Final] = {}  # (the reference run is often one of the noise runs)

    def run_of(p: Program, side: Side) -> Final:
        if p is not program:
            return _safe_run(p, side)
        if side not in runs:
            runs[side] = _safe_run(p, side)
        return runs[side]

    ours, theirs = run_of(program, ref.ours), run_of(program, ref.side)
    noise = [run_of(ref.noise_program or program, side) for side in ref.noise]
    return lightning_problems(program, ref, ours, theirs, noise)


def lightning_problems(program: Program, ref: Reference, ours: Final, theirs: Final,
                       noise: Optional[list[Final]] = None) -> list[str]:
    """How our run of ``program`` differs from the reference run ``theirs`` (``noise``: the runs of ``ref.noise``)."""
    if theirs.error is not None or ours.error is not None:
        if theirs.error is not None and ours.error is not None:
            return []  # both refuse the program (e.g. a combination Lightning does not run): nothing to compare
        return [f"error: ours {ours.error!r}, Lightning's {theirs.error!r}"]
    problems = _stream_problems(program, theirs, "Lightning") + _stream_problems(program, ours, "ours")
    if problems:
        return problems
    state_ours, state_theirs = _state(ours), _state(theirs)
    allow = None
    if not ref.exact:
        # 16-bit weights and state against Lightning's fp32 (or fp32 guarded pieces against 16-bit ones)
        state_ours, state_theirs = _float(state_ours), _float(state_theirs)
        allow = _allowance(noise or [])
    problems += compare(state_ours, state_theirs, "state", allow)
    problems += compare(ours.global_step, theirs.global_step, "global_step")
    problems += compare((ours.steps, ours.skipped), (ours.global_step, 0), "plugin.stats (steps, skipped)")
    if problems:
        problems.append(f"(the oracle: Lightning's {ref.side.lightning}, {ref.why})")
    return problems


def noise_group(where: str) -> str:
    """The tensors whose noise is measured together: all parameters, each optimizer-state entry over the parameters
    (``exp_avg``, ``momentum_buffer``, ...), each buffer, each list of floats. (One tensor's own noise is no measure:
    Adam moves every element by about ``lr`` whatever its gradient, so rounding that flips the sign of a gradient
    near 0 moves an element by 2 lr, in one run's tensor or another's.)"""
    if where.startswith("state.params."):
        return "state.params"
    state = re.fullmatch(r"(state\.optimizer\.state)\.\d+\.(.+)", where)
    if state:
        return f"{state.group(1)}.{state.group(2)}"
    return re.sub(r"\[\d+\]$", "", where)


def noise_by_group(noise: list[Final]) -> dict[str, float]:
    errors = [f.error for f in noise if f.error is not None]
    if len(noise) != 2 or errors:
        raise AssertionError(f"the noise runs of the oracle failed: {errors}")
    groups: dict[str, float] = {}
    for where, d in distances(_float(_state(noise[0])), _float(_state(noise[1])), "state", {}).items():
        group = noise_group(where)
        groups[group] = max(groups.get(group, 0.0), d)
    return groups


def _allowance(noise: list[Final]) -> Callable[[str], float]:
    """``allow`` for :func:`compare`: NOISE_FLOOR, or NOISE_FACTOR x the distance of the two noise runs there."""
    groups = noise_by_group(noise)
    return lambda where: max(NOISE_FLOOR, NOISE_FACTOR * groups.get(noise_group(where), 0.0))


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


# ---------------------------------------------------------------------------------------------- (4) entry points
def merged_entries(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """The entry points without validates, each resume's steps added to the fit before it."""
    merged: list[Entry] = []
    for entry in entries:
        if entry.kind == "resume":
            merged[-1] = Entry("fit", merged[-1].steps + entry.steps)
        elif entry.kind == "fit":
            merged.append(entry)
    return tuple(merged)


def check_entry_points(program: Program) -> list[str]:
    """A program with validate or resume entries against the same program without them, both ours."""
    assert program.poison is None and merged_entries(program.entries) != program.entries
    side = Side.ours(program)
    merged = dataclasses.replace(program, entries=merged_entries(program.entries))
    staged, whole = _safe_run(program, side), _safe_run(merged, side)
    if staged.error is not None or whole.error is not None:
        return [f"error: as drawn {staged.error!r}, merged {whole.error!r}"]
    problems = _stream_problems(program, staged, "as drawn") + _stream_problems(merged, whole, "merged")
    if problems:
        return problems
    state_staged, state_whole = _state(staged), _state(whole)
    for state in (state_staged, state_whole):
        del state["validation losses"]
        if program.ema == "non-persistent" and any(e.kind == "resume" for e in program.entries):
            del state["buffers"]["ema"]  # not in the checkpoint: a resumed module starts it afresh
    problems += compare(state_staged, state_whole, "state")
    problems += compare(staged.masters, whole.masters, "masters")
    problems += compare(staged.scaler, whole.scaler, "loss scaler")
    problems += compare((staged.steps, staged.skipped), (whole.steps, whole.skipped), "plugin.stats (steps, skipped)")
    return problems
