"""DDP and FSDP with MPPlugin on several GPUs: the same skip decision everywhere, the same loss as one GPU,
and the throughput from 1 to N GPUs, against Lightning's own ``bf16-mixed`` under the same strategies.

Each run is its own process (Lightning's DDP/FSDP launcher re-runs this script for the other ranks) on the core
benchmark's GPT model, with the same initial weights and the same global batch every step: one GPU takes the whole
batch, N GPUs take 1/N of it each, so every run sees the same data and the loss curves are comparable. The data
is learnable (each sequence follows ``x[t+1] = (a * x[t] + b) mod vocab`` from a random start), so the loss falls.

MPPlugin runs get an overflow injected (an inf written into one gradient) on the LAST rank only, at the
``--poison-steps``; the one-GPU runs get it at the same steps. Checked per run: every rank skipped exactly those
steps, every rank ends with the same weights (a float64 fingerprint of the full parameters), and the global loss
curve stays within ``--loss-rtol`` of the one-GPU run of the same mode. Lightning's baselines are not poisoned
(they have no step skipping: an inf gradient would destroy the weights).

Run on a machine with 2 GPUs, from the repository root::

    PYTHONPATH=. python benchmarks/bench_distributed.py --out benchmarks/results

FSDP2's weight gathers, Transformer Engine against torchao (``--torchao`` adds torchao's rows: ``tensorwise``, fp32
shards gathered in bf16 (``weights="auto"``, bf16 ``MixedPrecisionPolicy``) or in FP8 (``weights="fp8"``: torchao's
``enable_fsdp_float8_all_gather``, each weight's scale computed after the step), torch's fused AdamW), on the 1.89 B
GPT of the earlier FP8-weights rows, step time and peak memory a GPU (Transformer Engine set up, and torchao
installed: ``pip install --no-deps .whl/torchao-0.18.0-*.whl``); about 7-8 minutes on two H200s (about 70 s a
Transformer Engine or bf16 run, 100-130 s a torchao run: its layers compile first)::

    PYTHONPATH=. python benchmarks/bench_distributed.py --torchao --hidden 4096 --layers 8 --heads 32 \
        --steps 12 --warmup 5 --out benchmarks/results --tag fsdp2_gather_torchao_h200x2 \
        --runs "fsdp2 mp-bf16" "fsdp2 mp-fp8 bf16-gather" "fsdp2 mp-fp8 fp8-weights" \
               "fsdp2 torchao bf16-gather" "fsdp2 torchao fp8-gather"

(``--torchao`` alone runs torchao's three rows, one GPU's among them: the loss reference of the bf16-gather row.)
CPU smoke of the torchao rows (gloo; torch runs torchao's FP8 matmuls on the CPU, so the GPU checks stand aside
there)::

    PYTHONPATH=. python benchmarks/bench_distributed.py --accelerator cpu --hidden 32 --layers 1 --heads 2 --seq 16 \
        --vocab 64 --global-batch 4 --steps 6 --warmup 2 --poison-steps 3 --act-poison-steps 4 --torchao \
        --fp8-options '{"size_rule": "off"}' --runs "1gpu mp-fp8 torchao" "fsdp2 torchao bf16-gather" \
        "fsdp2 torchao fp8-gather"

Step time: CUDA-synchronised wall time per optimizer step, median over the steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GPT, Block, fmt, init_gpt_weights, quiet_lightning  # noqa: E402  the shared model

RUNS = [
    # name, strategy, devices, precision ("mp:<mode>" or "lightning:<precision>"), MPPlugin arguments
    ("1gpu mp-bf16", "single", 1, "mp:bf16"),
    ("1gpu mp-fp16", "single", 1, "mp:fp16"),
    ("1gpu lightning bf16-mixed", "single", 1, "lightning:bf16-mixed"),
    ("ddp mp-bf16", "ddp", 2, "mp:bf16"),
    ("ddp mp-fp16", "ddp", 2, "mp:fp16"),
    ("ddp lightning bf16-mixed", "ddp", 2, "lightning:bf16-mixed"),
    ("fsdp mp-bf16", "fsdp", 2, "mp:bf16"),
    ("fsdp mp-fp16", "fsdp", 2, "mp:fp16"),
    ("fsdp mp-bf16 bf16-gather", "fsdp", 2, "mp:bf16", {"fsdp_param_dtype": "bf16"}),
    ("fsdp lightning bf16-mixed", "fsdp", 2, "lightning:bf16-mixed"),
]
#: with --fp8 (Transformer Engine): FP8 on one GPU, under DDP, FSDP and FSDP2 (ModelParallelStrategy, prepare_fp8 in
#: configure_model), beside bf16 under FSDP/FSDP2; the resume runs save at --resume-at and go on in a new process
FP8_RUNS = [
    ("1gpu mp-fp8", "single", 1, "mp:fp8"),
    ("ddp mp-fp8", "ddp", 2, "mp:fp8"),
    ("fsdp mp-bf16", "fsdp", 2, "mp:bf16"),
    ("fsdp mp-fp8", "fsdp", 2, "mp:fp8"),
    ("fsdp mp-fp8 bf16-gather", "fsdp", 2, "mp:fp8", {"fsdp_param_dtype": "bf16"}),
    ("fsdp2 mp-bf16", "fsdp2", 2, "mp:bf16"),
    ("fsdp2 mp-fp8", "fsdp2", 2, "mp:fp8"),
    ("fsdp2 mp-fp8 bf16-gather", "fsdp2", 2, "mp:fp8", {}, {"fsdp2_param_dtype": "bf16"}),
]
FP8_RESUME_RUNS = [
    ("fsdp mp-fp8 resume-sharded", "fsdp", 2, "mp:fp8", {}, {"resume": "sharded"}),
    ("fsdp mp-fp8 resume-full", "fsdp", 2, "mp:fp8", {}, {"resume": "full"}),
    ("fsdp2 mp-fp8 resume", "fsdp2", 2, "mp:fp8", {}, {"resume": "sharded"}),
    ("ddp mp-fp8 resume", "ddp", 2, "mp:fp8", {}, {"resume": "full"}),
]
#: with --fp8-weights: FP8 primary weights (fp8={"weights": "fp8"}: FSDP2 gathers FP8, Transformer Engine's FusedAdam
#: keeps the fp32 masters) beside the fp32 shards with bf16 gathers, under torch's AdamW and under FusedAdam
FP8_WEIGHT = {"fp8": {"weights": "fp8"}}
TE_ADAM_BF16 = {"fsdp2_param_dtype": "bf16", "optimizer": "te-adam"}
FP8_WEIGHT_RUNS = [
    ("1gpu mp-fp8 fp8-weights", "single", 1, "mp:fp8", FP8_WEIGHT, {"optimizer": "te-adam"}),
    ("fsdp2 mp-fp8 bf16-gather", "fsdp2", 2, "mp:fp8", {}, {"fsdp2_param_dtype": "bf16"}),
    ("fsdp2 mp-fp8 bf16-gather te-adam", "fsdp2", 2, "mp:fp8", {}, TE_ADAM_BF16),
    ("fsdp2 mp-fp8 fp8-weights", "fsdp2", 2, "mp:fp8", FP8_WEIGHT, TE_ADAM_BF16),
    ("fsdp2 mp-fp8 fp8-weights resume", "fsdp2", 2, "mp:fp8", FP8_WEIGHT, {**TE_ADAM_BF16, "resume": "sharded"}),
]
#: with --torchao: torchao's float8 (tensorwise) under FSDP2, fp32 shards gathered in bf16 (weights "auto" and a bf16
#: MixedPrecisionPolicy) against torchao's FP8 all-gather (weights "fp8"), torch's fused AdamW; one GPU: the loss
#: reference of the bf16-gather row (one GPU refuses FP8 gathers)
AO_TENSORWISE = {"fp8": {"backend": "torchao", "recipe": "tensorwise"}}
AO_FP8_GATHER = {"fp8": {"backend": "torchao", "recipe": "tensorwise", "weights": "fp8"}}
TORCHAO_RUNS = [
    ("1gpu mp-fp8 torchao", "single", 1, "mp:fp8", AO_TENSORWISE),
    ("fsdp2 torchao bf16-gather", "fsdp2", 2, "mp:fp8", AO_TENSORWISE, {"fsdp2_param_dtype": "bf16"}),
    ("fsdp2 torchao fp8-gather", "fsdp2", 2, "mp:fp8", AO_FP8_GATHER, {"fsdp2_param_dtype": "bf16"}),
]
#: with --more: true-half (fp32 masters; under FSDP the shards are the masters) and where MPPlugin's DDP time goes
MORE_RUNS = [
    ("1gpu mp-bf16-true", "single", 1, "mp:bf16-true"),
    ("ddp mp-bf16-true", "ddp", 2, "mp:bf16-true"),
    ("fsdp mp-bf16-true", "fsdp", 2, "mp:bf16-true"),
    ("ddp mp-bf16 no-check", "ddp", 2, "mp:bf16", {"skip_nonfinite": False}),  # not poisoned
    ("ddp mp-bf16 keep-grads", "ddp", 2, "mp:bf16", {"release_grads_after_step": False}),
]


# --------------------------------------------------------------------------------------------- the worker
def learnable_tokens(step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """The global batch of ``step``: affine-recurrence sequences from random starts (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(vocab, (batch, 1), generator=g)
    a = torch.randint(1, 8, (batch, 1), generator=g) * 2 + 1
    b = torch.randint(vocab, (batch, 1), generator=g)
    tokens = [start]
    for _ in range(seq):
        tokens.append((a * tokens[-1] + b) % vocab)
    return torch.cat(tokens, dim=1)


def worker(cfg: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.utils.data import DataLoader

    from lightning_mp import MPPlugin, prepare_fp8
    from lightning_mp.fp8 import fp8_gemm_modules
    from lightning_mp.fp8.torchao_backend import TorchAOFloat8, is_float8_linear

    quiet_lightning()
    cuda = cfg["accelerator"] == "cuda"
    if not cuda and (cfg["plugin_kwargs"].get("fp8") or {}).get("backend") == "torchao":
        import lightning_mp.fp8.support as support  # a CPU smoke run: torch runs torchao's FP8 matmuls on the CPU

        TorchAOFloat8.check = lambda self, device: None  # type: ignore[method-assign]
        support.fp8_device_problem = lambda *args, **kwargs: None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    precision = cfg["precision"]
    checked = precision.startswith("mp:") and cfg["plugin_kwargs"].get("skip_nonfinite", True)
    poison = set(cfg["poison_steps"]) if checked else set()
    act_poison = set(cfg["act_poison_steps"]) if checked and precision == "mp:fp8" else set()
    opts = cfg["options"]

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(cfg["seed"])
            self.gpt = init_gpt_weights(GPT(cfg["vocab"], cfg["hidden"], cfg["layers"], cfg["heads"], cfg["seq"]))

        def configure_model(self) -> None:
            if cfg["strategy"] != "fsdp2":
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            prepare_fp8(self)  # MPPlugin("fp8"): the FP8 backend's layers before sharding; bf16: nothing
            gather = {"bf16": torch.bfloat16}.get(opts.get("fsdp2_param_dtype"))
            policy = MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=torch.float32 if gather else None)
            mesh = self.device_mesh["data_parallel"]
            for block in self.gpt.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(self.gpt, mesh=mesh, mp_policy=policy)  # the root: training_step calls self.gpt

        def on_fit_start(self) -> None:
            fp8_layers = fp8_gemm_modules(self) or [m for m in self.modules() if is_float8_linear(m)]  # TE or torchao
            if act_poison and fp8_layers and self.global_rank == self.trainer.world_size - 1:
                # an inf only the FP8 cast sees (first: before torchao's saturation watch reads the input)
                fp8_layers[0].register_forward_pre_hook(self._poison_input, prepend=True)

        def _poison_input(self, module: torch.nn.Module, args: tuple) -> Optional[tuple]:
            if not (self.training and self.trainer.fit_loop.epoch_loop.total_batch_idx in act_poison):
                return None
            x = args[0].clone()
            x.view(-1)[0] = math.inf
            return (x, *args[1:])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            step = self.trainer.fit_loop.epoch_loop.total_batch_idx  # (restored on resume, unlike the loader)
            tokens = learnable_tokens(step, cfg["global_batch"], cfg["seq"], cfg["vocab"])
            share = cfg["global_batch"] // self.trainer.world_size
            mine = tokens[self.global_rank * share : (self.global_rank + 1) * share].to(self.device, non_blocking=True)
            return self.gpt(mine)

        def on_after_backward(self) -> None:
            step = self.trainer.fit_loop.epoch_loop.total_batch_idx
            if step in poison and self.global_rank == self.trainer.world_size - 1:
                for p in self.trainer.model.parameters():  # DDP: a parameter; FSDP: this rank's flat shard
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: a DTensor
                    if grad is not None and grad.numel():
                        grad.view(-1)[0] = math.inf
                        break

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # FSDP's flat parameters live on the wrapped model (Lightning's rule for FSDP optimizers)
            if opts.get("optimizer") == "te-adam":  # Transformer Engine's; it keeps the masters of FP8 weights
                from transformer_engine.pytorch.optimizers import FusedAdam

                fp8_weights = (cfg["plugin_kwargs"].get("fp8") or {}).get("weights") == "fp8"
                params = self.trainer.model.parameters()
                return FusedAdam(params, lr=cfg["lr"], weight_decay=0.01, master_weights=fp8_weights)
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=cfg["lr"], fused=cuda)

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.skipped: list[int] = []
            self._t0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            sync()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sync()
            self.times.append(time.perf_counter() - self._t0)
            loss = trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean")
            self.losses.append(float(loss))
            plugin = trainer.precision_plugin
            if isinstance(plugin, MPPlugin) and plugin.stats.skipped:
                self.skipped.append(trainer.fit_loop.epoch_loop.total_batch_idx)  # (counted on after a resume)

    def fingerprint(trainer: pl.Trainer, module: LM) -> list[float]:
        model = trainer.model
        ctx = (
            FullyShardedDataParallel.summon_full_params(model)
            if isinstance(model, FullyShardedDataParallel)
            else None
        )
        if ctx is not None:
            ctx.__enter__()
        try:
            values = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in module.gpt.parameters()]
            values = [(v.dequantize() if hasattr(v, "dequantize") else v).double() for v in values]  # FP8 weights
            total = sum(v.sum() for v in values)
            squares = sum(v.square().sum() for v in values)
            return [float(total), float(squares)]
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def fp8_fingerprint(trainer: pl.Trainer) -> Optional[list[float]]:
        """Sums of every FP8 module's delayed-scaling scales and amax histories (None without FP8 state)."""
        plugin = trainer.precision_plugin
        state = plugin.state_dict().get("fp8") if isinstance(plugin, MPPlugin) else None
        modules = (state or {}).get("modules") or {}
        if not modules:
            return None
        tensors = [t for entry in modules.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        scales = [t for entry in modules.values() for k, t in entry.items() if k in ("scale_fwd", "scale_bwd")]
        # (the scales alone too: with FP8 primary weights each rank's optimizer step records its own shard's amax,
        # reduced over the ranks at the next forward, so the newest history row may differ at the end of a run)
        total = float(sum(t.double().sum() for t in tensors))
        return [total, float(len(tensors)), float(sum(t.double().sum() for t in scales))]

    plugins: list[Any] = []
    trainer_precision: Optional[str] = None
    if precision.startswith("mp:"):
        plugins.append(MPPlugin(precision[3:], **cfg["plugin_kwargs"]))
    else:
        trainer_precision = precision.split(":", 1)[1]
    if cfg["strategy"] == "fsdp":
        strategy: Any = FSDPStrategy(
            auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD", state_dict_type=opts.get("resume", "full")
        )
    elif cfg["strategy"] == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=cfg["devices"], tensor_parallel_size=1)
    elif cfg["strategy"] == "ddp":
        strategy = DDPStrategy(gradient_as_bucket_view=True)
    else:
        strategy = SingleDeviceStrategy(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    probe = Probe()
    trainer = pl.Trainer(
        accelerator=cfg["accelerator"],
        devices=cfg["devices"],
        strategy=strategy,
        precision=trainer_precision,
        plugins=plugins or None,
        max_steps=cfg.get("stop_at") or cfg["steps"],
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe],
    )
    module = LM()
    data = DataLoader(torch.arange(cfg["steps"]), batch_size=1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=data, ckpt_path=cfg.get("resume_from"))
    if cfg.get("save_to"):
        trainer.save_checkpoint(cfg["save_to"])
    result = {
        "rank": trainer.global_rank,
        "times": probe.times,
        "losses": probe.losses,
        "skipped": probe.skipped,
        "fingerprint": fingerprint(trainer, module),
        "fp8_state": fp8_fingerprint(trainer),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "stats": trainer.precision_plugin.stats.as_dict() if isinstance(trainer.precision_plugin, MPPlugin) else None,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
    }
    with open(f"{cfg['out']}.rank{trainer.global_rank}.json", "w") as fh:
        json.dump(result, fh)


