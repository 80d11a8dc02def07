"""MPPlugin's overhead against a plain autocast loop and Lightning's own precision modes, on one CUDA GPU.

Trains a GPT-style decoder (pre-norm LayerNorm blocks, SDPA causal attention, 4x GELU MLP, learned positions,
untied head) with fused AdamW on random tokens, once per mode, each from the same initial weights (same seed,
built on the GPU), all in one process:

=======================  ====================================================================
plain-bf16               ``torch.autocast("cuda", torch.bfloat16)`` loop, no Lightning
lightning-bf16-mixed     ``Trainer(precision="bf16-mixed")``
mp-bf16                  ``Trainer(plugins=[MPPlugin("bf16")])``
lightning-16-mixed       ``Trainer(precision="16-mixed")`` (no clipping, so fused AdamW is allowed)
mp-fp16                  ``Trainer(plugins=[MPPlugin("fp16")])``
mp-bf16-keep-grads       ``MPPlugin("bf16", release_grads_after_step=False)``: where the memory saving comes from
mp-bf16-noskip           ``MPPlugin("bf16", skip_nonfinite=False)``: what the inf/NaN check costs
mp-bf16-checkafter       ``MPPlugin("bf16")`` with the check after backward (``lightning_mp.overlap`` off): what
                         taking it during backward saves
mp-bf16-spike            ``MPPlugin("bf16", spike_sigma=6.0)``: what the loss-spike guard costs
...+sched                the same with a constant step-interval LambdaLR (holding it reads the skip flag)
...+clip                 the same with gradient clipping by norm at 1.0 (``gradient_clip_val`` / ``clip_grad_norm_``);
                         Lightning's bf16-mixed refuses clipping with a fused optimizer, so plain-bf16+clip is
                         the reference
lightning-bf16-true      ``Trainer(precision="bf16-true")``: bf16 weights and AdamW state, no master copy
mp-bf16-true             ``MPPlugin("bf16-true")``: bf16 weights, fp32 master weights (AdamW state fp32),
                         plain LayerNorms in bf16 (the defaults with masters)
mp-bf16-true-guarded     ``MPPlugin("bf16-true", fp32_modules=["defaults"])``: the same with the LayerNorms guarded
                         in fp32 (the defaults before; what the guards cost)
mp-bf16-true-kahan       ``MPPlugin("bf16-true", master_weights="kahan")``: bf16 compensation instead of masters
mp-bf16-true-stochastic  ``MPPlugin("bf16-true", master_weights="stochastic")``: stochastic rounding, no copy
mp-bf16-true-none        ``MPPlugin("bf16-true", master_weights="none")``: plain bf16 weights and state (guards on)
mp-bf16-true-noguards    ``MPPlugin("bf16-true", fp32_modules=[])``: fp32 masters, LayerNorms in bf16 (what the
                         guards cost)
...-bf16states           the same with ``optimizer_states="bf16"``: AdamW's moments held in bf16 between steps
                         (``mp-bf16-true-bf16states``: fp32 masters and bf16 moments, 10 bytes a parameter held)
...-teadam               either of the two above with Transformer Engine's ``FusedAdam(master_weights=True)``
                         instead of torch's fused AdamW: the optimizer keeps the fp32 masters (one kernel reads
                         bf16 gradients, writes fp32 masters and bf16 weights); needs Transformer Engine
mp-bf16+log              ``MPPlugin("bf16")`` logging to a ``CSVLogger``, no callback: the callbacks' reference
mp-bf16+monitor          the same with ``PrecisionMonitor()`` (logs every ``log_every_n_steps``, 50)
mp-bf16+detector         the same with ``NonFiniteDetector()`` (its flags read every 50 batches)
mp-bf16+monitor-layers   ``PrecisionMonitor(layer_stats=True)`` (not in the monitor's defaults)
mp-bf16+detector-inputs  ``NonFiniteDetector(track_inputs=True)`` (not in the detector's defaults)
=======================  ====================================================================

The true-half modes are not in the default ``--modes`` list; name them, e.g.
``--modes plain-bf16,lightning-bf16-mixed,lightning-bf16-true,mp-bf16-true,mp-bf16-true-kahan,...``. When any
ran, a second table compares them with the bf16 autocast loop (speed), Lightning's bf16-mixed (peak memory)
and Lightning's bf16-true, and gives ``resident GiB``: what stays allocated after training (weights, masters or
compensation, optimizer state), divided by the parameter count as bytes/param.

The callback modes (``--modes mp-bf16+log,mp-bf16+monitor,mp-bf16+detector --steps 50 --rounds 2``: with 50
timed steps each run holds one logging step of the monitor and one read of the detector's flags) add a table of
their cycle times against ``mp-bf16+log``; targets: the monitor at most 1.02x, the detector at most 1.03x (medians;
the mean cycle includes the logging step and the flag read).

Per mode: ``--warmup`` steps, then ``--steps`` timed steps, then ``--sync-steps`` steps under
``torch.cuda.set_sync_debug_mode("warn")`` that count host-device syncs. ``--rounds N`` runs the list N times,
interleaved (slow drift of the GPU's clock or temperature spreads over every mode), and reports the medians of the
rounds.

Timing: CUDA events recorded in ``on_train_batch_start`` / ``on_train_batch_end`` (for the plain loop: at the top
of the iteration, before the batch's host-to-device copy, and after ``zero_grad``). ``step ms`` is the median
start-to-end time of the timed steps; ``cycle ms`` is the median end-to-end time between consecutive steps, which
also holds the gap between steps (batch fetch, hooks, any GPU idle time a host sync causes). tokens/s and MFU use
``step ms``; a ``cycle ms`` well above ``step ms`` means the GPU waited for the host between steps.

FLOPs per token (the PaLM-style count with causal attention scores counted at half, the convention of the
anchor figures in shared/GPU.md)::

    6 * n_params + 6 * layers * hidden * seq

``n_params`` counts every parameter (embeddings included). MFU = tokens/s * FLOPs per token / ``--peak-tflops``
(782 TFLOP/s: the bf16 dense matmul ceiling measured on the H200, see shared/GPU.md; use the same figure on an
H100 only to compare against H200 numbers, not as the H100's own ceiling).

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_overhead.py [--json out.json]
    PYTHONPATH=. python benchmarks/bench_overhead.py --hidden 256 --layers 2 --heads 4 --seq 256 --batch 4 \\
        --vocab 1024 --warmup 2 --steps 3 --sync-steps 2   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    StepProbe,
    build_model,
    cleanup,
    count_params,
    fmt,
    lit_gpt,
    make_batches,
    make_optimizer,
    quiet_lightning,
    te_fused_adam,
    weights_fingerprint,
)

ALL_MODES = (
    "plain-bf16",
    "lightning-bf16-mixed",
    "mp-bf16",
    "mp-bf16-keep-grads",
    "lightning-16-mixed",
    "mp-fp16",
    "mp-bf16-noskip",
    "mp-bf16-checkafter",
    "mp-bf16-spike",
    "lightning-bf16-mixed+sched",
    "mp-bf16+sched",
    "plain-bf16+clip",
    "mp-bf16+clip",
)
#: bf16-true modes: runnable with --modes, not part of the default list (the original run stays as it was)
TRUE_HALF_MODES = (
    "lightning-bf16-true",
    "mp-bf16-true",
    "mp-bf16-true-kahan",
    "mp-bf16-true-stochastic",
    "mp-bf16-true-none",
    "mp-bf16-true-noguards",
    "mp-bf16-true-guarded",
    "mp-bf16-true-teadam",
    "mp-bf16-true-noguards-teadam",
    "mp-bf16-true-bf16states",
    "mp-bf16-true-stochastic-bf16states",
)
#: what the monitoring callbacks cost (runnable with --modes): each logs to a CSVLogger, as does its reference
#: ``mp-bf16+log`` (no callback); the probe's callback runs after theirs, so the cycle holds their work
CALLBACK_MODES = (
    "mp-bf16+log",
    "mp-bf16+monitor",
    "mp-bf16+detector",
    "mp-bf16+monitor-layers",
    "mp-bf16+detector-inputs",
)
#: largest cycle-time ratio to ``mp-bf16+log`` (medians)
CALLBACK_TARGETS = {"mp-bf16+monitor": 1.02, "mp-bf16+detector": 1.03}
KNOWN_MODES = ALL_MODES + TRUE_HALF_MODES + CALLBACK_MODES
NATIVE = {
    "plain-bf16": "lightning-bf16-mixed",
    "lightning-bf16-mixed": "lightning-bf16-mixed",
    "mp-bf16": "lightning-bf16-mixed",
    "mp-bf16-keep-grads": "lightning-bf16-mixed",
    "lightning-16-mixed": "lightning-16-mixed",
    "mp-fp16": "lightning-16-mixed",
    "lightning-bf16-mixed+sched": "lightning-bf16-mixed+sched",
    "mp-bf16+sched": "lightning-bf16-mixed+sched",
    "mp-bf16-noskip": "lightning-bf16-mixed",
    "mp-bf16-checkafter": "lightning-bf16-mixed",
    "mp-bf16-spike": "lightning-bf16-mixed",
    # Lightning's bf16-mixed refuses clipping with a fused optimizer: the plain loop is the reference
    "plain-bf16+clip": "plain-bf16+clip",
    "mp-bf16+clip": "plain-bf16+clip",
    # true-half: the target compares speed with bf16 autocast and memory with Lightning's bf16-mixed
    **{mode: "lightning-bf16-mixed" for mode in TRUE_HALF_MODES},
    **{mode: "mp-bf16+log" for mode in CALLBACK_MODES},
}
CLIP = 1.0


# --------------------------------------------------------------------------------------------- measuring
def make_callbacks(name: Optional[str]) -> list:
    """The monitoring callbacks of a ``+<name>`` mode (``log``: none, only the logger)."""
    from lightning_mp.callbacks import NonFiniteDetector, PrecisionMonitor

    return {
        None: lambda: [],
        "log": lambda: [],
        "monitor": lambda: [PrecisionMonitor()],
        "detector": lambda: [NonFiniteDetector()],
        "monitor-layers": lambda: [PrecisionMonitor(layer_stats=True)],
        "detector-inputs": lambda: [NonFiniteDetector(track_inputs=True)],
    }[name]()


def run_plain(
    args: argparse.Namespace, batches: list[torch.Tensor], probe: StepProbe, clip: bool = False
) -> dict[str, Any]:
    model = build_model(args)
    fingerprint = weights_fingerprint(model)
    opt = make_optimizer(model.parameters(), args.lr)
    model.train()
    try:
        for batch in batches:
            probe.start()
            x = batch.to("cuda", non_blocking=True)
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            probe.end()
        final_loss = float(loss.detach())
    finally:
        probe.close_sync_window()
    return {"fingerprint": fingerprint, "final_loss": final_loss}


def run_lightning(
    args: argparse.Namespace, batches: list[torch.Tensor], probe: StepProbe, mode: str
) -> dict[str, Any]:
    from lightning.pytorch import Trainer

    def configure_optimizers(params):
        if te_adam:
            return te_fused_adam(params, args.lr)
        opt = make_optimizer(params, args.lr)
        if not with_scheduler:
            return opt
        # a constant step-interval schedule: measures what holding schedulers on skipped steps costs
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    te_adam = mode.endswith("-teadam")
    mode = mode.removesuffix("-teadam")
    states = {"optimizer_states": "bf16"} if mode.endswith("-bf16states") else {}
    mode = mode.removesuffix("-bf16states")
    watch = mode.partition("+")[2] if mode in CALLBACK_MODES else None
    mode = mode.partition("+")[0] if watch else mode
    with_scheduler = mode.endswith("+sched")
    with_clip = mode.endswith("+clip")
    mode = mode.removesuffix("+sched").removesuffix("+clip")
    kwargs: dict[str, Any] = {}
    plugin = None
    if mode == "lightning-bf16-mixed":
        kwargs["precision"] = "bf16-mixed"
    elif mode == "lightning-16-mixed":
        kwargs["precision"] = "16-mixed"
    elif mode == "lightning-bf16-true":
        kwargs["precision"] = "bf16-true"
    else:
        from lightning_mp import MPPlugin

        if mode.startswith("mp-bf16-true"):
            variant = mode.removeprefix("mp-bf16-true").removeprefix("-")
            if variant == "noguards":
                plugin = MPPlugin("bf16-true", fp32_modules=[], **states)
            elif variant == "guarded":
                plugin = MPPlugin("bf16-true", fp32_modules=["defaults"], **states)
            else:  # unset: fp32, or the optimizer's own
                plugin = MPPlugin("bf16-true", master_weights=variant or None, **states)
        elif mode == "mp-bf16-keep-grads":
            plugin = MPPlugin("bf16", release_grads_after_step=False)
        elif mode == "mp-bf16-noskip":
            plugin = MPPlugin("bf16", skip_nonfinite=False)
        elif mode == "mp-bf16-spike":
            plugin = MPPlugin("bf16", spike_sigma=6.0)
        elif mode == "mp-bf16-checkafter":
            from lightning_mp import overlap

            overlap.MIN_NUMEL, saved_min_numel = 1 << 62, overlap.MIN_NUMEL  # put back after the fit
            plugin = MPPlugin("bf16")
        else:
            plugin = MPPlugin({"mp-bf16": "bf16", "mp-fp16": "fp16"}[mode])
        kwargs["plugins"] = [plugin]

    model = build_model(args)
    fingerprint = weights_fingerprint(model)
    module = lit_gpt(model, batches, configure_optimizers)
    log_dir = tempfile.TemporaryDirectory(prefix="bench_overhead_") if watch else None
    if log_dir is not None:  # the monitor's figures are really written, and its reference logs alike
        from lightning.pytorch.loggers import CSVLogger

        kwargs["logger"] = CSVLogger(log_dir.name, name=watch)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        logger=kwargs.pop("logger", False),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=probe.total,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        # the probe last: its end event comes after the other callbacks' on_train_batch_end work
        callbacks=[*make_callbacks(watch), probe.callback()],
        gradient_clip_val=CLIP if with_clip else None,
        **kwargs,
    )
    try:
        trainer.fit(module)
    finally:
        if log_dir is not None:
            log_dir.cleanup()
        probe.close_sync_window()
        if mode == "mp-bf16-checkafter":
            from lightning_mp import overlap

            overlap.MIN_NUMEL = saved_min_numel
    torch.cuda.synchronize()
    # what training keeps between steps: weights, master weights / compensation, optimizer state
    resident = torch.cuda.memory_allocated()
    extra: dict[str, Any] = {
        "fingerprint": fingerprint,
        "precision": str(trainer.precision),
        "resident_gib": resident / 2**30,
        "resident_bytes_per_param": resident / sum(p.numel() for p in model.parameters()),
    }
    if plugin is not None and plugin.master_weights is not None:
        extra["master_weights"] = plugin.master_weights
    if module.last_loss is not None:
        extra["final_loss"] = float(module.last_loss)
    if plugin is not None:
        extra["plugin_stats"] = plugin.stats.as_dict()
    elif getattr(trainer.precision_plugin, "scaler", None) is not None:
        # Lightning's 16-mixed: a final scale below the initial 2**16 means steps were skipped
        extra["loss_scale"] = float(trainer.precision_plugin.scaler.get_scale())
    return extra


def run_mode(args: argparse.Namespace, mode: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    probe = StepProbe(args.warmup, args.steps, args.sync_steps)
    if mode.startswith("plain-bf16"):
        extra = run_plain(args, batches, probe, clip=mode.endswith("+clip"))
    else:
        extra = run_lightning(args, batches, probe, mode)
    row = probe.results()
    # the mean cycle holds the rare steps the medians leave out (the monitor's logging step, the detector's read)
    cycles = [probe.ends[i - 1].elapsed_time(probe.ends[i]) for i in range(max(args.warmup, 1), probe.warmup
                                                                           + probe.steps)]
    row["mean_cycle_ms"] = statistics.fmean(cycles) if cycles else None
    row.update(extra)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a mode run in several rounds: the medians of its rounds' figures (the first round's other
    fields), the highest peak and sync count, and each round's figures."""
    ok = [r for r in runs if "error" not in r]
    if len(runs) == 1 or not ok:
        return runs[0]
    row = dict(ok[0])
    for key in ("step_ms", "cycle_ms", "mean_cycle_ms"):
        values = [r[key] for r in ok if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    row["peak_gib"] = max(r["peak_gib"] for r in ok)
    syncs = [r["syncs_per_step"] for r in ok if r.get("syncs_per_step") is not None]
    row["syncs_per_step"] = max(syncs) if syncs else None
    row["rounds"] = [{k: r.get(k) for k in ("step_ms", "cycle_ms", "mean_cycle_ms", "error")} for r in runs]
    return row


# --------------------------------------------------------------------------------------------- report
def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | step ms | cycle ms | tokens/s | MFU | peak GiB | syncs/step | vs plain-bf16 | vs reference"
        " | reference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} | | | | | | | | |")
            continue
        syncs = r["syncs_per_step"]
        syncs_txt = "—" if syncs is None else (f"{syncs:.0f}" if float(syncs).is_integer() else f"{syncs:.2f}")
        lines.append(
            f"| {r['mode']} | {r['step_ms']:.1f} | {fmt(r['cycle_ms'], '.1f')} | {r['tokens_per_s']:,.0f} "
            f"| {fmt(r['mfu'] * 100, '.1f', ' %')} | {r['peak_gib']:.1f} | {syncs_txt} "
            f"| {fmt(r.get('vs_plain'), '.3f')} | {fmt(r.get('vs_native'), '.3f')} | {NATIVE.get(r['mode'], '')} |"
        )
    return "\n".join(lines)


