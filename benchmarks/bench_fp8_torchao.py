"""FP8 through torchao's float8: MPPlugin("fp8", fp8={"backend": "torchao"}) against a plain compiled torchao loop.

Trains the 1.89 B GPT of ``common.py`` (hidden 4096, 8 layers, 32 heads, 8 x 2048 tokens, vocab 32768, fused
AdamW, random tokens; the same initial weights in every mode) once per mode, all in one process, every mode under
the same ``torch.compile`` setting (the whole model compiled, as torchao's float8 is fast only compiled):

=====================  ===========================================================================================
plain-bf16             a plain loop: fp32 weights under ``torch.autocast("cuda", torch.bfloat16)``, the model
                       ``torch.compile``d
plain-tensorwise       the same loop after torchao's ``convert_to_float8_training`` with
plain-rowwise          ``Float8LinearConfig.from_recipe_name(recipe)``: every linear but the LM head (left in bf16)
mp-bf16                ``MPPlugin("bf16")`` through the Trainer, the LightningModule holding the compiled model
mp-tensorwise          ``MPPlugin("fp8", fp8={"backend": "torchao", "recipe": ...})`` through the Trainer, the
mp-rowwise             compiled model: its defaults (bf16 weights with fp32 master weights in the step, the LM head
                       in bf16, the saturation watch)
=====================  ===========================================================================================

Diagnostic modes (``--modes`` names them): ``mp-<recipe>-fp32w`` (``weights="fp32"``: the plain loop's layout, fp32
weights under autocast, no master weights), ``mp-<recipe>-nocheck`` (``check_saturation=False``: what the watch
costs), ``mp-<recipe>-layers`` (the model not compiled: the backend compiles each FP8 layer's forward itself).

The same layers run FP8 in the plain loops and the plugin's (at hidden 4096 every block linear passes the plugin's
size rule; the head is kept by ``keep_last=1``). Per mode: ``--warmup`` steps (the compilation happens there), then
``--steps`` timed steps: CUDA events from the start to the end of each training batch, the median; peak GiB is
``torch.cuda.max_memory_allocated`` over the mode's run. The table at the end gives each mode's speed against
``plain-bf16`` and against the plain loop of its recipe.

Run on the GPU machine from the repository root (torchao installed: ``pip install --no-deps .whl/torchao-*.whl``;
about 6-8 minutes for the six modes on an H200, most of it compiling)::

    PYTHONPATH=. python benchmarks/bench_fp8_torchao.py --json fp8_torchao.json
    PYTHONPATH=. python benchmarks/bench_fp8_torchao.py --smoke     # a tiny model, 2 + 3 steps a mode

Without CUDA ``--smoke`` checks the set-up only (imports, the swap of the plain loop, one eager FP8 step on the
CPU, the plugins built) and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    GPT,
    StepProbe,
    build_model,
    cleanup,
    count_params,
    fmt,
    init_gpt_weights,
    lit_gpt,
    make_batches,
    make_optimizer,
    quiet_lightning,
    weights_fingerprint,
)

RECIPES = ("tensorwise", "rowwise")
ALL_MODES = ("plain-bf16", "plain-tensorwise", "plain-rowwise", "mp-bf16", "mp-tensorwise", "mp-rowwise")
EXTRA_MODES = tuple(f"mp-{r}-{tag}" for r in RECIPES for tag in ("fp32w", "nocheck", "layers"))
SMOKE = {"hidden": 256, "layers": 2, "heads": 4, "seq": 128, "batch": 2, "vocab": 1024, "warmup": 2, "steps": 3}


# --------------------------------------------------------------------------------------------- the modes
def float8_filter(module: nn.Module, fqn: str) -> bool:
    """The plain loop's layers: every linear but the LM head, with both sides divisible by 16."""
    assert isinstance(module, nn.Linear)
    return fqn != "head" and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_plain(model: nn.Module, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)


def fp8_share(model: nn.Module) -> float:
    """Share of ``sum(in * out)`` over the linear layers held by torchao's Float8Linear."""
    fp8 = total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.in_features * m.out_features
            if type(m).__name__ == "Float8Linear":
                fp8 += m.in_features * m.out_features
    return fp8 / total if total else 0.0


