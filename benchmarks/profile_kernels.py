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

from lightning_mp import MPPlugin  # noqa: E402

LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true"}


class Sync(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.t0, self.t1 = warmup, 0.0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.t1 = time.perf_counter()


def fit(mode: str, model, batches, steps: int, warmup: int, prof: bool = False):
    kwargs = {"precision": mode[4:]} if mode.startswith("lit-") else {"plugins": [MPPlugin(mode)]}
    sync = Sync(warmup)
    trainer = Trainer(accelerator="gpu", devices=1, max_steps=warmup + steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[sync], **kwargs)
    lit = bhc.Lit(model, batches, "gpt", True)
    if not prof:
        trainer.fit(lit)
        return (sync.t1 - sync.t0) / steps, None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        trainer.fit(lit)
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return None, kernels


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
    for ours in args.pairs.split(","):
        counts = {}
        for mode in (f"lit-{LIGHTNING[ours]}", ours):
            model = bhc.build("gpt", torch.device("cuda"))
            fit(mode, model, batches, 10, 5)
            wall = sorted(fit(mode, model, batches, args.steps, 5)[0] for _ in range(3))[1]
            _, kernels = fit(mode, model, batches, args.steps, 0, prof=True)
            n = args.steps
            busy = sum(k.time_range.elapsed_us() for k in kernels) / n / 1e3  # ms a step
            counts[mode] = collections.Counter(k.name for k in kernels)
            rows.append((mode, wall * 1e3, busy, len(kernels) / n))
        lit, mine = counts[f"lit-{LIGHTNING[ours]}"], counts[ours]
        extra = sorted(((mine[k] - lit.get(k, 0)) / args.steps, k) for k in set(mine) | set(lit))
        print(f"\n{ours}: kernels a step launched more (+) or fewer (-) than Lightning's {LIGHTNING[ours]}:")
        for d, name in sorted(extra, reverse=True)[: args.top] + sorted(extra)[:3]:
            if d:
                print(f"  {d:+6.1f}  {name[:110]}")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.steps} steps a fit")
    print("| mode | wall ms a step | GPU busy ms a step | kernels a step |")
    print("|---|---|---|---|")
    for mode, wall, busy, k in rows:
        print(f"| {mode} | {wall:.2f} | {busy:.2f} | {k:.0f} |")


if __name__ == "__main__":
    main()
