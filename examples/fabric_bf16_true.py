"""GPT-mini trained by a Lightning Fabric loop in bf16-true, under lightning_mp's ``MPFabricPrecision``.

The model and data are ``examples/gpt_mini.py``'s (a byte-level GPT on the standard library's source, its output
layer tied to the embedding); the loop is a plain Fabric one, as LitGPT's: gradient accumulation through
``fabric.no_backward_sync``, clipping, a warm-up/cosine schedule held after a skipped step, a checkpoint with the
plugin's state, and a resume from it. bf16 weights and compute, fp32 master weights, FP32 guards, steps with an
inf/NaN skipped::

    python -m examples.fabric_bf16_true                              # 2 CPU cores with native bf16: about 2 min
    python -m examples.fabric_bf16_true --precision fp32             # a CPU without native bf16 (AVX2 alone)
    python -m examples.fabric_bf16_true --precision fp16 --steps 100  # any mode of MPPlugin
    python -m examples.fabric_bf16_true --steps 300 --checkpoint ckpt.pt
    python -m examples.fabric_bf16_true --steps 400 --resume ckpt.pt  # goes on from step 300, bit for bit
"""

from __future__ import annotations

import argparse
import itertools
import math
from typing import Any, Optional

import torch
from lightning.fabric import Fabric
from torch.nn import functional as F
from torch.utils.data import DataLoader

from examples.gpt_mini import DEFAULT_MODULES, ByteWindows, GPTMini, module_sources, warmup_cosine
from lightning_mp import MPFabricPrecision


def arguments(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16-true", help="any MPPlugin mode (default: %(default)s)")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train to")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-bytes", type=int, default=None, help="use the first bytes of the text only")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--checkpoint", default=None, help="save model, optimizer, schedule and plugin here")
    parser.add_argument("--resume", default=None, help="a --checkpoint file to go on from")
    return parser.parse_args(argv)


def byte_text(max_bytes: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard-library source as bytes: 95 % to train on, the rest to validate on."""
    text = b"\n".join(source for _, source in module_sources(DEFAULT_MODULES))[:max_bytes]
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = int(len(data) * 0.95)
    return data[:cut], data[cut:]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = arguments(argv)
    plugin = MPFabricPrecision(args.precision)
    fabric = Fabric(accelerator=args.accelerator, devices=1, plugins=[plugin])
    fabric.seed_everything(0)
    train, val = byte_text(args.max_bytes)
    loader = DataLoader(ByteWindows(train, args.seq_len), batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(ByteWindows(val, args.seq_len), batch_size=args.batch_size)

    model = GPTMini(args.width, args.depth, args.heads, context=args.seq_len, sample_bytes=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    plugin.setup_optimizers(optimizer)  # before fabric.load: the optimizer state of bf16 weights stays fp32
    loader, val_loader = fabric.setup_dataloaders(loader, val_loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, min(50, args.steps // 10), args.steps, 0.1)
    )
    # the plugin in the checkpoint: its loss scale, step counters and fp32 master weights come back with it
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 0,
                             "precision": plugin}  # fmt: skip
    if args.resume:
        fabric.load(args.resume, state)

    batches = itertools.cycle(loader)
    while state["step"] < args.steps:
        for i in range(args.accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=i < args.accumulate - 1):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                fabric.backward(loss / args.accumulate)
        # error_if_nonfinite=False: a step with an inf/NaN gradient is skipped by the plugin instead of raising here
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()  # skipped (weights, masters, optimizer state as they were) if a gradient is inf/NaN
        optimizer.zero_grad()
        if not plugin.stats.skipped:  # the schedule holds after a skipped step, as MPPlugin holds the Trainer's
            schedule.step()
        state["step"] += 1
        if state["step"] % args.log_every == 0:
            fabric.print(f"step {state['step']}: loss {loss.item():.3f}, {plugin.stats}")

    val_loss = validate(model, val_loader)
    fabric.print(f"step {state['step']}: validation bits per byte {val_loss / math.log(2):.3f}")
    if args.checkpoint:
        fabric.save(args.checkpoint, state)
    plugin.teardown()  # the model is a plain module again (Fabric calls no teardown of its own)
    return {"step": state["step"], "val_loss": val_loss, "stats": plugin.stats.as_dict(), "model": model.module}


@torch.no_grad()
def validate(model: Any, loader: DataLoader, batches: int = 8) -> float:
    model.eval()
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in itertools.islice(loader, batches)]
    model.train()
    return float(torch.stack(losses).mean())


if __name__ == "__main__":
    main()
