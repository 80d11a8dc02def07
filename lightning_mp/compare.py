"""``python -m lightning_mp compare``: which precision should this model use, and what does it cost?

Runs a LightningModule for N steps under each precision mode, from the same initial weights and the same
batches, and prints one table: step time (median, and ratio to fp32 and bf16), throughput, peak memory,
final loss and its drift from fp32, skipped steps, final loss scale, and a verdict. It ends with a
recommendation to paste: the ``MPPlugin`` line and the YAML block.

Example::

    python -m lightning_mp compare                                  # the built-in byte-level GPT-mini
    python -m lightning_mp compare --model mypkg.models:MyModule --modes fp32 bf16 fp16 --steps 100
    python -m lightning_mp compare --json out.json --plot out.png
    python -m lightning_mp compare --modes fp32 bf16-true bf16-true:kahan bf16-true:stochastic bf16-true:none

A mode is a precision (``bf16``, ``fp16``, ``bf16-true``, ...; Lightning's strings are accepted as aliases),
optionally followed by ``:<master weights>`` for the true-half modes (``bf16-true:kahan`` runs
``MPPlugin("bf16-true", master_weights="kahan")``), or ``lightning:<precision>`` for Lightning's own plugin
as a baseline.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

#: thresholds of the verdict and of the recommendation
DRIFT_TOLERANCE = 0.05  # final loss within 5 % of fp32's
MAX_SKIP_RATE = 0.10  # at most 10 % of the steps skipped


@dataclass
class ModeResult:
    """What one mode did. ``status`` is ok / unstable / diverged / unsupported / failed."""

    mode: str
    status: str = "ok"
    reason: str = ""
    lightning_precision: Optional[str] = None
    step_ms: Optional[float] = None
    items_per_s: Optional[float] = None
    item_name: str = "samples"
    peak_mem_mib: Optional[float] = None
    final_loss: Optional[float] = None
    loss_drift: Optional[float] = None
    steps: int = 0
    skipped_steps: Optional[int] = None
    loss_scale: Optional[float] = None
    losses: list[float] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        return self.status in ("ok", "unstable")


# --------------------------------------------------------------------------------------------- choosing
def assess(results: list[ModeResult], drift_tolerance: float = DRIFT_TOLERANCE, max_skip_rate: float = MAX_SKIP_RATE) -> None:
    """Fill each row's loss drift from fp32 and turn 'ok' into 'unstable' where drift or skips are too high."""
    reference = next((r for r in results if r.mode == "fp32" and r.ran and r.final_loss is not None), None)
    for r in results:
        if not r.ran:
            continue
        if reference is not None and r.final_loss is not None and reference.final_loss:
            r.loss_drift = (r.final_loss - reference.final_loss) / abs(reference.final_loss)
        problems = []
        if r.loss_drift is not None and abs(r.loss_drift) > drift_tolerance:
            problems.append(f"final loss {r.loss_drift:+.1%} from fp32 (tolerance {drift_tolerance:.0%})")
        if r.steps and r.skipped_steps is not None and r.skipped_steps / r.steps > max_skip_rate:
            problems.append(f"{r.skipped_steps}/{r.steps} steps skipped (tolerance {max_skip_rate:.0%})")
        if problems:
            r.status, r.reason = "unstable", "; ".join(problems)


def choose(
    results: list[ModeResult], drift_tolerance: float = DRIFT_TOLERANCE, max_skip_rate: float = MAX_SKIP_RATE
) -> tuple[Optional[ModeResult], str]:
    """The fastest mode whose loss drift and skip rate are within the thresholds, and why.

    A row qualifies when it ran, its |drift| from fp32 is at most ``drift_tolerance`` (unknown drift only
    qualifies when no fp32 row exists) and its skip rate is at most ``max_skip_rate``.
    """
    has_reference = any(r.mode == "fp32" and r.ran for r in results)
    candidates = []
    for r in results:
        if not r.ran or r.step_ms is None or r.mode.startswith("lightning:"):  # baselines are not advice
            continue
        if r.loss_drift is None and has_reference:
            continue
        if r.loss_drift is not None and abs(r.loss_drift) > drift_tolerance:
            continue
        if r.steps and r.skipped_steps is not None and r.skipped_steps / r.steps > max_skip_rate:
            continue
        candidates.append(r)
    if not candidates:
        return None, "no mode ran within the thresholds; keep fp32 and look at the unstable rows"
    best = min(candidates, key=lambda r: r.step_ms)
    parts = [f"the fastest mode whose final loss is within {drift_tolerance:.0%} of fp32"
             f" with at most {max_skip_rate:.0%} of steps skipped"]
    fp32 = next((r for r in results if r.mode == "fp32" and r.ran and r.step_ms), None)
    if fp32 is not None and best is not fp32:
        parts.append(f"{fp32.step_ms / best.step_ms:.2f}x the speed of fp32")
    if not has_reference:
        parts.append("(no fp32 run to measure drift against)")
    return best, ", ".join(parts)