# --------------------------------------------------------------------------------------------- the driver
def _launch(cfg: dict[str, Any], args: argparse.Namespace) -> tuple[Optional[str], list[dict[str, Any]]]:
    """One worker process (Lightning launches the other ranks); returns (error or None, the ranks' results)."""
    env = dict(os.environ)
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=args.run_timeout,
    )
    ranks = []
    for rank in range(cfg["devices"]):
        path = f"{cfg['out']}.rank{rank}.json"
        if os.path.exists(path):
            with open(path) as fh:
                ranks.append(json.load(fh))
    if proc.returncode != 0 or len(ranks) != cfg["devices"]:
        return (proc.stderr or proc.stdout)[-2000:], ranks
    return None, ranks


def run(
    name: str,
    strategy: str,
    devices: int,
    precision: str,
    kwargs: dict[str, Any],
    options: dict[str, Any],
    args: argparse.Namespace,
    folder: str,
) -> dict[str, Any]:
    """One run; with ``options["resume"]`` two processes: up to ``--resume-at`` (saving a checkpoint of that
    kind), then a new Trainer resuming it to the end. Their steps are joined into one row."""
    cfg = {
        key: getattr(args, key)
        for key in ("vocab", "hidden", "layers", "heads", "seq", "global_batch", "steps", "lr", "seed", "poison_steps")
    }
    if precision == "mp:fp8" and args.fp8_options:
        kwargs = {**kwargs, "fp8": {**json.loads(args.fp8_options), **kwargs.get("fp8", {})}}
    cfg.update(
        accelerator=args.accelerator,
        strategy=strategy,
        devices=devices,
        precision=precision,
        plugin_kwargs=kwargs,
        options=options,
        act_poison_steps=args.act_poison_steps,
        out=os.path.join(folder, name.replace(" ", "_")),
    )
    start = time.perf_counter()
    if options.get("resume"):
        ckpt = cfg["out"] + ".ckpt"
        error, first = _launch(dict(cfg, stop_at=args.resume_at, save_to=ckpt, out=cfg["out"] + ".a"), args)
        second: list[dict[str, Any]] = []
        if error is None:
            error, second = _launch(dict(cfg, resume_from=ckpt, out=cfg["out"] + ".b"), args)
        joined = ("times", "losses", "skipped")
        ranks = [
            dict(b, **{k: a[k] + b[k] for k in joined}, peak_gib=max(a["peak_gib"], b["peak_gib"]))
            for a, b in zip(first, second)
        ]
    else:
        error, ranks = _launch(cfg, args)
    row: dict[str, Any] = {
        "run": name,
        "strategy": strategy,
        "devices": devices,
        "precision": precision,
        "kwargs": kwargs,
        "options": options,
        "wall_s": time.perf_counter() - start,
    }
    if error is not None:
        row["error"] = error
        return row
    r0 = ranks[0]
    timed = r0["times"][args.warmup:]
    row.update(
        step_ms=1000 * statistics.median(timed),
        tokens_per_s=args.global_batch * args.seq / statistics.median(timed),
        peak_gib=max(r["peak_gib"] for r in ranks),
        peak_gib_per_rank=[round(r["peak_gib"], 2) for r in ranks],
        losses=r0["losses"],
        skipped_per_rank=[r["skipped"] for r in ranks],
        same_weights_all_ranks=all(r["fingerprint"] == r0["fingerprint"] for r in ranks),
        same_stats_all_ranks=all(r["stats"] == r0["stats"] for r in ranks),
        same_fp8_state_all_ranks=all(r.get("fp8_state") == r0.get("fp8_state") for r in ranks),
        same_fp8_scales_all_ranks=all((r.get("fp8_state") or [0] * 3)[2:] == (r0.get("fp8_state") or [0] * 3)[2:]
                                      for r in ranks),
        fp8_state=r0.get("fp8_state"),
        fingerprint=r0["fingerprint"],
        stats=r0["stats"],
        gpu=r0["gpu"],
    )
    return row


