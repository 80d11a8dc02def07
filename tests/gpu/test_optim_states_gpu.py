"""bf16 optimizer states on CUDA: large moments rounded by one compiled kernel (unbiased, its noise from the run's
own generator, so a rewind or a resume draws the same), and a real run with a fused AdamW, whose skips happen on the
device (``found_inf``), leaving the moments bit-identical.

Skipped without CUDA. Run on the GPU machine from the repository root::

    PYTHONPATH=.:tests python -m pytest -q -m gpu tests/gpu/test_optim_states_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp import optim_states as _states

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]


def test_the_compiled_rounding_is_unbiased_exact_where_it_can_be_and_follows_its_generator():
    n = _states.COMPILED_ROUNDING_MIN_NUMEL * 2
    x = torch.rand(n, device="cuda") * 1e-3 + 1.0  # between two bf16 values (1 and 1 + 2**-7)
    g = torch.Generator(device="cuda").manual_seed(7)
    state = g.get_state()
    default_before = torch.cuda.get_rng_state()
    first = _states._round(x, torch.bfloat16, g)
    assert _states._COMPILED_ROUNDING["failed"] is None, _states._COMPILED_ROUNDING["failed"]
    assert torch.equal(torch.cuda.get_rng_state(), default_before)  # the device's own generator untouched
    assert not torch.equal(g.get_state(), state)  # the run's generator moved on
    assert first.dtype == torch.bfloat16
    assert abs(first.float().mean().item() - x.mean().item()) < 1e-5  # unbiased (nearest would give 1.0)
    g.set_state(state)
    assert torch.equal(_states._round(x, torch.bfloat16, g), first)  # rewound: the same noise
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(_states._round(exact, torch.bfloat16, g).float(), exact)


class GPT(LightningModule):
    def __init__(self, poison: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024))
        self.poison = poison

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = (self.net(x).float() - x.flip(-1)).pow(2).mean()
        return loss * (float("inf") if batch_idx == self.poison else 1.0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 1024, generator=g)),
                                           batch_size=8)


class States(Callback):
    def __init__(self) -> None:
        self.after: list = []

    def on_train_batch_end(self, trainer, *args):
        self.after.append(copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))


@pytest.mark.parametrize("precision", ["bf16-true", "fp16"])
def test_a_device_skip_of_a_fused_adamw_leaves_the_bf16_moments_bit_identical(precision):
    states = States()
    plugin = MPPlugin(precision, optimizer_states="bf16")
    Trainer(accelerator="gpu", devices=1, max_steps=6, plugins=[plugin], callbacks=[states], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(GPT(poison=3))
    assert plugin.stats.skipped_steps == 1
    assert {s["exp_avg_sq"].dtype for s in states.after[-1].values()} == {torch.bfloat16}
    for key, before in states.after[2].items():
        for name, value in before.items():
            assert torch.equal(value, states.after[3][key][name]), name
    assert _states._COMPILED_ROUNDING["failed"] is None