def recommendation_text(best: Optional[ModeResult], reason: str) -> str:
    if best is None:
        return f"Recommendation: none — {reason}."
    precision, master = split_mode(best.mode)
    master_arg = "" if master is None else f', master_weights="{master}"'
    return (
        f"Recommendation: {best.mode} — {reason}.\n\n"
        f'    Trainer(plugins=[MPPlugin("{precision}"{master_arg})])\n\n'
        "    trainer:\n"
        "      plugins:\n"
        "        - class_path: lightning_mp.MPPlugin\n"
        "          init_args:\n"
        f"            precision: {precision}\n"
        + ("" if master is None else f"            master_weights: {master}\n")
    )


# --------------------------------------------------------------------------------------------- mode names
def split_mode(mode: str) -> tuple[str, Optional[str]]:
    """A canonical MPPlugin mode to ``(precision, master_weights)``: ``"bf16-true:kahan"`` to
    ``("bf16-true", "kahan")``, ``"bf16"`` to ``("bf16", None)`` (see :func:`parse_mode`)."""
    precision, sep, master = mode.partition(":")
    return precision, (master if sep else None)


def parse_mode(value: str) -> str:
    """Check one mode of ``--modes`` and return its canonical spelling.

    ``"<precision>"`` (any name or alias :func:`lightning_mp.modes.parse_precision` accepts),
    ``"<true-half precision>:<master weights>"`` (``"bf16-true:kahan"``, ``"16-true:none"``; the options of
    ``MPPlugin(master_weights=...)``) or ``"lightning:<precision>"`` (passed to Lightning unchecked).

    Raises:
        ValueError: naming the bad value, the accepted ones and the fix.
    """
    from lightning_mp.master import MASTER_WEIGHT_KINDS, parse_master_weights
    from lightning_mp.modes import MODES, parse_precision

    if value.startswith("lightning:"):
        return value
    base, sep, option = value.partition(":")
    precision = parse_precision(base)
    if not sep:
        return precision
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


# --------------------------------------------------------------------------------------------- running
def default_modes(device_type: str) -> list[str]:
    from lightning_mp import modes

    return [*modes.MODES, *[m for m in modes.PLANNED if m not in modes.MODES]]


def _unsupported_reason(mode: str, device_type: str) -> Optional[str]:
    from lightning_mp.modes import resolve_mode

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


class _PeakMemory:
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


def _count_items(batch: Any) -> tuple[int, str]:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    if isinstance(first, torch.Tensor):
        if first.dim() == 2 and not first.is_floating_point():
            return first.numel(), "tokens"
        return first.shape[0], "samples"
    return 1, "batches"


