"""``python -m lightning_mp compare``: which precision should this model use, and what does it cost?

Trains your LightningModule (or the built-in byte-level GPT-mini, sized to the device) for N steps under each
precision mode, from the same initial weights and the same batches, with the modes taking turns round by round,
and prints one table (format | memory | speed | stability) and a recommendation with its confidence: the
``MPPlugin`` line and the YAML block to paste.

Examples::

    python -m lightning_mp compare                                   # built-in GPT-mini, sized to the device
    python -m lightning_mp compare --model mypkg.models:MyModule --model.width 512 --modes fp32 bf16 fp16
    python -m lightning_mp compare --config train.yaml               # your model, data and Trainer settings
    python -m lightning_mp compare --json out.json --plot out.png
    python -m lightning_mp compare --modes fp32 bf16-true bf16-true:kahan bf16-true:stochastic bf16-true:none

A mode is a precision (``bf16``, ``fp16``, ``bf16-true``, ...; Lightning's strings are accepted as aliases),
optionally followed by ``:<master weights>`` for the true-half modes (``bf16-true:kahan`` runs
``MPPlugin("bf16-true", master_weights="kahan")``) and ``bf16-states`` for Adam's moments in bf16
(``bf16:bf16-states``, ``bf16-true:kahan+bf16-states``: ``optimizer_states="bf16"``, a row beside the mode's own, to
see the memory it saves), or ``lightning:<precision>`` for Lightning's own plugin as a baseline (never recommended).

How it measures (:mod:`lightning_mp.tools.compare_engine`), how it decides (:mod:`lightning_mp.tools.compare_stats`),
what it reads from the flags and a config (:mod:`lightning_mp.tools.compare_setup`) and what it prints
(:mod:`lightning_mp.tools.compare_report`) are documented in those modules.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch

from lightning_mp.tools import compare_report as report
from lightning_mp.tools import program_name
from lightning_mp.tools.compare_engine import Job, ModeResult, Schedule, _count_items, run_jobs
from lightning_mp.tools.compare_setup import (  # noqa: F401 - BUILTIN_DATAMODULES: kept for earlier callers
    BUILTIN_DATAMODULES,
    BUILTIN_MODELS,
    InputError,
    find_batch_size,
    load_class,
    make_spec,
    plugin_kwargs_for,
    set_batch_size,
)
from lightning_mp.tools.compare_stats import (
    BF16_STATES,
    MIN_SPEEDUP,
    Candidate,
    Decision,
    batch_probe,
    decide,
    safety_rank,
    speedup,
    split_mode,
)

#: thresholds of the verdict and of the recommendation
DRIFT_TOLERANCE = 0.05  # final loss within 5 % of fp32's
MAX_SKIP_RATE = 0.10  # at most 10 % of the steps skipped
MIN_HEADROOM = 1.0  # fp16 modes are unsafe when activations come within 2**1 of fp16's largest value
FP16_FAMILY = ("fp16", "fp16-true", "lightning:16-mixed", "lightning:16-true", "lightning:16")

DEFAULT_STEPS = 30
DEFAULT_WARMUP = 4
DEFAULT_ROUNDS = 8


# --------------------------------------------------------------------------------------------- choosing
def reference_row(results: list[ModeResult]) -> Optional[ModeResult]:
    """fp32's row when it ran, else the numerically safest row that ran (not a Lightning baseline)."""
    ran = [r for r in results if r.ran and not r.mode.startswith("lightning:")]
    fp32 = next((r for r in ran if r.mode == "fp32"), None)
    return fp32 or (min(ran, key=lambda r: safety_rank(r.mode)) if ran else None)


