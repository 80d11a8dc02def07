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
...-teadam               either of the two above with Transformer Engine's ``FusedAdam(master_weights=True)``
                         instead of torch's fused AdamW: the optimizer keeps the fp32 masters (one kernel reads
                         bf16 gradients, writes fp32 masters and bf16 weights); needs Transformer Engine
=======================  ====================================================================

The true-half modes are not in the default ``--modes`` list; name them, e.g.
``--modes plain-bf16,lightning-bf16-mixed,lightning-bf16-true,mp-bf16-true,mp-bf16-true-kahan,...``. When any
ran, a second table compares them with the bf16 autocast loop (speed), Lightning's bf16-mixed (peak memory)
and Lightning's bf16-true, and gives ``resident GiB``: what stays allocated after training (weights, masters or
compensation, optimizer state), divided by the parameter count as bytes/param.

Per mode: ``--warmup`` steps, then ``--steps`` timed steps, then ``--sync-steps`` steps under
``torch.cuda.set_sync_debug_mode("warn")`` that count host-device syncs.

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
import gc
import json
import logging
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

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
)
KNOWN_MODES = ALL_MODES + TRUE_HALF_MODES
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
}
CLIP = 1.0
SYNC_MESSAGE = "synchronizing CUDA operation"


# --------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}.")
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, final LayerNorm, untied LM head."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ``tokens`` (batch, seq + 1)."""
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def build_model(args: argparse.Namespace) -> GPT:
    """The same initial weights every call: same seed, same ops, built directly on the GPU."""
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed)
    with torch.device("cuda"):
        model = init_gpt_weights(GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq))
    return model


def init_gpt_weights(model: nn.Module) -> nn.Module:
    """GPT-style initialisation in place: N(0, 0.02) for Linear and Embedding weights, zero biases."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, fused=True)


def te_fused_adam(params, lr: float) -> torch.optim.Optimizer:
    """Transformer Engine's FusedAdam keeping the fp32 masters itself (MPPlugin: ``master_weights="optimizer"``)."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    return FusedAdam(params, lr=lr, master_weights=True)


