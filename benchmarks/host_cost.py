"""Per-step host cost of MPPlugin against Lightning's own precision modes, on models too small to hide it.

A small model's step is bound by the host (Python and kernel launches), so what our step adds to Lightning's shows
in the step time. One entry point, five measures, a subcommand each:

``lockstep`` (the trusted figure)
    Lightning's Trainer and ours run in two threads that hand a baton to each other at every
    ``on_train_batch_start``: Lightning's step k, then ours, then Lightning's step k + 1, ... Each figure is the time
    from taking the baton to the next ``on_train_batch_start`` (the step, its hooks and the next batch's fetch), so
    the two steps of a pair run milliseconds apart on the same host; the result is the median over pairs of the ratio
    Lightning / ours (above 1: ours is faster), beside each mode's median and the spread of the pairs' ratios, and
    the geometric mean over runs that alternate which side opens a pair (``--repeats``). Both threads run on one
    core, the fastest the probe below finds (``--cores``): cores of a shared host differ steadily in speed, and two
    threads the scheduler leaves on two cores would compare the cores. Only one thread runs Python at a time (the
    other waits for the baton outside any step): the autocast state is per thread; the default dtype and the TF32
    flags are process-wide but only set inside a step (true-half modes) or left as they were by the modes compared
    here. No sync a step (on a GPU: the host's pace, which binds on the small GPT). ``--same`` is the A/A check:
    Lightning's mode on both sides (the ratio then shows the harness's own bias).
``rounds``
    The modes interleaved by rounds: ``--rounds`` rounds, and in each round every mode, in a rotated order, runs one
    ``fit`` of ``--warmup`` + ``--steps`` steps with a fresh Trainer (the model keeps training across rounds). Only
    the steps after the warm-up are timed, from ``on_train_batch_start`` to the next one. On a GPU a round gives one
    figure, its mean step (``torch.cuda.synchronize()`` at the first timed step and at the end only): what measures
    a GPU-bound mode (``fp32``), which lockstep (no sync) does not. ``--cpu-time`` times the process's CPU time (with
    one torch thread, the host work alone: other processes do not show in it; the CPU MLP); ``--thread-time`` the
    main thread's CPU time of every step; ``--per-step`` every step's wall interval on a GPU, with the 20th
    percentile of all steps. The figure of a mode is the median over its rounds' timed steps, with the interquartile
    range (``torch.utils.benchmark``'s ``Measurement``); ``ratio`` is Lightning's median over ours; ``paired ratio``
    the median over rounds of the round's Lightning figure over ours. On a shared host whose cores' speed moves by
    up to 2x from one second to the next, rounds of the same code differ by ±20 %: use lockstep for host-bound modes.
``phases``
    Where a step's host time goes, hook to hook: each step is cut at the points Lightning marks
    (``on_train_batch_start``, ``optimizer_step`` in and out, ``training_step`` in and out, ``on_before_zero_grad``,
    ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``, ``on_train_batch_end``) with
    ``time.perf_counter`` (no sync). Modes interleaved over ``--rounds`` rounds; a phase's figure is its median over
    the timed steps. The forward and backward phases run the same operators in every pair, so the phases that differ
    are the precision plugin's own: ``after_bwd>before_opt`` (gathering and checking the gradients),
    ``before_opt>optstep_out`` (the step) and ``zero_grad>before_bwd`` (Lightning's ``zero_grad``; ours releases
    the gradients inside the step).
``kernels``
    Is the step bound by the host or by the GPU? For each pair: a warm-up ``fit``, three timed ``fit``s (the middle
    one's synchronised wall time a step), then a ``fit`` under ``torch.profiler`` that counts the GPU kernels a step
    launches and sums their time (busy time: the union of their intervals). A step whose GPU busy time is well below
    its wall time is bound by the host; the kernels and host ops ours runs more often than Lightning's say where the
    extra host work goes.
``cprofile``
    cProfile over one ``fit`` of one mode after a warm-up fit: the host time a step in ``lightning_mp``'s own Python
    and in the torch calls made directly from it, then the costliest functions (inflated by the profiler).

Attribution switches (``lockstep`` pairs and ``phases`` modes, e.g. ``bf16-true+hostcopy``): each removes one part
of our step (training is then wrong: timing only): ``hostcopy`` the verdict's copy to the host for the step
counters; ``check`` the masters' inf/NaN check kernel; ``writeback`` the masters' write-back to the half weights;
``follow`` the masters following weights written since the last step (``.data`` writes included); ``release`` the
gradients' release after the step (Lightning's ``zero_grad`` then has nothing to free).

Modes: ours by name (``bf16``, ``fp16``, ``fp32``, ``bf16-true``), each beside Lightning's same mode (``bf16-mixed``,
``16-mixed``, ``32-true``, ``bf16-true``); a variant names its options after the mode:
``bf16-true/master_weights=none/fp32_modules=none``. ``phases`` names both sides: ``lightning-bf16-true``,
``mp-bf16-true+follow``.

Models (``--model``, ``common.small_model``): ``gpt`` (the default on a GPU: hidden 512, 4 layers, 8 x 512 tokens,
fused AdamW), ``tiny`` (a GPT of the same depth but width 32, whose step on the CPU is nearly all host work, as
``gpt``'s on a GPU) and ``mlp`` (32 -> 64 -> 64 -> 1, batch 32, Adam; the CPU).

Cores: on a shared virtual machine the cores do not run alike (a fixed piece of Python took 1.5 ms on some cores of
a GPU host and 3.1 ms on others, steadily). ``--cores N`` / ``--fast-cores N`` probe every core the process may use
with the same piece of Python and keep the process on the N fastest (all threads made after the call inherit the
mask); the line printed names the cores' speeds, so a result says on which it ran.

Run from the repository root::

    PYTHONPATH=. python benchmarks/host_cost.py lockstep [--model gpt|mlp|tiny] [--pairs bf16,fp16,bf16-true]
    PYTHONPATH=. python benchmarks/host_cost.py lockstep --same --pairs bf16          # the A/A check
    PYTHONPATH=. python benchmarks/host_cost.py rounds --pairs fp32 [--per-step] [--json out.json]
    PYTHONPATH=. python benchmarks/host_cost.py rounds --model mlp --cpu-time          # the CPU MLP
    PYTHONPATH=. python benchmarks/host_cost.py phases --modes lightning-bf16-true,mp-bf16-true,mp-bf16-true+hostcopy
    PYTHONPATH=. python benchmarks/host_cost.py kernels --pairs bf16-true,bf16
    PYTHONPATH=. python benchmarks/host_cost.py cprofile --mode bf16-true --steps 200

Smoke test on the CPU (each a few seconds)::

    PYTHONPATH=. python benchmarks/host_cost.py lockstep --model tiny --warmup 2 --steps 8 --repeats 2 --cores 0
    PYTHONPATH=. python benchmarks/host_cost.py rounds --model mlp --rounds 2 --warmup 2 --steps 5
    PYTHONPATH=. python benchmarks/host_cost.py phases --model tiny --rounds 1 --warmup 2 --steps 5
    PYTHONPATH=. python benchmarks/host_cost.py kernels --model tiny --steps 5 --pairs bf16
    PYTHONPATH=. python benchmarks/host_cost.py cprofile --model tiny --mode bf16 --steps 5
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.benchmark.utils.common import Measurement, TaskSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import package_host_time, small_batches, small_model  # noqa: E402

from lightning_mp import MPPlugin  # noqa: E402
from lightning_mp import master as _master  # noqa: E402
from lightning_mp import stats as _stats  # noqa: E402
from lightning_mp import step as _step  # noqa: E402

#: (Lightning's precision, our mode)
PAIRS = [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("bf16-true", "bf16-true")]
LIGHTNING = {ours: lit for lit, ours in PAIRS}


# --------------------------------------------------------------------------------------------- process set-up
def quiet(threads: int = 1) -> None:
    """A benchmark process: ``threads`` torch threads, Lightning's routine warnings and messages off."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def _work() -> int:
    total, seen = 0, {}
    for i in range(20000):
        total += i * i
        seen[i & 255] = total
    return total


