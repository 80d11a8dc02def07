"""Cost of the inf/NaN gradient check that bf16/fp32 steps pay, on one CUDA GPU.

Gradients shaped like the GPT model of bench_overhead.py (hidden 4096, 8 layers, vocab 32768: 1.89 B fp32
values), timed with CUDA events, median of ``--iters`` runs after warm-up:

- ``amp-unscale``: ``torch._amp_foreach_non_finite_check_and_unscale_`` with scale 1 (what GradScaler's
  check costs: it reads and writes every gradient);
- ``check-only``: the step guard's read-only check (``NonfiniteGuard``; ``torch._foreach_norm(grads, inf)``
  at this size);
- ``fused-adamw``: one fused AdamW step on the same parameters, for scale.

Run: ``PYTHONPATH=. python benchmarks/bench_nonfinite_check.py``
"""

import argparse
import statistics

import torch

from lightning_mp.verdict import check_grads_


def shapes(hidden: int, layers: int, vocab: int, seq: int) -> list[tuple[int, ...]]:
    out = [(vocab, hidden), (seq, hidden)]
    for _ in range(layers):
        out += [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                (hidden,), (hidden,), (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
    return out + [(hidden,), (hidden,), (vocab, hidden)]


def time_cuda(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    params = [
        torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02)
        for s in shapes(args.hidden, args.layers, args.vocab, args.seq)
    ]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    n = sum(q.numel() for q in params)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    grads = [q.grad for q in params]
    one = torch.ones((), device="cuda")
    found = torch.zeros((), device="cuda")

    rows = {
        "amp-unscale (scale 1)": time_cuda(
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one), args.iters
        ),
        "check-only (foreach_norm inf)": time_cuda(lambda: check_grads_(opt, found), args.iters),
        "fused AdamW step": time_cuda(lambda: opt.step(), args.iters),
    }
    # the check must see one NaN anywhere
    found.zero_()
    params[5].grad.view(-1)[-1] = float("nan")
    check_grads_(opt, found)
    assert found.item() > 0, "check-only missed a NaN"
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__}"
        f" | {n / 1e9:.2f} B fp32 gradients ({4 * n / 2**30:.1f} GiB)"
    )
    print("| operation | median ms | GB/s (gradient bytes read) |")
    print("|---|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} | {4 * n / ms / 1e6:,.0f} |")


if __name__ == "__main__":
    main()
