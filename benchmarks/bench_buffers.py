"""What the buffer snapshot of a skippable step costs (lightning_mp/buffers.py), on one CUDA GPU.

A skipped step must leave the buffers its forward passes changed (BatchNorm running statistics) as they were, so
``MPPlugin`` copies the module's buffers when a training step begins. This times that copy against the step:

1. a BatchNorm CNN (ResNet-style conv-BN-ReLU stages, 53 BN layers' worth of statistics at the default width)
   trained with ``MPPlugin("bf16")``, the snapshot on and off (monkeypatched away), runs interleaved in one process;
2. ``BufferSnapshot.take`` + ``drop`` alone on that CNN and on the 1.89 B GPT of ``bench_overhead.py`` (which holds
   no floating buffers: the cost there is the walk over its modules), against a step time given on the command line
   or measured here.

Timing: CUDA events around each training batch (``on_train_batch_start`` / ``on_train_batch_end``), median of
``--steps`` after ``--warmup``; isolated copies timed with ``torch.utils.benchmark.Timer`` (synchronised).

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_buffers.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.utils.benchmark as tb
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp.buffers import BufferSnapshot
from lightning_mp.step import OptimizerSteps


def conv_bn(c_in: int, c_out: int, stride: int = 1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class CNN(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = [conv_bn(3, width)]
        c = width
        for stage in range(4):
            out = width * 2**stage
            for b in range(blocks):
                layers.append(conv_bn(c, out, stride=2 if (b == 0 and stage > 0) else 1))
                c = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class LitCNN(LightningModule):
    def __init__(self, batches: list) -> None:
        super().__init__()
        self.model = CNN()
        self.batches = batches

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)  # the batches as they are


class StepTimes(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[Any, Any]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.events.append((start, None))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.events[-1] = (self.events[-1][0], end)

    def median(self, warmup: int) -> float:
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in self.events[warmup:])


def fit_cnn(snapshot: bool, batches: list, warmup: int, steps: int) -> float:
    seed_everything(0)
    original = OptimizerSteps.begin_batch
    if not snapshot:
        OptimizerSteps.begin_batch = lambda self, module, optimizers: None  # type: ignore[method-assign]
    try:
        times = StepTimes()
        model = LitCNN(batches)
        Trainer(
            accelerator="gpu", devices=1, plugins=[MPPlugin("bf16")], max_steps=warmup + steps, callbacks=[times],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ).fit(model)  # fmt: skip
        return times.median(warmup)
    finally:
        OptimizerSteps.begin_batch = original  # type: ignore[method-assign]


def take_ms(module: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    snap = BufferSnapshot()

    def once() -> None:
        snap.take(module, [optimizer])
        snap.drop()

    timer = tb.Timer(stmt="once(); torch.cuda.synchronize()", globals={"once": once, "torch": torch})
    return timer.blocked_autorange(min_run_time=1.0).median * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="snapshot on/off runs, interleaved")
    p.add_argument(
        "--gpt-step-ms", type=float, default=None, help="the GPT's step time to compare with (bench_overhead)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(args.batch, 3, args.image, args.image, generator=g),
            torch.randint(0, 1000, (args.batch,), generator=g),
        )
        for _ in range(args.warmup + args.steps)
    ]
    on, off = [], []
    for _ in range(args.rounds):
        on.append(fit_cnn(True, batches, args.warmup, args.steps))
        off.append(fit_cnn(False, batches, args.warmup, args.steps))
    cnn = CNN().cuda()
    n_buffers = sum(1 for _ in cnn.buffers())
    cnn_take = take_ms(cnn, torch.optim.SGD(cnn.parameters(), lr=0.1))
    del cnn
    rows = {
        "gpu": torch.cuda.get_device_name(),
        "cnn_step_ms_snapshot_on": statistics.median(on),
        "cnn_step_ms_snapshot_off": statistics.median(off),
        "cnn_take_ms": cnn_take,
        "cnn_buffers": n_buffers,
    }
    try:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_overhead import build_model

        gpt_args = argparse.Namespace(hidden=4096, layers=8, heads=32, seq=2048, vocab=32768, batch=8, seed=0)
        gpt = build_model(gpt_args).cuda()
        rows["gpt_take_ms"] = take_ms(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1))
        rows["gpt_buffers"] = sum(1 for _ in gpt.buffers())
        del gpt
    except Exception as err:  # noqa: BLE001 - report, keep the CNN figures
        rows["gpt_error"] = f"{type(err).__name__}: {err}"
    if args.gpt_step_ms:
        rows["gpt_step_ms"] = args.gpt_step_ms
    print(json.dumps(rows, indent=1))
    ratio = rows["cnn_step_ms_snapshot_on"] / rows["cnn_step_ms_snapshot_off"]
    print("\n| model | step ms (snapshot on / off) | take+drop ms | share of a step |\n|---|---|---|---|")
    print(f"| BN CNN ({n_buffers} buffers) | {rows['cnn_step_ms_snapshot_on']:.2f}"
          f" / {rows['cnn_step_ms_snapshot_off']:.2f}"
          f" ({ratio:.3f}x) | {cnn_take:.3f} | {cnn_take / rows['cnn_step_ms_snapshot_off']:.2%} |")
    if "gpt_take_ms" in rows and args.gpt_step_ms:
        print(f"| GPT 1.89 B ({rows['gpt_buffers']} buffers) | {args.gpt_step_ms:.1f} | {rows['gpt_take_ms']:.3f} |"
              f" {rows['gpt_take_ms'] / args.gpt_step_ms:.3%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
