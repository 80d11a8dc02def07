"""How often the loss-spike guard skips steps of smooth runs (false positives), by spike_sigma and spike_window.

Four small models train 300 steps each without any injected spike: a noisy regression, a separable classifier, a
tiny transformer language model and Lightning's ``BoringModel`` (whose loss converges to ~0). Every skipped step is a
false positive; each row says which figure (loss, gradient norm) was above its limit. CPU, a few minutes::

    python benchmarks/survey_spike_guard.py --models boring,reg,sep,lm --modes bf16,fp32 --sigma 3,6 --window 8,32,128
"""

from __future__ import annotations

import argparse
import itertools
import logging
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin, NonFiniteTrainingError
from lightning_mp import spike as spike_module

STEPS = 300
_which = {"loss": 0, "norm": 0}
_decide = spike_module.SpikeGuard.decide


def _counting_decide(self, loss, norm, index=0):
    """The guard's decision, and which figure made it (each judged alone; syncs the host: a survey, not a timing)."""
    out = _decide(self, loss, norm, index)
    if bool(out):
        _which["loss"] += int(loss is not None and bool(_decide(self, loss, None, index)))
        _which["norm"] += int(norm is not None and bool(_decide(self, None, norm, index)))
    return out


class Boring(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 4 * STEPS), batch_size=4)


class Regression(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(16 * STEPS, 8, generator=g)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(16 * STEPS, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=16)


class Separable(LightningModule):
    """A linearly separable 4-class problem: the cross-entropy falls towards 0."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 3e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(32 * STEPS, 16, generator=g)
        w = torch.randn(16, 4, generator=g)
        return DataLoader(TensorDataset(x, (x @ w).argmax(1)), batch_size=32, shuffle=True)


class TinyLM(LightningModule):
    """One transformer block on rotations of a fixed token pattern, 10 % of tokens replaced by noise."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 64)
        self.block = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        self.head = nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1] - 1, device=tokens.device)
        hidden = self.block(self.emb(tokens[:, :-1]), src_mask=mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(hidden).float().flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        base = torch.randint(0, 64, (16,), generator=g)
        seqs = torch.stack([torch.roll(base, int(s)) for s in torch.randint(0, 16, (16 * STEPS,), generator=g)])
        noise = torch.randint(0, 64, seqs.shape, generator=g)
        noisy = torch.where(torch.rand(seqs.shape, generator=g) < 0.1, noise, seqs)
        return DataLoader(TensorDataset(noisy.repeat(1, 2)), batch_size=16)


MODELS = {"boring": Boring, "reg": Regression, "sep": Separable, "lm": TinyLM}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="boring,reg,sep,lm", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--modes", default="bf16,fp32")
    parser.add_argument("--sigma", default="3,6", help="spike_sigma values")
    parser.add_argument("--window", default="8,32,128", help="spike_window values")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_mp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    spike_module.SpikeGuard.decide = _counting_decide
    print("| model | mode | spike_sigma | spike_window | steps skipped (of 300) | by the loss | by the gradient norm |")
    print("|---|---|---|---|---|---|---|")
    lists = (args.models, args.modes, args.sigma, args.window)
    grid = itertools.product(*(text.split(",") for text in lists))
    for model, mode, sigma, window in grid:
        torch.manual_seed(0)
        _which.update(loss=0, norm=0)
        scale = {"init_scale": 2.0**8} if mode.startswith("fp16") else {}
        plugin = MPPlugin(mode, spike_sigma=float(sigma), spike_window=int(window), **scale)
        quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer = Trainer(accelerator="cpu", plugins=[plugin], max_steps=STEPS, limit_val_batches=0, **quiet)
        stopped = ""
        try:
            trainer.fit(MODELS[model]())
        except NonFiniteTrainingError:
            stopped = " (stopped: spikes in a row)"
        skipped = plugin.stats.spike_skips
        print(f"| {model} | {mode} | {sigma} | {window} | {skipped}{stopped} | {_which['loss']} | {_which['norm']} |",
              flush=True)


if __name__ == "__main__":
    main()