def true_half_table(rows: list[dict[str, Any]]) -> Optional[str]:
    """The bf16-true rows against bf16 autocast (speed), Lightning's bf16-mixed (memory) and bf16-true."""
    by_mode = {r["mode"]: r for r in rows if "error" not in r}
    chosen = [r for r in rows if r["mode"] in TRUE_HALF_MODES]
    if not chosen:
        return None
    plain, mixed, half = (by_mode.get(m) for m in ("plain-bf16", "lightning-bf16-mixed", "lightning-bf16-true"))
    lines = [
        "| mode | step ms | speed vs plain-bf16 | speed vs lightning-bf16-mixed | peak GiB"
        " | peak vs lightning-bf16-mixed | speed vs lightning-bf16-true | peak vs lightning-bf16-true | resident GiB"
        " | resident bytes/param |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in chosen:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} | | | | | | | | |")
            continue
        speed = lambda ref: ref["step_ms"] / r["step_ms"] if ref else None  # noqa: E731
        mem = lambda ref: r["peak_gib"] / ref["peak_gib"] if ref and ref["peak_gib"] else None  # noqa: E731
        lines.append(
            f"| {r['mode']} | {r['step_ms']:.1f} | {fmt(speed(plain), '.3f')} | {fmt(speed(mixed), '.3f')}"
            f" | {r['peak_gib']:.1f} | {fmt(mem(mixed), '.3f')} | {fmt(speed(half), '.3f')} | {fmt(mem(half), '.3f')}"
            f" | {fmt(r.get('resident_gib'), '.1f')} | {fmt(r.get('resident_bytes_per_param'), '.2f')} |"
        )
    return "\n".join(lines)


