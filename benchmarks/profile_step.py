"""Where the host time of a small, launch-bound training step goes (cProfile over a Lightning fit), on one GPU.

Run from the repository root: ``PYTHONPATH=. python benchmarks/profile_step.py [precision] [steps]``. A model this
small (hidden 512, 4 layers, 8 x 512 tokens) is bound by the host, so host time is step time.
"""

from __future__ import annotations

import cProfile
import logging
import os
import pstats
import sys
import time
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as bo  # noqa: E402

from lightning_mp import MPPlugin  # noqa: E402


class Lit(LightningModule):
    def __init__(self, batches) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = bo.GPT(32768, 512, 4, 8, 512)
        self.batches = batches

    def training_step(self, batch, batch_idx):
        return self.model(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def main() -> None:
    precision = sys.argv[1] if len(sys.argv) > 1 else "bf16-true"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    batches = [torch.randint(0, 32768, (8, 513)) for _ in range(steps)]
    kwargs = {"precision": precision[len("lightning-"):]} if precision.startswith("lightning-") else {"plugins": [MPPlugin(precision)]}
    trainer = Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    trainer.fit(Lit(batches))
    torch.cuda.synchronize()
    profile.disable()
    print(f"{precision}: {(time.perf_counter() - start) / steps * 1e3:.2f} ms a step (with start-up)")
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumtime").print_stats("lightning_mp", 25)


if __name__ == "__main__":
    main()
