"""Probe: FP8 weights in FSDP2's all-gather with Transformer Engine, against bf16 gathers (two GPUs).

A probe for FP8 weights in the all-gather (results in benchmarks/RESULTS.md, "FP8 weights in the all-gather:
measured, not offered"; 2 x H100: 64.1 ms against 63.7 ms, 7.25 GiB against 5.88 GiB). Transformer Engine 2.20 gathers
FP8 under FSDP2 only for FP8 *primary* weights (modules built under ``te.quantized_model_init``: the parameters
are ``Float8Tensor``s and ``Float8Tensor.fsdp_pre_all_gather`` sends their uint8 data); the fp32 masters then live
in the optimizer (TE's ``FusedAdam(master_weights=True)``, which handles DTensor and quantized parameters).
Its FSDP (1) support refuses FP8 primary weights.

Two layouts of the same stack of ``te.Linear`` layers, each trained a few steps in FP8 (delayed scaling):

* ``bf16-gather``: fp32 shards, FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, torch's fused
  AdamW on the shards (what ``MPPlugin("fp8")`` with a bf16 policy does under ``ModelParallelStrategy``);
* ``fp8-gather``: FP8 primary weights sharded by FSDP2 (uint8 gathers), TE ``FusedAdam(master_weights=True)``.

Prints per layout: median step ms (CUDA events, after warm-up), peak GiB a GPU, the bytes each step gathers a
GPU, the first and last loss, and whether the ranks' final weights agree. Run from the repository root on a machine
with two GPUs and Transformer Engine::

    source .te/te_install.sh && PYTHONPATH=.:$PYTHONPATH python benchmarks/probe_fp8_gather.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build(layout: str, args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    import transformer_engine.pytorch as te
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        if layout == "fp8-gather":
            with te.quantized_model_init(enabled=True, recipe=recipe):
                layers.append(te.Linear(args.hidden, args.hidden, bias=False, device=device))
        else:
            layers.append(te.Linear(args.hidden, args.hidden, bias=False, device=device))
    model = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if layout == "bf16-gather"
        else MixedPrecisionPolicy()
    )
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if layout == "fp8-gather":
        from transformer_engine.pytorch.optimizers import FusedAdam

        optimizer = FusedAdam(model.parameters(), lr=args.lr, master_weights=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    return model, optimizer, recipe


def run_layout(layout: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import transformer_engine.pytorch as te

    device = torch.device("cuda", rank)
    model, optimizer, recipe = build(layout, args, device)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    target_map = torch.randn(args.hidden, args.hidden, device=device, generator=gen) / args.hidden**0.5
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.hidden, device=device, generator=gen)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", torch.bfloat16), te.autocast(enabled=True, recipe=recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), x @ target_map)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
        losses.append(float(loss))
    fingerprint = 0.0
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        full = full.dequantize() if hasattr(full, "dequantize") else full
        fingerprint += float(full.double().sum())
    params = sum(p.numel() for p in model.parameters())
    gathered = params * (1 if layout == "fp8-gather" else 2) * 2  # forward and backward gathers, bytes a GPU
    return {
        "layout": layout,
        "step_ms": statistics.median(times[args.warmup :]),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "gathered_gib_per_step": gathered / 2**30,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "fingerprint": fingerprint,
    }


def worker(rank: int, args: argparse.Namespace, world: int, out: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows = []
    for layout in args.layouts:
        try:
            rows.append(run_layout(layout, args, rank))
        except Exception as err:  # a probe: report what failed and go on
            rows.append({"layout": layout, "error": f"{type(err).__name__}: {err}"[:1500]})
        torch.cuda.empty_cache()
    with open(f"{out}.rank{rank}.json", "w") as fh:
        json.dump(rows, fh)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens a GPU a step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--layouts", nargs="*", default=["bf16-gather", "fp8-gather"])
    p.add_argument("--out", default="probe_fp8_gather")
    args = p.parse_args()
    world = min(2, torch.cuda.device_count())
    if world < 2:
        print("probe_fp8_gather needs two CUDA GPUs.")
        return
    mp.spawn(worker, args=(args, world, args.out), nprocs=world, join=True)
    ranks = [json.load(open(f"{args.out}.rank{r}.json")) for r in range(world)]
    gpu = torch.cuda.get_device_name(0)
    print(f"{world} x {gpu}: {args.layers} x te.Linear {args.hidden}, {args.tokens} tokens a GPU")
    print("| layout | step ms | peak GiB/GPU | gathered GiB/GPU/step | loss first -> last | same weights |")
    print("|---|---|---|---|---|---|")
    for i, row in enumerate(ranks[0]):
        if "error" in row:
            print(f"| {row['layout']} | failed: {row['error'][:300]} | | | | |")
            continue
        same = all(r[i].get("fingerprint") == row["fingerprint"] for r in ranks)
        print(
            f"| {row['layout']} | {row['step_ms']:.1f} | {row['peak_gib']:.2f} | {row['gathered_gib_per_step']:.2f}"
            f" | {row['loss_first']:.4f} -> {row['loss_last']:.4f} | {'yes' if same else 'NO'} |"
        )


if __name__ == "__main__":
    main()
