"""FP8 through Transformer Engine: MPPlugin("fp8") against MPPlugin("bf16") and Lightning's TransformerEnginePrecision.

Trains the GPT-style decoder of ``bench_overhead.py`` (``common.py``'s builders: same model, same initial weights,
fused AdamW, random tokens) at two sizes, once per mode, all in one process:

====================  =====================================================================================
mp-bf16               ``MPPlugin("bf16")``: the reference for the fp32-master-weights target
mp-fp8                ``MPPlugin("fp8")`` defaults: the FP8 layers' weights fp32 (stepped directly: their own
                      masters), the other weights bf16 with fp32 masters in the step, activations bf16, delayed
                      scaling, the LM head in bf16
mp-fp8-bf16m          ``fp8={"weights": "bf16"}``: every weight bf16, fp32 masters in the step (the default of
                      the 2026-11-28 morning: its masters' copy, compare and write-back cover the FP8 layers too)
mp-fp8-bf16m-all      the same with every linear and LayerNorm in TE (like ``mp-fp8-all``)
mp-fp8-head           the defaults with the LM head in FP8 too (``keep_last=0``): the head's bf16 cost on its own
mp-fp8-all            the defaults with ``keep_last=0``, ``size_rule="off"`` and no FP32 guards: every linear
                      and LayerNorm in TE (the same layers as Lightning's plugin)
mp-fp8-fp32w          ``fp8={"weights": "fp32"}``: fp32 weights in the model (the default until 0.2: an fp32
                      residual stream)
mp-fp8-bf16w          ``MPPlugin("fp8", master_weights="none")``: bf16 weights, no fp32 copy
mp-fp8-bf16w-all      bf16 weights, ``keep_last=0``, ``size_rule="off"`` and no FP32 guards: the same layers in
                      TE as Lightning's plugin (the LM head and LayerNorms too), for a like-for-like comparison
lightning-te          ``Trainer(precision="transformer-engine")``: Lightning's TransformerEnginePrecision
                      (bf16 weights, DelayedScaling, deprecated ``te.fp8_autocast`` each step)
====================  =====================================================================================

Targets: ``mp-fp8`` (and ``-all``) >= 1.6x ``mp-bf16``; ``mp-fp8-bf16w`` (and ``-all``) >= 1.0x ``lightning-te``.

Per mode: ``--warmup`` steps, then ``--steps`` timed steps (CUDA events from ``on_train_batch_start`` to
``on_train_batch_end``, median). tokens/s uses the median step; peak GiB is ``torch.cuda.max_memory_allocated``
over the mode's whole run; ``FP8 share`` is the share of the model's linear-layer FLOPs (``sum in*out`` over
``nn.Linear`` and ``te.Linear``; every linear sees the same tokens) that ran in Transformer Engine FP8 layers;
MFU counts ``6 * n_params + 6 * layers * hidden * seq`` FLOPs per token against the bf16 ceiling
(``--peak-tflops``, 782 on the H200), as bench_overhead.py does.

Run on the GPU machine from the repository root (12 runs; estimated 4-5 minutes on an H200 with the defaults)::

    source .te/te_install.sh && PYTHONPATH=. python benchmarks/bench_fp8.py --json fp8.json
    PYTHONPATH=. python benchmarks/bench_fp8.py --sizes 1024:2:8:16 --seq 512 --vocab 4096 \\
        --warmup 2 --steps 3      # smoke test

Where the time goes (``--profile N``): N more steps a mode under ``torch.profiler`` (CUDA activity only), whose
kernels are summed per family, modes side by side (about 4 minutes for four modes at 4096 x 8 on an H100)::

    source .te/te_install.sh && PYTHONPATH=. python benchmarks/bench_fp8.py --sizes 4096:8:8:32 --steps 8 \\
        --profile 3 --modes lightning-te,mp-fp8-bf16w-all,mp-fp8-all,mp-fp8 --json fp8_profile.json

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

The step's GPU time is the sum of the families (kernels on one stream; the union of intervals is printed too). Each
size's table ends with each mode's difference to the first mode named, family by family, so a gap in the step time
is split into its kernel families; the kernels that differ most are listed under it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import inspect
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any, Optional

import torch
from torch import nn
from lightning.pytorch import Callback
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    StepProbe,
    build_model,
    count_params,
    fmt,
    lit_gpt,
    make_batches,
    make_optimizer,
    quiet_lightning,
    te_fused_adam,
    weights_fingerprint,
)

ALL_MODES = ("mp-bf16", "mp-fp8", "mp-fp8-head", "mp-fp8-all", "mp-fp8-fp32w", "mp-fp8-bf16w", "mp-fp8-bf16w-all",
             "lightning-te")
#: diagnostic modes (``--modes`` names them): what the defaults' parts cost
EXTRA_MODES = (
    "mp-fp8-bf16m",
    "mp-fp8-bf16m-all",
    "mp-fp8-noguards",
    "mp-fp8-nocheck",
    "mp-fp8-bf16w-all-nocheck",
    "mp-fp8-bf16w-all-current",
    "mp-fp8-bf16w-all-current-nocheck",
    # bf16 weights with Transformer Engine's FusedAdam(master_weights=True): fp32 masters kept by the optimizer
    "mp-fp8-bf16w-teadam",
    "mp-fp8-bf16w-all-teadam",
    # the same with Adam's moments in bf16 (Megatron-Core's precision-aware optimizer route): fp32 masters at bf16
    # moments' traffic
    "mp-fp8-bf16w-all-teadam-bf16m",
)
FP8_SETTINGS: dict[str, dict[str, Any]] = {
    "mp-fp8": {},
    "mp-fp8-head": {"keep_last": 0},
    "mp-fp8-all": {"keep_last": 0, "size_rule": "off"},
    "mp-fp8-fp32w": {"weights": "fp32"},
    "mp-fp8-bf16m": {"weights": "bf16"},
    "mp-fp8-bf16m-all": {"weights": "bf16", "keep_last": 0, "size_rule": "off"},
    "mp-fp8-bf16w": {"weights": "bf16"},
    "mp-fp8-bf16w-all": {"weights": "bf16", "keep_last": 0, "size_rule": "off"},
    # the defaults with the LayerNorms converted to TE (guards off), head still bf16
    "mp-fp8-noguards": {},
    # the saturation sentinel off: its cost with delayed scaling (TE's amaxes) and current scaling (hooks)
    "mp-fp8-nocheck": {"check_saturation": False},
    "mp-fp8-bf16w-all-nocheck": {"weights": "bf16", "keep_last": 0, "size_rule": "off", "check_saturation": False},
    "mp-fp8-bf16w-all-current": {"weights": "bf16", "keep_last": 0, "size_rule": "off", "recipe": "current"},
    "mp-fp8-bf16w-teadam": {"weights": "bf16"},
    "mp-fp8-bf16w-all-teadam": {"weights": "bf16", "keep_last": 0, "size_rule": "off"},
    "mp-fp8-bf16w-all-teadam-bf16m": {"weights": "bf16", "keep_last": 0, "size_rule": "off"},
    "mp-fp8-bf16w-all-current-nocheck": {
        "weights": "bf16", "keep_last": 0, "size_rule": "off", "recipe": "current", "check_saturation": False,
    },
}
#: the Trainer's accelerator; a module global so the logic can be dry-run elsewhere
ACCELERATOR = "gpu"
#: (mode, reference, target speed ratio)
#: modes whose bf16 weights train without fp32 master weights (Lightning's layout)
NO_MASTERS = ("-bf16w",)
TARGETS = (
    ("mp-fp8", "lightning-te", 0.95),
    ("mp-fp8-all", "lightning-te", 0.95),
    ("mp-fp8-bf16w", "lightning-te", 1.0),
    ("mp-fp8-bf16w-all", "lightning-te", 1.0),
    # fp32 masters kept by the optimizer (bf16 weights in the model): the fp32-master target again
    ("mp-fp8-bf16w-teadam", "mp-bf16", 1.6),
    ("mp-fp8-bf16w-all-teadam", "mp-bf16", 1.6),
)


# --------------------------------------------------------------------------------------------- the plugin
def make_fp8_plugin(fp8: dict[str, Any], **kwargs: Any) -> Any:
    from lightning_mp import MPPlugin

    return MPPlugin("fp8", fp8=fp8, **kwargs)


def _mp_kwargs_without_guards() -> dict[str, Any]:
    from lightning_mp import MPPlugin

    return {"fp32_modules": []} if "fp32_modules" in inspect.signature(MPPlugin).parameters else {}


def te_fused_adam_bf16_moments(params: Any, lr: float) -> torch.optim.Optimizer:
    """Transformer Engine's FusedAdam with fp32 masters and Adam's moments in bf16 (one kernel reads bf16
    gradients and moments and writes fp32 masters, bf16 moments and bf16 weights)."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    return FusedAdam(
        params, lr=lr, master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16
    )


