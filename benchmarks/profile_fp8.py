"""Where FP8 with fp32 master weights spends the time Lightning's Transformer Engine plugin does not: GPU time a step
by kernel family, mode beside mode.

For each mode of ``bench_fp8.py`` named (same model, weights and batches; one process): ``--warmup`` steps, ``--steps``
steps timed with CUDA events (median), then ``--prof`` steps under ``torch.profiler`` (CUDA activity only) whose
kernels are summed per family:

==============  ==========================================================================================
gemm            cuBLAS(Lt)/CUTLASS matrix multiplies (FP8 and bf16 alike)
attention       flash / fused attention
optimizer       the optimizer's multi-tensor kernels (torch's fused AdamW, Transformer Engine's FusedAdam)
fp8 cast        Transformer Engine's quantize / cast-transpose / amax kernels
layer norm      LayerNorm forward and backward (torch's or Transformer Engine's)
copy / convert  torch's copies and dtype conversions (``.to``, ``copy_``)
elementwise     the other torch elementwise kernels (GELU, adds, masks, scaling)
loss / softmax  softmax, log-softmax, cross-entropy, reductions
memset          fills and memsets
other           the rest
==============  ==========================================================================================

The step's GPU time is the sum of the families (kernels on one stream; the union of intervals is printed too). The
table ends with each mode's difference to the first mode named, family by family, so a gap in the step time is
split into its kernel families; the kernels that differ most are listed under it.

Run on the GPU machine from the repository root (about 4 minutes for four modes at 4096 x 8 on an H100)::

    source .te/te_install.sh && PYTHONPATH=. python benchmarks/profile_fp8.py \\
        --modes lightning-te,mp-fp8-bf16w-all,mp-fp8-all,mp-fp8 --json fp8_profile.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fp8  # noqa: E402
from bench_overhead import StepProbe, count_params, make_batches, quiet_lightning  # noqa: E402

#: (family, name fragments), first match wins; names are lower-cased
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100_", "splitk")),
    ("fp8 cast", ("amax", "scale_update", "compute_scale")),  # delayed scaling's updates, before "multi_tensor"
    ("optimizer", ("multi_tensor", "adam", "fused_sgd")),
    ("fp8 cast", ("cast_transpose", "quantize", "fp8", "cast_kernel", "transpose_kernel")),
    ("layer norm", ("layer_norm", "layernorm", "ln_fwd", "ln_bwd", "rmsnorm", "norm_")),
    ("loss / softmax", ("softmax", "cross_entropy", "nll_loss", "reduce_kernel", "logsumexp")),
    ("copy / convert", ("copy", "to_copy", "direct_copy", "cat_")),
    ("memset", ("fill", "memset", "zero")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)
ORDER = list(dict.fromkeys(f for f, _ in FAMILIES)) + ["other"]


def family(name: str) -> str:
    low = name.lower()
    for fam, parts in FAMILIES:
        if any(p in low for p in parts):
            return fam
    return "other"


class ProfiledProbe(StepProbe):
    """``StepProbe`` timing ``warmup`` .. ``warmup + steps``, then ``prof`` more steps under ``torch.profiler``."""

    def __init__(self, warmup: int, steps: int, prof: int) -> None:
        super().__init__(warmup, steps, 0)
        self.prof = prof
        self.profiler: Optional[profile] = None
        self.kernels: list[tuple[str, float, int, int]] = []

    @property
    def total(self) -> int:
        return self.warmup + self.steps + self.prof

    def start(self) -> None:
        if len(self.starts) == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.profiler = profile(activities=[ProfilerActivity.CUDA])
            self.profiler.__enter__()
        super().start()

    def end(self) -> None:
        super().end()
        if len(self.ends) == self.total and self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            self.kernels = [
                (e.name, e.time_range.elapsed_us(), e.time_range.start, e.time_range.end)
                for e in self.profiler.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
            ]
            self.profiler = None


def busy_us(kernels: list[tuple[str, float, int, int]]) -> float:
    total, end = 0.0, None
    for _, _, a, b in sorted(kernels, key=lambda k: k[2]):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def profile_mode(args: argparse.Namespace, mode: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    probe = ProfiledProbe(args.warmup, args.steps, args.prof)
    bench_fp8.cleanup()
    torch.cuda.reset_peak_memory_stats()
    row = bench_fp8.run_mode(args, mode, batches, probe=probe)
    n = args.prof
    by_family: collections.Counter = collections.Counter()
    by_kernel: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for name, us, _, _ in probe.kernels:
        by_family[family(name)] += us / n / 1e3
        by_kernel[name] += us / n / 1e3
        count[family(name)] += 1 / n
    row.update(
        mode=mode,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        gpu_ms=sum(by_family.values()),
        busy_ms=busy_us(probe.kernels) / n / 1e3,
        families={f: round(by_family.get(f, 0.0), 3) for f in ORDER},
        kernels_per_step={f: round(count.get(f, 0.0), 1) for f in ORDER},
        top_kernels=[(k, round(v, 3)) for k, v in by_kernel.most_common(40)],
    )
    row.pop("step_ms_all", None)
    return row


def report(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "families" in r]
    if not ok:
        return "no mode ran"
    head = "| family (GPU ms a step) | " + " | ".join(r["mode"] for r in ok) + " |"
    lines = [head, "|---|" + "---|" * len(ok)]
    for f in ORDER:
        cells = [f"{r['families'][f]:.1f} ({r['kernels_per_step'][f]:.0f})" for r in ok]
        lines.append(f"| {f} (kernels) | " + " | ".join(cells) + " |")
    lines.append("| **sum of kernels** | " + " | ".join(f"{r['gpu_ms']:.1f}" for r in ok) + " |")
    lines.append("| GPU busy (union) | " + " | ".join(f"{r['busy_ms']:.1f}" for r in ok) + " |")
    lines.append("| step (CUDA events, median) | " + " | ".join(f"{r['step_ms']:.1f}" for r in ok) + " |")
    lines.append("| peak GiB | " + " | ".join(f"{r['peak_gib']:.1f}" for r in ok) + " |")
    base = ok[0]
    for r in ok[1:]:
        diff = {f: r["families"][f] - base["families"][f] for f in ORDER}
        parts = ", ".join(f"{f} {d:+.1f}" for f, d in sorted(diff.items(), key=lambda kv: -abs(kv[1])) if abs(d) >= 0.3)
        lines.append(
            f"\n{r['mode']} - {base['mode']}: step {r['step_ms'] - base['step_ms']:+.1f} ms, kernels"
            f" {r['gpu_ms'] - base['gpu_ms']:+.1f} ms: {parts}"
        )
        bk, rk = dict(base["top_kernels"]), dict(r["top_kernels"])
        delta = sorted(((rk.get(k, 0.0) - bk.get(k, 0.0), k) for k in set(bk) | set(rk)), key=lambda t: -abs(t[0]))
        for d, k in delta[:6]:
            lines.append(f"    {d:+7.2f} ms  [{family(k)}] {k[:100]}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="lightning-te,mp-fp8-bf16w-all,mp-fp8-all,mp-fp8")
    p.add_argument("--size", default="4096:8:8:32", help="hidden:layers:batch:heads (default 4096:8:8:32, 1.89 B)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps (median)")
    p.add_argument("--prof", type=int, default=3, help="profiled steps after the timed ones")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in bench_fp8.ALL_MODES + bench_fp8.EXTRA_MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(bench_fp8.ALL_MODES + bench_fp8.EXTRA_MODES)}")
    if min(args.warmup, args.steps, args.prof) < 1:
        p.error("--warmup, --steps and --prof must be >= 1")
    if not torch.cuda.is_available():
        print("profile_fp8.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    (size,) = bench_fp8.parse_sizes(args.size)
    args = argparse.Namespace(**{**vars(args), **size})
    quiet_lightning()
    device = torch.cuda.get_device_name()
    print(f"# {device} | torch {torch.__version__} | {count_params(args) / 1e9:.2f} B params, {args.size}"
          f" | {args.steps} timed + {args.prof} profiled steps a mode", flush=True)
    batches = make_batches(args, args.warmup + args.steps + args.prof)
    rows = []
    for mode in modes:
        t0 = time.perf_counter()
        try:
            rows.append(profile_mode(args, mode, batches))
            print(f"{mode}: {rows[-1]['step_ms']:.1f} ms a step ({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as err:  # one mode's failure must not lose the others'
            rows.append({"mode": mode, "error": f"{type(err).__name__}: {err}"[:300]})
            print(f"{mode}: FAILED {rows[-1]['error']}", flush=True)
    if args.json:
        meta = {"device": device, "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "config": {k: v for k, v in vars(args).items() if k != "json"}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{device}\n" + report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