def callback_table(rows: list[dict[str, Any]]) -> Optional[str]:
    """The callback rows against ``mp-bf16+log``: cycle ms (what the targets compare), step ms, mean cycle ms."""
    base = next((r for r in rows if r["mode"] == "mp-bf16+log" and "error" not in r), None)
    chosen = [r for r in rows if r["mode"] in CALLBACK_MODES]
    if not chosen:
        return None
    lines = [
        "| mode | cycle ms | per-round cycle ms | step ms | mean cycle ms | vs +log: cycle | vs +log: step"
        " | vs +log: mean cycle | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in chosen:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} | | | | | | | | |")
            continue
        ratio = {k: r[k] / base[k] if base and r.get(k) and base.get(k) else None
                 for k in ("cycle_ms", "step_ms", "mean_cycle_ms")}
        target = CALLBACK_TARGETS.get(r["mode"])
        met = "—" if target is None or ratio["cycle_ms"] is None else ("yes" if ratio["cycle_ms"] <= target else "no")
        per_round = ", ".join(fmt(x.get("cycle_ms"), ".1f") for x in r.get("rounds", [r]))
        lines.append(
            f"| {r['mode']} | {fmt(r['cycle_ms'], '.1f')} | {per_round} | {r['step_ms']:.1f}"
            f" | {fmt(r['mean_cycle_ms'], '.1f')} | {fmt(ratio['cycle_ms'], '.3f')} | {fmt(ratio['step_ms'], '.3f')}"
            f" | {fmt(ratio['mean_cycle_ms'], '.3f')} | {fmt(target, '.2f')} | {met} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--modes",
        default=",".join(ALL_MODES),
        help=f"comma-separated subset of {', '.join(KNOWN_MODES)} (default: all but the bf16-true ones)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode; the median is reported (default 20)")
    p.add_argument(
        "--sync-steps",
        type=int,
        default=3,
        help="steps counted for host syncs after the timed ones (default 3; 0 skips)",
    )
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes this many times, interleaved; a mode's figures are its rounds' medians "
                        "(default 1)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peak-tflops", type=float, default=782.0, help="MFU denominator (default 782: H200 bf16 matmul ceiling)"
    )
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in KNOWN_MODES]
    if unknown or not modes:
        p.error(f"--modes: unknown {unknown or 'empty list'}; choose from {', '.join(KNOWN_MODES)}")
    args.modes = modes
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1 or args.sync_steps < 0:
        p.error("--warmup, --steps and --rounds must be >= 1, --sync-steps >= 0")
    return args


