"""Lightning Fabric: ``MPFabricPrecision`` against Fabric's own precision plugins on a LitGPT model, step by step.

A LitGPT ``GPT`` (a Pythia-like config, default 12 layers × 768, 2 × 1024 tokens a step) trained with Fabric in a
plain loop (forward, ``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step``, ``optimizer.zero_grad``;
foreach AdamW), one Fabric per mode, one process; the modes' rounds interleaved (``--rounds``), each the median of
``--steps`` CUDA-event-timed steps after ``--warmup``. Rows: Fabric's ``bf16-mixed`` / ``16-mixed`` / ``bf16-true``
and ours at the same mode (``bf16``, ``fp16``, ``bf16-true`` with fp32 master weights, and
``bf16-true`` with ``master_weights="none"``, Fabric's own layout); the ratios Fabric / ours (above 1: ours faster).

Needs litgpt (``pip install litgpt``; on the GPU machine its wheel with ``--no-deps`` and ``safetensors``). Run::

    PYTHONPATH=. python benchmarks/bench_fabric.py                       # GPU
    PYTHONPATH=. python benchmarks/bench_fabric.py --device cpu --layers 2 --embd 64 --seq 64 --steps 3 --rounds 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import HalfPrecision, MixedPrecision, Precision

from lightning_mp import MPFabricPrecision

#: (row, Fabric's plugin, ours) per mode; ratios are of each "ours" row to the Fabric row of its mode
ROWS: list[tuple[str, Callable[[str], Precision]]] = [
    ("fabric bf16-mixed", lambda dev: MixedPrecision("bf16-mixed", dev)),
    ("mp bf16", lambda dev: MPFabricPrecision("bf16")),
    ("fabric 16-mixed", lambda dev: MixedPrecision("16-mixed", dev, scaler=torch.amp.GradScaler(dev, 2.0**12))),
    ("mp fp16", lambda dev: MPFabricPrecision("fp16", init_scale=2.0**12)),
    ("fabric bf16-true", lambda dev: HalfPrecision("bf16-true")),
    ("mp bf16-true", lambda dev: MPFabricPrecision("bf16-true")),
    ("mp bf16-true/none", lambda dev: MPFabricPrecision("bf16-true", master_weights="none")),
]
PAIRS = {"mp bf16": "fabric bf16-mixed", "mp fp16": "fabric 16-mixed", "mp bf16-true": "fabric bf16-true",
         "mp bf16-true/none": "fabric bf16-true"}


def build(args: argparse.Namespace, plugin: Precision) -> tuple[Fabric, Any, Any, torch.Tensor]:
    from litgpt import GPT, Config

    fabric = Fabric(accelerator="cuda" if args.device == "cuda" else "cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    config = Config(n_layer=args.layers, n_embd=args.embd, n_head=args.embd // 64 or 1, vocab_size=args.vocab,
                    padded_vocab_size=args.vocab, block_size=args.seq)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    # (foreach, not fused: Fabric's own 16-mixed refuses clipping with an optimizer that unscales in its kernel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(fabric.device)
    return fabric, model, optimizer, data


def timed_steps(args: argparse.Namespace, fabric: Fabric, model: Any, optimizer: Any, data: torch.Tensor,
                count: int) -> list[float]:
    times = []
    for _ in range(count):
        if args.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), data[:, 1:].reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        if args.device == "cuda":
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every row (default 3)")
    args = p.parse_args()
    runs = {}
    for name, make in ROWS:  # (set up once each: the rounds below time the same runs)
        fabric, model, optimizer, data = build(args, make(args.device))
        timed_steps(args, fabric, model, optimizer, data, args.warmup)
        runs[name] = (fabric, model, optimizer, data)
    medians: dict[str, list[float]] = {name: [] for name, _ in ROWS}
    for _ in range(args.rounds):
        for name, _ in ROWS:
            medians[name].append(statistics.median(timed_steps(args, *runs[name], args.steps)))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\nLitGPT {args.layers} x {args.embd}, {args.batch} x {args.seq} tokens, on {where}, torch "
          f"{torch.__version__}: median step ms per round, interleaved")
    print("| row | step ms (rounds) | ratio Fabric / ours |\n|---|---|---|")
    for name, _ in ROWS:
        ms = statistics.median(medians[name])
        ratio = f"{statistics.median(medians[PAIRS[name]]) / ms:.3f}" if name in PAIRS else ""
        print(f"| {name} | {ms:.2f} ({', '.join(f'{m:.2f}' for m in medians[name])}) | {ratio} |")


if __name__ == "__main__":
    main()
