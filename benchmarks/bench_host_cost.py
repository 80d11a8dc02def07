"""Per-step host cost of MPPlugin against Lightning's own precision modes, on models too small to hide it.

Two models, every mode from the same initial weights and the same batches, all in one process:

- ``--model mlp`` (default on the CPU): a tiny MLP (32 -> 64 -> 64 -> 1, batch 32, Adam), on the CPU.
- ``--model gpt`` (default on a GPU): the small, launch-bound GPT of ``bench_overhead.py`` (hidden 512, 4 layers,
  8 x 512 tokens, fused AdamW).

Pairs (Lightning's mode, then ours): ``32-true``/``fp32``, ``bf16-mixed``/``bf16``, ``16-mixed``/``fp16``,
``bf16-true``/``bf16-true`` (ours with fp32 masters).

The modes are interleaved: ``--rounds`` rounds, and in each round every mode, in a rotated order, runs one ``fit``
of ``--warmup`` + ``--steps`` steps with a fresh Trainer (the model keeps training across rounds). Only the steps
after the warm-up are timed, from ``on_train_batch_start`` to the next one (the cycle: the step, the hooks and
the batch fetch). On a GPU a round gives one figure, its mean step (``torch.cuda.synchronize()`` at the first timed
step and at the end only), and the statistics are over rounds. ``--cpu-time`` times the process's CPU time instead
(with one torch thread, the host work alone: on a shared machine other processes do not show in it);
``--thread-time`` the main thread's CPU time of every step, also on a GPU (a figure a step, no sync per step: the
time the thread was descheduled on a shared host does not count, a wait on the GPU does). The figure of
a mode is the median over all its rounds' timed steps, with the interquartile range, from ``torch.utils.benchmark``'s
``Measurement``; ``ratio`` is Lightning's median over ours (above 1: ours is faster); ``paired ratio`` the median over
rounds of the round's Lightning figure over ours (with a figure a round, on a GPU: what a host whose speed drifts
between rounds still resolves). ``--per-step`` times every step on a GPU too (its wall interval, no sync) and adds
the 20th percentile of all steps: where a shared host's speed also moves within a round, the fast steps of both
modes, run on the same host minutes apart, are what still compares.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_host_cost.py [--model mlp|gpt] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.benchmark.utils.common import Measurement, TaskSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fast_cores  # noqa: E402
from lightning_mp import MPPlugin  # noqa: E402

PAIRS = [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("bf16-true", "bf16-true")]


class Timer(Callback):
    """CPU: the time of each step after the warm-up. GPU: the mean step time of the round (synchronised at the first
    timed step and at the end only: a sync per step would add the GPU's tail to every step of a launch-bound model)."""

    def __init__(self, warmup: int, cuda: bool) -> None:
        self.warmup, self.cuda, self.marks, self.cpu_marks, self.thread_marks = warmup, cuda, [], [], []
        self.step_marks: list[float] = []  # every timed step's start, no sync (``--per-step``)
        self.steps = 0

    def _mark(self) -> None:
        self.marks.append(time.perf_counter())
        self.cpu_marks.append(time.process_time())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.thread_marks.append(time.thread_time())
            self.step_marks.append(time.perf_counter())
        if batch_idx == self.warmup and self.cuda:
            torch.cuda.synchronize()
            self._mark()
        elif batch_idx >= self.warmup and not self.cuda:
            self._mark()

    def on_train_end(self, trainer, pl_module):
        self.thread_marks.append(time.thread_time())
        if self.cuda:
            torch.cuda.synchronize()
        self._mark()

    def times(self, cpu: bool = False, thread: bool = False, per_step: bool = False) -> list[float]:
        if thread:  # every step: the main thread's CPU time (no sync per step on a GPU)
            return [b - a for a, b in zip(self.thread_marks, self.thread_marks[1:])]
        if per_step:  # every step's wall interval, no sync (the last step's ends where training ends)
            return [b - a for a, b in zip(self.step_marks, self.step_marks[1:])]
        marks = self.cpu_marks if cpu else self.marks
        if self.cuda:  # one figure per round: its mean step
            return [(marks[-1] - marks[0]) / self.steps] if len(marks) == 2 else []
        return [b - a for a, b in zip(marks, marks[1:])]


class Lit(LightningModule):
    def __init__(self, model: nn.Module, batches: list, kind: str, fused: bool) -> None:
        super().__init__()
        self.model, self.batches, self.kind, self.fused = model, batches, kind, fused

    def training_step(self, batch, batch_idx):
        if self.kind == "mlp":
            x, y = batch
            return nn.functional.mse_loss(self.model(x).float(), y.float())
        return self.model(batch)

    def configure_optimizers(self):
        if self.kind == "mlp":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.fused)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def build(kind: str, device: torch.device) -> nn.Module:
    """``mlp``, ``gpt`` (the small GPT), or ``tiny``: a GPT of the same depth and parameter count as ``gpt`` but
    width 32, whose step on the CPU is nearly all host work, as ``gpt``'s on a GPU."""
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    import bench_overhead as bo

    return bo.GPT(256, 32, 4, 4, 16) if kind == "tiny" else bo.GPT(32768, 512, 4, 8, 512)


