"""What a guarded LayerNorm costs on a small, launch-bound input, way by way (one GPU).

A true-half model without master weights keeps its LayerNorms' weights in fp32 (the FP32 guard) and feeds them 16-bit
activations. Ways to compute ``layer_norm(x.float(), w32, b32).to(x.dtype)``: the composite (three kernels forward,
three backward, torch's autograd nodes), torch's own kernel on mixed dtypes where it accepts them, GroupNorm over
one group (which accepts mixed dtypes on some devices), the compiled function, and, for reference, torch's kernel
on bf16 weights (what Lightning's ``bf16-true`` runs) and the guarded module as the plugin installs it. Each: host
µs and GPU µs of forward + backward (CUDA events), median of many, plus kernels launched and whether it matches
the composite bit for bit.

    PYTHONPATH=. python benchmarks/probe_layer_norm.py [--rows 4096] [--width 512] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mp.guards import apply_fp32_guards


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dev, half = torch.device(args.device), torch.bfloat16
    torch.manual_seed(0)
    x0 = torch.randn(args.rows, args.width, device=dev, dtype=half)
    g0 = torch.randn_like(x0)
    shape = (args.width,)
    w32 = torch.randn(args.width, device=dev, requires_grad=True)
    b32 = torch.randn(args.width, device=dev, requires_grad=True)
    w16 = w32.detach().to(half).requires_grad_(True)
    b16 = b32.detach().to(half).requires_grad_(True)
    holder = nn.Sequential(nn.LayerNorm(args.width, device=dev))  # (the root is never guarded: a child is)
    guarded = holder[0]
    with torch.no_grad():
        guarded.weight.copy_(w32)
        guarded.bias.copy_(b32)
    apply_fp32_guards(holder, ["LayerNorm"])

    def composite(x):
        return F.layer_norm(x.float(), shape, w32, b32).to(x.dtype)

    def mixed(x):
        return F.layer_norm(x, shape, w32, b32)

    def group(x):
        return F.group_norm(x.unsqueeze(-1), 1, w32, b32).squeeze(-1)

    compiled_fn = torch.compile(composite, fullgraph=True)

    ways = {
        "bf16 weights (Lightning)": (lambda x: F.layer_norm(x, shape, w16, b16), (w16, b16)),
        "composite upcast": (composite, (w32, b32)),
        "torch kernel, mixed dtypes": (mixed, (w32, b32)),
        "group_norm, one group, mixed": (group, (w32, b32)),
        "compiled": (compiled_fn, (w32, b32)),
        "guarded nn.LayerNorm (ours)": (guarded, (guarded.weight, guarded.bias)),
    }
    x = x0.clone().requires_grad_(True)
    ref_out = composite(x)
    ref = torch.autograd.grad(ref_out, (x, w32, b32), g0)
    rows = []
    for name, (fn, params) in ways.items():
        try:
            out = fn(x)
            grads = torch.autograd.grad(out, (x, *params), g0)
            same = torch.equal(out, ref_out) and all(torch.equal(a.float(), b.float()) for a, b in zip(grads, ref))
            err = max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(grads, ref))
        except Exception as e:  # noqa: BLE001
            rows.append((name, f"fails: {type(e).__name__}: {str(e)[:80]}", "", "", ""))
            continue
        host, gpu = [], []
        for i in range(args.steps + 20):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            out = fn(x)
            torch.autograd.grad(out, (x, *params), g0)
            end.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            if i >= 20:
                host.append((t1 - t0) * 1e6)
                gpu.append(start.elapsed_time(end) * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = fn(x)
            torch.autograd.grad(out, (x, *params), g0)
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        rows.append((name, f"{statistics.median(host):.1f}", f"{statistics.median(gpu):.1f}", str(kernels),
                     "yes" if same else f"no ({err:.1e})"))
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__}: layer_norm on ({args.rows}, {args.width})"
          " bf16, forward + backward")
    print(f"{'way':32} {'host µs':>9} {'GPU µs':>8} {'kernels':>8}  same as composite")
    for r in rows:
        print(f"{r[0]:32} {r[1]:>9} {r[2]:>8} {r[3]:>8}  {r[4]}")


if __name__ == "__main__":
    main()