# --------------------------------------------------------------------------------------------- measuring
def fp8_linear_share(model: nn.Module) -> float:
    """Share of ``sum(in * out)`` over all linear layers held by Transformer Engine linears."""
    try:
        import transformer_engine.pytorch as te

        te_linear: tuple = (te.Linear,)
    except ImportError:
        te_linear = ()
    fp8 = total = 0
    for m in model.modules():
        if te_linear and isinstance(m, te_linear):
            fp8 += m.in_features * m.out_features
            total += m.in_features * m.out_features
        elif isinstance(m, nn.Linear):
            total += m.in_features * m.out_features
    return fp8 / total if total else 0.0


def run_mode(
    args: argparse.Namespace, mode: str, batches: list[torch.Tensor], probe: Optional[StepProbe] = None
) -> dict[str, Any]:
    """One mode's fit; ``probe`` (default: ``--warmup`` then ``--steps`` timed) may run more steps than it times
    (``--profile`` profiles steps after the timed ones)."""
    from lightning.pytorch import Trainer

    from lightning_mp import MPPlugin

    probe = probe if probe is not None else StepProbe(args.warmup, args.steps, 0)
    # -teadam: the fp32 masters kept by Transformer Engine's FusedAdam
    optimizer = (
        te_fused_adam if mode.endswith("-teadam")
        else te_fused_adam_bf16_moments if mode.endswith("-teadam-bf16m")
        else make_optimizer
    )

    kwargs: dict[str, Any] = {}
    plugin = None
    if mode == "lightning-te":
        kwargs["precision"] = "transformer-engine"
    elif mode == "mp-bf16":
        plugin = MPPlugin("bf16")
    else:
        unguarded = "-all" in mode or mode.endswith("-noguards")
        extra = _mp_kwargs_without_guards() if unguarded else {}
        if any(tag in mode for tag in NO_MASTERS) and not mode.endswith(("-teadam", "-teadam-bf16m")):
            extra["master_weights"] = "none"  # (FusedAdam(master_weights=True) keeps its own: found by the plugin)
        plugin = make_fp8_plugin(FP8_SETTINGS[mode], **extra)
    if plugin is not None:
        kwargs["plugins"] = [plugin]

    model = build_model(args)
    fingerprint = weights_fingerprint(model)
    phases = MemoryPhases()
    module = lit_gpt(model, batches, lambda params: optimizer(params, args.lr))
    trainer = Trainer(
        accelerator=ACCELERATOR,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=probe.total,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[probe.callback(), phases],
        **kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        trainer.fit(module)
    row = probe.results()
    row.update(phases.figures())
    row.update(
        fingerprint=fingerprint,
        precision=str(trainer.precision),
        plugin=type(trainer.precision_plugin).__name__,
        fp8_share=fp8_linear_share(module),
        final_loss=float(module.last_loss) if module.last_loss is not None else None,
        deprecation_warnings=sum("fp8_autocast" in str(w.message) for w in caught),
    )
    fp8 = getattr(plugin, "_fp8", None) if plugin is not None else None
    if fp8 is not None and getattr(fp8, "report", None) is not None:
        row["conversion"] = fp8.report.summary()
    if plugin is not None:
        row["plugin_stats"] = plugin.stats.as_dict()
    del trainer, module, model
    return row


class MemoryPhases(Callback):
    """Where the step's memory peaks, read on the last training batch: GiB held at its start (weights, masters,
    optimizer state), the peak of forward and backward, and the peak from the end of backward to the batch's end
    (the step: gradients copied, the optimizer's work)."""

    def __init__(self) -> None:
        self.held = self.fwd_bwd = self.step = self.peak = 0.0

    def _read(self) -> float:
        """The peak since the last read (the run's peak is kept: the resets here would lose it)."""
        torch.cuda.synchronize()
        value = torch.cuda.max_memory_allocated() / 2**30
        self.peak = max(self.peak, value)
        torch.cuda.reset_peak_memory_stats()
        return value

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._read()
        self.held = torch.cuda.memory_allocated() / 2**30

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.fwd_bwd = self._read()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step = self._read()

    def figures(self) -> dict[str, float]:
        self._read()
        return {"held_gib": self.held, "fwd_bwd_gib": self.fwd_bwd, "step_gib": self.step, "run_peak_gib": self.peak}


def cleanup() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with contextlib.suppress(Exception):  # TE's global amax buffers hold the previous mode's tensors
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()


# --------------------------------------------------------------------------------------------- profiling
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
FAMILY_ORDER = list(dict.fromkeys(f for f, _ in FAMILIES)) + ["other"]


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
    """The GPU's busy time: the union of the kernels' intervals (overlapping kernels counted once)."""
    total, end = 0.0, None
    for _, _, a, b in sorted(kernels, key=lambda k: k[2]):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def kernel_figures(probe: ProfiledProbe) -> dict[str, Any]:
    """GPU ms a step by kernel family (and kernels a step), their union, and the 40 costliest kernels."""
    n = probe.prof
    by_family: collections.Counter = collections.Counter()
    by_kernel: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for name, us, _, _ in probe.kernels:
        by_family[family(name)] += us / n / 1e3
        by_kernel[name] += us / n / 1e3
        count[family(name)] += 1 / n
    return {
        "gpu_ms": sum(by_family.values()),
        "busy_ms": busy_us(probe.kernels) / n / 1e3,
        "families": {f: round(by_family.get(f, 0.0), 3) for f in FAMILY_ORDER},
        "kernels_per_step": {f: round(count.get(f, 0.0), 1) for f in FAMILY_ORDER},
        "top_kernels": [(k, round(v, 3)) for k, v in by_kernel.most_common(40)],
    }


def family_table(rows: list[dict[str, Any]]) -> str:
    """Modes side by side, family by family; then each mode's difference to the first, and the kernels that differ
    most."""
    ok = [r for r in rows if "families" in r]
    if not ok:
        return "no mode ran"
    head = "| family (GPU ms a step) | " + " | ".join(r["mode"] for r in ok) + " |"
    lines = [head, "|---|" + "---|" * len(ok)]
    for f in FAMILY_ORDER:
        cells = [f"{r['families'][f]:.1f} ({r['kernels_per_step'][f]:.0f})" for r in ok]
        lines.append(f"| {f} (kernels) | " + " | ".join(cells) + " |")
    lines.append("| **sum of kernels** | " + " | ".join(f"{r['gpu_ms']:.1f}" for r in ok) + " |")
    lines.append("| GPU busy (union) | " + " | ".join(f"{r['busy_ms']:.1f}" for r in ok) + " |")
    lines.append("| step (CUDA events, median) | " + " | ".join(f"{r['step_ms']:.1f}" for r in ok) + " |")
    lines.append("| peak GiB | " + " | ".join(f"{r['peak_gib']:.1f}" for r in ok) + " |")
    base = ok[0]
    for r in ok[1:]:
        diff = {f: r["families"][f] - base["families"][f] for f in FAMILY_ORDER}
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


# --------------------------------------------------------------------------------------------- report
def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| size | mode | step ms | tokens/s | MFU (bf16 ceiling) | peak GiB | held / fwd+bwd / step GiB | FP8 share"
        " | final loss | vs mp-bf16 | vs lightning-te |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['size']} | {r['mode']} | {r['error']}: {r.get('error_detail', '')[:80]} | | "
                f"| {fmt(r.get('peak_gib'), '.1f')} | | | | | |"
            )
            continue
        lines.append(
            f"| {r['size']} | {r['mode']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu'] * 100:.1f} % "
            f"| {r['peak_gib']:.1f} | {fmt(r.get('held_gib'), '.1f')} / {fmt(r.get('fwd_bwd_gib'), '.1f')} / "
            f"{fmt(r.get('step_gib'), '.1f')} | {r['fp8_share'] * 100:.0f} % | {fmt(r.get('final_loss'), '.4f')} "
            f"| {fmt(r.get('vs_bf16'), '.2f', 'x')} | {fmt(r.get('vs_lightning_te'), '.2f', 'x')} |"
        )
    return "\n".join(lines)


