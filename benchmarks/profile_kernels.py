"""Is a small step bound by the host or by the GPU? Kernel counts and GPU busy time per step, ours beside Lightning's.

For each mode pair (Lightning's ``precision=``, then ``MPPlugin``), on the small GPT of ``bench_overhead.py``
(hidden 512, 4 layers, 8 x 512 tokens, fused AdamW): a warm-up ``fit``, a timed ``fit`` (synchronised wall time a
step), then a ``fit`` under ``torch.profiler`` that counts the GPU kernels a step launches and sums their time. A
step whose GPU busy time is well below its wall time is bound by the host (Python and kernel launches); the kernel
names that ours launches more often than Lightning's say where the extra host work goes.

Run from the repository root on a GPU: ``PYTHONPATH=. python benchmarks/profile_kernels.py [--pairs bf16-true,bf16]``
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import time
import warnings

import torch
from lightning.pytorch import Callback, Trainer
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_host_cost as bhc  # noqa: E402


LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true"}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Sync(Callback):
    """Times the steps after the warm-up (synchronised at their start and at the end); with ``prof``, profiles only
    them (set-up, the warm-up and teardown stay out of the kernel counts)."""

    def __init__(self, warmup: int, prof: bool = False) -> None:
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


def fit(mode: str, model, batches, steps: int, warmup: int, prof: bool = False):
    if mode.startswith("lit-"):
        kwargs = {"precision": mode[4:]}
    else:  # "bf16-true", or variants such as "bf16-true/master_weights=none/fp32_modules=none"
        kwargs = {"plugins": [bhc.plugin(mode)]}
    sync = Sync(warmup, prof)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer = Trainer(accelerator=accelerator, devices=1, max_steps=warmup + steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[sync], **kwargs)
    lit = bhc.Lit(model, batches, "gpt", True)
    trainer.fit(lit)
    if not prof:
        return (sync.t1 - sync.t0) / steps, None
    p = sync.prof
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = {a.key: (a.count, a.self_cpu_time_total) for a in p.key_averages()}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="bf16-true,bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    batches = bhc.make_batches("gpt", args.steps + 10)
    rows = []
    counts, times, cpu = {}, {}, {}
    for ours in args.pairs.split(","):
        for mode in (f"lit-{LIGHTNING[ours.split('/')[0]]}", ours):
            if mode in counts:
                continue
            model = bhc.build("gpt", torch.device("cpu"))
            fit(mode, model, batches, 10, 5)
            wall = sorted(fit(mode, model, batches, args.steps, 5)[0] for _ in range(3))[1]
            _, (kernels, ops) = fit(mode, model, batches, args.steps, 5, prof=True)
            n = args.steps
            busy = busy_ms(kernels) / n
            counts[mode] = collections.Counter(k.name for k in kernels)
            ktime = collections.Counter()
            for k in kernels:
                ktime[k.name] += k.time_range.elapsed_us() / n
            times[mode], cpu[mode] = ktime, ops
            rows.append((mode, wall * 1e3, busy, len(kernels) / n))
        base = f"lit-{LIGHTNING[ours.split('/')[0]]}"
        lit, mine = counts[base], counts[ours]
        extra = sorted(((mine[k] - lit.get(k, 0)) / args.steps, k) for k in set(mine) | set(lit))
        print(f"\n{ours}: kernels a step launched more (+) or fewer (-) than Lightning's {base[4:]}:")
        for d, name in sorted(extra, reverse=True)[: args.top] + sorted(extra)[:3]:
            if d:
                print(f"  {d:+6.1f}  {name[:110]}")
        lt, mt = times[base], times[ours]
        dt = sorted(((mt[k] - lt.get(k, 0), k) for k in set(mt) | set(lt)), reverse=True)
        print(f"{ours}: GPU time a step (us) more than Lightning's, by kernel:")
        for d, name in dt[:8]:
            print(f"  {d:+8.1f}  {name[:110]}")
        lc, mc = cpu[base], cpu[ours]
        dc = sorted((((mc.get(k, (0, 0))[1] - lc.get(k, (0, 0))[1]) / args.steps, k,
                      (mc.get(k, (0, 0))[0] - lc.get(k, (0, 0))[0]) / args.steps) for k in set(mc) | set(lc)),
                    reverse=True)
        print(f"{ours}: host (self CPU) time a step (us) more than Lightning's, by op, with calls a step:")
        for d, name, c in dc[: args.top]:
            print(f"  {d:+8.1f}  {c:+6.1f}  {name[:100]}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, torch {torch.__version__}; {args.steps} steps a fit")
    print("| mode | wall ms a step | GPU busy ms a step | kernels a step |")
    print("|---|---|---|---|")
    for mode, wall, busy, k in rows:
        print(f"| {mode} | {wall:.2f} | {busy:.2f} | {k:.0f} |")


if __name__ == "__main__":
    main()