def _poisoned(row: dict[str, Any]) -> bool:
    return row["precision"].startswith("mp:") and row["kwargs"].get("skip_nonfinite", True)


def expected_skips(row: dict[str, Any], args: argparse.Namespace) -> list[int]:
    """The steps a poisoned run must skip: the gradient poisons, and in fp8 the activation poisons too."""
    steps = set(args.poison_steps) | (set(args.act_poison_steps) if row["precision"] == "mp:fp8" else set())
    return sorted(s for s in steps if s < args.steps)


def window_rel_diffs(losses: list[float], base: list[float], window: int, leave_out: set[int]) -> list[float]:
    """The relative difference of the mean loss over each ``window`` steps (steps in ``leave_out`` left out)."""
    out = []
    for start in range(0, min(len(losses), len(base)), window):
        steps = [i for i in range(start, min(start + window, len(losses), len(base))) if i not in leave_out]
        if steps:
            mine, theirs = (sum(x[i] for i in steps) / len(steps) for x in (losses, base))
            out.append(abs(mine - theirs) / max(abs(theirs), 1e-6))
    return out


def check(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Fill each row's verdicts: skips as injected on every rank, weights equal across ranks, loss = one GPU,
    and a resumed run = the same run uninterrupted (losses and final weights)."""
    def key(row: dict[str, Any]) -> tuple[str, str, str]:  # mode, fp8 settings, optimizer: what one GPU must match
        return row["precision"], json.dumps(row["kwargs"].get("fp8"), sort_keys=True), row["options"].get("optimizer")

    single = {
        key(r): r
        for r in rows
        if r["strategy"] == "single"
        and "error" not in r
        and not (set(r["kwargs"]) - {"fp8"})
        and not (set(r["options"]) - {"optimizer"})
    }
    by_name = {r["run"]: r for r in rows}
    poisoned_anywhere = set(args.act_poison_steps)  # an input poison changes that step's loss on the poisoned share
    for row in rows:
        if "error" in row:
            continue
        base = single.get(key(row))
        if row["strategy"] != "single" and base is not None and _poisoned(row) == _poisoned(base):
            rel = [
                abs(a - b) / max(abs(b), 1e-6)
                for i, (a, b) in enumerate(zip(row["losses"], base["losses"]))
                if i not in poisoned_anywhere
            ]
            row["loss_max_rel_diff"] = max(rel)
            row["loss_equal"] = max(rel) <= args.loss_rtol
            if args.loss_window:  # a long run: the loss curve (means of windows of steps), not each step's loss
                windows = window_rel_diffs(row["losses"], base["losses"], args.loss_window, poisoned_anywhere)
                row["loss_window_max_rel_diff"] = max(windows)
                row["loss_equal"] = max(windows) <= args.loss_rtol
            row["speedup_vs_1gpu"] = row["tokens_per_s"] / base["tokens_per_s"]
        if _poisoned(row):
            row["skips_as_injected"] = all(s == expected_skips(row, args) for s in row["skipped_per_rank"])
        if row["options"].get("resume"):
            whole = by_name.get(row["run"].rsplit(" resume", 1)[0])
            if whole is not None and "error" not in whole:
                rel = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(row["losses"], whole["losses"])]
                row["resume_max_rel_diff"] = max(rel)
                row["resume_same_weights"] = row["fingerprint"] == whole["fingerprint"]
                row["resume_equal"] = max(rel) <= args.resume_rtol and len(row["losses"]) == len(whole["losses"])


def _loss_text(r: dict[str, Any]) -> str:
    text = fmt(r.get("loss_max_rel_diff"), ".2%")
    if "loss_window_max_rel_diff" in r:
        text = f"{r['loss_window_max_rel_diff']:.2%} (curve; {text} a step)"
    return text


def _resume_text(r: dict[str, Any]) -> str:
    if "resume_equal" not in r:
        return "—"
    weights = "same weights" if r["resume_same_weights"] else "weights differ"
    return f"{'✓' if r['resume_equal'] else '✗'} loss Δ {r['resume_max_rel_diff']:.1e}, {weights}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | step ms | tokens/s | vs 1 GPU | peak GiB/GPU | final loss | max loss diff vs 1 GPU"
        " | skipped steps (every rank) | same weights on all ranks | resume = uninterrupted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error'].strip().splitlines()[-1][:120]} | | | | | | | | |")
            continue
        skipped = r["skipped_per_rank"]
        skip_text = "—" if "skips_as_injected" not in r else (
            f"{skipped[0]}" + (" ✓" if r.get("skips_as_injected") else " ✗ " + str(skipped))
        )
        lines.append(
            f"| {r['run']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f}"
            f" | {fmt(r.get('speedup_vs_1gpu'), '.2f', '×')} "
            f"| {r['peak_gib']:.1f} | {r['losses'][-1]:.4f} | {_loss_text(r)} | {skip_text} "
            f"| {'yes' if r['same_weights_all_ranks'] else 'NO'} | {_resume_text(r)} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, split over the GPUs")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poison-steps", type=int, nargs="*", default=[12, 25])
    p.add_argument("--loss-rtol", type=float, default=0.02, help="largest relative loss difference from one GPU")
    p.add_argument("--loss-window", type=int, default=0,
                   help="compare the means of this many steps with one GPU's (0: every step's loss)")
    p.add_argument("--runs", nargs="*", help="run names to keep (default: the main set)")
    p.add_argument("--devices", type=int, default=2, help="GPUs (processes) for the multi-GPU runs")
    p.add_argument("--more", action="store_true", help="add the true-half and diagnostic runs (about 3 more minutes)")
    p.add_argument("--fp8", action="store_true", help="add the FP8 runs (needs Transformer Engine)")
    p.add_argument("--fp8-resume", action="store_true", help="add the FP8 resume runs (with --fp8)")
    p.add_argument("--fp8-weights", action="store_true", help="add the FP8 primary-weight runs (FP8 gathers)")
    p.add_argument("--torchao", action="store_true",
                   help="add torchao's FP8 runs: one GPU, FSDP2 with bf16 gathers, FSDP2 with FP8 gathers")
    p.add_argument("--fp8-options", default=None, help="JSON of fp8 settings for the fp8 runs, e.g. a layer filter")
    p.add_argument("--act-poison-steps", type=int, nargs="*", default=[18],
                   help="fp8 runs: steps whose first FP8 layer input gets an inf on the last rank (saturation)")
    p.add_argument("--resume-at", type=int, default=20, help="resume runs: the step the first process stops at")
    p.add_argument("--resume-rtol", type=float, default=1e-3, help="largest relative loss difference after resume")
    p.add_argument("--run-timeout", type=int, default=300)
    p.add_argument("--accelerator", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (gloo DDP rows)")
    p.add_argument("--out", help="folder for the JSON and markdown results")
    p.add_argument("--tag", default=None, help="file-name tag (default: GPU name and date)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print("bench_distributed needs CUDA GPUs (or --accelerator cpu for a smoke run of the DDP rows).")
        return 1
    count = torch.cuda.device_count() if args.accelerator == "cuda" else max(2, args.devices)
    runs = [
        r for r in RUNS + (MORE_RUNS if args.more or args.runs else [])
        + (FP8_RUNS if args.fp8 or args.runs else []) + (FP8_RESUME_RUNS if args.fp8_resume or args.runs else [])
        + (FP8_WEIGHT_RUNS if args.fp8_weights or args.runs else [])
        + (TORCHAO_RUNS if args.torchao or args.runs else [])
        if r[2] <= count and (not args.runs or r[0] in args.runs)
        and (args.accelerator == "cuda" or (r[1] != "fsdp" and r[3].startswith("mp:")))  # Lightning: FSDP needs CUDA
    ]
    runs = list({r[0]: r for r in runs}.values())  # a run listed in two sets runs once
    if args.devices != 2:  # the multi-GPU runs on that many GPUs (the global batch is split over them)
        if args.devices > count or args.global_batch % args.devices:
            print(f"--devices {args.devices}: {count} available; the global batch must split over them evenly.")
            return 1
        runs = [(r[0], r[1], args.devices if r[2] > 1 else 1, *r[3:]) for r in runs]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, strategy, devices, precision, *extra in runs:
            kwargs, options = (list(extra) + [{}, {}])[:2]
            row = run(name, strategy, devices, precision, kwargs, options, args, folder)
            done = f"{row['step_ms']:.1f} ms/step, peak {row['peak_gib_per_rank']} GiB" if "step_ms" in row else "-"
            print(f"{name}: {done}", flush=True)  # (a run cut short by a time limit keeps these lines)
            rows.append(row)
    check(rows, args)
    gpu = next((r["gpu"] for r in rows if "gpu" in r), args.accelerator)
    header = (
        f"{max((r[2] for r in runs), default=count)}× {gpu}, torch {torch.__version__}, GPT {args.hidden}×{args.layers}"
        f" (vocab {args.vocab}, seq {args.seq}),"
        f" global batch {args.global_batch} sequences, {args.steps} steps (median after {args.warmup}),"
        f" overflow injected on the last rank at steps {args.poison_steps}"
        + (f", an inf into the first FP8 layer's input at steps {args.act_poison_steps}" * bool(args.act_poison_steps))
    )
    text = header + "\n\n" + table(rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = args.tag or f"{gpu.split()[-1].lower()}x{count}_{time.strftime('%Y-%m-%d')}"
        with open(os.path.join(args.out, f"bench_distributed_{tag}.json"), "w") as fh:
            json.dump({"header": header, "rows": rows}, fh, indent=1)
        with open(os.path.join(args.out, f"bench_distributed_{tag}.md"), "w") as fh:
            fh.write(text + "\n")
    failures = [
        r["run"]
        for r in rows
        if "error" in r
        or r.get("loss_equal") is False
        or r.get("skips_as_injected") is False
        or r.get("resume_equal") is False
        or not r.get("same_weights_all_ranks", False)
    ]
    print(text)
    if failures:
        print("checks failed:", ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
