"""Lightning's precision mode and ours, step by step in lockstep: paired step times a shared host cannot blur.

``bench_host_cost.py`` interleaves the modes by rounds (a fit each). On the GPU hosts this project is lent, the
cores' speed moves by up to 2x from one second to the next (other tenants; a fixed piece of Python ran 1.5 ms and
2.8 ms on the same core seconds apart), so rounds of the same code differ by ±20 % and a 2 % target cannot be
resolved by any practical number of them. Here the two Trainers run in two threads that hand a baton to each
other at every ``on_train_batch_start``: Lightning's step k, then ours, then Lightning's step k + 1, ... Each
figure is the time from taking the baton to the next ``on_train_batch_start`` (the step, its hooks and the next
batch's fetch), so the two steps of a pair run milliseconds apart on the same host; the result is the median over
pairs of the ratio Lightning / ours (above 1: ours is faster), beside each mode's median and the spread of the pairs'
ratios.

Both threads run on one core, the fastest the probe of ``fast_cores.py`` finds (``--cores``): cores of a shared host
differ steadily in speed, and two threads the scheduler leaves on two cores would compare the cores. Only one thread
runs Python at a time (the other waits for the baton outside any step): the autocast state is
per thread; the default dtype and the TF32 flags are process-wide but only set inside a step (true-half modes) or
left as they were by the modes compared here. No sync a step (on a GPU: the host's pace, which binds on the small
GPT; a GPU-bound mode, ``fp32``, is what ``bench_host_cost.py`` measures). The model, data and optimizer are those of
``bench_host_cost.py``.

Run from the repository root::

    PYTHONPATH=. python benchmarks/lockstep_host_cost.py [--model gpt|mlp|tiny] [--pairs bf16,fp16,bf16-true]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_host_cost as bhc  # noqa: E402
import fast_cores  # noqa: E402
import phase_host_cost as phc  # noqa: E402


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
    sides = [("lightning-" + lit, {"precision": lit}), ("mp-" + ours, {"plugins": [bhc.plugin(name)]})]
    if args.same:  # the A/A check: Lightning's mode on both sides (the harness's own bias)
        sides[1] = ("lightning-" + lit, {"precision": lit})
    if ours_first:
        sides.reverse()
    timers = [Lockstep(i, baton, args.warmup) for i in range(2)]
    errors: list[BaseException] = []

    def fit(i: int) -> None:
        try:
            _, kwargs = sides[i]
            trainer = Trainer(accelerator=accelerator, devices=1, max_steps=args.warmup + args.steps, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                              callbacks=[timers[i]], **kwargs)
            model = bhc.build(args.model, device)
            trainer.fit(bhc.Lit(model, batches, args.model, accelerator == "gpu" or args.model == "tiny"))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
            baton.finish(i)

    batches = bhc.make_batches(args.model, args.warmup + args.steps + 1)
    # (attribution switches, timing only: they change our code, which Lightning's side never runs)
    with phc.without(parts):
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


def _mode(spec: str) -> str:
    """``bf16-true`` of ``bf16-true/master_weights=none+hostcopy``."""
    return spec.split("+")[0].split("/")[0]


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["gpt", "mlp", "tiny"], default=None,
                   help="gpt (the small GPT, on a GPU), mlp (CPU) or tiny (a GPT of the same depth and parameter "
                        "count as gpt but width 32, on the CPU: its step is nearly all host work, as gpt's on a GPU); "
                        "default: gpt on a GPU, mlp otherwise")
    p.add_argument("--pairs", default="bf16,fp16,bf16-true",
                   help="our modes, each beside Lightning's (variants as in bench_host_cost.py; attribution switches "
                        "as in phase_host_cost.py, e.g. bf16-true+hostcopy: timing only)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per side (default 20)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per side (default 300)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each pair, the side that opens each pair of steps alternating (default 2)")
    p.add_argument("--json", default=None, help="also write the raw figures to this JSON file")
    p.add_argument("--same", action="store_true",
                   help="the A/A check: Lightning's mode on both sides (the ratio then shows the harness's bias)")
    p.add_argument("--cores", type=int, default=1,
                   help="keep the process on the N fastest cores (default 1: both sides on one core; 0: as it is)")
    args = p.parse_args(argv)
    if args.cores:
        print(fast_cores.pin_fast_cores(args.cores))
    bhc.quiet()
    cuda = torch.cuda.is_available()
    args.model = args.model or ("gpt" if cuda else "mlp")
    accelerator = "gpu" if cuda and args.model == "gpt" else "cpu"
    lightning = {ours: lit for lit, ours in bhc.PAIRS}
    wanted = args.pairs.split(",")
    unknown = [w for w in wanted if _mode(w) not in lightning
               or any(part not in phc.WITHOUT for part in w.split("+")[1:])]
    if unknown:
        p.error(f"--pairs {unknown}: use our modes {sorted(lightning)}, optionally with /option=value variants")
    rows = []
    for repeat in range(args.repeats):
        for ours in wanted:
            rows.append(run_pair(lightning[_mode(ours)], ours, args, accelerator, ours_first=repeat % 2 == 1))
    name = torch.cuda.get_device_name() if accelerator == "gpu" else "CPU"
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
        print(f"| {lightning[_mode(ours)]} / {ours} | {statistics.geometric_mean(mine):.3f} | {len(mine)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
