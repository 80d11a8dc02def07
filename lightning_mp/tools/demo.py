"""A small, real training run under MPPlugin in several modes, side by side (``python -m lightning_mp demo``).

A character-level transformer language model learns the source text of a Python standard-library module
(always available offline) for a few dozen steps in each mode, from the same initial weights and batches.
One step can be poisoned with an inf loss to show that MPPlugin skips it and carries on.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import time
import warnings
from typing import Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mp.plugin import MPPlugin
from lightning_mp.tools import program_name


def corpus() -> bytes:
    import argparse as module  # a large, stable stdlib source file

    return inspect.getsource(module).encode("utf-8")


class ByteWindows(Dataset):
    def __init__(self, data: bytes, seq_len: int) -> None:
        self.data = torch.tensor(list(data), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TinyByteLM(LightningModule):
    """Byte-level causal transformer (pre-norm, SDPA attention through ``nn.TransformerEncoderLayer``)."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 64, batch_size: int = 16,
                 lr: float = 3e-3, poison_step: Optional[int] = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.seq_len, self.batch_size, self.lr, self.poison_step = seq_len, batch_size, lr, poison_step
        self.mask: torch.Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
        if self.poison_step is not None and self.global_step == self.poison_step:
            loss = loss * math.inf
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(ByteWindows(corpus(), self.seq_len), batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(0))


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._t0)
        self.losses.append(float(outputs["loss"]))


def run(modes: list[str], steps: int, poison_step: Optional[int]) -> list[dict]:
    rows = []
    seed_everything(0, verbose=False)
    initial = TinyByteLM().state_dict()
    for mode in modes:
        seed_everything(0, verbose=False)
        model = TinyByteLM(poison_step=poison_step)
        model.load_state_dict(initial)
        plugin = MPPlugin(mode)
        record = _Record()
        trainer = Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=True,
                          callbacks=[record])
        print(f"--- {mode}: MPPlugin({mode!r}) -> Trainer.precision={trainer.precision!r}")
        trainer.fit(model)
        finite = [loss for loss in record.losses if math.isfinite(loss)]
        stats = plugin.stats.as_dict()
        rows.append({
            "mode": mode,
            "first_loss": finite[0],
            "final_loss": sum(finite[-5:]) / len(finite[-5:]),
            "ms_per_step": 1000 * sorted(record.times[2:])[len(record.times[2:]) // 2],
            "skipped": stats["skipped_steps"],
            "loss_scale": stats["loss_scale"],
        })
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| mode | first loss | final loss (mean of last 5) | median ms/step | skipped steps | loss scale |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        scale = "—" if r["loss_scale"] is None else f"{r['loss_scale']:g}"
        lines.append(f"| {r['mode']} | {r['first_loss']:.3f} | {r['final_loss']:.3f} | {r['ms_per_step']:.1f} |"
                     f" {r['skipped']} | {scale} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{program_name()} demo", description=__doc__)
    # (CPUs have no fast fp16 matmul: fp16 took most of a CPU demo's minutes, so it runs there when asked for)
    default_modes = ["fp32", "bf16", "fp16"] if torch.cuda.is_available() else ["fp32", "bf16"]
    parser.add_argument("--modes", nargs="+", default=default_modes,
                        help="modes to run (default: %(default)s; add fp16 on a CPU to see the loss scale, slowly)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per mode (default: %(default)s)")
    parser.add_argument("--poison-step", type=int, default=20,
                        help="multiply the loss by inf at this step to show the skip (-1: never; default: %(default)s)")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run(args.modes, args.steps, None if args.poison_step < 0 else args.poison_step)
    print()
    print(f"Byte-level transformer on the `argparse` module's source, {args.steps} steps per mode, CPU"
          + (f", inf loss injected at step {args.poison_step}" if args.poison_step >= 0 else ""))
    print(format_table(rows))
    if "fp16" in args.modes:
        print("Note: CPUs have no fast fp16 matmul, so fp16 is slow here; on NVIDIA GPUs it runs at bf16's speed.")
    else:
        print(f"(fp16 with its dynamic loss scale: {program_name()} demo --modes fp32 bf16 fp16; slow on a CPU)")
    return 0
