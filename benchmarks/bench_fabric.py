"""Lightning Fabric: ``MPFabricPrecision`` against Fabric's own precision plugins on a LitGPT model, step by step.

A LitGPT ``GPT`` trained with Fabric in a plain loop, as LitGPT's pretraining loop runs it: forward, cross-entropy,
``fabric.backward``, ``fabric.clip_gradients(max_norm=1.0)``, ``optimizer.step()``, ``optimizer.zero_grad()``
(foreach AdamW; ``--optimizer fused`` for LitGPT's own choice on a GPU, which Fabric's ``16-mixed`` cannot clip).
Fabric's side is ``Fabric(precision=...)`` (``bf16-mixed``, ``16-mixed``, ``bf16-true``, ...); ours is
``Fabric(plugins=[MPFabricPrecision(mode, ...)])`` with ``plugin.setup_optimizers(optimizer)``, as docs/fabric.md
shows (``--join-at-step``: without it, as LitGPT's own scripts run, the optimizer joining at its first step; the
run's set-up differs, e.g. the inf/NaN check during backward of ``lightning_mp.overlap`` is installed only for the
optimizers known when the run connects). Both build the same model config from the same seed and train on the same
batches. Two commands:

``lockstep`` (the trusted figure)
    Fabric's run and ours, both set up in one process, alternate single steps: Fabric's step k, ours, Fabric's
    step k + 1, ... Each step is timed alone: ``torch.cuda.synchronize()`` before it and after it, host clock
    between (the step's host work and its GPU work, nothing of the other side's), ``--turn N`` steps a turn (one
    sync a turn: the host runs ahead of the GPU inside a turn, as in a loop that never syncs). After ``--warmup``
    untimed steps a side, ``--pairs`` pairs with Fabric's step first, then ``--pairs`` with ours first. The figure
    is the median over pairs of the ratio Fabric / ours (above 1: ours is faster), with the ratios' interquartile
    range and a 95 % interval of the median (order statistics; the pairs are taken as independent), per order, then
    the geometric mean of both orders and the median of all pairs with its interval. ``--same`` is the A/A check:
    Fabric's plugin on both sides, then ours on both sides (the ratio shows the harness's own bias; it should read
    1.00 within the interval). ``--profile`` profiles instead (below).
``lockstep --profile``
    Where ours spends more than Fabric's, per mode: the host time of each phase of the step (forward and loss,
    backward, clip, step, zero_grad; no sync inside the step, so a phase that waits on the GPU shows the wait) and
    the GPU tail after it, medians over ``--profile-steps`` alternating steps; then ``torch.profiler`` over
    ``--profile-steps`` steps of each side: the operators whose self CPU time and the kernels whose GPU time are
    larger in ours, ours minus Fabric's a step, and for the top CPU operators the lightning_mp functions that call
    them (a second profile of ours with Python stacks; on a GPU the hooks autograd runs during backward run on its
    device thread, which the profiler's Python tracer does not follow: their time shows as ``AccumulateGrad``'s own,
    and cProfile names them); last, cProfile of ours: lightning_mp's own host time a step and its costliest
    functions.
``rounds``
    The older measure: one Fabric per row, the rows' rounds interleaved (``--rounds``), each the median of
    ``--steps`` synchronised steps after ``--warmup``; ratios Fabric / ours of the rounds' medians. Rounds move by
    ±10–20 % on a shared host: use lockstep for gaps of a few per cent.

Modes (``--modes``): ours by name, each beside Fabric's same mode (``bf16`` / ``bf16-mixed``, ``fp16`` /
``16-mixed``, ``bf16-true`` / ``bf16-true``, ``fp16-true`` / ``16-true``, ``fp32`` / ``32-true``); a variant names
plugin arguments after the mode: ``bf16-true/master_weights=none`` (Fabric's own layout: half weights, no masters),
``bf16-true/master_weights=none/fp32_modules=none`` (no FP32 guards either).

Models (``--model``): ``litgpt`` (the default: LitGPT's Pythia-like GPT, 12 layers × 768, vocab 50304, 2 × 1024
tokens a step), ``pythia-160m`` (LitGPT's own config of that name, block size ``--seq``), ``tiny`` (2 layers × 64,
vocab 256, 2 × 64 tokens, on the CPU: the smoke run). ``--layers``, ``--embd``, ``--vocab``, ``--seq``, ``--batch``
override the shapes.

Needs litgpt (``pip install litgpt``; on the GPU machine its wheel with ``--no-deps``, and ``safetensors``). Run::

    PYTHONPATH=. python benchmarks/bench_fabric.py lockstep [--modes bf16,fp16,bf16-true,...] [--pairs 100]
    PYTHONPATH=. python benchmarks/bench_fabric.py lockstep --same --modes bf16-true       # the A/A check
    PYTHONPATH=. python benchmarks/bench_fabric.py lockstep --profile --modes bf16-true,bf16-true/master_weights=none
    PYTHONPATH=. python benchmarks/bench_fabric.py rounds [--rounds 3]

Smoke runs on the CPU (each well under a minute)::

    PYTHONPATH=. python benchmarks/bench_fabric.py lockstep --model tiny --warmup 2 --pairs 5
    PYTHONPATH=. python benchmarks/bench_fabric.py lockstep --model tiny --warmup 2 --pairs 5 --same --modes bf16
    PYTHONPATH=. python benchmarks/bench_fabric.py lockstep --model tiny --warmup 2 --profile --profile-steps 3 \
        --modes bf16-true
    PYTHONPATH=. python benchmarks/bench_fabric.py rounds --model tiny --warmup 2 --steps 3 --rounds 1
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import LIGHTNING_PRECISION, mode_spec, package_host_time, paired_summary  # noqa: E402

from lightning_mp import MPFabricPrecision  # noqa: E402

DEFAULT_MODES = "bf16,fp16,bf16-true,bf16-true/master_weights=none"
#: shapes per model: layers, embd, vocab, seq, batch (``pythia-160m`` takes its layers, width and vocab from LitGPT)
SHAPES = {"litgpt": (12, 768, 50304, 1024, 2), "pythia-160m": (12, 768, 50304, 1024, 2), "tiny": (2, 64, 256, 64, 2)}
#: the step's phases, in order, as ``--profile`` reports them (``tail``: waiting for the GPU after the step)
PHASES = ["forward+loss", "backward", "clip", "step", "zero_grad", "tail"]


# --------------------------------------------------------------------------------------------- one side
class Side:
    """One Fabric run: ``kind`` ``"fabric"`` (``Fabric(precision=...)``, the mode's own plugin) or ``"ours"``
    (``MPFabricPrecision`` of the spec), its model, optimizer and batches; :meth:`step` runs one training step."""

    def __init__(self, kind: str, spec: str, args: argparse.Namespace, label: Optional[str] = None) -> None:
        from litgpt import GPT

        mode, kwargs = mode_spec(spec)
        self.kind, self.spec = kind, spec
        self.label = label or (f"Fabric {LIGHTNING_PRECISION[mode]}" if kind == "fabric" else f"ours {spec}")
        accelerator = "cuda" if args.device == "cuda" else "cpu"
        self.plugin: Optional[MPFabricPrecision] = None
        if kind == "fabric":
            if kwargs:
                raise ValueError(f"{spec!r}: Fabric's own plugin takes no options")
            self.fabric = Fabric(accelerator=accelerator, devices=1, precision=LIGHTNING_PRECISION[mode])
        else:
            self.plugin = MPFabricPrecision(mode, **kwargs)
            self.fabric = Fabric(accelerator=accelerator, devices=1, plugins=[self.plugin])
        torch.manual_seed(0)
        with self.fabric.init_module(empty_init=False):
            model = GPT(litgpt_config(args))
        opt = {"fused": True} if args.optimizer == "fused" else {"foreach": True}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **opt)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        if self.plugin is not None and not args.join_at_step:
            self.plugin.setup_optimizers(self.optimizer)
        self.batches = [batch.to(self.fabric.device) for batch in make_batches(args)]
        self.count = 0
        self.cuda = self.fabric.device.type == "cuda"

    def step(self, mark: Optional[Callable[[], None]] = None) -> None:
        """One training step on the next batch; ``mark`` is called after each phase (:data:`PHASES` but the tail)."""
        batch = self.batches[self.count % len(self.batches)]
        self.count += 1
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        if mark is not None:
            mark()
        self.fabric.backward(loss)
        if mark is not None:
            mark()
        self.fabric.clip_gradients(self.model, self.optimizer, max_norm=1.0, error_if_nonfinite=False)
        if mark is not None:
            mark()
        self.optimizer.step()
        if mark is not None:
            mark()
        self.optimizer.zero_grad()
        if mark is not None:
            mark()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def turn(self, steps: int) -> float:
        """ms a step over ``steps`` steps, synchronised before and after them."""
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        return (time.perf_counter() - start) / steps * 1e3

    def close(self) -> None:
        if self.plugin is not None:
            self.plugin.teardown()  # (the TF32 flags and anything else process-wide go back)


def litgpt_config(args: argparse.Namespace) -> Any:
    from litgpt import Config

    if args.model == "pythia-160m":
        return Config.from_name("pythia-160m", block_size=args.seq)
    return Config(n_layer=args.layers, n_embd=args.embd, n_head=max(1, args.embd // 64), vocab_size=args.vocab,
                  padded_vocab_size=args.vocab, block_size=args.seq)


def make_batches(args: argparse.Namespace, count: int = 4) -> list[torch.Tensor]:
    """``count`` batches of random tokens (seed 1), the same for every side; the sides cycle through them."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(count)]


def release(sides: list[Side]) -> None:
    for side in sides:
        side.close()
    sides.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_up(sides: list[Side], steps: int) -> None:
    for _ in range(steps):
        for side in sides:
            side.step()
    for side in sides:
        side.sync()


# --------------------------------------------------------------------------------------------- lockstep
def lockstep(a: tuple[str, str, str], b: tuple[str, str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Sides ``a`` and ``b`` (kind, spec, label) in lockstep: ``args.pairs`` pairs with ``a`` first, then as many
    with ``b`` first; a row per order (ratio: a / b)."""
    sides = [Side(a[0], a[1], args, a[2]), Side(b[0], b[1], args, b[2])]
    try:
        warm_up(sides, args.warmup)
        rows = []
        for opener in (0, 1):
            times: tuple[list[float], list[float]] = ([], [])
            for _ in range(args.pairs):
                for i in (opener, 1 - opener):
                    times[i].append(sides[i].turn(args.turn))
            rows.append({"a": sides[0].label, "b": sides[1].label, "first": sides[opener].label,
                         "a_ms": statistics.median(times[0]), "b_ms": statistics.median(times[1]),
                         **paired_summary([x / y for x, y in zip(*times)]), "a_times": times[0],
                         "b_times": times[1]})
        return rows
    finally:
        release(sides)


def cmd_lockstep(args: argparse.Namespace) -> None:
    if args.profile:
        for spec in args.modes:
            profile(spec, args)
        return
    runs = []
    for spec in args.modes:
        mode = mode_spec(spec)[0]
        fabric = ("fabric", mode, f"Fabric {LIGHTNING_PRECISION[mode]}")
        ours = ("ours", spec, f"ours {spec}")
        if args.same:
            runs.append(lockstep(fabric, fabric[:2] + (fabric[2] + " #2",), args))
            runs.append(lockstep(ours, ours[:2] + (ours[2] + " #2",), args))
        else:
            runs.append(lockstep(fabric, ours, args))
    print(f"\n{describe(args)}: lockstep, {args.pairs} pairs an order, {args.turn} step(s) a turn"
          + (" — A/A check: the same plugin on both sides" if args.same else ""))
    print("| a / b | first | a ms | b ms | paired ratio a / b | ratios' IQR | median's 95 % interval |")
    print("|---|---|---|---|---|---|---|")
    for rows in runs:
        for row in rows:
            print(f"| {row['a']} / {row['b']} | {row['first']} | {row['a_ms']:.2f} | {row['b_ms']:.2f} | "
                  f"{row['ratio']:.3f} | {row['q1']:.3f}–{row['q3']:.3f} | {row['ci_lo']:.3f}–{row['ci_hi']:.3f} |")
    # (which side opens a pair can move the ratio a little: the geometric mean of both orders cancels it)
    print("\n| a / b (above 1: b faster) | both orders: geometric mean | all pairs: median (95 % interval) |"
          + (" A/A |" if args.same else "") + "\n|---|---|---|" + ("---|" if args.same else ""))
    for rows in runs:
        gm = statistics.geometric_mean([row["ratio"] for row in rows])
        ratios = [x / y for row in rows for x, y in zip(row["a_times"], row["b_times"])]
        both = paired_summary(ratios)
        verdict = ""
        if args.same:
            verdict = " within |" if both["ci_lo"] <= 1.0 <= both["ci_hi"] else " **outside** |"
        print(f"| {rows[0]['a']} / {rows[0]['b']} | {gm:.3f} | {both['ratio']:.3f} ({both['ci_lo']:.3f}–"
              f"{both['ci_hi']:.3f}) |{verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": describe(args), "args": vars(args), "runs": runs}, f, indent=1)


def describe(args: argparse.Namespace) -> str:
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    import lightning

    shape = "Pythia-160M config" if args.model == "pythia-160m" else f"{args.layers} x {args.embd}"
    joins = "joining at its first step" if args.join_at_step else "given to setup_optimizers"
    return (f"LitGPT {shape} ({args.model}), {args.batch} x {args.seq} tokens, {args.optimizer} AdamW ({joins}), "
            f"clipping every step, on {where}, torch {torch.__version__}, lightning {lightning.__version__}")


# --------------------------------------------------------------------------------------------- profile
def phase_times(side: Side) -> list[float]:
    """Host ms of each phase of one step (:data:`PHASES`), synchronised before the step and after it only."""
    marks: list[float] = []
    side.sync()
    marks.append(time.perf_counter())
    side.step(lambda: marks.append(time.perf_counter()))
    side.sync()
    marks.append(time.perf_counter())
    return [(t1 - t0) * 1e3 for t0, t1 in zip(marks, marks[1:])]


def torch_profile(side: Side, steps: int, stack: bool = False) -> Any:
    from torch.profiler import ProfilerActivity, profile as torch_profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if side.cuda else [])
    with torch_profiler(activities=activities, with_stack=stack) as prof:
        for _ in range(steps):
            side.step()
        side.sync()
    return prof


def _device_us(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def op_table(theirs: Any, ours: Any, steps: int, key: Callable[[Any], float], top: int) -> list[tuple]:
    """(name, ours − theirs µs a step, ours µs, theirs µs, ours calls, theirs calls a step), largest differences
    first, of the profiles' operators by ``key`` (µs over the profile)."""
    a = {e.key: e for e in theirs.key_averages()}
    b = {e.key: e for e in ours.key_averages()}
    rows = []
    for name in set(a) | set(b):
        ta, tb = (key(a[name]) if name in a else 0.0), (key(b[name]) if name in b else 0.0)
        ca, cb = (a[name].count if name in a else 0), (b[name].count if name in b else 0)
        rows.append((name, (tb - ta) / steps, tb / steps, ta / steps, cb / steps, ca / steps))
    rows.sort(key=lambda row: row[1], reverse=True)
    return rows[:top]


def callers_in_package(prof: Any, names: list[str], top: int = 3) -> dict[str, list[tuple[str, float]]]:
    """For each operator name, the innermost lightning_mp function among the Python frames above it (a profile taken
    with ``with_stack=True`` records them as events, each operator's ``cpu_parent`` chain), with the operator's self
    CPU µs over the profile summed by that function."""
    found: dict[str, dict[str, float]] = {name: {} for name in names}
    marker = "lightning_mp" + os.sep
    for event in prof.events():
        if event.name not in found:
            continue
        where, parent = "(no lightning_mp frame)", event.cpu_parent
        while parent is not None:
            if marker in parent.name:
                where = parent.name.split(marker, 1)[-1]
                break
            parent = parent.cpu_parent
        found[event.name][where] = found[event.name].get(where, 0.0) + event.self_cpu_time_total
    return {name: sorted(w.items(), key=lambda kv: -kv[1])[:top] for name, w in found.items()}


def profile(spec: str, args: argparse.Namespace) -> None:
    mode = mode_spec(spec)[0]
    sides = [Side("fabric", mode, args), Side("ours", spec, args)]
    try:
        warm_up(sides, args.warmup)
        n = args.profile_steps
        print(f"\n### Profile: {sides[0].label} against {sides[1].label} — {describe(args)}")
        phases: list[list[list[float]]] = [[], []]
        for _ in range(max(n, 20)):
            for i, side in enumerate(sides):
                phases[i].append(phase_times(side))
        print(f"\nHost ms a step by phase (median of {max(n, 20)} alternating steps; no sync inside a step)")
        print("| phase | Fabric | ours | ours − Fabric |\n|---|---|---|---|")
        for j, phase in enumerate(PHASES + ["whole step"]):
            med = [statistics.median(sum(p) if phase == "whole step" else p[j] for p in phases[i]) for i in (0, 1)]
            print(f"| {phase} | {med[0]:.3f} | {med[1]:.3f} | {med[1] - med[0]:+.3f} |")
        profs = [torch_profile(side, n) for side in sides]
        warnings.filterwarnings("ignore", message=".*self_cuda_time_total.*")
        tables = [("self CPU", lambda e: e.self_cpu_time_total)]
        if sides[0].cuda:
            tables.append(("GPU", _device_us))
        for what, key in tables:
            totals = [sum(key(e) for e in prof.key_averages()) / n for prof in profs]
            print(f"\nTop operators by {what} time, ours − Fabric's (µs a step over {n} steps; totals: Fabric "
                  f"{totals[0]:.0f}, ours {totals[1]:.0f})")
            print("| operator | ours − Fabric | ours | Fabric | calls a step ours / Fabric |\n|---|---|---|---|---|")
            rows = op_table(profs[0], profs[1], n, key, args.top)
            for name, diff, mine, theirs, cm, ct in rows:
                print(f"| {name[:90]} | {diff:+.0f} | {mine:.0f} | {theirs:.0f} | {cm:.1f} / {ct:.1f} |")
            if what == "self CPU":
                cpu_top = [row[0] for row in rows if row[1] > 0]
        stacked = torch_profile(sides[1], n, stack=True)
        print(f"\nWhere in lightning_mp ours calls its top CPU operators (self CPU µs a step, {n} steps, with stacks)")
        print("| operator | innermost lightning_mp frame: µs a step |\n|---|---|")
        for name, frames in callers_in_package(stacked, cpu_top).items():
            print(f"| {name[:60]} | " + "; ".join(f"{w} {us / n:.0f}" for w, us in frames) + " |")
        cprof = cProfile.Profile()
        cprof.enable()
        for _ in range(n):
            sides[1].step()
        sides[1].sync()
        cprof.disable()
        print(f"\ncProfile of ours, {n} steps")
        package_host_time(pstats.Stats(cprof), n, args.top)
    finally:
        release(sides)


# --------------------------------------------------------------------------------------------- rounds
def cmd_rounds(args: argparse.Namespace) -> None:
    """Every row set up once (the rounds time the same runs); the rows' rounds interleaved."""
    rows: list[Side] = []
    pairs: dict[str, str] = {}
    for spec in args.modes:
        mode = mode_spec(spec)[0]
        fabric_label = f"Fabric {LIGHTNING_PRECISION[mode]}"
        if all(side.label != fabric_label for side in rows):
            rows.append(Side("fabric", mode, args))
        rows.append(Side("ours", spec, args))
        pairs[rows[-1].label] = fabric_label
    try:
        warm_up(rows, args.warmup)
        medians: dict[str, list[float]] = {side.label: [] for side in rows}
        for _ in range(args.rounds):
            for side in rows:
                medians[side.label].append(statistics.median(side.turn(1) for _ in range(args.steps)))
        print(f"\n{describe(args)}: median step ms per round, {args.rounds} interleaved rounds of {args.steps} steps")
        print("| row | step ms (rounds) | ratio Fabric / ours |\n|---|---|---|")
        for side in rows:
            ms = statistics.median(medians[side.label])
            fabric = pairs.get(side.label)
            ratio = f"{statistics.median(medians[fabric]) / ms:.3f}" if fabric else ""
            print(f"| {side.label} | {ms:.2f} ({', '.join(f'{m:.2f}' for m in medians[side.label])}) | {ratio} |")
    finally:
        release(rows)


# --------------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", choices=sorted(SHAPES), default="litgpt",
                        help="litgpt (12 x 768, the default), pythia-160m (LitGPT's config), tiny (the CPU smoke)")
    common.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one, cpu for tiny)")
    for name in ("layers", "embd", "vocab", "seq", "batch"):
        common.add_argument(f"--{name}", type=int, default=None, help="override the model's shape")
    common.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"our modes, each beside Fabric's same mode (default {DEFAULT_MODES}); variants: "
                             "bf16-true/master_weights=none/fp32_modules=none")
    common.add_argument("--optimizer", choices=["foreach", "fused"], default="foreach",
                        help="AdamW's implementation (default foreach: Fabric's 16-mixed cannot clip a fused one)")
    common.add_argument("--join-at-step", action="store_true",
                        help="ours: no plugin.setup_optimizers(optimizer); the optimizer joins at its first step, as "
                             "in LitGPT's own scripts")
    sub = p.add_subparsers(dest="command", required=True, metavar="{lockstep,rounds}")
    lock = sub.add_parser("lockstep", parents=[common], help="Fabric's step and ours alternating (the trusted figure)")
    lock.add_argument("--warmup", type=int, default=20, help="untimed steps a side (default 20)")
    lock.add_argument("--pairs", type=int, default=100, help="timed pairs an order (default 100)")
    lock.add_argument("--turn", type=int, default=1, help="steps a side runs per turn, one sync a turn (default 1)")
    lock.add_argument("--same", action="store_true",
                      help="the A/A check: Fabric's plugin on both sides, then ours on both sides")
    lock.add_argument("--profile", action="store_true",
                      help="profile each mode instead: phases, torch.profiler ours − Fabric's, cProfile of ours")
    lock.add_argument("--profile-steps", type=int, default=5, help="steps a side profiled (default 5)")
    lock.add_argument("--top", type=int, default=12, help="rows of each profile table (default 12)")
    lock.add_argument("--json", default=None, help="also write the raw figures to this JSON file")
    rounds = sub.add_parser("rounds", parents=[common], help="the rows' rounds interleaved (the older measure)")
    rounds.add_argument("--warmup", type=int, default=5, help="untimed steps a row (default 5)")
    rounds.add_argument("--steps", type=int, default=20, help="timed steps a round (default 20)")
    rounds.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every row (default 3)")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    layers, embd, vocab, seq, batch = SHAPES[args.model]
    for name, value in zip(("layers", "embd", "vocab", "seq", "batch"), (layers, embd, vocab, seq, batch)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and args.model != "tiny" else "cpu"
    if args.device == "cpu":
        torch.set_num_threads(1)  # (the host's work alone, not the other threads' scheduling)
    args.modes = [m for m in args.modes.split(",") if m]
    for spec in args.modes:
        try:
            if mode_spec(spec)[0] not in LIGHTNING_PRECISION:
                p.error(f"--modes {spec!r}: use our modes {sorted(LIGHTNING_PRECISION)}")
        except ValueError as err:
            p.error(str(err))
    import logging

    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*precision.*")
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    {"lockstep": cmd_lockstep, "rounds": cmd_rounds}[args.command](args)


if __name__ == "__main__":
    main()
