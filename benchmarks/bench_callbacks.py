"""What each monitoring callback costs, on the GPT model of ``bench_overhead.py``, on one CUDA GPU.

Trains the same model (``bench_overhead.build_model``: same seed, same initial weights; fused AdamW; random
tokens) under ``Trainer(plugins=[MPPlugin("bf16")])``, all in one process, with:

=====================  ===================================================================================
none                   no callback (the baseline)
monitor                ``PrecisionMonitor()``: defaults, logs every ``Trainer.log_every_n_steps`` (50) steps
detector               ``NonFiniteDetector()``: defaults (module outputs, their gradients, parameter gradients;
                       flags read every 50 batches)
monitor-layers         ``PrecisionMonitor(layer_stats=True)`` (not in the default set)
detector-inputs        ``NonFiniteDetector(track_inputs=True)`` (not in the default set)
=====================  ===================================================================================

Every variant runs ``--rounds`` times, interleaved (none, monitor, detector, none, monitor, ...), so slow drift
of the GPU clock or temperature spreads over all of them. Per run: ``--warmup`` untimed steps, ``--steps`` timed
steps, then ``--sync-steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")`` that count host syncs.
With the defaults (3 + 50 timed) each run holds one logging step of the monitor (step 50) and one read of the
detector's flags (batch 50), so the mean cycle includes them; the medians are the steady state.
Every variant logs to a ``CSVLogger`` in a temporary folder (the baseline too), so the monitor's figures
really are written.

Timing: CUDA events in ``on_train_batch_start`` / ``on_train_batch_end`` (``bench_overhead.StepProbe``).
``cycle ms`` (end of one step to the end of the next: every hook, the batch fetch and any GPU idle time a host
sync causes) is what the ratios compare; ``step ms`` (start to end of a step) is shown too. Targets: the monitor
at most 1.02x and the detector at most 1.03x the baseline's cycle time (medians); the mean cycle includes the
logging step and the flag read.

Run from the repository root (needs lightning, torchmetrics and a CUDA GPU; not jsonargparse or matplotlib)::

    PYTHONPATH=. python benchmarks/bench_callbacks.py [--json out.json]
    PYTHONPATH=. python benchmarks/bench_callbacks.py --hidden 256 --layers 2 --heads 4 --seq 256 --batch 4 \\
        --vocab 1024 --warmup 2 --steps 5 --sync-steps 2 --rounds 1   # smoke test
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
import warnings
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead  # noqa: E402  (the model, data and step probe of the core benchmark)

DEFAULT_VARIANTS = ("none", "monitor", "detector")
ALL_VARIANTS = (*DEFAULT_VARIANTS, "monitor-layers", "detector-inputs")
TARGETS = {"monitor": 1.02, "detector": 1.03}


def make_callbacks(variant: str) -> list:
    from lightning_mp.callbacks import NonFiniteDetector, PrecisionMonitor

    return {
        "none": lambda: [],
        "monitor": lambda: [PrecisionMonitor()],
        "detector": lambda: [NonFiniteDetector()],
        "monitor-layers": lambda: [PrecisionMonitor(layer_stats=True)],
        "detector-inputs": lambda: [NonFiniteDetector(track_inputs=True)],
    }[variant]()


def run_variant(args: argparse.Namespace, variant: str, batches: list[torch.Tensor], log_dir: str) -> dict[str, Any]:
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mp import MPPlugin

    probe = bench_overhead.StepProbe(args.warmup, args.steps, args.sync_steps)

    callbacks = make_callbacks(variant)
    model = bench_overhead.build_model(args)
    fingerprint = bench_overhead.weights_fingerprint(model)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        logger=CSVLogger(log_dir, name=variant),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=probe.total,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        # the probe last: its end event comes after the other callbacks' on_train_batch_end work
        callbacks=[*callbacks, probe.callback()],
        plugins=[MPPlugin("bf16")],
    )
    try:
        trainer.fit(
            bench_overhead.lit_gpt(model, batches, lambda params: bench_overhead.make_optimizer(params, args.lr))
        )
    finally:
        probe.close_sync_window()
    row = probe.results()
    timed = range(max(args.warmup, 1), args.warmup + args.steps)
    cycles = [probe.ends[i - 1].elapsed_time(probe.ends[i]) for i in timed]
    row["cycle_ms_all"] = [round(c, 3) for c in cycles]
    row["mean_cycle_ms"] = statistics.fmean(cycles)
    row["fingerprint"] = fingerprint
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for cb in callbacks:
        if hasattr(cb, "last") and cb.last:
            row["monitor_last"] = {k: v for k, v in cb.last.items() if not k.startswith("precision/act")}
        if hasattr(cb, "reports"):
            row["detector_reports"] = len(cb.reports)
    return row


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    def median_of(results: list[dict[str, Any]], key: str) -> Optional[float]:
        values = [r[key] for r in results if r.get(key) is not None]
        return statistics.median(values) if values else None

    baseline = [r for r in runs.get("none", []) if "error" not in r]
    base = {key: median_of(baseline, key) for key in ("cycle_ms", "step_ms", "mean_cycle_ms")}
    rows = []
    for variant, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            rows.append({"variant": variant, "error": results[0].get("error", "?")})
            continue
        row: dict[str, Any] = {"variant": variant, "target": TARGETS.get(variant)}
        for key in ("cycle_ms", "step_ms", "mean_cycle_ms"):
            row[key] = median_of(ok, key)
            row[f"{key}_ratio"] = row[key] / base[key] if row[key] is not None and base[key] else None
        row["cycle_ms_runs"] = [round(r["cycle_ms"], 2) for r in ok if r.get("cycle_ms") is not None]
        row["peak_gib"] = max(r["peak_gib"] for r in ok)
        syncs = [r["syncs_per_step"] for r in ok if r.get("syncs_per_step") is not None]
        row["syncs_per_step"] = max(syncs) if syncs else None
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | cycle ms (median) | per-run medians | step ms | mean cycle ms | peak GiB | syncs/step"
        " | vs none: cycle | vs none: step | vs none: mean cycle | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Optional[float], spec: str) -> str:
        return "—" if value is None else format(value, spec)

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error']} | | | | | | | | | | |")
            continue
        target, ratio = r["target"], r["cycle_ms_ratio"]
        met = "—" if target is None or ratio is None else ("yes" if ratio <= target else "no")
        syncs = r["syncs_per_step"]
        lines.append(
            f"| {r['variant']} | {fmt(r['cycle_ms'], '.1f')} | {', '.join(f'{v:.1f}' for v in r['cycle_ms_runs'])}"
            f" | {fmt(r['step_ms'], '.1f')} | {fmt(r['mean_cycle_ms'], '.1f')} | {r['peak_gib']:.1f}"
            f" | {'—' if syncs is None else f'{syncs:g}'} | {fmt(ratio, '.3f')} | {fmt(r['step_ms_ratio'], '.3f')}"
            f" | {fmt(r['mean_cycle_ms_ratio'], '.3f')} | {fmt(target, '.2f')} | {met} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated subset of {', '.join(ALL_VARIANTS)}"
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every variant (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default 3)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per run; the median is reported (default 50)")
    p.add_argument(
        "--sync-steps",
        type=int,
        default=3,
        help="steps counted for host syncs after the timed ones (default 3; 0 skips)",
    )
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
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: unknown {unknown or 'empty list'}; choose from {', '.join(ALL_VARIANTS)}")
    if "none" not in variants:
        variants.insert(0, "none")  # the ratios need the baseline
    args.variants = variants
    if args.rounds < 1 or args.warmup < 1 or args.steps < 1 or args.sync_steps < 0:
        p.error("--rounds, --warmup and --steps must be >= 1, --sync-steps >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_callbacks.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    import lightning

    bench_overhead.quiet_lightning()
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")

    device = torch.cuda.get_device_name()
    n_params = bench_overhead.count_params(args)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(
        f"# {device} | torch {torch.__version__} | lightning {lightning.__version__} | {date}\n"
        f"# model: {n_params / 1e9:.3f} B params (hidden {args.hidden}, {args.layers} layers, {args.heads} heads,"
        f" vocab {args.vocab}), {args.batch} x {args.seq} tokens/step, fused AdamW, MPPlugin('bf16')\n"
        f"# {args.rounds} interleaved round(s) of {', '.join(args.variants)}; per run {args.warmup} warm-up +"
        f" {args.steps} timed + {args.sync_steps} sync-count steps",
        flush=True,
    )
    batches = bench_overhead.make_batches(args, args.warmup + args.steps + args.sync_steps)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_callbacks_") as log_dir:
        for round_ in range(args.rounds):
            for variant in args.variants:
                bench_overhead.cleanup()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                try:
                    row = run_variant(args, variant, batches, log_dir)
                except torch.cuda.OutOfMemoryError as err:
                    row = {"error": "OOM", "error_detail": str(err).splitlines()[0][:300]}
                except Exception as err:  # report and go on with the other variants
                    traceback.print_exc()
                    row = {"error": type(err).__name__, "error_detail": str(err)[:300]}
                row["wall_s"] = time.perf_counter() - t0
                runs[variant].append(row)
                status = row.get("error") or (
                    f"cycle {row['cycle_ms']:.1f} ms, step {row['step_ms']:.1f} ms,"
                    f" mean cycle {row['mean_cycle_ms']:.1f} ms, syncs/step {row['syncs_per_step']}"
                )
                print(f"# round {round_ + 1} {variant}: {status} ({row['wall_s']:.0f} s)", flush=True)
    rows = summarise(runs)
    print(f"# total {time.perf_counter() - t_all:.0f} s\n")
    print(markdown_table(rows))
    fingerprints = {r.get("fingerprint") for rs in runs.values() for r in rs if "fingerprint" in r}
    if len(fingerprints) > 1:
        print(f"\nWARNING: runs started from different weights: {sorted(fingerprints)}")
    if args.json:
        meta = {
            "device": device,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "date": date,
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "n_params": n_params,
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "summary": rows, "runs": runs}, fh, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