def parse_sizes(text: str) -> list[dict[str, int]]:
    sizes = []
    for part in text.split(","):
        fields = [int(x) for x in part.strip().split(":")]
        if len(fields) != 4:
            raise argparse.ArgumentTypeError(f"size {part!r}: use hidden:layers:batch:heads, e.g. 4096:8:8:32")
        hidden, layers, batch, heads = fields
        sizes.append({"hidden": hidden, "layers": layers, "batch": batch, "heads": heads})
    return sizes


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--modes",
        default=",".join(ALL_MODES),
        help=f"comma-separated subset of {', '.join(ALL_MODES)}; diagnostic: {', '.join(EXTRA_MODES)}",
    )
    p.add_argument(
        "--sizes", type=parse_sizes, default=parse_sizes("4096:8:8:32,8192:4:4:64"),
        help="comma-separated hidden:layers:batch:heads"
        " (default 4096:8:8:32,8192:4:4:64: the anchor shapes of shared/GPU.md)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode; the median is reported (default 10)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peak-tflops", type=float, default=782.0, help="MFU denominator (default 782: H200 bf16 matmul ceiling)"
    )
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N steps after the timed ones (torch.profiler, CUDA kernels) and print GPU time a step"
                        " by kernel family, each mode beside the first named (default 0: off)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES + EXTRA_MODES]
    if unknown or not modes:
        p.error(f"--modes: unknown {unknown or 'empty list'}; choose from {', '.join(ALL_MODES + EXTRA_MODES)}")
    args.modes = modes
    if args.warmup < 1 or args.steps < 1 or args.profile < 0:
        p.error("--warmup and --steps must be >= 1, --profile >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    import lightning

    from lightning_mp.fp8 import check_fp8_support
    from lightning_mp.fp8.support import te_version

    check_fp8_support("cuda", "delayed")  # a clear message instead of a failing row per mode
    quiet_lightning()

    device = torch.cuda.get_device_name()
    meta = {
        "device": device,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformer_engine": te_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "fp8_plugin": "MPPlugin('fp8')",
        "flops_formula": "6 * n_params + 6 * layers * hidden * seq",
    }
    print(
        f"# {device} | torch {torch.__version__} | lightning {lightning.__version__} | TE {meta['transformer_engine']}"
        f" | {meta['date']}\n# fp8 plugin: {meta['fp8_plugin']} | {args.warmup} warm-up + {args.steps} timed steps"
        " (median) per mode",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for size in args.sizes:
        size_args = argparse.Namespace(**{**vars(args), **size})
        n_params = count_params(size_args)
        tokens_per_step = size_args.batch * args.seq
        flops_per_token = 6 * n_params + 6 * size_args.layers * size_args.hidden * args.seq
        label = f"{size_args.hidden}x{size_args.layers}"
        print(
            f"## {label}: {n_params / 1e9:.2f} B params (hidden {size_args.hidden}, {size_args.layers} layers,"
            f" {size_args.heads} heads, vocab {args.vocab}), {size_args.batch} x {args.seq} tokens/step",
            flush=True,
        )
        batches = make_batches(size_args, args.warmup + args.steps + args.profile)
        for mode in args.modes:
            cleanup()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            row: dict[str, Any] = {
                "size": label, "mode": mode, "n_params": n_params, "tokens_per_step": tokens_per_step
            }
            try:
                probe = ProfiledProbe(args.warmup, args.steps, args.profile) if args.profile else None
                row.update(run_mode(size_args, mode, batches, probe=probe))
                if probe is not None:
                    row.update(kernel_figures(probe))
                    row.pop("step_ms_all", None)
            except torch.cuda.OutOfMemoryError as err:
                row["error"], row["error_detail"] = "OOM", str(err).splitlines()[0][:300]
            except Exception as err:  # report and go on with the other modes
                traceback.print_exc()
                row["error"] = type(err).__name__
                row["error_detail"] = str(err).splitlines()[0][:300] if str(err) else ""
            row["peak_gib"] = max(torch.cuda.max_memory_allocated() / 2**30, row.get("run_peak_gib") or 0.0)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            if "error" not in row:
                row["tokens_per_s"] = tokens_per_step / (row["step_ms"] / 1e3)
                row["mfu"] = row["tokens_per_s"] * flops_per_token / (args.peak_tflops * 1e12)
                print(
                    f"[{label} {mode}] step {row['step_ms']:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s, peak"
                    f" {row['peak_gib']:.1f} GiB, FP8 share {row['fp8_share'] * 100:.0f} %, loss"
                    f" {fmt(row.get('final_loss'), '.4f')}, {row['precision']} ({row['wall_s']} s)",
                    flush=True,
                )
                if row.get("conversion"):
                    print(f"[{label} {mode}] {row['conversion']}", flush=True)
            else:
                print(
                    f"[{label} {mode}] error {row['error']}: {row.get('error_detail', '')} ({row['wall_s']} s)",
                    flush=True,
                )
            rows.append(row)
            cleanup()

    for r in rows:
        if "error" in r:
            continue
        same = {x["mode"]: x for x in rows if x["size"] == r["size"] and "error" not in x}
        for key, ref in (("vs_bf16", "mp-bf16"), ("vs_lightning_te", "lightning-te")):
            r[key] = same[ref]["step_ms"] / r["step_ms"] if ref in same else None
        fingerprints = {x["fingerprint"] for x in same.values()}
        if len(fingerprints) > 1:
            print(f"WARNING: the {r['size']} modes did not start from the same weights: {fingerprints}", flush=True)

    verdicts = []
    for size in sorted({r["size"] for r in rows}):
        same = {x["mode"]: x for x in rows if x["size"] == size and "error" not in x}
        for mode, ref, target in TARGETS:
            if mode in same and ref in same:
                ratio = same[ref]["step_ms"] / same[mode]["step_ms"]
                verdicts.append(
                    {
                        "size": size,
                        "mode": mode,
                        "reference": ref,
                        "target": target,
                        "ratio": ratio,
                        "met": ratio >= target,
                    }
                )

    print()
    print(f"{device} | torch {torch.__version__} | lightning {lightning.__version__} | TE {meta['transformer_engine']}"
          f" | {meta['fp8_plugin']} | median of {args.steps} steps after {args.warmup} warm-up")
    print()
    print(markdown_table(rows))
    if args.profile:
        for size in dict.fromkeys(r["size"] for r in rows):
            print(f"\n{size}: GPU time a step by kernel family (mean of {args.profile} profiled steps)\n")
            print(family_table([r for r in rows if r["size"] == size]))
    print()
    for v in verdicts:
        print(f"target {v['size']} {v['mode']} >= {v['target']:.1f}x {v['reference']}: {v['ratio']:.2f}x"
              f" {'met' if v['met'] else 'MISSED'}")
    print("vs columns: speed ratio (reference step ms / this step ms; > 1 is faster). FP8 share: share of linear FLOPs"
          " in Transformer Engine FP8 layers.")
    print(f"total {time.perf_counter() - t_all:.1f} s", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "targets": verdicts}, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
