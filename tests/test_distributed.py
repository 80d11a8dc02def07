"""DDP on the CPU (gloo, 2 processes): every rank takes the same skip decision."""

import math

import pytest
import torch
from conftest import TinyRegressor
from lightning.pytorch import Callback, Trainer

from lightning_mp import MPPlugin

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


class OneRankPoison(TinyRegressor):
    """Poisons a gradient on one rank only, after DDP's all-reduce (so the other rank's gradients are clean)."""

    def __init__(self, poison_rank: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.poison_rank = poison_rank

    def _poison_grads(self) -> None:
        if self.global_rank == self.poison_rank:
            super()._poison_grads()


class Dump(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        plugin = trainer.precision_plugin
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in pl_module.named_parameters()},
                "stats": plugin.stats.as_dict(),
                "adam_step": int(next(iter(trainer.optimizers[0].state.values()))["step"]),
            },
            f"{self.folder}/rank{trainer.global_rank}.pt",
        )


@pytest.mark.parametrize(("mode", "value"), [("fp16", math.inf), ("bf16", math.nan)])
def test_inf_on_one_rank_is_skipped_by_every_rank(tmp_path, mode, value):
    model = OneRankPoison(optimizer="adam", poison_grad=(2, 3), poison_value=value)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        plugins=[MPPlugin(mode, init_scale=2.0**8)],
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Dump(str(tmp_path))],
    )
    trainer.fit(model)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), f"{name} differs across ranks"
        assert torch.isfinite(r0["params"][name]).all()
    assert r0["stats"] == r1["stats"]
    assert r0["stats"]["skipped_steps"] == 2 and r0["stats"]["steps"] == 6
    assert r0["adam_step"] == r1["adam_step"] == 4
    if mode == "fp16":
        assert r0["stats"]["loss_scale"] == 2.0**6