def lit_gpt(model: nn.Module, batches: list, configure_optimizers: Callable[[Any], Any]) -> Any:
    """``model`` (returning its loss) as a LightningModule: ``batches`` in order, ``configure_optimizers(params)``,
    and the last loss kept on the device in ``.last_loss`` (read after training: no sync per step)."""
    from lightning.pytorch import LightningModule

    class LitGPT(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.last_loss: Optional[torch.Tensor] = None

        def training_step(self, batch, batch_idx):
            loss = self.model(batch)
            self.last_loss = loss.detach()
            return loss

        def configure_optimizers(self):
            return configure_optimizers(self.parameters())

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    return LitGPT()


def weights_fingerprint(model: nn.Module) -> float:
    """A cheap checksum showing every mode starts from the same weights (one host sync, before training)."""
    with torch.no_grad():
        return float(sum(p.sum(dtype=torch.float64) * (i + 1) for i, p in enumerate(model.parameters())).item())


# --------------------------------------------------------------------------------------------- measuring
class StepProbe:
    """CUDA events per step, and a sync-counting window over the last ``sync_steps`` whole step cycles.

    The window opens at the end of the last timed step and closes at the end of the last step, so it holds
    ``sync_steps`` complete cycles (batch fetch and copy, forward, backward, optimizer step, hooks).
    """

    def callback(self) -> Any:
        """A Lightning callback that brackets every training batch with :meth:`start` and :meth:`end`."""
        from lightning.pytorch import Callback

        probe = self

        class Probe(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                probe.start()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                probe.end()

        return Probe()

    def __init__(self, warmup: int, steps: int, sync_steps: int) -> None:
        self.warmup, self.steps, self.sync_steps = warmup, steps, sync_steps
        self.starts: list[torch.cuda.Event] = []
        self.ends: list[torch.cuda.Event] = []
        self.syncs: Optional[int] = None
        self._catcher: Optional[warnings.catch_warnings] = None
        self._log: list = []

    @property
    def total(self) -> int:
        return self.warmup + self.steps + self.sync_steps

    def start(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.starts.append(event)

    def end(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.ends.append(event)
        done = len(self.ends)
        if done == self.warmup + self.steps and self.sync_steps > 0:
            self.open_sync_window()
        elif done == self.total:
            self.close_sync_window()

    def open_sync_window(self) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._log = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def close_sync_window(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None
            self.syncs = sum(SYNC_MESSAGE in str(w.message) for w in self._log)
            self._log = []

    def results(self) -> dict[str, Any]:
        torch.cuda.synchronize()
        if len(self.ends) < self.warmup + self.steps:
            raise RuntimeError(f"only {len(self.ends)} steps ran, {self.warmup + self.steps} needed")
        timed = range(self.warmup, self.warmup + self.steps)
        step_ms = [self.starts[i].elapsed_time(self.ends[i]) for i in timed]
        cycle_ms = [self.ends[i - 1].elapsed_time(self.ends[i]) for i in timed if i > 0]
        return {
            "step_ms": statistics.median(step_ms),
            "cycle_ms": statistics.median(cycle_ms) if cycle_ms else None,
            "step_ms_all": [round(t, 3) for t in step_ms],
            "syncs_per_step": None if self.syncs is None else self.syncs / self.sync_steps,
        }


def make_batches(args: argparse.Namespace, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(n)]


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
                plugin = MPPlugin("bf16-true", fp32_modules=[])
            elif variant == "guarded":
                plugin = MPPlugin("bf16-true", fp32_modules=["defaults"])
            else:
                plugin = MPPlugin("bf16-true", master_weights=variant or None)  # unset: fp32, or the optimizer's own
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
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=probe.total,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[probe.callback()],
        gradient_clip_val=CLIP if with_clip else None,
        **kwargs,
    )
    try:
        trainer.fit(module)
    finally:
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
    row.update(extra)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def cleanup() -> None:
    torch.cuda.set_sync_debug_mode(0)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- report
def count_params(args: argparse.Namespace) -> int:
    h, L, v, s = args.hidden, args.layers, args.vocab, args.seq
    per_block = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    return v * h + s * h + L * per_block + 2 * h + h * v


def fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


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
    if args.warmup < 1 or args.steps < 1 or args.sync_steps < 0:
        p.error("--warmup and --steps must be >= 1, --sync-steps >= 0")
    return args


def quiet_lightning() -> None:
    """Keep Lightning's info lines and known harmless warnings out of the benchmark output."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


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
        f"# {args.warmup} warm-up + {args.steps} timed (median) + {args.sync_steps} sync-count steps per mode",
        flush=True,
    )

    batches = make_batches(args, args.warmup + args.steps + args.sync_steps)
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for mode in args.modes:
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
        if "error" not in row:
            row["tokens_per_s"] = tokens_per_step / (row["step_ms"] / 1e3)
            row["mfu"] = row["tokens_per_s"] * flops_per_token / (args.peak_tflops * 1e12)
        else:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        summary = (
            f"error {row['error']}: {row.get('error_detail', '')}"
            if "error" in row
            else f"step {row['step_ms']:.1f} ms, cycle {fmt(row['cycle_ms'], '.1f')} ms,"
            f" peak {row['peak_gib']:.1f} GiB, syncs/step {fmt(row['syncs_per_step'], '.2f')},"
            f" final loss {row.get('final_loss', float('nan')):.4f}"
        )
        print(f"[{mode}] {summary} ({row['wall_s']} s)", flush=True)
        if "plugin_stats" in row:
            print(f"[{mode}] plugin stats: {row['plugin_stats']}", flush=True)
        if "loss_scale" in row:
            print(f"[{mode}] final loss scale: {row['loss_scale']:g}", flush=True)
        cleanup()

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
    print(f"total {time.perf_counter() - t_all:.1f} s", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