def probe_core(cpu: int, seconds: float = 0.3) -> float:
    """The median time (ms) of a fixed piece of Python on ``cpu`` (the calling thread is moved there)."""
    os.sched_setaffinity(0, {cpu})
    for _ in range(3):
        _work()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        _work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def pin_fast_cores(count: int, passes: int = 2) -> str:
    """Keep this process on the ``count`` fastest of the cores it may use (the slower of ``passes`` probes per core);
    returns a line that lists each core's time. Call it before CUDA starts its threads. Where the platform has no
    affinity call, nothing is done."""
    if not hasattr(os, "sched_getaffinity"):
        return "cores: not pinned (no sched_setaffinity here)"
    allowed = sorted(os.sched_getaffinity(0))
    if count <= 0 or (count >= len(allowed) and count > 1):
        return f"cores: not pinned ({len(allowed)} allowed, {count} asked)"
    speed = {cpu: 0.0 for cpu in allowed}
    for _ in range(passes):
        for cpu in allowed:
            speed[cpu] = max(speed[cpu], probe_core(cpu))
    fast = sorted(allowed, key=speed.__getitem__)[:count]
    os.sched_setaffinity(0, set(fast))
    listed = " ".join(f"{cpu}:{speed[cpu]:.2f}" for cpu in allowed)
    return f"cores (probe ms, slower of {passes}): {listed}; pinned to {sorted(fast)}"