def assess(results: list[ModeResult], drift_tolerance: float = DRIFT_TOLERANCE,
           max_skip_rate: float = MAX_SKIP_RATE, min_headroom: float = MIN_HEADROOM) -> None:
    """Fill each row's loss drift, memory share and speed-up against the reference (fp32), and turn 'ok' into
    'unstable' where drift, skips or (fp16 modes) the reference's activation headroom are out of bounds."""
    reference = next((r for r in results if r.mode == "fp32" and r.ran and r.final_loss is not None), None)
    base = reference_row(results)
    headroom_ref = next((r for r in (reference, base) if r is not None and r.act_headroom_bits is not None), None)
    for r in results:
        if not r.ran:
            continue
        if reference is not None and r.final_loss is not None and reference.final_loss:
            r.loss_drift = (r.final_loss - reference.final_loss) / abs(reference.final_loss)
        if base is not None and r is not base:
            if base.peak_mem_mib and r.peak_mem_mib is not None and r.memory_kind == base.memory_kind:
                r.mem_share = r.peak_mem_mib / base.peak_mem_mib
            ratio = speedup(base.round_ms, r.round_ms, base.times_ms, r.times_ms) if r.step_ms else None
            if ratio is None and base.step_ms and r.step_ms:
                r.speedup = base.step_ms / r.step_ms
            elif ratio is not None:
                r.speedup, r.speedup_lo, r.speedup_hi = ratio.median, ratio.lo, ratio.hi
        elif r is base and r.peak_mem_mib:
            r.mem_share = 1.0
        problems = []
        lower = r.loss_drift is not None and r.loss_drift < -drift_tolerance
        if r.loss_drift is not None and r.loss_drift > drift_tolerance:
            problems.append(f"final loss {r.loss_drift:+.1%} from fp32 (tolerance {drift_tolerance:.0%})")
        if r.steps and r.skipped_steps is not None and r.skipped_steps / r.steps > max_skip_rate:
            problems.append(f"{r.skipped_steps}/{r.steps} steps skipped (tolerance {max_skip_rate:.0%})")
        if r.mode.partition(":")[0] in FP16_FAMILY or r.mode in FP16_FAMILY:
            seen = headroom_ref if headroom_ref is not None and headroom_ref is not r else None
            bits = seen.act_headroom_bits if seen is not None else None
            if seen is not None and bits is not None and bits < min_headroom:
                where = f" in {seen.act_layer}" if seen.act_layer else ""
                top = f"{seen.act_absmax:.3g}" if seen.act_absmax is not None else "close to 65504"
                problems.append(
                    f"fp16 is unsafe for this model: under {seen.mode} the activations reach {top}{where},"
                    f" {bits:.1f} bits of headroom below fp16's largest value 65504 (at least {min_headroom:g}"
                    " needed); a larger batch or longer run overflows, the loss turns inf and steps are skipped:"
                    " prefer bf16")
        if problems and r.status == "ok":
            r.status, r.reason = "unstable", "; ".join(problems)
        elif lower and r.status == "ok":
            # lower precision does not learn faster: a lower loss is another trajectory, worth a word, not a failure
            r.status, r.reason = "differs", _lower_loss_reason(r, drift_tolerance)


def _lower_loss_reason(r: ModeResult, drift_tolerance: float) -> str:
    reason = (
        f"final loss {r.loss_drift:+.1%} from fp32 (tolerance {drift_tolerance:.0%}): lower, so it took another path,"
        " not a better one; it is not picked until it follows fp32"
    )
    if r.mode.partition(":")[0] == "fp8":
        reason += (
            " (FP8 with delayed scaling takes each tensor's scale from earlier steps' largest values: when an early"
            " loss spike makes activations and gradients outgrow them, they saturate at FP8's largest value, which"
            " clips the spike; fp8={'recipe': 'current'} scales each tensor by its own largest value and follows"
            " bf16)"
        )
    return reason


def candidates(results: list[ModeResult], drift_tolerance: float = DRIFT_TOLERANCE,
               max_skip_rate: float = MAX_SKIP_RATE) -> list[ModeResult]:
    """The rows a recommendation may pick: ran 'ok', timed, within the thresholds, not a Lightning baseline.

    Unknown drift only qualifies when no fp32 row exists.
    """
    has_reference = any(r.mode == "fp32" and r.ran for r in results)
    out = []
    for r in results:
        if r.status != "ok" or r.step_ms is None or r.mode.startswith("lightning:"):
            continue
        if r.loss_drift is None and has_reference and r.mode != "fp32":
            continue
        if r.loss_drift is not None and abs(r.loss_drift) > drift_tolerance:
            continue
        if r.steps and r.skipped_steps is not None and r.skipped_steps / r.steps > max_skip_rate:
            continue
        out.append(r)
    return out


def decide_results(results: list[ModeResult], drift_tolerance: float = DRIFT_TOLERANCE,
                   max_skip_rate: float = MAX_SKIP_RATE, min_speedup: float = MIN_SPEEDUP) -> Decision:
    """The decision of :func:`lightning_mp.tools.compare_stats.decide` over the qualifying rows."""
    rows = candidates(results, drift_tolerance, max_skip_rate)
    return decide([Candidate(r.mode, r.round_ms or [r.step_ms], r.times_ms, r.peak_mem_mib, r.step_ms) for r in rows],
                  min_speedup)


