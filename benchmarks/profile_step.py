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
    kwargs = (
        {"precision": precision[len("lightning-"):]}
        if precision.startswith("lightning-")
        else {"plugins": [MPPlugin(precision)]}
    )

    def fit(n: int) -> Lit:
        trainer = Trainer(accelerator="gpu", devices=1, max_steps=n, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, **kwargs)
        lit = Lit(batches)
        trainer.fit(lit)
        return lit

    fit(20)  # compilation, allocator and cuBLAS warm-up stay out of the profile
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    fit(steps)
    torch.cuda.synchronize()
    profile.disable()
    print(f"{precision}: {(time.perf_counter() - start) / steps * 1e3:.2f} ms a step (with the Trainer's start-up)")
    stats = pstats.Stats(profile)
    attribute(stats, steps)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumtime").print_stats("lightning_mp", 25)


def attribute(stats: pstats.Stats, steps: int) -> None:
    """Host time per step spent in lightning_mp's own code, and in torch calls made directly from it."""
    own, called = [], []
    for (file, line, name), (_, ncalls, tottime, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "lightning_mp" in file:
            own.append((tottime, f"{os.path.basename(file)}:{line}:{name}", ncalls))
            continue
        for (cfile, _, cname), caller in callers.items():
            if "lightning_mp" in cfile:
                called.append((caller[2], f"{name} from {os.path.basename(cfile)}:{cname}", caller[0]))
    us = 1e6 / steps
    print(f"lightning_mp's own Python: {sum(t for t, *_ in own) * us:.1f} us a step; what it calls directly: "
          f"{sum(t for t, *_ in called) * us:.1f} us a step")
    for tottime, where, ncalls in (
        sorted(own, reverse=True)[:15] + [(0, "-- direct calls:", 0)] + sorted(called, reverse=True)[:15]
    ):
        print(f"  {tottime * us:8.1f} us  {where}  x{ncalls / steps:.1f}")


if __name__ == "__main__":
    main()