def accelerator_for(model: str) -> str:
    """``gpu`` for the small GPT where CUDA is, else ``cpu``."""
    return "gpu" if torch.cuda.is_available() and model == "gpt" else "cpu"


def device_name(accelerator: str) -> str:
    return torch.cuda.get_device_name() if accelerator == "gpu" else platform.processor() or "CPU"


def trainer(accelerator: str, max_steps: int, callbacks: list, **kwargs: Any) -> Trainer:
    return Trainer(accelerator=accelerator, devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)


# --------------------------------------------------------------------------------------------- modes
class Lit(LightningModule):
    def __init__(self, model: nn.Module, batches: list, kind: str, fused: bool, capturable: bool = False) -> None:
        super().__init__()
        self.model, self.batches, self.kind, self.fused = model, batches, kind, fused
        self.capturable = capturable

    def training_step(self, batch, batch_idx):
        if self.kind == "mlp":
            x, y = batch
            return nn.functional.mse_loss(self.model(x).float(), y.float())
        return self.model(batch)

    def configure_optimizers(self):
        if self.kind == "mlp":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        if self.capturable:  # (both sides: the same optimizer; ours captures its step, Lightning's runs it eagerly)
            lr = torch.tensor(1e-4, device=self.device)
            return torch.optim.AdamW(self.parameters(), lr=lr, fused=self.fused, capturable=True)
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.fused)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


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


def precision_kwargs(mode: str) -> dict[str, Any]:
    """``lightning-<precision>``: Lightning's plugin; ``mp-<spec>``: ours (:func:`plugin`)."""
    if mode.startswith("lightning-"):
        return {"precision": mode[len("lightning-"):]}
    return {"plugins": [plugin(mode.removeprefix("mp-"))]}


def _mode(spec: str) -> str:
    """``bf16-true`` of ``bf16-true/master_weights=none+hostcopy``."""
    return spec.split("+")[0].split("/")[0]


def parse_pairs(p: argparse.ArgumentParser, text: str, switches: bool) -> list[str]:
    """Our modes of ``--pairs``; with ``switches``, attribution switches after ``+`` too."""
    wanted = [w for w in text.split(",") if w]
    unknown = [w for w in wanted if _mode(w) not in LIGHTNING
               or any(part not in WITHOUT for part in w.split("+")[1:]) or ("+" in w and not switches)]
    if unknown or not wanted:
        p.error(f"--pairs {unknown or 'empty'}: use our modes {sorted(LIGHTNING)}, optionally with /option=value "
                f"variants{' and +switches ' + str(sorted(WITHOUT)) if switches else ''}")
    return wanted


# --------------------------------------------------------------------------------------------- attribution switches
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


# --------------------------------------------------------------------------------------------- lockstep
class Baton:
    """Whose turn it is (0 or 1); a side that has finished no longer takes turns."""

    def __init__(self) -> None:
        self.turn, self.done = 0, [False, False]
        self.cond = threading.Condition()

    def pass_to_other(self, me: int) -> None:
        with self.cond:
            self.turn = 1 - me
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me or self.done[1 - me])

    def finish(self, me: int) -> None:
        with self.cond:
            self.done[me] = True
            self.turn = 1 - me
            self.cond.notify_all()


