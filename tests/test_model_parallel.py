"""MPPlugin under Lightning's ModelParallelStrategy (FSDP2 ``fully_shard`` in ``configure_model``), on the CPU.

ModelParallelStrategy runs on gloo; the test harness only swaps its script launcher for a fork (as ``ddp_fork``).
Gradients are DTensor shards, some empty: the inf/NaN check reads each rank's shard and agrees across ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ForkModelParallel, TinyRegressor, make_trainer
from lightning.pytorch import Callback

from lightning_mp import MPPlugin

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


class Sharded(TinyRegressor):
    """TinyRegressor sharded with FSDP2; poisons rank 1's shard of a gradient."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net1, mesh=mesh)
        fully_shard(self.net2, mesh=mesh)  # net2.bias has one element: rank 1's shard of it is empty
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def _poison_grads(self):
        if self.global_rank == 1 and self.batch_index in self.poison_grad:
            self.net1.weight.grad.to_local().view(-1)[0] = self.poison_value


class Dump(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        params = {k: v.full_tensor().detach().clone() for k, v in pl_module.named_parameters()}
        torch.save({"params": params, "stats": trainer.precision_plugin.stats.as_dict()},
                   f"{self.folder}/rank{trainer.global_rank}.pt")


def trainer_for(plugin, folder, **kwargs):
    strategy = ForkModelParallel(data_parallel_size=2, tensor_parallel_size=1)
    return make_trainer(plugin, 5, [Dump(folder)], devices=2, strategy=strategy, **kwargs)


@pytest.mark.parametrize(
    ("mode", "value", "clip"), [("bf16", math.nan, None), ("fp16", math.inf, None), ("bf16", math.inf, 1.0)]
)
def test_one_rank_overflow_is_skipped_by_every_rank(tmp_path, mode, value, clip):
    trainer_for(MPPlugin(mode, init_scale=2.0**8), str(tmp_path), gradient_clip_val=clip).fit(
        Sharded(poison_grad=(2,), poison_value=value)
    )
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["stats"] == r1["stats"] and (r0["stats"]["steps"], r0["stats"]["skipped_steps"]) == (5, 1)
    for name, value_ in r0["params"].items():
        assert torch.equal(value_, r1["params"][name]) and torch.isfinite(value_).all()
    if mode == "fp16":
        assert r0["stats"]["loss_scale"] == 2.0**7
    if clip is not None:
        assert math.isfinite(r0["stats"]["grad_norm"])  # the norm of all shards, the same on both ranks


@pytest.mark.parametrize("mode", ["bf16-true"])
def test_modes_that_cast_weights_are_refused_with_the_fsdp2_way(tmp_path, mode):
    with pytest.raises(Exception, match="does not run under ModelParallelStrategy.*MixedPrecisionPolicy"):
        trainer_for(MPPlugin(mode), str(tmp_path)).fit(Sharded())
