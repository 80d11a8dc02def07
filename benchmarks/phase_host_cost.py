"""Where a training step's host time goes, hook to hook: Lightning's precision modes beside ours, one process.

Each step is cut at the points Lightning itself marks (``on_train_batch_start``, ``optimizer_step`` in and out,
``training_step`` in and out, ``on_before_zero_grad``, ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``, ``on_train_batch_end``) with ``time.perf_counter`` (no sync: on a model whose step is
bound by the host, each phase is the host's work in it). Modes are interleaved over ``--rounds`` rounds (a fresh
Trainer each, the model keeps training); the figure of a phase is its median over the timed steps. The forward
and backward phases run the same operators in every pair (checked with a dispatch-mode count), so the phases that
differ are the precision plugin's own: ``after_bwd>before_opt`` (gathering and checking the gradients),
``before_opt>optstep_out`` (the step) and ``zero_grad>before_bwd`` (Lightning's ``zero_grad``; ours releases the
gradients inside the step).

``--without`` attributes: each name removes one part of our step for that mode (training is then wrong: timing
only), e.g. ``mp-bf16-true+hostcopy``:

- ``hostcopy``: the verdict's copy to the host for the step counters;
- ``check``: the masters' inf/NaN check kernel;
- ``writeback``: the masters' write-back to the half weights;
- ``follow``: the masters following weights written since the last step (``.data`` writes included);
- ``release``: the gradients' release after the step (Lightning's ``zero_grad`` then has nothing to free).

Run from the repository root (``--model gpt`` on a GPU, the small GPT of ``bench_host_cost.py``; ``tiny``: a 4-layer
GPT of width 32, whose host work dominates on the CPU too)::

    PYTHONPATH=. python benchmarks/phase_host_cost.py --modes lightning-bf16-true,mp-bf16-true,mp-bf16-true+hostcopy
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_host_cost as bhc  # noqa: E402
import fast_cores  # noqa: E402

from lightning_mp import master as _master  # noqa: E402
from lightning_mp import stats as _stats  # noqa: E402
from lightning_mp import step as _step  # noqa: E402

_clock = time.perf_counter


class Marks(Callback):
    """Every hook's time, a list a step (only reads gradients: our step takes no extra check for it)."""

    reads_gradients_only = True

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, float]]] = []
        self.now: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.now.append((name, _clock()))

    def on_train_batch_start(self, *args: Any) -> None:
        if self.now:
            self.steps.append(self.now)
        self.now = [("batch_start", _clock())]

    def on_before_zero_grad(self, *args: Any) -> None:
        self.mark("zero_grad")

    def on_before_backward(self, *args: Any) -> None:
        self.mark("before_bwd")

    def on_after_backward(self, *args: Any) -> None:
        self.mark("after_bwd")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.mark("before_opt")

    def on_train_batch_end(self, *args: Any) -> None:
        self.mark("batch_end")


class Marked(bhc.Lit):
    marks: Marks

    def training_step(self, batch, batch_idx):
        self.marks.mark("ts_in")
        out = super().training_step(batch, batch_idx)
        self.marks.mark("ts_out")
        return out

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self.marks.mark("optstep_in")
        super().optimizer_step(*args, **kwargs)
        self.marks.mark("optstep_out")


def _no_host_copy(self: Any, skipped: Any, verdict: Any) -> None:
    self.steps += 1  # (the counters no longer see the device's verdicts)


#: attribution switches: (owner, attribute, stand-in)
WITHOUT: dict[str, list[tuple[Any, str, Callable[..., Any]]]] = {
    "hostcopy": [(_stats.OptimizerStats, "record", _no_host_copy)],
    "check": [(torch, "_amp_foreach_non_finite_check_and_unscale_", lambda *args: None)],
    "writeback": [(_master.FP32MasterWeights, "write_back", lambda self, records, **kwargs: None)],
    "release": [(_step, "_release_grads", lambda optimizer: None)],
    "follow": [(_master.FP32MasterWeights, "_resync_layout", lambda self, layout: None),
               (_master.FP32MasterWeights, "_resync", lambda self, entries: None)],
}


@contextlib.contextmanager
def without(parts: list[str]) -> Iterator[None]:
    """Inside: the named parts of our step are switched off (:data:`WITHOUT`; timing only)."""
    undo = []
    try:
        for part in parts:
            for owner, attribute, stand_in in WITHOUT[part]:
                undo.append((owner, attribute, getattr(owner, attribute)))
                setattr(owner, attribute, stand_in)
        yield
    finally:
        for owner, attribute, old in reversed(undo):
            setattr(owner, attribute, old)


def run(mode: str, model: torch.nn.Module, batches: list, args: argparse.Namespace, accelerator: str) -> dict:
    name, *parts = mode.split("+")
    with without(parts):
        lit = name[len("lightning-"):] if name.startswith("lightning-") else None
        kwargs: dict[str, Any] = {"precision": lit} if lit else {"plugins": [bhc.plugin(name[3:])]}
        marks = Marks()
        module = Marked(model, batches, args.model, True)
        module.marks = marks
        Trainer(accelerator=accelerator, devices=1, max_steps=args.warmup + args.steps, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[marks], **kwargs).fit(module)
    phases: dict[str, list[float]] = collections.defaultdict(list)
    timed = marks.steps[args.warmup:]
    for step, following in zip(timed, timed[1:]):
        for (a, ta), (b, tb) in zip(step, step[1:]):
            phases[f"{a}>{b}"].append(tb - ta)
        phases["batch_end>next"].append(following[0][1] - step[-1][1])
        phases["step"].append(following[0][1] - step[0][1])
    return phases


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="lightning-bf16-true,mp-bf16-true,lightning-bf16-mixed,mp-bf16",
                   help="lightning-<precision> or mp-<mode>[/option=value...][+part...] (parts: see --without above)")
    p.add_argument("--model", choices=["gpt", "tiny", "mlp"], default=None, help="default: gpt on a GPU, tiny else")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fast-cores", type=int, default=0,
                   help="probe every core and keep the process on the N fastest (see fast_cores.py; 0: not pinned)")
    args = p.parse_args(argv)
    if args.fast_cores:
        print(fast_cores.pin_fast_cores(args.fast_cores))
    bhc.quiet()
    cuda = torch.cuda.is_available()
    args.model = args.model or ("gpt" if cuda else "tiny")
    accelerator = "gpu" if cuda else "cpu"
    modes = args.modes.split(",")
    for mode in modes:
        unknown = [part for part in mode.split("+")[1:] if part not in WITHOUT]
        if unknown:
            p.error(f"{mode}: unknown part(s) {unknown}; known: {sorted(WITHOUT)}")
    models = {m: bhc.build(args.model, torch.device("cpu")) for m in modes}
    batches = bhc.make_batches(args.model, args.warmup + args.steps)
    figures: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            for phase, times in run(mode, models[mode], batches, args, accelerator).items():
                figures[mode][phase] += times
    names: list[str] = []
    for mode in modes:
        names += [k for k in figures[mode] if k not in names and k != "step"]
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{args.model} on {device}: host µs a step by phase (median of {args.rounds} x {args.steps} steps)")
    print("| phase | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    for phase in names + ["step"]:
        cells = [f"{statistics.median(figures[m][phase]) * 1e6:.0f}" if figures[m].get(phase) else "-" for m in modes]
        print(f"| {phase} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