def run_plain(args: argparse.Namespace, mode: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    """A plain loop: bf16 autocast over fp32 weights, torchao's swap for an FP8 recipe, the whole model compiled."""
    probe = StepProbe(args.warmup, args.steps, 0)
    model = build_model(args)
    fingerprint = weights_fingerprint(model)
    recipe = mode.removeprefix("plain-")
    if recipe != "bf16":
        convert_plain(model, recipe)
    share = fp8_share(model)
    compiled = torch.compile(model)
    opt = make_optimizer(model.parameters(), args.lr)
    model.train()
    loss = None
    for batch in batches:
        probe.start()
        x = batch.to("cuda", non_blocking=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = compiled(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        probe.end()
    row = probe.results()
    row.update(fingerprint=fingerprint, fp8_share=share, final_loss=float(loss.detach()) if loss is not None else None)
    return row


def mp_plugin(mode: str) -> Any:
    from lightning_mp import MPPlugin

    if mode == "mp-bf16":
        return MPPlugin("bf16")
    recipe, _, tag = mode.removeprefix("mp-").partition("-")
    fp8: dict[str, Any] = {"backend": "torchao", "recipe": recipe}
    if tag == "fp32w":
        fp8["weights"] = "fp32"
    elif tag == "nocheck":
        fp8["check_saturation"] = False
    return MPPlugin("fp8", fp8=fp8)


def run_lightning(args: argparse.Namespace, mode: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    """The plugin through the Trainer; the LightningModule holds the compiled model (``-layers``: the plain one)."""
    from lightning.pytorch import Trainer

    probe = StepProbe(args.warmup, args.steps, 0)
    plugin = mp_plugin(mode)
    model = build_model(args)
    fingerprint = weights_fingerprint(model)
    held = model if mode.endswith("-layers") else torch.compile(model)
    module = lit_gpt(held, batches, lambda params: make_optimizer(params, args.lr))
    trainer = Trainer(
        accelerator="gpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=probe.total, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[probe.callback()], plugins=[plugin],
    )  # fmt: skip
    trainer.fit(module)
    row = probe.results()
    row.update(fingerprint=fingerprint, fp8_share=fp8_share(model), plugin_stats=plugin.stats.as_dict(),
               final_loss=float(module.last_loss) if module.last_loss is not None else None)  # fmt: skip
    backend = getattr(plugin, "_fp8", None)
    if backend is not None and getattr(backend, "report", None) is not None:
        row["conversion"] = backend.report.summary()
    return row


# --------------------------------------------------------------------------------------------- the report
def ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_plain_bf16`` (plain-bf16's step over the mode's: above 1 is faster) and ``vs_plain_recipe``."""
    steps = {r["mode"]: r["step_ms"] for r in rows if "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        base = steps.get("plain-bf16")
        r["vs_plain_bf16"] = base / r["step_ms"] if base else None
        recipe = next((x for x in ("bf16",) + RECIPES if f"-{x}" in r["mode"]), None)
        same = steps.get(f"plain-{recipe}")
        r["vs_plain_recipe"] = same / r["step_ms"] if same else None


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | step ms | vs plain-bf16 | vs plain loop, same recipe | peak GiB | FP8 share | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']}: {r.get('error_detail', '')[:80]} | | | "
                         f"{fmt(r.get('peak_gib'), '.1f')} | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['mode']} | {r['step_ms']:.1f} | {fmt(r.get('vs_plain_bf16'), '.2f', 'x')}"
            f" | {fmt(r.get('vs_plain_recipe'), '.2f', 'x')} | {r['peak_gib']:.1f} | {r['fp8_share'] * 100:.0f} %"
            f" | {fmt(r.get('final_loss'), '.4f')} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- without CUDA
def smoke_without_cuda(args: argparse.Namespace) -> int:
    """The set-up of every mode, on the CPU: imports, the plain loop's swap and one eager FP8 step, the plugins."""
    torch.manual_seed(args.seed)
    model = init_gpt_weights(GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq))
    convert_plain(model, "tensorwise")
    batch = make_batches(args, 1)[0]
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(batch)
    loss.backward()
    share = fp8_share(model)
    plugins = {mode: type(mp_plugin(mode)).__name__ for mode in args.modes if mode.startswith("mp-")}
    print(
        f"no CUDA: --smoke checked the set-up only. One eager FP8 step of the plain tensorwise loop on the CPU:"
        f" loss {loss.item():.4f}, FP8 share {share * 100:.0f} %; plugins built for {', '.join(plugins)}."
    )
    return 0 if torch.isfinite(loss) else 1


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--modes", default=",".join(ALL_MODES),
                   help=f"comma-separated subset of {', '.join(ALL_MODES)}; diagnostic: {', '.join(EXTRA_MODES)}")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model (hidden 256, 2 layers, 2 x 128 tokens), 2 warm-up + 3 timed steps a mode")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per mode, compilation included (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode; the median is reported (default 20)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES + EXTRA_MODES]
    if unknown or not modes:
        p.error(f"--modes: unknown {unknown or 'empty list'}; choose from {', '.join(ALL_MODES + EXTRA_MODES)}")
    args.modes = modes
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import torchao
    except ImportError:
        print('bench_fp8_torchao.py needs torchao: pip install "torchao>=0.18".', file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        if args.smoke:
            return smoke_without_cuda(args)
        print("bench_fp8_torchao.py needs a CUDA GPU (--smoke checks the set-up on a CPU).", file=sys.stderr)
        return 2
    import lightning

    from lightning_mp.fp8.torchao_backend import TorchAOFloat8

    for recipe in RECIPES:  # a clear message instead of a failing row per mode
        if any(recipe in m for m in args.modes):
            TorchAOFloat8({"backend": "torchao", "recipe": recipe}).check("cuda")
    quiet_lightning()
    warnings.filterwarnings("ignore", message=".*get_autocast_gpu_dtype.*")
    device = torch.cuda.get_device_name()
    n_params = count_params(args)
    meta = {
        "device": device, "torch": torch.__version__, "lightning": lightning.__version__,
        "torchao": getattr(torchao, "__version__", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: v for k, v in vars(args).items() if k != "json"}, "n_params": n_params,
    }  # fmt: skip
    print(
        f"# {device} | torch {torch.__version__} | lightning {lightning.__version__} | torchao {meta['torchao']}"
        f" | {meta['date']}\n# GPT {n_params / 1e9:.2f} B params (hidden {args.hidden}, {args.layers} layers,"
        f" {args.heads} heads, vocab {args.vocab}), {args.batch} x {args.seq} tokens/step; whole model compiled;"
        f" {args.warmup} warm-up + {args.steps} timed steps (median) per mode",
        flush=True,
    )
    batches = make_batches(args, args.warmup + args.steps)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        cleanup()
        torch._dynamo.reset()  # each mode compiles from scratch: no cache limit shared, no graph reused
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        row: dict[str, Any] = {"mode": mode}
        run: Callable[..., dict[str, Any]] = run_plain if mode.startswith("plain-") else run_lightning
        try:
            row.update(run(args, mode, batches))
        except torch.cuda.OutOfMemoryError as err:
            row["error"], row["error_detail"] = "OOM", str(err).splitlines()[0][:300]
        except Exception as err:  # report and go on with the other modes
            traceback.print_exc()
            row["error"], row["error_detail"] = type(err).__name__, (str(err).splitlines() or [""])[0][:300]
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        if "error" in row:
            print(f"[{mode}] error {row['error']}: {row['error_detail']} ({row['wall_s']} s)", flush=True)
        else:
            spread = statistics.pstdev(row["step_ms_all"]) if len(row["step_ms_all"]) > 1 else 0.0
            print(
                f"[{mode}] step {row['step_ms']:.1f} ms (sd {spread:.1f}), peak {row['peak_gib']:.1f} GiB, FP8 share"
                f" {row['fp8_share'] * 100:.0f} %, loss {fmt(row.get('final_loss'), '.4f')} ({row['wall_s']} s)",
                flush=True,
            )
            if row.get("conversion"):
                print(f"[{mode}] {row['conversion']}", flush=True)
        rows.append(row)
    ratios(rows)
    print("\n" + table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