def run_reported(args: argparse.Namespace, mode: str, batches: list[torch.Tensor], tag: str) -> dict[str, Any]:
    """One run of ``mode``, its line printed; an error (OOM included) is reported in the row, not raised."""
    cleanup()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    row: dict[str, Any] = {"mode": mode}
    try:
        row.update(run_mode(args, mode, batches))
    except torch.cuda.OutOfMemoryError as err:
        row["error"] = "OOM"
        row["error_detail"] = str(err).splitlines()[0][:300]
    except Exception as err:  # report and go on with the other modes
        traceback.print_exc()
        row["error"] = f"{type(err).__name__}"
        row["error_detail"] = str(err).splitlines()[0][:300] if str(err) else ""
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if "error" in row:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    summary = (
        f"error {row['error']}: {row.get('error_detail', '')}"
        if "error" in row
        else f"step {row['step_ms']:.1f} ms, cycle {fmt(row['cycle_ms'], '.1f')} ms,"
        f" peak {row['peak_gib']:.1f} GiB, syncs/step {fmt(row['syncs_per_step'], '.2f')},"
        f" final loss {row.get('final_loss', float('nan')):.4f}"
    )
    print(f"[{tag}] {summary} ({row['wall_s']} s)", flush=True)
    if "plugin_stats" in row:
        print(f"[{tag}] plugin stats: {row['plugin_stats']}", flush=True)
    if "loss_scale" in row:
        print(f"[{tag}] final loss scale: {row['loss_scale']:g}", flush=True)
    cleanup()
    return row


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overhead.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    import lightning

    quiet_lightning()

    device = torch.cuda.get_device_name()
    n_params = count_params(args)
    tokens_per_step = args.batch * args.seq
    flops_per_token = 6 * n_params + 6 * args.layers * args.hidden * args.seq
    meta = {
        "device": device,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "n_params": n_params,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token,
        "flops_formula": "6 * n_params + 6 * layers * hidden * seq",
    }
    print(
        f"# {device} | torch {torch.__version__} | lightning {lightning.__version__} | {meta['date']}\n"
        f"# model: {n_params / 1e9:.3f} B params (hidden {args.hidden}, {args.layers} layers, {args.heads} heads,"
        f" vocab {args.vocab}), {args.batch} x {args.seq} tokens/step, fused AdamW lr {args.lr}\n"
        f"# {args.warmup} warm-up + {args.steps} timed (median) + {args.sync_steps} sync-count steps per mode"
        f"{f', {args.rounds} interleaved rounds' if args.rounds > 1 else ''}",
        flush=True,
    )

    batches = make_batches(args, args.warmup + args.steps + args.sync_steps)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    t_all = time.perf_counter()
    for round_ in range(args.rounds):
        for mode in args.modes:
            tag = mode if args.rounds == 1 else f"{mode} round {round_ + 1}"
            runs[mode].append(run_reported(args, mode, batches, tag))
    rows = [combine_rounds(mode_runs) for mode_runs in runs.values()]
    for row in rows:
        if "error" not in row:
            row["tokens_per_s"] = tokens_per_step / (row["step_ms"] / 1e3)
            row["mfu"] = row["tokens_per_s"] * flops_per_token / (args.peak_tflops * 1e12)

    by_mode = {r["mode"]: r for r in rows if "error" not in r}
    fingerprints = {r["fingerprint"] for r in by_mode.values()}
    if len(fingerprints) > 1:
        print(f"WARNING: the modes did not start from the same weights: {fingerprints}", flush=True)
    for r in rows:
        if "error" in r:
            continue
        plain = by_mode.get("plain-bf16")
        native = by_mode.get(NATIVE[r["mode"]])
        # speed ratio: > 1 means this mode is faster than the reference
        r["vs_plain"] = plain["step_ms"] / r["step_ms"] if plain else None
        r["vs_native"] = native["step_ms"] / r["step_ms"] if native else None

    print()
    print(
        f"{device} | torch {torch.__version__} | lightning {lightning.__version__} | {meta['date']} | "
        f"{n_params / 1e9:.2f} B params, {args.batch} x {args.seq} tokens/step | MFU vs {args.peak_tflops:g} TFLOP/s"
        f" ({meta['flops_formula']}) | median of {args.steps} steps after {args.warmup} warm-up"
    )
    print()
    print(markdown_table(rows))
    print()
    print("vs columns: speed ratio (reference step ms / this step ms; > 1 is faster); the reference of each row is"
          " in NATIVE at the top of this file. bf16 modes compare with"
          " lightning-bf16-mixed, fp16 modes with lightning-16-mixed.")
    half_table = true_half_table(rows)
    if half_table is not None:
        print()
        print("bf16-true: speed ratios > 1 are faster; peak ratios < 1 use less memory (targets for mp-bf16-true:"
              " speed vs plain-bf16 >= 1.05, peak vs lightning-bf16-mixed <= 0.85)")
        print()
        print(half_table)
    watch_table = callback_table(rows)
    if watch_table is not None:
        print()
        print("callbacks: ratios to mp-bf16+log (the same run with its CSVLogger, no callback); the targets bound the"
              " median cycle")
        print()
        print(watch_table)
    print(f"total {time.perf_counter() - t_all:.1f} s", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
