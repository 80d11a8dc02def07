"""What the benchmarks share: the GPT-style decoder and its builders, the small models of the host-cost benchmark,
the CUDA-event step probe, and the process set-up.

Imported by the entry points of this folder (``sys.path`` holds the folder when a script runs from it); runs
nothing itself.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import pstats
import statistics
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

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


def make_batches(args: argparse.Namespace, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(n)]


def small_model(kind: str, device: torch.device) -> nn.Module:
    """The host-cost benchmark's models (seed 0): ``mlp`` (32 -> 64 -> 64 -> 1), ``gpt`` (the small, launch-bound GPT:
    hidden 512, 4 layers, 8 heads, 512 tokens, vocab 32768), or ``tiny``: a GPT of the same depth but width 32, whose
    step on the CPU is nearly all host work, as ``gpt``'s on a GPU."""
    torch.manual_seed(0)
    if kind == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    else:
        model = GPT(256, 32, 4, 4, 16) if kind == "tiny" else GPT(32768, 512, 4, 8, 512)
    return model.to(device)


def small_batches(kind: str, n: int) -> list:
    """``n`` batches for :func:`small_model` ``kind`` (seed 1): (x, y) pairs of 32 for the MLP, tokens else."""
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return [(torch.randn(32, 32, generator=g), torch.randn(32, 1, generator=g)) for _ in range(n)]
    if kind == "tiny":
        return [torch.randint(0, 256, (2, 17), generator=g) for _ in range(n)]
    return [torch.randint(0, 32768, (8, 513), generator=g) for _ in range(n)]


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


def cleanup() -> None:
    torch.cuda.set_sync_debug_mode(0)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def count_params(args: argparse.Namespace) -> int:
    h, L, v, s = args.hidden, args.layers, args.vocab, args.seq
    per_block = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    return v * h + s * h + L * per_block + 2 * h + h * v


def fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def quiet_lightning() -> None:
    """Keep Lightning's info lines and known harmless warnings out of the benchmark output."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")


# --------------------------------------------------------------------------------------------- modes and paired figures
#: Lightning's (and Fabric's) precision string of the same mode beside each of our modes
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                       "fp16-true": "16-true"}


def mode_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Our mode and plugin arguments of a spec such as ``"bf16-true/master_weights=none/fp32_modules=none"``
    (``fp32_modules``: ``none`` is the empty list, else entries joined by ``+``; ``true``/``false`` are booleans,
    other values strings)."""
    name, *options = spec.split("/")
    kwargs: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        if not value:
            raise ValueError(f"{spec!r}: options are key=value, e.g. bf16-true/master_weights=none")
        if key == "fp32_modules":
            kwargs[key] = [] if value == "none" else value.split("+")
        else:
            kwargs[key] = {"true": True, "false": False}.get(value, value)
    return name, kwargs


def paired_summary(ratios: list[float]) -> dict[str, float]:
    """The median of paired ratios, their interquartile range and a distribution-free 95 % confidence interval of
    the median (the order statistics of ranks (n - 1.96 √n) / 2 and 1 + (n + 1.96 √n) / 2)."""
    ordered = sorted(ratios)
    n = len(ordered)
    quart = statistics.quantiles(ordered, n=4) if n > 1 else [ordered[0]] * 3
    half = 1.96 * n**0.5
    lo, hi = max(0, math.floor((n - half) / 2) - 1), min(n - 1, math.ceil(1 + (n + half) / 2) - 1)
    return {"ratio": statistics.median(ordered), "q1": quart[0], "q3": quart[2],
            "ci_lo": ordered[lo], "ci_hi": ordered[hi], "n": n}


def package_host_time(stats: pstats.Stats, steps: int, top: int) -> None:
    """Host time a step in lightning_mp's own Python and in the calls it makes directly (cProfile), and its
    costliest functions."""
    own, called = [], []
    for (file, line, name), (_, ncalls, tottime, cumtime, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "lightning_mp" in file:
            own.append((tottime, cumtime, f"{file.split('lightning_mp' + os.sep, 1)[-1]}:{line}:{name}", ncalls))
            continue
        for (cfile, _, cname), caller in callers.items():
            if "lightning_mp" in cfile:
                called.append((caller[2], f"{name} from {os.path.basename(cfile)}:{cname}", caller[0]))
    us = 1e6 / steps
    print(f"lightning_mp's own Python: {sum(t for t, *_ in own) * us:.0f} µs a step; what it calls directly: "
          f"{sum(t for t, *_ in called) * us:.0f} µs a step (cProfile's own cost inflates both)")
    print("| lightning_mp function | self µs a step | cumulative µs a step | calls a step |\n|---|---|---|---|")
    for tottime, cumtime, where, ncalls in sorted(own, reverse=True)[:top]:
        print(f"| {where} | {tottime * us:.0f} | {cumtime * us:.0f} | {ncalls / steps:.1f} |")
    print("| **called directly from lightning_mp** | self µs a step | | calls a step |")
    for tottime, where, ncalls in sorted(called, reverse=True)[:top]:
        print(f"| {where} | {tottime * us:.0f} | | {ncalls / steps:.1f} |")
