"""fp32 masters follow their weights on CUDA: large weights through one compiled kernel, which must give the eager
kernels' values bit for bit; a ``.data`` write on a large weight reaches the next step of a real run.

Skipped without CUDA. Run on the GPU machine from the repository root::

    PYTHONPATH=.:tests python -m pytest -q -m gpu tests/gpu/test_follow_weights_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp import master as _master

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_compiled_kernel_computes_the_eager_values(dtype):
    n = _master.COMPILED_FOLLOW_MIN_NUMEL + 3
    g = torch.Generator(device="cuda").manual_seed(0)
    master = torch.randn(n, device="cuda", generator=g)
    weight = master.to(dtype)
    weight[::7] = torch.randn(weight[::7].shape, device="cuda", generator=g).to(dtype)  # written since
    eager = master.clone()
    _master._follow_weight(eager, weight)
    compiled = master.clone()
    _master.follow_weight_(compiled, weight)
    assert _master._COMPILED_FOLLOW["failed"] is None, _master._COMPILED_FOLLOW["failed"]
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled.to(dtype), weight)
    kept = torch.ones(n, dtype=torch.bool, device="cuda")
    kept[::7] = False
    assert torch.equal(compiled[kept], master[kept])  # unchanged weights keep their masters' low bits


class Wide(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2048, 2048)  # 4 M weights: the compiled kernel
        self.l2 = nn.Linear(2048, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.l2(torch.relu(self.l1(x.to(self.l1.weight.dtype))))
        return (out.float() - y.float()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.0, fused=True)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 2048), torch.randn(64, 1))
        return torch.utils.data.DataLoader(data, batch_size=16)


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_a_data_write_on_a_large_weight_reaches_the_next_step(kind):
    undone = []

    class Clip(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx and not bool((pl_module.l1.weight.abs() <= 0.01).all()):
                undone.append(batch_idx)
            pl_module.l1.weight.data.clamp_(-0.01, 0.01)

    trainer = Trainer(
        accelerator="gpu", devices=1, plugins=[MPPlugin("bf16-true", master_weights=kind)], max_steps=4,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Clip()],
    )  # fmt: skip
    trainer.fit(Wide())
    assert undone == []