def choose(results: list[ModeResult], drift_tolerance: float = DRIFT_TOLERANCE, max_skip_rate: float = MAX_SKIP_RATE,
           min_speedup: float = MIN_SPEEDUP) -> tuple[Optional[ModeResult], str]:
    """The recommended row and why: the numerically safest mode that is not clearly slower than the fastest.

    See :mod:`lightning_mp.tools.compare_stats` for the rule; rows must qualify as in :func:`candidates`.
    """
    decision = decide_results(results, drift_tolerance, max_skip_rate, min_speedup)
    if decision.mode is None:
        return None, "no mode ran within the thresholds; keep fp32 and look at the unstable rows"
    best = next(r for r in results if r.mode == decision.mode)
    return best, report.explain(decision, results, None, noisy=any(r.noisy for r in results))


def recommendation_text(best: Optional[ModeResult], reason: str, confidence: Optional[str] = None) -> str:
    return report.recommendation_text(best, reason, confidence)


# --------------------------------------------------------------------------------------------- mode names
def parse_mode(value: str) -> str:
    """Check one mode of ``--modes`` and return its canonical spelling.

    ``"<precision>"`` (any name or alias :func:`lightning_mp.modes.parse_precision` accepts),
    ``"<true-half precision>:<master weights>"`` (``"bf16-true:kahan"``, ``"16-true:none"``; the options of
    ``MPPlugin(master_weights=...)``), either with ``bf16-states`` among its options, joined by ``+``
    (``"bf16:bf16-states"``, ``"bf16-true:kahan+bf16-states"``: ``optimizer_states="bf16"``), or
    ``"lightning:<precision>"`` (passed to Lightning unchecked).

    Raises:
        ValueError: naming the bad value, the accepted ones and the fix.
    """
    from lightning_mp.settings import MASTER_WEIGHT_KINDS, parse_master_weights
    from lightning_mp.modes import MODES, parse_precision

    if value.startswith("lightning:"):
        return value
    base, sep, option = value.partition(":")
    precision = parse_precision(base)
    if not sep:
        return precision
    options = [o.strip().lower() for o in option.split("+") if o.strip()]
    if BF16_STATES in options:  # Adam's moments in bf16 (any mode whose optimizer steps fp32 values)
        rest = [o for o in options if o != BF16_STATES]
        if len(rest) > 1:
            raise ValueError(f"mode {value!r}: one master-weight option at most beside {BF16_STATES!r}.")
        master = parse_mode(f"{precision}:{rest[0]}").partition(":")[2] if rest else None
        if master in ("none", "optimizer"):
            raise ValueError(
                f"mode {value!r}: {BF16_STATES!r} holds the moments of an optimizer that steps fp32 values;"
                f" master_weights={master!r} leaves them to the optimizer. Use '{precision}:{BF16_STATES}'."
            )
        return f"{precision}:{master + '+' if master else ''}{BF16_STATES}"
    accepted = ", ".join(repr(k) for k in MASTER_WEIGHT_KINDS)
    true_half = [name for name, mode in MODES.items() if mode.true_half]
    if precision not in true_half:
        raise ValueError(
            f"mode {value!r}: a master-weight option (':{option}') applies to half-precision weights only."
            f" Use {' or '.join(repr(n + ':' + option) for n in true_half)}, or {precision!r} without it."
        )
    try:
        master = parse_master_weights(option)
    except ValueError:
        raise ValueError(
            f"mode {value!r}: unknown master-weight option {option!r}. Accepted: {accepted}"
            f" (e.g. '{precision}:kahan'; '{precision}' alone means '{precision}:fp32')."
        ) from None
    return f"{precision}:{master}"


def default_modes(device_type: str) -> list[str]:
    import lightning_mp.modes as modes

    return list(modes.MODES)


def _unsupported_reason(mode: str, device_type: str) -> Optional[str]:
    from lightning_mp.modes import resolve_mode

    if mode.startswith("lightning:"):
        return None
    mode = split_mode(mode)[0]  # a master-weight option changes nothing the hardware needs
    if mode == "tf32" and device_type != "cuda":
        return "TF32 needs an NVIDIA GPU (Ampere or newer); elsewhere it is fp32"
    if mode == "tf32" and torch.cuda.get_device_capability()[0] < 8:
        return "TF32 needs compute capability 8.0 or newer"
    try:
        resolve_mode(mode, device_type)
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return None