def make_batches(kind: str, n: int) -> list:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return [(torch.randn(32, 32, generator=g), torch.randn(32, 1, generator=g)) for _ in range(n)]
    if kind == "tiny":
        return [torch.randint(0, 256, (2, 17), generator=g) for _ in range(n)]
    return [torch.randint(0, 32768, (8, 513), generator=g) for _ in range(n)]


def quiet(threads: int = 1) -> None:
    """A benchmark process: ``threads`` torch threads, Lightning's routine warnings and messages off."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def plugin(spec: str) -> MPPlugin:
    """``"bf16-true"``, or a variant such as ``"bf16-true/master_weights=none/fp32_modules=none"`` (``fp32_modules``:
    ``none`` is the empty list, else entries joined by ``+``; other values are passed as strings, ``true``/``false``
    as booleans)."""
    name, *options = spec.split("/")
    kw: dict[str, Any] = {}
    for option in options:
        key, value = option.split("=", 1)
        if key == "fp32_modules":
            kw[key] = [] if value == "none" else value.split("+")  # e.g. "defaults", "defaults+*.router"
        else:
            kw[key] = {"true": True, "false": False}.get(value, value)
    return MPPlugin(name, **kw)


def run_round(mode: str, model: nn.Module, batches: list, args, accelerator: str) -> list[float]:
    lit_precision = mode[len("lightning-"):] if mode.startswith("lightning-") else None
    kwargs: dict[str, Any] = {"precision": lit_precision} if lit_precision else {"plugins": [plugin(mode[3:])]}
    timer = Timer(args.warmup, accelerator == "gpu")
    timer.steps = args.steps
    trainer = Trainer(accelerator=accelerator, devices=1, max_steps=args.warmup + args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[timer], **kwargs)
    trainer.fit(Lit(model, batches, args.model, accelerator == "gpu"))
    return timer.times(cpu=args.cpu_time, thread=args.thread_time, per_step=args.per_step)


def measurement(name: str, times: list[float]) -> Measurement:
    return Measurement(1, times, TaskSpec(stmt=name, setup="", label="host cost", sub_label=name))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mlp", "gpt"], default=None,
                   help="mlp (CPU) or gpt (GPU); default: gpt on a GPU, mlp otherwise")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per round (default 10)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per round (default 60)")
    p.add_argument("--pairs", default=",".join(m for _, m in PAIRS),
                   help="our modes to run, each beside Lightning's (default: all four); a variant names its options "
                        "after the mode: bf16-true/master_weights=none/fp32_modules=none")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the process's CPU time instead of wall time (with one thread: the host work alone, "
                        "unaffected by other processes on a shared machine)")
    p.add_argument("--thread-time", action="store_true",
                   help="time each step by the main thread's CPU time (a figure a step, also on a GPU: where the "
                        "host is shared, time the thread spent descheduled does not count; waits on the GPU do, as "
                        "spinning)")
    p.add_argument("--per-step", action="store_true",
                   help="on a GPU: every step's wall interval (no sync per step; in a steady state the host's or the "
                        "GPU's pace, whichever binds) instead of one mean a round; also prints the 20th percentile "
                        "of the steps, which a host whose speed moves within a round (a shared machine) still "
                        "resolves, and the paired ratio of the rounds' medians")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--json", default=None, help="also write the raw figures to this JSON file")
    p.add_argument("--fast-cores", type=int, default=0,
                   help="probe every core and keep the process on the N fastest (see fast_cores.py; 0: not pinned)")
    args = p.parse_args(argv)
    if args.fast_cores:
        print(fast_cores.pin_fast_cores(args.fast_cores))
    quiet(args.threads)
    cuda = torch.cuda.is_available()
    args.model = args.model or ("gpt" if cuda else "mlp")
    accelerator = "gpu" if cuda and args.model == "gpt" else "cpu"
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    wanted = args.pairs.split(",")
    lightning = dict((ours, lit) for lit, ours in PAIRS)
    unknown = [w for w in wanted if w.split("/")[0] not in lightning]
    if unknown:
        p.error(f"--pairs {unknown}: use our modes {sorted(lightning)}, optionally with /option=value variants")
    pairs = [(lightning[w.split("/")[0]], w) for w in wanted]
    modes = []
    for lit, ours in pairs:
        modes += [m for m in (f"lightning-{lit}", f"mp-{ours}") if m not in modes]
    models = {m: build(args.model, device) for m in modes}
    batches = make_batches(args.model, args.warmup + args.steps)
    times: dict[str, list[float]] = {m: [] for m in modes}
    by_round: dict[str, list[list[float]]] = {m: [] for m in modes}  # each round's figures
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            figures = run_round(mode, models[mode], batches, args, accelerator)
            times[mode] += figures
            by_round[mode].append(figures)
    device_name = torch.cuda.get_device_name() if accelerator == "gpu" else platform.processor() or "CPU"
    print(f"\n{args.model} on {device_name}, torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps, "
          f"{'main-thread CPU' if args.thread_time else 'process CPU' if args.cpu_time else 'wall'} time"
          f"{' of every step' if args.per_step else ''}, {args.threads} thread(s)")
    print("| mode | Lightning ms (IQR) | MPPlugin ms (IQR) | ratio (Lightning / ours) | paired ratio |"
          + (" Lightning / ours p20 ms | p20 ratio |" if args.per_step else ""))
    print("|---|---|---|---|---|" + ("---|---|" if args.per_step else ""))
    rows = []
    for lit, ours in pairs:
        a, b = measurement(lit, times[f"lightning-{lit}"]), measurement(ours, times[f"mp-{ours}"])
        ratio = a.median / b.median
        # the same round's figures side by side (run minutes apart at most): a host whose speed drifts between
        # rounds moves both alike; the median of these ratios is what a noisy machine still resolves
        # (a figure a round: the rounds' figures; several: the rounds' medians)
        paired = statistics.median(
            statistics.median(x) / statistics.median(y)
            for x, y in zip(by_round[f"lightning-{lit}"], by_round[f"mp-{ours}"]) if x and y
        )
        row = {"lightning": lit, "ours": ours, "lightning_ms": a.median * 1e3, "lightning_iqr_ms": a.iqr * 1e3,
               "ours_ms": b.median * 1e3, "ours_iqr_ms": b.iqr * 1e3, "ratio": ratio, "paired_ratio": paired}
        line = (f"| {lit} / {ours} | {a.median * 1e3:.3f} ({a.iqr * 1e3:.3f}) | {b.median * 1e3:.3f} "
                f"({b.iqr * 1e3:.3f}) | {ratio:.3f} | {paired:.3f} |")
        if args.per_step:
            low = [statistics.quantiles(times[m], n=5)[0] for m in (f"lightning-{lit}", f"mp-{ours}")]
            row.update(lightning_p20_ms=low[0] * 1e3, ours_p20_ms=low[1] * 1e3, p20_ratio=low[0] / low[1])
            line += f" {low[0] * 1e3:.3f} / {low[1] * 1e3:.3f} | {low[0] / low[1]:.3f} |"
        rows.append(row)
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "model": args.model, "rows": rows,
                       "fast_cores": args.fast_cores, "times_s": times}, f, indent=1)


if __name__ == "__main__":
    main()
