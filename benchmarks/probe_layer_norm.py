"""Whether torch's own CUDA layer_norm takes a 16-bit input with fp32 weight and bias (one kernel, fp32 statistics and
affine, 16-bit output), and what a guarded LayerNorm's forward+backward costs each way on the host and the GPU.

Run on the GPU machine from the repository root: ``PYTHONPATH=. python benchmarks/probe_layer_norm.py``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def main() -> None:
    dev = "cuda"
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(8, 512, 512, device=dev, dtype=dtype, requires_grad=True)
        w = torch.randn(512, device=dev, requires_grad=True)
        b = torch.randn(512, device=dev, requires_grad=True)
        try:
            y = F.layer_norm(x, (512,), w, b)
            y.float().sum().backward()
            ref = F.layer_norm(x.detach().float(), (512,), w.detach(), b.detach()).to(dtype)
            exact = torch.equal(y.detach(), ref)
            diff = (y.detach().float() - ref.float()).abs().max().item()
            print(f"mixed {dtype}: ok, out {y.dtype}, grads x {x.grad.dtype} w {w.grad.dtype}; equal to upcast: {exact}"
                  f" (max diff {diff:.3g})")
        except Exception as err:  # noqa: BLE001
            print(f"mixed {dtype}: refused: {type(err).__name__}: {str(err)[:200]}")
    from lightning_mp import guards

    ln = torch.nn.LayerNorm(512, device=dev)
    guards.apply_fp32_guards(torch.nn.Sequential(ln))
    x = torch.randn(8, 512, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
    plain = torch.nn.LayerNorm(512, device=dev, dtype=torch.bfloat16)
    for name, fn in (("guarded (compiled)", lambda: ln(x)), ("plain bf16", lambda: plain(x)),
                     ("mixed native", lambda: F.layer_norm(x, (512,), ln.weight, ln.bias))):
        try:
            for _ in range(20):
                fn().sum().backward()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                fn().sum().backward()
            host = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            total = (time.perf_counter() - t) / 200 * 1e6
            print(f"{name:20s} host {host:7.1f} us, with GPU {total:7.1f} us per forward+backward")
        except Exception as err:  # noqa: BLE001
            print(f"{name}: failed: {type(err).__name__}: {str(err)[:200]}")


if __name__ == "__main__":
    main()