def _make_recorder(device_type: str):
    from lightning.pytorch import Callback

    class Recorder(Callback):
        def __init__(self) -> None:
            self._times: list[float] = []
            self._events: list[tuple[Any, Any]] = []
            self._losses: list[torch.Tensor] = []
            self.items, self.item_name = 0, "samples"
            self._t0 = 0.0
            self._start = None

        @property
        def times(self) -> list[float]:
            if device_type == "cuda":  # read the events once, at the end: no host sync per step
                torch.cuda.synchronize()
                return [start.elapsed_time(end) / 1000 for start, end in self._events]
            return self._times

        @property
        def losses(self) -> list[float]:
            return [float(x) for x in torch.stack(self._losses).tolist()] if self._losses else []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.items, self.item_name = _count_items(batch)
            if device_type == "cuda":
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            else:
                self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if device_type == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((self._start, end))
            else:
                self._times.append(time.perf_counter() - self._t0)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                self._losses.append(loss.detach().float().reshape(()))

    return Recorder()


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
    """Train ``steps`` optimizer steps under ``MPPlugin(mode)``; any failure lands in the returned row.

    ``mode`` is spelt as :func:`parse_mode` accepts: ``"bf16-true:kahan"`` runs
    ``MPPlugin("bf16-true", master_weights="kahan")``, and ``"lightning:<precision>"`` (e.g.
    ``"lightning:bf16-mixed"``) runs Lightning's own precision plugin as a baseline. The step time is the median
    after ``warmup`` steps (default: ``min(3, steps // 4)``).
    """
    from lightning.pytorch import Trainer, seed_everything

    from lightning_mp import MPPlugin, NonFiniteTrainingError

    result = ModeResult(mode=mode)
    native = mode.startswith("lightning:")
    if not native:
        try:
            mode = parse_mode(mode)
        except ValueError as err:
            result.status, result.reason = "failed", str(err)
            return result
    precision, master_weights = (None, None) if native else split_mode(mode)
    why = None if native else _unsupported_reason(mode, device_type)
    if why is not None:
        result.status, result.reason = "unsupported", why
        return result
    plugin = None
    memory = _PeakMemory(device_type)
    recorder = _make_recorder(device_type)
    try:
        seed_everything(seed, verbose=False)
        module = make_module()
        if initial_state is not None:  # None: make_module builds the same weights every call itself
            module.load_state_dict(initial_state)
        precision_kwargs: dict[str, Any]
        if native:
            precision_kwargs = {"precision": mode.split(":", 1)[1]}
        else:
            plugin = MPPlugin(precision, master_weights=master_weights)
            precision_kwargs = {"plugins": [plugin]}
        trainer = Trainer(
            accelerator="gpu" if device_type == "cuda" else "cpu",
            devices=1,
            **precision_kwargs,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=progress,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[recorder],
        )
        result.lightning_precision = str(trainer.precision)
        memory.reset()
        seed_everything(seed, verbose=False)  # the same batches in every mode
        if make_datamodule is not None:
            trainer.fit(module, datamodule=make_datamodule())
        else:
            trainer.fit(module)
        if plugin is not None:
            stats = plugin.stats.as_dict()
            result.skipped_steps, result.loss_scale, result.steps = stats["skipped_steps"], stats["loss_scale"], stats["steps"]
        else:
            result.steps = trainer.global_step
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            result.loss_scale = float(scaler.get_scale()) if scaler is not None else None
    except NonFiniteTrainingError as err:
        result.status, result.reason = "diverged", str(err).split(". ")[0]
    except torch.OutOfMemoryError:
        result.status, result.reason = "failed", "out of memory"
    except NotImplementedError as err:
        result.status, result.reason = "unsupported", str(err)
    except Exception as err:  # one mode's failure must not stop the others
        result.status, result.reason = "failed", f"{type(err).__name__}: {err}"
    finally:
        result.peak_mem_mib = memory.peak_mib()
        if device_type == "cuda":
            torch.cuda.empty_cache()
    result.losses = recorder.losses
    times = recorder.times
    skip = min(3, len(times) // 4) if warmup is None else min(warmup, max(0, len(times) - 1))
    timed = times[skip:]  # warm-up excluded
    if timed:
        result.step_ms = 1000 * statistics.median(timed)
        result.items_per_s = recorder.items / (result.step_ms / 1000)
        result.item_name = recorder.item_name
    finite = [x for x in result.losses if math.isfinite(x)]
    if finite:
        tail = finite[-max(1, min(10, len(finite) // 5)):]
        result.final_loss = sum(tail) / len(tail)
    if result.status == "ok" and result.losses and not math.isfinite(result.losses[-1]):
        result.status, result.reason = "diverged", "the last loss is not finite"
    return result


# --------------------------------------------------------------------------------------------- output
def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def format_table(results: list[ModeResult]) -> str:
    fp32 = next((r.step_ms for r in results if r.mode == "fp32" and r.step_ms), None)
    bf16 = next((r.step_ms for r in results if r.mode == "bf16" and r.step_ms), None)
    item = next((r.item_name for r in results if r.items_per_s), "samples")
    lines = [
        f"| mode | verdict | step ms | vs fp32 | vs bf16 | {item}/s | peak MiB | final loss | drift vs fp32 | skipped | loss scale | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        speed32 = fp32 / r.step_ms if fp32 and r.step_ms else None
        speed16 = bf16 / r.step_ms if bf16 and r.step_ms else None
        lines.append(
            f"| {r.mode} | {r.status} | {_fmt(r.step_ms, '.1f')} | {_fmt(speed32, '.2f', 'x')} | {_fmt(speed16, '.2f', 'x')}"
            f" | {_fmt(r.items_per_s, ',.0f')} | {_fmt(r.peak_mem_mib, ',.0f')} | {_fmt(r.final_loss, '.4f')}"
            f" | {_fmt(None if r.loss_drift is None else 100 * r.loss_drift, '+.2f', ' %')}"
            f" | {'—' if r.skipped_steps is None else r.skipped_steps} | {_fmt(r.loss_scale, 'g')}"
            f" | {r.reason.replace('|', '/')[:160]} |"
        )
    return "\n".join(lines)


def write_plot(results: list[ModeResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from err
    ran = [r for r in results if r.step_ms is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [r.mode for r in ran]
    axes[0].bar(names, [r.step_ms for r in ran], color="tab:blue")
    axes[0].set_title("median step time (ms, lower is faster)")
    axes[1].bar(names, [r.peak_mem_mib or 0 for r in ran], color="tab:orange")
    axes[1].set_title("peak memory (MiB)")
    for r in ran:
        axes[2].plot(range(1, len(r.losses) + 1), r.losses, label=r.mode)
    axes[2].set_title("training loss")
    axes[2].set_xlabel("step")
    axes[2].legend()
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- models
BUILTIN_MODELS = {
    "gpt-mini": "lightning_mp.demo:TinyByteLM",
    # the repository's examples (run from the repository root)
    "examples.gpt_mini": "examples.gpt_mini:GPTMini",
    "examples.vlm_mini": "examples.vlm_mini:VLMMini",
}
BUILTIN_DATAMODULES = {
    "examples.gpt_mini": "examples.gpt_mini:ByteTextDataModule",
    "examples.vlm_mini": "examples.vlm_mini:DigitCaptionDataModule",
}


def load_class(spec: str) -> Callable[..., Any]:
    """``"package.module:ClassName"`` (or a built-in name) to the class; a clear error otherwise."""
    spec = BUILTIN_MODELS.get(spec, spec)
    if ":" not in spec:
        raise ValueError(
            f"--model {spec!r}: use 'package.module:ClassName' or a built-in name ({', '.join(BUILTIN_MODELS)})."
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({err}).") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise ValueError(f"--model {spec!r}: {module_name!r} has no {attr!r}.") from err


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_mp compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-mini",
                        help="'package.module:ClassName' of a LightningModule, or a built-in name (default: %(default)s)")
    parser.add_argument("--model-args", default="{}", help="JSON object of keyword arguments for the model (default: {})")
    parser.add_argument("--datamodule", default=None, help="'package.module:ClassName' of a LightningDataModule (optional)")
    parser.add_argument("--datamodule-args", default="{}", help="JSON object of keyword arguments for the datamodule")
    parser.add_argument("--modes", nargs="+", default=None,
                        help="modes to run (default: every mode; ones this hardware cannot run are reported as such);"
                             " 'bf16-true:kahan' etc. pick the master weights of a true-half mode"
                             " (fp32, kahan, stochastic, none); 'lightning:bf16-mixed' etc. add Lightning's own"
                             " plugins as baselines")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per mode (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--drift-tolerance", type=float, default=DRIFT_TOLERANCE)
    parser.add_argument("--max-skip-rate", type=float, default=MAX_SKIP_RATE)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="also draw speed, memory and loss curves into this PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: use at least 1")
    try:
        model_cls = load_class(args.model)
        model_kwargs = json.loads(args.model_args)
        datamodule = args.datamodule or BUILTIN_DATAMODULES.get(args.model)
        dm_cls = load_class(datamodule) if datamodule else None
        dm_kwargs = json.loads(args.datamodule_args)
    except (ValueError, json.JSONDecodeError) as err:
        parser.error(str(err))
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    try:
        modes = [parse_mode(m) for m in args.modes] if args.modes else default_modes(device_type)
    except ValueError as err:
        parser.error(f"--modes: {err}")

    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")
            return _compare(args, parser, model_cls, model_kwargs, dm_cls, dm_kwargs, device_type, modes)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def _compare(args, parser, model_cls, model_kwargs, dm_cls, dm_kwargs, device_type, modes) -> int:

    from lightning.pytorch import seed_everything

    seed_everything(args.seed, verbose=False)
    initial_state = {k: v.clone() for k, v in model_cls(**model_kwargs).state_dict().items()}
    device_name = torch.cuda.get_device_name() if device_type == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    print(f"compare: {args.model} on {device_name}, {args.steps} steps per mode, modes: {', '.join(modes)}", flush=True)

    results = []
    for i, mode in enumerate(modes, 1):
        print(f"[{i}/{len(modes)}] {mode}", flush=True)
        results.append(run_mode(
            mode, lambda: model_cls(**model_kwargs), initial_state, args.steps, device_type, args.seed,
            (lambda: dm_cls(**dm_kwargs)) if dm_cls else None, progress=not args.no_progress,
        ))
        print(f"      -> {results[-1].status}{': ' + results[-1].reason if results[-1].reason else ''}", flush=True)
    assess(results, args.drift_tolerance, args.max_skip_rate)
    best, why = choose(results, args.drift_tolerance, args.max_skip_rate)

    print()
    print(f"{args.model} | {device_name} | torch {torch.__version__} | {args.steps} steps per mode, median step time"
          f" after warm-up | peak memory: {'CUDA max allocated' if device_type == 'cuda' else 'process peak RSS'}")
    print()
    print(format_table(results))
    print()
    print(recommendation_text(best, why))
    if args.json:
        payload = {
            "meta": {"model": args.model, "device": device_name, "torch": torch.__version__, "steps": args.steps,
                     "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "drift_tolerance": args.drift_tolerance,
                     "max_skip_rate": args.max_skip_rate},
            "results": [asdict(r) for r in results],
            "recommendation": {"mode": best.mode if best else None, "reason": why},
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
