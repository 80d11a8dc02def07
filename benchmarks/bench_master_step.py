"""The optimizer step of true-half training with fp32 master weights, in parts, on the GPT benchmark's parameters.

``MPPlugin("bf16-true")`` (fp32 masters) pays, per optimizer step, for the gradients' carry into fp32, the inf/NaN
check, an fp32 AdamW step and the refresh of the bf16 weights, where Lightning's ``bf16-true`` pays only a bf16
AdamW step (and keeps no masters). This script times each on the parameter shapes of bench_overhead.py's GPT
(``common.GPT``; 1.89 B parameters at hidden 4096 × 8 layers), side by side in one process:

* ``torch-adamw-bf16``: fused ``torch.optim.AdamW`` on bf16 parameters, bf16 state (Lightning's ``bf16-true``);
* ``torch-adamw-fp32``: fused AdamW on fp32 parameters and gradients (the step of bf16 autocast), and the inf/NaN
  check beside it: GradScaler's ``_amp_foreach_non_finite_check_and_unscale_`` at scale 1 (reads and writes every
  gradient) against the step guard's read-only check (``lightning_mp.verdict.check_grads_``);
* ``mp-masters``: ``FP32MasterWeights`` as the plugin runs it: the masters following weights written since the last
  step, carry, check, fused AdamW on the masters, refresh (also each part alone; following also with eager kernels);
* ``mp-masters-bf16-states``: the same with ``optimizer_states="bf16"`` (AdamW's moments held in bf16: fp32 copies
  made for the step, rounded back stochastically), and the bytes a parameter held by weights, masters and moments;
* ``te-fusedadam-masters`` / ``te-fusedadam-remainders``: Transformer Engine's ``FusedAdam(master_weights=True)``
  (one kernel reads bf16 gradients and writes fp32 masters and bf16 weights), with and without
  ``store_param_remainders`` (the masters held as 16 extra bits). Only where TE is installed.

CUDA events around each step, median of ``--steps`` after ``--warmup``. Run on the GPU machine::

    source .te/te_install.sh && PYTHONPATH=. python benchmarks/bench_master_step.py
    PYTHONPATH=. python benchmarks/bench_master_step.py --device cpu --scale 64 --steps 3   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_mp import master as _master
from lightning_mp.master import FP32MasterWeights
from lightning_mp import optim_states as _states
from lightning_mp.optim_states import OptimizerStates
from lightning_mp.verdict import check_grads_


def gpt_shapes(hidden: int, layers: int, vocab: int, seq: int) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is a LayerNorm parameter) of common.GPT, in registration order."""
    shapes: list[tuple[tuple[int, ...], bool]] = [((vocab, hidden), False), ((seq, hidden), False)]
    for _ in range(layers):
        shapes += [((hidden,), True), ((hidden,), True)]
        shapes += [((3 * hidden, hidden), False), ((3 * hidden,), False), ((hidden, hidden), False), ((hidden,), False)]
        shapes += [((hidden,), True), ((hidden,), True)]
        shapes += [
            ((4 * hidden, hidden), False), ((4 * hidden,), False), ((hidden, 4 * hidden), False), ((hidden,), False)
        ]
    shapes += [((hidden,), True), ((hidden,), True), ((vocab, hidden), False)]
    return shapes


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], None], warmup: int, steps: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(steps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def make_params(
    shapes, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Parameters (LayerNorm ones fp32, as the guards keep them) and one gradient each, made once."""
    g = torch.Generator(device=device).manual_seed(seed)
    params, grads = [], []
    for shape, is_norm in shapes:
        dt = torch.float32 if is_norm else dtype
        p = nn.Parameter(torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dt))
        params.append(p)
        grads.append(torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(1e-3).to(dt))
    return params, grads


def set_grads(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def state_bytes(opt: Any) -> int:
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                total += v.numel() * v.element_size()
    return total


def check_section(shapes, device: torch.device, fused: bool, timer: Timer, args: argparse.Namespace, row) -> None:
    """The inf/NaN check of bf16 autocast's step on its fp32 gradients: GradScaler's kernel at scale 1 (reads and
    writes every gradient) against the step guard's read-only check (``check_grads_``)."""
    params, grads = make_params(shapes, torch.float32, device)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    set_grads(params, grads)
    one, found = torch.ones((), device=device), torch.zeros((), device=device)
    t_unscale = timer(lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one), args.warmup,
                      args.steps)
    t_guard = timer(lambda: check_grads_(opt, found), args.warmup, args.steps)
    found.zero_()
    grads[5].view(-1)[-1] = float("nan")
    check_grads_(opt, found)
    if not found.item():  # a check that misses a NaN times nothing worth comparing
        raise AssertionError("check_grads_ missed a NaN in the gradients")
    gbytes = sum(g.numel() * g.element_size() for g in grads) / 1e9
    rate = lambda ms: f"{gbytes / ms * 1e3:,.0f} GB/s of gradients"  # noqa: E731
    row("  check: amp unscale, scale 1", t_unscale, 0, f"GradScaler's kernel; {rate(t_unscale)}")
    row("  check: step guard", t_guard, 0, f"read-only; {rate(t_guard)}")


def masters_section(
    shapes, device: torch.device, fused: bool, timer: Timer, args: argparse.Namespace, row, states: str = "fp32"
) -> None:
    """FP32MasterWeights as the plugin's step runs it: gather, check, fused AdamW on the masters, write back
    (``states="bf16"``: with ``MPPlugin(optimizer_states="bf16")``'s moments held in bf16 between steps)."""
    params, grads = make_params(shapes, torch.bfloat16, device)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    masters = FP32MasterWeights()
    masters.attach(opt)
    if states != "fp32":
        OptimizerStates(states).hold(opt, host="bench")
    master_list = masters.tensors()

    def gather():
        set_grads(params, grads)
        return masters.gather(opt)  # fp32 gradients on the masters (the bf16 ones stay where hooks read them)

    def check() -> None:
        torch._foreach_norm([m.grad for m in master_list if m.grad is not None], math.inf)

    def whole() -> None:
        records = gather()
        check()
        with masters.stepping(records):
            opt.step()
        masters.write_back(records, skipped=False)

    def step_alone() -> None:
        with masters.stepping(records):
            opt.step()

    t_whole = timer(whole, args.warmup, args.steps)
    t_gather = timer(lambda: masters.write_back(gather(), skipped=True), args.warmup, args.steps)
    records = gather()
    t_check = timer(check, args.warmup, args.steps)
    t_step = timer(step_alone, args.warmup, args.steps)
    pairs = ([r.param.data for r in records.records], [r.standin.data for r in records.records])
    t_refresh = timer(lambda: torch._foreach_copy_(*pairs), args.warmup, args.steps)
    entries = list(masters._entries.values())
    t_follow = timer(lambda: masters._resync(entries), args.warmup, args.steps)
    compiled = _master._COMPILED_FOLLOW["failed"]
    _master._COMPILED_FOLLOW["failed"] = "timing the eager kernels"
    t_follow_eager = timer(lambda: masters._resync(entries), args.warmup, args.steps)
    _master._COMPILED_FOLLOW["failed"] = compiled
    masters_bytes = sum(m.numel() * m.element_size() for m in master_list)
    weights_bytes = sum(p.numel() * p.element_size() for p in params)
    held = (weights_bytes + masters_bytes + state_bytes(opt)) / sum(p.numel() for p in params)
    if states != "fp32":
        row(f"mp-masters-{states}-states", t_whole, state_bytes(opt) + masters_bytes,
            f"optimizer_states={states!r}: {held:.2f} B/param held with the weights")  # fmt: skip
        row("  fused AdamW, moments in and out", t_step, 0, "fp32 copies, the step, stochastic rounding")
        compiled = _states._COMPILED_ROUNDING["failed"]
        _states._COMPILED_ROUNDING["failed"] = "timing the eager kernels"
        t_eager = timer(step_alone, args.warmup, args.steps)
        _states._COMPILED_ROUNDING["failed"] = compiled
        row("  the same, eager rounding", t_eager, 0, "without the compiled kernel"
            + ("" if compiled is None else f"; not compiled: {compiled!r}"))
        return
    row("mp-masters", t_whole, state_bytes(opt) + masters_bytes,
        f"MPPlugin('bf16-true'): all below; {held:.2f} B/param held with the weights")  # fmt: skip
    row("  follow the weights", t_follow, 0, "masters take weights written since (in gather)"
        + ("" if compiled is None else f"; not compiled: {compiled!r}"))
    row("  follow, eager kernels", t_follow_eager, 0, "the same without the compiled kernel")
    row("  gather (bf16 -> fp32 grads)", t_gather, 0)
    row("  check (inf-norm, fp32)", t_check, 0)
    row("  fused AdamW on fp32 masters", t_step, 0)
    row("  write back (fp32 -> bf16)", t_refresh, 0)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    shapes = gpt_shapes(args.hidden // args.scale, args.layers, args.vocab // args.scale, args.seq)
    n = sum(math.prod(s) for s, _ in shapes)
    timer = Timer(device)
    fused = device.type == "cuda"
    rows: list[dict[str, Any]] = []

    def row(name: str, ms: float, extra_bytes: int, note: str = "") -> None:
        rows.append({"mode": name, "ms": ms, "bytes_per_param": extra_bytes / n, "note": note})
        print(f"{name:28s} {ms:8.2f} ms   {extra_bytes / n:5.2f} B/param {note}", flush=True)

    def cleanup() -> None:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def step_row(name: str, dtype: torch.dtype, make_optimizer: Callable[[list], Any], note: str) -> None:
        """One optimizer's step alone, on fresh parameters and gradients (freed when this returns)."""
        params, grads = make_params(shapes, dtype, device)
        opt = make_optimizer(params)
        set_grads(params, grads)
        row(name, timer(opt.step, args.warmup, args.steps), state_bytes(opt), note)

    print(f"{n / 1e9:.3f} B parameters in {len(shapes)} tensors on {device}", flush=True)

    # Lightning's bf16-true: bf16 parameters, bf16 AdamW state
    step_row(
        "torch-adamw-bf16", torch.bfloat16, lambda p: torch.optim.AdamW(p, lr=1e-4, fused=fused), "Lightning bf16-true"
    )
    cleanup()
    # bf16 autocast: fp32 parameters and gradients
    step_row("torch-adamw-fp32", torch.float32, lambda p: torch.optim.AdamW(p, lr=1e-4, fused=fused), "bf16 autocast")
    cleanup()
    # what the check of bf16 autocast's step costs beside it (MPPlugin("bf16") checks every step)
    check_section(shapes, device, fused, timer, args, row)
    cleanup()

    # MPPlugin's fp32 masters, whole and in parts (in a function: its tensors go when it returns)
    masters_section(shapes, device, fused, timer, args, row)
    cleanup()
    # the same with bf16 moments (MPPlugin("bf16-true", optimizer_states="bf16"))
    masters_section(shapes, device, fused, timer, args, row, states="bf16")
    cleanup()

    # Transformer Engine's FusedAdam with master weights
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except ImportError:
        FusedAdam = None
    if FusedAdam is not None and device.type == "cuda":
        for name, remainders in (("te-fusedadam-masters", False), ("te-fusedadam-remainders", True)):
            step_row(
                name,
                torch.bfloat16,
                lambda p: FusedAdam(
                    p, lr=1e-4, adam_w_mode=True, master_weights=True, store_param_remainders=remainders
                ),
                "one kernel: bf16 grads in",
            )
            cleanup()
    else:
        print("transformer_engine not importable (or not on CUDA): TE FusedAdam rows left out", flush=True)
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--scale", type=int, default=1, help="divide hidden and vocab by this (smoke tests)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    base = {r["mode"]: r["ms"] for r in rows}
    ref = base.get("torch-adamw-bf16")
    print("\n| mode | step ms | vs Lightning bf16-true's step | optimizer-held bytes/param |")
    print("|---|---|---|---|")
    for r in rows:
        extra = f"{r['ms'] - ref:+.2f} ms" if ref is not None and not r["mode"].startswith(" ") else ""
        print(f"| {r['mode'].strip()} | {r['ms']:.2f} | {extra} | {r['bytes_per_param']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
