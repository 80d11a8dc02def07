"""Does running plain LayerNorms in bf16 change what ``bf16-true`` with fp32 master weights learns?

A small GPT (``bench_overhead.GPT``: hidden 128, 2 layers, 4 heads, 64 tokens, vocab 64) learns sequences of a fixed
random Markov chain (the loss it can reach is the chain's entropy), from the same weights and batches, in:

- ``fp32``: the reference;
- ``bf16-true (LayerNorms guarded)``: ``MPPlugin("bf16-true", fp32_modules=["defaults"])``: LayerNorms in fp32 with
  fp32 weights (the guard), other weights bf16 with fp32 masters;
- ``bf16-true (defaults: LayerNorms in bf16)``: ``MPPlugin("bf16-true")``: plain LayerNorms in bf16 with bf16 weights
  and fp32 masters (torch's kernel computes their statistics and affine in fp32);
- ``Lightning bf16-true``: Lightning's own, no masters, for scale.

Each run's figure is the validation loss (256 fresh sequences, computed in fp32 after training), per seed.

Run from the repository root (CPU is enough): ``PYTHONPATH=. python benchmarks/numerics_layer_norm.py [--steps 300]``
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as bo  # noqa: E402

from lightning_mp import MPPlugin  # noqa: E402

VOCAB, TOKENS = 64, 64


def markov_batches(n: int, batch: int, generator: torch.Generator, transitions: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        x = torch.empty(batch, TOKENS + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (batch,), generator=generator)
        for t in range(TOKENS):
            x[:, t + 1] = torch.multinomial(transitions[x[:, t]], 1, generator=generator).squeeze(1)
        out.append(x)
    return out


class Lit(LightningModule):
    def __init__(self, seed: int, batches: list[torch.Tensor], lr: float) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = bo.GPT(VOCAB, 128, 2, 4, TOKENS)
        self.batches, self.lr = batches, lr

    def training_step(self, batch, batch_idx):
        return self.model(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(123)
    transitions = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3, -1)
    batches = markov_batches(args.steps, 16, g, transitions)
    val = markov_batches(1, 256, torch.Generator().manual_seed(7), transitions)[0]
    modes = {  # (a fresh plugin for every run)
        "fp32": lambda: {"plugins": [MPPlugin("fp32")]},
        "bf16-true (LayerNorms guarded)": lambda: {"plugins": [MPPlugin("bf16-true", fp32_modules=["defaults"])]},
        "bf16-true (defaults: LayerNorms in bf16)": lambda: {"plugins": [MPPlugin("bf16-true")]},
        "Lightning bf16-true": lambda: {"precision": "bf16-true"},
    }
    print(f"| mode | validation loss per seed ({args.steps} steps) | mean |")
    print("|---|---|---|")
    for name, kwargs in modes.items():
        losses = []
        for seed in range(args.seeds):
            lit = Lit(seed, batches, args.lr)
            Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, **kwargs()).fit(lit)
            with torch.no_grad():
                losses.append(float(lit.model.float()(val)))
        print(f"| {name} | {' '.join(f'{v:.4f}' for v in losses)} | {statistics.mean(losses):.4f} |", flush=True)


if __name__ == "__main__":
    main()
