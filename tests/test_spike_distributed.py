"""The loss-spike guard across ranks, on the CPU (gloo, 2 forked processes): DDP, FSDP and FSDP2.

Each rank judges its own loss against the window of its own losses; the decision is all-reduced, so a spike seen
by one rank only is skipped by every rank. The spike here is in the loss's *value* on rank 1 only (its gradient is
the clean one), so nothing but that agreement can make rank 0 skip the step: without it the ranks' weights part.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CPUFSDPStrategy, ForkModelParallel, TinyRegressor, make_trainer
from lightning.pytorch import Callback
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.multiprocessing.spawn import ProcessExitedException

from lightning_mp import MPPlugin

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

SPIKE_AT, STEPS, WINDOW = 12, 16, 16  # the guard judges from step WINDOW // 4 = 4 on


class OneRankSpike(TinyRegressor):
    """Rank 1's loss *value* is 1000× at one step; its gradient stays the clean one (``fsdp2``: sharded)."""

    def __init__(self, fsdp2: bool = False, factor: float = 1e3) -> None:
        super().__init__(optimizer="adam")
        self.fsdp2, self.factor = fsdp2, factor

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net1, mesh=mesh)
            fully_shard(self.net2, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-2)

    def _loss(self, batch):
        loss = super()._loss(batch)
        if self.global_rank == 1 and self.trainer.global_step == SPIKE_AT:
            loss = loss + (self.factor - 1) * loss.detach()
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


class Record(Callback):
    """Each rank's own shard of the weights and optimizer state around the spike step, and its figures at the end."""

    def __init__(self, folder: str) -> None:
        self.folder, self.before, self.after = folder, None, None

    @staticmethod
    def _take(trainer):
        opt = trainer.optimizers[0]
        params = [_local(p) for p in trainer.model.parameters()]
        state = [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return params + state

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SPIKE_AT:
            self.before = self._take(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.before is not None and self.after is None:
            self.after = self._take(trainer)

    def on_train_end(self, trainer, pl_module):
        unchanged = len(self.before) == len(self.after) and all(map(torch.equal, self.before, self.after))
        if isinstance(trainer.model, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(trainer.model):
                full = [p.detach().clone() for p in pl_module.parameters()]
        else:
            full = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for p in pl_module.parameters()]  # fmt: skip
        stats = trainer.precision_plugin.stats
        torch.save({"unchanged": unchanged, "full": full, "stats": stats.as_dict()},
                   f"{self.folder}/rank{trainer.global_rank}.pt")  # fmt: skip


STRATEGIES = {
    "ddp": lambda: "ddp_fork",
    "fsdp": lambda: CPUFSDPStrategy(),
    "fsdp2": lambda: ForkModelParallel(data_parallel_size=2, tensor_parallel_size=1),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "mode"), [("ddp", "bf16"), ("ddp", "fp16"), ("ddp", "bf16-true"), ("fsdp", "fp16"), ("fsdp2", "bf16")]
)
def test_a_spike_on_one_rank_is_skipped_by_every_rank(tmp_path, strategy, mode):
    kwargs = {"init_scale": 2.0**8} if mode.startswith("fp16") else {}
    plugin = MPPlugin(mode, spike_sigma=6.0, spike_window=WINDOW, **kwargs)
    model = OneRankSpike(fsdp2=strategy == "fsdp2")
    trainer = make_trainer(plugin, STEPS, [Record(str(tmp_path))], devices=2, strategy=STRATEGIES[strategy]())
    trainer.fit(model)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for rank, r in enumerate((r0, r1)):
        assert r["stats"]["spike_skips"] == 1 and r["stats"]["skipped_steps"] == 1, (rank, r["stats"])
        assert r["stats"]["steps"] == STEPS
        assert r["unchanged"], f"rank {rank}'s weights or optimizer state moved at the skipped step"
    assert r0["stats"] == r1["stats"]
    for a, b in zip(r0["full"], r1["full"]):
        assert torch.equal(a, b), "the ranks' weights parted"


@pytest.mark.slow
def test_under_ddp_spawn_the_figures_come_back_through_callback_metrics(tmp_path):
    """``ddp_spawn`` trains in child processes; the launching process gets the weights and ``callback_metrics``
    back (Lightning's launcher), so PrecisionMonitor's figures are where a user reads the skip there."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mp import PrecisionMonitor

    for attempt in (1, 2):
        plugin = MPPlugin("bf16", spike_sigma=6.0, spike_window=WINDOW)
        trainer = make_trainer(plugin, STEPS, [PrecisionMonitor(log_every_n_steps=1)], devices=2,
                               strategy="ddp_spawn", logger=CSVLogger(tmp_path / str(attempt)))  # fmt: skip
        try:
            trainer.fit(OneRankSpike())
            break
        except ProcessExitedException as err:
            # A spawned child sometimes aborts in C++ static destruction after the interpreter has finished
            # ("terminate called without an active exception", no Python frame): torch's gloo teardown, about once in
            # 10-40 runs on a 2-core CPU with Lightning's own bf16-mixed plugin as well. Once is tolerated, not twice.
            if attempt == 2 or err.signal_name != "SIGABRT":
                raise
    assert trainer.callback_metrics["precision/spike_skips"] == 1
    assert trainer.callback_metrics["precision/skipped_steps"] == 1