class Lockstep(Callback):
    """Takes turns with the other side at every batch start and times its own turns."""

    def __init__(self, me: int, baton: Baton, warmup: int) -> None:
        self.me, self.baton, self.warmup = me, baton, warmup
        self.times: list[float] = []  # the turns after the warm-up, in step order
        self._start: Optional[float] = None
        self._index = -1

    def _end_turn(self) -> None:
        if self._start is not None and self._index >= self.warmup:
            self.times.append(time.perf_counter() - self._start)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._end_turn()
        self.baton.pass_to_other(self.me)
        self._index = batch_idx
        self._start = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_turn()
        self._start = None
        self.baton.finish(self.me)


def run_pair(lit: str, ours: str, args: Any, accelerator: str, ours_first: bool = False) -> dict[str, Any]:
    """Lightning's ``lit`` and our ``ours`` in lockstep for ``args.warmup + args.steps`` steps each (``ours_first``:
    our step opens each pair)."""
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    baton = Baton()
    name, *parts = ours.split("+")
    sides = [("lightning-" + lit, {"precision": lit}), ("mp-" + ours, {"plugins": [plugin(name)]})]
    if args.same:  # the A/A check: Lightning's mode on both sides (the harness's own bias)
        sides[1] = ("lightning-" + lit, {"precision": lit})
    if ours_first:
        sides.reverse()
    timers = [Lockstep(i, baton, args.warmup) for i in range(2)]
    errors: list[BaseException] = []

    def fit(i: int) -> None:
        try:
            _, kwargs = sides[i]
            model = small_model(args.model, device)
            fused = (accelerator == "gpu" or args.model == "tiny") and args.optimizer != "foreach"
            trainer(accelerator, args.warmup + args.steps, [timers[i]], **kwargs).fit(
                Lit(model, batches, args.model, fused, args.capturable))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
            baton.finish(i)

    batches = small_batches(args.model, args.warmup + args.steps + 1)
    # (attribution switches, timing only: they change our code, which Lightning's side never runs)
    with without(parts):
        first = threading.Thread(target=fit, args=(0,))
        first.start()
        with baton.cond:  # the second side sets up while the first waits at its first batch
            baton.cond.wait_for(lambda: baton.turn == 1 or baton.done[0])
        second = threading.Thread(target=fit, args=(1,))
        second.start()
        first.join()
        second.join()
    if errors:
        raise errors[0]
    a, b = timers[0].times, timers[1].times
    if ours_first:
        a, b = b, a
    n = min(len(a), len(b))
    ratios = [x / y for x, y in zip(a[:n], b[:n])]
    quart = statistics.quantiles(ratios, n=4)
    return {"lightning": lit, "ours": ours, "ours_first": ours_first, "pairs": n,
            "lightning_ms": statistics.median(a) * 1e3, "ours_ms": statistics.median(b) * 1e3,
            "ratio": statistics.median(ratios), "ratio_q1": quart[0], "ratio_q3": quart[2],
            "lightning_s": a, "ours_s": b}