# --------------------------------------------------------------------------------------------- one mode alone
class _PeakMemory:
    """Process-level peak memory (CUDA max allocated, or the CPU process's peak RSS) for callers that run one mode
    per process or per measurement (``benchmarks/run_all.py``). ``compare`` itself measures per mode instead (see
    :mod:`lightning_mp.tools.compare_engine`): the CPU's RSS only grows with run order."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def reset(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            try:  # Linux: writing 5 resets the process's peak resident set size (VmHWM)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    def peak_mib(self) -> Optional[float]:
        if self.device_type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mode(
    mode: str,
    make_module: Callable[[], Any],
    initial_state: Optional[dict[str, torch.Tensor]],
    steps: int,
    device_type: str,
    seed: int = 0,
    make_datamodule: Optional[Callable[[], Any]] = None,
    progress: bool = True,
    warmup: Optional[int] = None,
) -> ModeResult:
    """Train ``steps`` optimizer steps under ``MPPlugin(mode)`` alone; any failure lands in the returned row.

    The engine of ``compare`` with one participant: ``warmup`` untimed steps (default ``min(3, steps // 4)``), the
    rest timed; ``step_ms`` is their median, ``step_iqr_ms`` their IQR, ``peak_mem_mib`` per mode as in ``compare``.
    ``mode`` is spelt as :func:`parse_mode` accepts (``"lightning:<precision>"`` runs Lightning's own plugin).
    """
    del progress  # a single mode shows no bar
    result = ModeResult(mode=mode)
    if not mode.startswith("lightning:"):
        try:
            mode = parse_mode(mode)
        except ValueError as err:
            result.status, result.reason = "failed", str(err)
            return result
    why = _unsupported_reason(mode, device_type)
    if why is not None:
        result.status, result.reason = "unsupported", why
        return result
    warm = min(3, steps // 4) if warmup is None else min(warmup, max(0, steps - 1))
    job = Job(mode, mode, lambda: (make_module(), make_datamodule() if make_datamodule else None))
    [out] = run_jobs([job], Schedule(steps, warm, 1), device_type, seed, initial_state, progress=False)
    return out


# --------------------------------------------------------------------------------------------- CLI
DESCRIPTION = """\
Which precision should this model use, and what does it cost? Trains the model under each precision mode for
--steps steps, from the same weights and batches, the modes taking turns round by round, and prints a table
(format | memory | speed | stability) and a recommendation with its confidence."""

EPILOG = """\
constructor and Trainer arguments (repeatable; values are YAML: 512, true, [1, 2], null; they override --config):
  --model.NAME VALUE    an argument of the model's constructor, e.g. --model.width 512 (checked against the
                        constructor; default: the class's own, or the built-in model's size for the device)
  --data.NAME VALUE     an argument of the data module's constructor, e.g. --data.batch_size 64 (needs
                        --datamodule or a data section in --config; default: the class's own)
  --trainer.NAME VALUE  a Trainer argument of your setup, e.g. --trainer.accumulate_grad_batches 4 (kept:
                        accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm, deterministic,
                        benchmark, detect_anomaly, limit_train_batches, ...; the rest is reported as left out)

exit status: 0 a recommendation was made; 1 no mode ran within the thresholds (or none ran); 2 bad input.
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <flag>: <what is wrong>``, exit status 2."""

    def error(self, message: str) -> Any:
        _fail(message)


def _fail(message: str) -> Any:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{program_name()} compare", description=DESCRIPTION,
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    what = p.add_argument_group("what to train")
    what.add_argument("--model", default=None, metavar="SPEC",
                      help="'package.module:ClassName' of a LightningModule, or a built-in name ("
                           + ", ".join(BUILTIN_MODELS) + "; the examples.* ones from the root of a source checkout)"
                           " (default: gpt-mini, sized to the device: small on the"
                           " CPU, width 2048 on a GPU with 40 GB or more; or the model's class_path in --config)")
    what.add_argument("--model-args", default="{}", metavar="JSON",
                      help="the model's constructor arguments as one JSON object, e.g. '{\"width\": 512}' (the older"
                           " spelling of --model.NAME VALUE) (default: {})")
    what.add_argument("--datamodule", default=None, metavar="SPEC",
                      help="'package.module:ClassName' of a LightningDataModule (default: none, the model's"
                           " train_dataloader; the built-in examples bring theirs)")
    what.add_argument("--datamodule-args", default="{}", metavar="JSON",
                      help="the data module's constructor arguments as one JSON object (default: {})")
    what.add_argument("--config", default=None, metavar="YAML",
                      help="a Lightning CLI config as 'python train.py fit --config' reads it (trainer, model, data,"
                           " optimizer, lr_scheduler, seed_everything): the model and data are built from it, and"
                           " its accumulation, clipping, batch size and MPPlugin settings are kept (default: none)")
    how = p.add_argument_group("what to run")
    how.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                     help="modes to run, by spaces or commas (default: every mode; those this hardware cannot run are"
                          " reported as such);"
                          " 'bf16-true:kahan' etc. pick the master weights of a true-half mode (fp32, kahan,"
                          " stochastic, none); ':bf16-states' holds Adam's moments in bf16 ('bf16:bf16-states',"
                          " 'bf16-true:kahan+bf16-states'); 'lightning:bf16-mixed' etc. add Lightning's own plugins"
                          " as baselines")
    how.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                     help="optimizer steps per mode, warm-up included (default: %(default)s)")
    how.add_argument("--warmup", type=int, default=None, metavar="N",
                     help=f"untimed steps at the start of each mode, fewer than --steps (default: {DEFAULT_WARMUP},"
                          " fewer where --steps is small)")
    how.add_argument("--rounds", type=int, default=None, metavar="N",
                     help="timed rounds; in each, every mode in turn runs (steps - warmup) / rounds steps; at most"
                          f" steps - warmup (default: {DEFAULT_ROUNDS}, fewer where there are fewer timed steps)")
    how.add_argument("--seed", type=int, default=None, metavar="N",
                     help="seed of the initial weights and the batch order, the same in every mode (default: 0, or"
                          " the config's seed_everything)")
    how.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                     help="where to run: auto is cuda when a GPU is available, else cpu (default: %(default)s)")
    how.add_argument("--no-batch-probe", action="store_true",
                     help="skip the batch probe: one mode also run at half the batch, to tell a model too small"
                          " for precision to matter (overhead- or launch-bound) (default: the probe runs when the"
                          " model or data module has a batch_size)")
    decide_group = p.add_argument_group("how to decide")
    decide_group.add_argument("--drift-tolerance", type=float, default=DRIFT_TOLERANCE, metavar="F",
                              help="a mode is unstable when its final loss lies more than this share above fp32's;"
                                   " one as far below it differs (another path, not picked)"
                                   " (default: %(default)s)")
    decide_group.add_argument("--max-skip-rate", type=float, default=MAX_SKIP_RATE, metavar="F",
                              help="a mode is unstable when more than this share of its steps were skipped"
                                   " (default: %(default)s)")
    decide_group.add_argument("--min-speedup", type=float, default=MIN_SPEEDUP, metavar="X",
                              help="a less safe mode wins only when it is at least this many times faster, at the"
                                   " lower end of its 95 %% interval; otherwise the modes tie and the safer one is"
                                   " recommended (default: %(default)s)")
    decide_group.add_argument("--min-headroom", type=float, default=MIN_HEADROOM, metavar="BITS",
                              help="fp16 modes are unstable when fp32's activations come within 2**BITS of fp16's"
                                   " largest value, 65504 (default: %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="PATH", help="also write the results to this JSON file"
                                                                  " (default: none)")
    out.add_argument("--plot", default=None, metavar="PATH",
                     help="also draw step time, memory and loss curves into this PNG (needs matplotlib)"
                          " (default: none)")
    out.add_argument("--no-progress", action="store_true",
                     help="no progress bar (default: a tqdm bar on stderr while the modes run, on a terminal)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    try:
        return _main(args, extras)
    except InputError as err:
        _fail(str(err))
    return 2  # pragma: no cover - _fail exits


def _check_numbers(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise InputError("--steps", f"{args.steps}: use at least 1")
    # a value given is checked against --steps; a default left alone shrinks to fit a short run
    if args.warmup is None:
        args.warmup = min(DEFAULT_WARMUP, args.steps - 1)
    elif args.warmup < 0:
        raise InputError("--warmup", f"{args.warmup}: use 0 or more")
    elif args.warmup >= args.steps:
        raise InputError("--warmup", f"{args.warmup}: must be below --steps ({args.steps}), or no step is timed")
    timed = args.steps - args.warmup
    if args.rounds is None:
        args.rounds = min(DEFAULT_ROUNDS, timed)
    elif args.rounds < 1:
        raise InputError("--rounds", f"{args.rounds}: use at least 1")
    elif args.rounds > timed:
        raise InputError("--rounds", f"{args.rounds}: more rounds than timed steps ({args.steps} steps - "
                                     f"{args.warmup} warm-up = {timed}); use at most that many")
    if args.min_speedup < 1:
        raise InputError("--min-speedup", f"{args.min_speedup}: use 1 or more (1.1: at least 10 % faster)")
    for flag, value in (("--drift-tolerance", args.drift_tolerance), ("--max-skip-rate", args.max_skip_rate)):
        if not value >= 0:
            raise InputError(flag, f"{value}: use 0 or more")
    _check_outputs(args)


def _check_outputs(args: argparse.Namespace) -> None:
    """``--json`` and ``--plot`` are checked before the first step, not after the whole run: a folder that does not
    exist or cannot be written, a path that is a folder, ``--plot`` without matplotlib."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise InputError(flag, f"{path}: a folder; name a file in it")
        if not os.path.isdir(folder):
            raise InputError(flag, f"{path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise InputError(flag, f"{path}: the folder {folder} cannot be written")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("--plot", f"{args.plot}: needs matplotlib (pip install matplotlib)") from None


def _check_timed(args: argparse.Namespace, device_type: str, warmup: Optional[int], rounds: Optional[int]) -> None:
    """Refuse, before anything runs, a run that would time no step: after the warm-up, the step whose memory the CPU
    counts and PrecisionMonitor's steps are untimed, and a short run may have no other (``warmup``/``rounds``: the
    values given, ``None`` where left to their defaults)."""
    schedule = Schedule(args.steps, args.warmup, args.rounds)
    if schedule.timed_steps(device_type, _monitor_every(schedule)):
        return

    def times_a_step(steps: int) -> bool:
        warm = warmup if warmup is not None else min(DEFAULT_WARMUP, steps - 1)
        longer = Schedule(steps, warm, rounds if rounds is not None else min(DEFAULT_ROUNDS, steps - warm))
        return bool(longer.timed_steps(device_type, _monitor_every(longer)))

    enough = next(n for n in range(args.steps + 1, args.steps + 1000) if times_a_step(n))
    monitor_every = _monitor_every(schedule)
    untimed = []
    for i in range(schedule.warmup, schedule.steps):
        why = ["counts the memory on the CPU"] if device_type != "cuda" and i == schedule.memory_step else []
        why += ["gathers PrecisionMonitor's per-layer figures"] if (i + 1) % monitor_every == 0 else []
        untimed.append(f"step {i + 1} {' and '.join(why)}")
    warm = f"{schedule.warmup} warm-up step{'s' if schedule.warmup != 1 else ''}"
    raise InputError("--steps", f"{args.steps}: after {warm} no step is left to time ({'; '.join(untimed)}: not"
                                f" timed), so no speed can be compared; use --steps {enough} or more")


def _main(args: argparse.Namespace, extras: list[str]) -> int:
    warmup, rounds = args.warmup, args.rounds  # as given (None: the default, set to fit --steps)
    _check_numbers(args)
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device", "cuda: CUDA is not available here")
    try:
        # "--modes fp32 bf16" and "--modes fp32,bf16" alike
        named = [m for arg in args.modes or () for m in arg.split(",") if m.strip()]
        modes = [parse_mode(m.strip()) for m in named] if named else default_modes(device_type)
    except ValueError as err:
        raise InputError("--modes", str(err)) from None
    modes = list(dict.fromkeys(modes))  # a mode named twice runs once
    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for message in (".*does not have many workers.*", ".*LeafSpec.*", ".*smaller than the logging interval.*",
                            ".*max_epochs=-1.*", ".*LightningCLI's args parameter.*", ".*seed set to.*"):
                warnings.filterwarnings("ignore", message=message)
            # a mode slow on this CPU (fp16; bf16 without native bf16): the table measures what the warning says
            from lightning_mp.modes import PerformanceWarning

            warnings.filterwarnings("ignore", category=PerformanceWarning)
            spec = make_spec(args.model, args.model_args, args.datamodule, args.datamodule_args, args.config, extras,
                             device_type)
            _check_timed(args, device_type, warmup, rounds)  # before anything trains
            seed = args.seed if args.seed is not None else (spec.seed if spec.seed is not None else 0)
            return _compare(args, spec, device_type, modes, seed)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def _first_model(spec: Any, seed: int) -> tuple[Any, Any]:
    """Build the model once, in the main process: bad arguments fail here, as input errors."""
    from lightning.pytorch import seed_everything
    from lightning.pytorch.utilities.model_helpers import is_overridden

    seed_everything(seed, verbose=False)
    try:
        module, datamodule = spec.build()
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's constructor: its message, on one line
        raise InputError(spec.flag, f"{spec.describe} failed: {type(err).__name__}: {err}") from None
    if datamodule is None and not is_overridden("train_dataloader", module):
        raise InputError("--model", f"{spec.name}: {type(module).__name__} has no train_dataloader(); give it one,"
                                    " or pass --datamodule pkg.mod:DataModule (or a data section in --config)")
    if datamodule is not None and not is_overridden("train_dataloader", datamodule):
        raise InputError("--datamodule", f"{type(datamodule).__name__} has no train_dataloader()")
    return module, datamodule


def _monitor_every(schedule: Schedule) -> int:
    """PrecisionMonitor's logging interval; its steps are not timed. Three times in a run of 15 steps or more;
    else once: at the end of the warm-up if it is longer than half the run, else at the last step."""
    if schedule.steps >= 15:
        return schedule.steps // 3
    if schedule.warmup and 2 * schedule.warmup > schedule.steps:
        return schedule.warmup
    return schedule.steps


def _device_name(device_type: str) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    from lightning_mp.cpu import cpu_capability

    # what decides bf16's speed there: native bf16 (AVX512-BF16, AMX) or none
    return f"CPU ({name}, {torch.get_num_threads()} threads; {cpu_capability().describe()})"


def _load() -> Optional[tuple[float, int]]:
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None


def _compare(args: argparse.Namespace, spec: Any, device_type: str, modes: list[str], seed: int) -> int:
    module, datamodule = _first_model(spec, seed)
    initial_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    batch = find_batch_size(module, datamodule)
    del module, datamodule

    rows: dict[str, ModeResult] = {}
    jobs: list[Job] = []
    for mode in modes:
        why = _unsupported_reason(mode, device_type)
        if why is not None:
            rows[mode] = ModeResult(mode=mode, status="unsupported", reason=why)
        else:
            jobs.append(Job(mode, mode, spec.build, plugin_kwargs=plugin_kwargs_for(mode, spec.plugin_kwargs)))
    probe_job, probe_why = None, None
    runnable = [j.mode for j in jobs if not j.mode.startswith("lightning:")]
    if args.no_batch_probe:
        probe_why = "off"
    elif batch is None:
        probe_why = "neither the model nor the data module has a batch_size to halve"
    elif batch[1] < 2:
        probe_why = f"the batch size is {batch[1]}"
    elif not runnable:
        probe_why = "no mode to probe"
    else:
        probe_mode = next((m for m in ("bf16", "fp32") if m in runnable), runnable[0])
        small = batch[1] // 2
        probe_job = Job(f"{probe_mode} @ batch {small}", probe_mode, spec.build, role="probe",
                        adjust=lambda m, d: set_batch_size(m, d, small),
                        plugin_kwargs=plugin_kwargs_for(probe_mode, spec.plugin_kwargs))
        jobs.append(probe_job)

    schedule = Schedule(args.steps, args.warmup, args.rounds)
    per_round = schedule.per_round()
    monitor_every = _monitor_every(schedule)
    logged = [i for i in range(1, args.steps + 1) if i % monitor_every == 0]
    device_name = _device_name(device_type)
    k = f"{min(per_round)}" if min(per_round) == max(per_round) else f"{min(per_round)}-{max(per_round)}"
    k += " timed step each" if k == "1" else " timed steps each"
    print(f"compare: {spec.name} — {spec.describe}", flush=True)
    print(report.wrap(
        f"on {device_name} · torch {torch.__version__} · {len(jobs)} runs"
        f" ({', '.join(j.label for j in jobs)}), {args.steps} steps each from the same weights and batches:"
        f" {schedule.warmup} warm-up, then {len(per_round)} round{'s' if len(per_round) > 1 else ''} in which the"
        f" runs take turns, {k};"
        f" PrecisionMonitor gathers its per-layer figures on step{'s' if len(logged) > 1 else ''}"
        f" {', '.join(map(str, logged))} (untimed)"), flush=True)
    for note in spec.notes:
        print(report.wrap(f"your setup: {note}", indent="    ", first="  "), flush=True)
    load_before = _load()
    started = time.perf_counter()
    results = run_jobs(jobs, schedule, device_type, seed, initial_state, spec.trainer_kwargs, monitor_every,
                       progress=False if args.no_progress else None)
    elapsed = time.perf_counter() - started
    load_after = _load()
    probe_row = None
    for job, result in zip(jobs, results):
        if job is probe_job:
            probe_row = result
        else:
            rows[job.mode] = result
    ordered = [rows[m] for m in modes]

    assess(ordered, args.drift_tolerance, args.max_skip_rate, args.min_headroom)
    probe = None
    if probe_job is not None and probe_row is not None:
        base = rows[probe_job.mode]
        if not (probe_row.ran and base.ran and probe_row.items_per_step and base.items_per_step):
            probe_why = f"the probe run {probe_row.status}" + (f": {probe_row.reason}" if probe_row.reason else "")
        elif probe_row.items_per_step * 1.5 > base.items_per_step:
            probe_why = "setting batch_size did not change the batch the data loader gives"
        else:
            assert batch is not None  # probe_job: made from it
            probe = batch_probe(probe_job.mode, batch[1], batch[1] // 2, base.round_ms, probe_row.round_ms,
                                base.times_ms, probe_row.times_ms, base.item_name)
            if probe.growth is None or math.isinf(probe.growth.hi):
                probe, probe_why = None, "too few timed steps to tell (use more --steps)"
    decision = decide_results(ordered, args.drift_tolerance, args.max_skip_rate, args.min_speedup)
    reference = reference_row(ordered)
    noisy = any(r.noisy for r in ordered if r.step_ms is not None)
    load = max((x for x in (load_before, load_after) if x is not None), default=None, key=lambda x: x[0])

    print()
    table, notes = report.format_table(ordered, reference.mode if reference else None, decision.mode,
                                       width=report.terminal_width())
    items = next((r for r in ordered if r.items_per_step), None)
    size = f"{items.items_per_step:,} {items.item_name} a step" if items else "steps"
    print(report.wrap(f"{spec.name} on {device_name}: {size}, {elapsed:.0f} s for all runs"))
    print()
    print(table)
    if notes:
        print("\nNotes:")
        print(report.format_notes(notes))
    print()
    print(report.legend(ordered, reference.mode if reference else None, device_type,
                        max(1, min(10, args.steps // 5))))
    print()
    print(report.noise_text(ordered, load))
    probe_line = report.probe_text(probe, probe_why, device_type)
    if probe_line:
        print(probe_line)
    print()
    if decision.mode is None:
        ran = [r for r in ordered if r.ran]
        why = ("no mode ran" if not ran else
               "no mode was timed; rerun with more --steps" if not any(r.step_ms is not None for r in ran) else
               "no mode ran within the thresholds; keep fp32 and look at the rows' stability notes")
        print(report.recommendation_text(None, why))
        code = 1
    else:
        best = rows[decision.mode]
        print(report.recommendation_text(best, report.explain(decision, ordered, probe, noisy), decision.confidence))
        code = 0
    if args.json:
        _write_json(args, spec, device_name, ordered, decision, probe, probe_row, probe_why, schedule, noisy, load,
                    elapsed, seed)
        print(f"wrote {args.json}")
    if args.plot:
        report.write_plot(ordered, args.plot)
        print(f"wrote {args.plot}")
    return code


def _write_json(args, spec, device_name, results, decision, probe, probe_row, probe_why, schedule, noisy, load,
                elapsed, seed) -> None:
    payload = {
        "meta": {"model": spec.name, "model_call": spec.describe, "device": device_name, "torch": torch.__version__,
                 "steps": schedule.steps, "warmup": schedule.warmup, "rounds": schedule.rounds,
                 "steps_per_round": schedule.per_round(), "seed": seed, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "drift_tolerance": args.drift_tolerance, "max_skip_rate": args.max_skip_rate,
                 "min_speedup": args.min_speedup, "min_headroom": args.min_headroom,
                 "trainer_kwargs": {k: repr(v) for k, v in spec.trainer_kwargs.items()},
                 "plugin_kwargs": {k: repr(v) for k, v in spec.plugin_kwargs.items()}, "config_notes": spec.notes,
                 "noisy": noisy, "load_average": load[0] if load else None, "cpus": load[1] if load else None,
                 "seconds": elapsed},
        "results": [_jsonable(asdict(r)) for r in results],
        "probe": None if probe is None else {
            "mode": probe.mode, "batch": probe.batch, "probe_batch": probe.probe_batch,
            "growth": None if probe.growth is None else asdict(probe.growth), "math_share": probe.math_share,
            "overhead_bound": probe.overhead_bound, "batch_to_matter": probe.batch_to_matter,
            "run": _jsonable(asdict(probe_row)) if probe_row is not None else None},
        "probe_skipped": probe_why if probe is None else None,
        "decision": {"mode": decision.mode, "confidence": decision.confidence, "fastest": decision.fastest,
                     "tied": decision.tied, "beaten": decision.beaten, "min_speedup": decision.min_speedup,
                     "vs_fastest": {k: asdict(v) for k, v in decision.vs_fastest.items()},
                     "vs_pick": {k: asdict(v) for k, v in decision.vs_pick.items()}},
        "recommendation": {"mode": decision.mode, "confidence": decision.confidence},
    }
    with open(args.json, "w") as f:
        json.dump(payload, f, indent=2)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


# names kept for earlier callers
__all__ = ["ModeResult", "assess", "candidates", "choose", "decide_results", "main", "parse_mode", "run_mode",
           "split_mode", "recommendation_text", "load_class", "default_modes", "_count_items", "_PeakMemory"]


if __name__ == "__main__":
    sys.exit(main())