def cmd_lockstep(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    wanted = parse_pairs(p, args.pairs, switches=True)
    if args.cores:
        print(pin_fast_cores(args.cores))
    quiet()
    args.model = args.model or ("gpt" if torch.cuda.is_available() else "mlp")
    accelerator = accelerator_for(args.model)
    rows = []
    for repeat in range(args.repeats):
        for ours in wanted:
            rows.append(run_pair(LIGHTNING[_mode(ours)], ours, args, accelerator, ours_first=repeat % 2 == 1))
    name = device_name(accelerator)
    print(f"\n{args.model} on {name}, torch {torch.__version__}: lockstep pairs ({args.steps} timed steps a side)"
          + (" — A/A check: Lightning's mode on both sides" if args.same else ""))
    print("| Lightning / ours | first | Lightning ms | ours ms | paired ratio (Lightning / ours) | ratios' IQR |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['lightning']} / {row['ours']} | {'ours' if row['ours_first'] else 'Lightning'} | "
              f"{row['lightning_ms']:.3f} | {row['ours_ms']:.3f} | {row['ratio']:.3f} | "
              f"{row['ratio_q1']:.3f}–{row['ratio_q3']:.3f} |")
    # which side opens a pair moves the ratio a little (about 0.5 % on the CPU with the same mode on both sides):
    # the geometric mean over runs with each side first cancels it
    print("\n| Lightning / ours | paired ratio, both orders (geometric mean) | runs |\n|---|---|---|")
    for ours in wanted:
        mine = [row["ratio"] for row in rows if row["ours"] == ours]
        print(f"| {LIGHTNING[_mode(ours)]} / {ours} | {statistics.geometric_mean(mine):.3f} | {len(mine)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "model": args.model, "rows": rows}, f, indent=1)


# --------------------------------------------------------------------------------------------- rounds
class Timer(Callback):
    """CPU: the time of each step after the warm-up. GPU: the mean step time of the round (synchronised at the first
    timed step and at the end only: a sync per step would add the GPU's tail to every step of a launch-bound model)."""

    def __init__(self, warmup: int, cuda: bool, steps: int) -> None:
        self.warmup, self.cuda, self.steps = warmup, cuda, steps
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []
        self.thread_marks: list[float] = []
        self.step_marks: list[float] = []  # every timed step's start, no sync (``--per-step``)

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


def run_round(mode: str, model: nn.Module, batches: list, args, accelerator: str) -> list[float]:
    timer = Timer(args.warmup, accelerator == "gpu", args.steps)
    trainer(accelerator, args.warmup + args.steps, [timer], **precision_kwargs(mode)).fit(
        Lit(model, batches, args.model, accelerator == "gpu"))
    return timer.times(cpu=args.cpu_time, thread=args.thread_time, per_step=args.per_step)


def measurement(name: str, times: list[float]) -> Measurement:
    return Measurement(1, times, TaskSpec(stmt=name, setup="", label="host cost", sub_label=name))


def cmd_rounds(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    wanted = parse_pairs(p, args.pairs, switches=False)
    if args.fast_cores:
        print(pin_fast_cores(args.fast_cores))
    quiet(args.threads)
    args.model = args.model or ("gpt" if torch.cuda.is_available() else "mlp")
    accelerator = accelerator_for(args.model)
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    pairs = [(LIGHTNING[_mode(w)], w) for w in wanted]
    modes: list[str] = []
    for lit, ours in pairs:
        modes += [m for m in (f"lightning-{lit}", f"mp-{ours}") if m not in modes]
    models = {m: small_model(args.model, device) for m in modes}
    batches = small_batches(args.model, args.warmup + args.steps)
    times: dict[str, list[float]] = {m: [] for m in modes}
    by_round: dict[str, list[list[float]]] = {m: [] for m in modes}  # each round's figures
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            figures = run_round(mode, models[mode], batches, args, accelerator)
            times[mode] += figures
            by_round[mode].append(figures)
    name = device_name(accelerator)
    print(f"\n{args.model} on {name}, torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps, "
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
            json.dump({"device": name, "torch": torch.__version__, "model": args.model, "rows": rows,
                       "fast_cores": args.fast_cores, "times_s": times}, f, indent=1)


# --------------------------------------------------------------------------------------------- phases
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


class Marked(Lit):
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


def run_phases(mode: str, model: nn.Module, batches: list, args: argparse.Namespace, accelerator: str) -> dict:
    name, *parts = mode.split("+")
    with without(parts):
        marks = Marks()
        module = Marked(model, batches, args.model, True)
        module.marks = marks
        trainer(accelerator, args.warmup + args.steps, [marks], **precision_kwargs(name)).fit(module)
    phases: dict[str, list[float]] = collections.defaultdict(list)
    timed = marks.steps[args.warmup:]
    for step, following in zip(timed, timed[1:]):
        for (a, ta), (b, tb) in zip(step, step[1:]):
            phases[f"{a}>{b}"].append(tb - ta)
        phases["batch_end>next"].append(following[0][1] - step[-1][1])
        phases["step"].append(following[0][1] - step[0][1])
    return phases


def cmd_phases(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        unknown = [part for part in mode.split("+")[1:] if part not in WITHOUT]
        if unknown or not mode.startswith(("lightning-", "mp-")):
            p.error(f"{mode}: use lightning-<precision> or mp-<mode>[/option=value...][+switch...]; unknown "
                    f"switch(es) {unknown}, known: {sorted(WITHOUT)}")
    if args.fast_cores:
        print(pin_fast_cores(args.fast_cores))
    quiet()
    cuda = torch.cuda.is_available()
    args.model = args.model or ("gpt" if cuda else "tiny")
    accelerator = "gpu" if cuda else "cpu"
    models = {m: small_model(args.model, torch.device("cpu")) for m in modes}
    batches = small_batches(args.model, args.warmup + args.steps)
    figures: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            for phase, times in run_phases(mode, models[mode], batches, args, accelerator).items():
                figures[mode][phase] += times
    names: list[str] = []
    for mode in modes:
        names += [k for k in figures[mode] if k not in names and k != "step"]
    print(f"{args.model} on {device_name(accelerator)}: host µs a step by phase (median of {args.rounds} x "
          f"{args.steps} steps)")
    print("| phase | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    for phase in names + ["step"]:
        cells = [f"{statistics.median(figures[m][phase]) * 1e6:.0f}" if figures[m].get(phase) else "-" for m in modes]
        print(f"| {phase} | " + " | ".join(cells) + " |")


# --------------------------------------------------------------------------------------------- kernels
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Sync(Callback):
    """Times the steps after the warm-up (synchronised at their start and at the end); with ``prof``, profiles only
    them (set-up, the warm-up and teardown stay out of the kernel counts)."""

    def __init__(self, warmup: int, prof: bool = False) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.warmup, self.t0, self.t1 = warmup, 0.0, 0.0
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if prof else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            _sync()
            if self.prof is not None:
                self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        _sync()
        self.t1 = time.perf_counter()
        if self.prof is not None:
            self.prof.__exit__(None, None, None)


def fit_kernels(mode: str, model, batches, args: argparse.Namespace, steps: int, warmup: int, prof: bool = False):
    """One fit of ``mode``: its synchronised wall time a step, or (``prof``) its kernels and host ops."""
    sync = Sync(warmup, prof)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer(accelerator, warmup + steps, [sync], **precision_kwargs(mode)).fit(Lit(model, batches, args.model, True))
    if not prof:
        return (sync.t1 - sync.t0) / steps, None
    profiled = sync.prof
    kernels = [e for e in profiled.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = {a.key: (a.count, a.self_cpu_time_total) for a in profiled.key_averages()}
    return None, (kernels, ops)


def busy_ms(kernels) -> float:
    """The GPU's busy time: the union of the kernels' intervals (overlapping kernels counted once)."""
    spans = sorted((k.time_range.start, k.time_range.end) for k in kernels)
    total, end = 0, None
    for a, b in spans:
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def cmd_kernels(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    wanted = parse_pairs(p, args.pairs, switches=False)
    quiet()
    args.model = args.model or ("gpt" if torch.cuda.is_available() else "tiny")
    batches = small_batches(args.model, args.steps + 10)
    rows = []
    counts, times, cpu = {}, {}, {}
    n = args.steps
    for ours in wanted:
        base = f"lightning-{LIGHTNING[_mode(ours)]}"
        for mode in (base, f"mp-{ours}"):
            if mode in counts:
                continue
            model = small_model(args.model, torch.device("cpu"))
            fit_kernels(mode, model, batches, args, 10, 5)
            wall = sorted(fit_kernels(mode, model, batches, args, n, 5)[0] for _ in range(3))[1]
            _, (kernels, ops) = fit_kernels(mode, model, batches, args, n, 5, prof=True)
            counts[mode] = collections.Counter(k.name for k in kernels)
            ktime: collections.Counter = collections.Counter()
            for k in kernels:
                ktime[k.name] += k.time_range.elapsed_us() / n
            times[mode], cpu[mode] = ktime, ops
            rows.append((mode, wall * 1e3, busy_ms(kernels) / n, len(kernels) / n))
        lit, mine = counts[base], counts[f"mp-{ours}"]
        extra = sorted(((mine[k] - lit.get(k, 0)) / n, k) for k in set(mine) | set(lit))
        print(f"\n{ours}: kernels a step launched more (+) or fewer (-) than Lightning's {base[len('lightning-'):]}:")
        for d, name in sorted(extra, reverse=True)[: args.top] + sorted(extra)[:3]:
            if d:
                print(f"  {d:+6.1f}  {name[:110]}")
        lt, mt = times[base], times[f"mp-{ours}"]
        dt = sorted(((mt[k] - lt.get(k, 0), k) for k in set(mt) | set(lt)), reverse=True)
        print(f"{ours}: GPU time a step (us) more than Lightning's, by kernel:")
        for d, name in dt[:8]:
            print(f"  {d:+8.1f}  {name[:110]}")
        lc, mc = cpu[base], cpu[f"mp-{ours}"]
        dc = sorted((((mc.get(k, (0, 0))[1] - lc.get(k, (0, 0))[1]) / n, k,
                      (mc.get(k, (0, 0))[0] - lc.get(k, (0, 0))[0]) / n) for k in set(mc) | set(lc)),
                    reverse=True)
        print(f"{ours}: host (self CPU) time a step (us) more than Lightning's, by op, with calls a step:")
        for d, name, c in dc[: args.top]:
            print(f"  {d:+8.1f}  {c:+6.1f}  {name[:100]}")
    print(f"\n{device_name('gpu' if torch.cuda.is_available() else 'cpu')}, torch {torch.__version__}; {n} steps a fit")
    print("| mode | wall ms a step | GPU busy ms a step | kernels a step |")
    print("|---|---|---|---|")
    for mode, wall, busy, k in rows:
        print(f"| {mode} | {wall:.2f} | {busy:.2f} | {k:.0f} |")


# --------------------------------------------------------------------------------------------- cprofile
def attribute(stats: pstats.Stats, steps: int) -> None:
    """Host time per step spent in lightning_mp's own code, and in torch calls made directly from it."""
    package_host_time(stats, steps, top=15)


def cmd_cprofile(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    mode = args.mode if args.mode.startswith("lightning-") else f"mp-{args.mode}"
    quiet()
    args.model = args.model or ("gpt" if torch.cuda.is_available() else "tiny")
    accelerator = accelerator_for(args.model)
    batches = small_batches(args.model, max(args.steps, args.warmup))

    def fit(n: int) -> None:
        model = small_model(args.model, torch.device("cpu"))
        trainer(accelerator, n, [], **precision_kwargs(mode)).fit(Lit(model, batches, args.model, True))

    fit(args.warmup)  # compilation, allocator and cuBLAS warm-up stay out of the profile
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    fit(args.steps)
    _sync()
    profile.disable()
    print(f"{args.mode} on {device_name(accelerator)}: {(time.perf_counter() - start) / args.steps * 1e3:.2f} ms a "
          "step (with the Trainer's start-up)")
    stats = pstats.Stats(profile)
    attribute(stats, args.steps)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumtime").print_stats("lightning_mp", 25)


# --------------------------------------------------------------------------------------------- command line
MODEL_HELP = ("gpt (the small GPT, on a GPU), tiny (a GPT of the same depth but width 32, on the CPU: its step is "
              "nearly all host work, as gpt's on a GPU) or mlp (CPU)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{lockstep,rounds,phases,kernels,cprofile}")

    lock = sub.add_parser("lockstep", help="Lightning's step and ours in lockstep (the trusted figure)")
    lock.add_argument("--model", choices=["gpt", "mlp", "tiny"], default=None,
                      help=MODEL_HELP + "; default: gpt on a GPU, mlp otherwise")
    lock.add_argument("--pairs", default="bf16,fp16,bf16-true",
                      help="our modes, each beside Lightning's (variants: bf16-true/master_weights=none; attribution "
                           "switches, timing only: bf16-true+hostcopy)")
    lock.add_argument("--warmup", type=int, default=20, help="untimed steps per side (default 20)")
    lock.add_argument("--steps", type=int, default=300, help="timed steps per side (default 300)")
    lock.add_argument("--repeats", type=int, default=2,
                      help="runs of each pair, the side that opens each pair of steps alternating (default 2)")
    lock.add_argument("--same", action="store_true",
                      help="the A/A check: Lightning's mode on both sides (the ratio then shows the harness's bias)")
    lock.add_argument("--cores", type=int, default=1,
                      help="keep the process on the N fastest cores (default 1: both sides on one core; 0: as it is)")
    lock.add_argument("--json", default=None, help="also write the raw figures to this JSON file")
    lock.add_argument("--optimizer", choices=["fused", "foreach"], default="fused",
                      help="the GPT's AdamW implementation, both sides (default fused)")
    lock.add_argument("--capturable", action="store_true",
                      help="AdamW(capturable=True, lr a CUDA tensor) on both sides: ours captures bf16/fp32 steps")

    rounds = sub.add_parser("rounds", help="the modes interleaved by rounds (GPU-bound modes, the CPU MLP)")
    rounds.add_argument("--model", choices=["mlp", "gpt", "tiny"], default=None,
                        help=MODEL_HELP + "; default: gpt on a GPU, mlp otherwise")
    rounds.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    rounds.add_argument("--warmup", type=int, default=10, help="untimed steps per round (default 10)")
    rounds.add_argument("--steps", type=int, default=60, help="timed steps per round (default 60)")
    rounds.add_argument("--pairs", default=",".join(m for _, m in PAIRS),
                        help="our modes, each beside Lightning's (default: all four); variants as for lockstep")
    rounds.add_argument("--cpu-time", action="store_true",
                        help="time the process's CPU time instead of wall time (with one thread: the host work alone, "
                             "unaffected by other processes on a shared machine)")
    rounds.add_argument("--thread-time", action="store_true",
                        help="time each step by the main thread's CPU time (a figure a step, also on a GPU: time the "
                             "thread spent descheduled does not count; waits on the GPU do, as spinning)")
    rounds.add_argument("--per-step", action="store_true",
                        help="on a GPU: every step's wall interval (no sync per step) instead of one mean a round; "
                             "also prints the 20th percentile of the steps and the paired ratio of the rounds' medians")
    rounds.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    rounds.add_argument("--fast-cores", type=int, default=0,
                        help="probe every core and keep the process on the N fastest (0: not pinned)")
    rounds.add_argument("--json", default=None, help="also write the raw figures to this JSON file")

    phases = sub.add_parser("phases", help="a step's host time hook to hook, with attribution switches")
    phases.add_argument("--modes", default="lightning-bf16-true,mp-bf16-true,lightning-bf16-mixed,mp-bf16",
                        help="lightning-<precision> or mp-<mode>[/option=value...][+switch...] (switches: "
                             + ", ".join(WITHOUT) + ")")
    phases.add_argument("--model", choices=["gpt", "tiny", "mlp"], default=None,
                        help="default: gpt on a GPU, tiny else")
    phases.add_argument("--rounds", type=int, default=5)
    phases.add_argument("--warmup", type=int, default=10)
    phases.add_argument("--steps", type=int, default=40)
    phases.add_argument("--fast-cores", type=int, default=0,
                        help="probe every core and keep the process on the N fastest (0: not pinned)")

    kernels = sub.add_parser("kernels", help="GPU kernels and busy time a step, ours beside Lightning's")
    kernels.add_argument("--pairs", default="bf16-true,bf16", help="our modes, each beside Lightning's")
    kernels.add_argument("--model", choices=["gpt", "tiny"], default=None, help="default: gpt on a GPU, tiny else")
    kernels.add_argument("--steps", type=int, default=40, help="steps a fit (default 40)")
    kernels.add_argument("--top", type=int, default=12, help="rows of each difference listed (default 12)")

    prof = sub.add_parser("cprofile", help="cProfile of one mode's fit: where lightning_mp's host time goes")
    prof.add_argument("--mode", default="bf16-true",
                      help="our mode (variants as for lockstep) or lightning-<precision> (default bf16-true)")
    prof.add_argument("--model", choices=["gpt", "tiny", "mlp"], default=None, help="default: gpt on a GPU, tiny else")
    prof.add_argument("--warmup", type=int, default=20, help="steps of the unprofiled warm-up fit (default 20)")
    prof.add_argument("--steps", type=int, default=200, help="steps of the profiled fit (default 200)")
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace, argparse.ArgumentParser], None]] = {
    "lockstep": cmd_lockstep, "rounds": cmd_rounds, "phases": cmd_phases, "kernels": cmd_kernels,
    "cprofile": cmd_cprofile,
}


def main(argv: Optional[list[str]] = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    COMMANDS[args.command](args, p)


if __name__ == "__main__":
    main()
