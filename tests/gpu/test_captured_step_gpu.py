"""The captured step (``capture_step=True``, lightning_mp/capture.py) against the eager one, bit for bit, on a GPU.

A user's run with a capturable optimizer: the same parameters, optimizer state (moments, step counts, momentum),
BatchNorm statistics, learning rate and counters as the same run with ``capture_step=False``, over steps whose
gradients were poisoned with inf or NaN, with accumulation, clipping by norm and by value, a per-step scheduler on a
tensor learning rate, and a resume from a checkpoint saved mid-run. Each run also says that its steps were replayed
from the graph (not only that it trained). Skipped without CUDA. Run on the GPU machine::

    PYTHONPATH=.:tests python -m pytest -q -m gpu tests/gpu/test_captured_step_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp import capture as capture_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

POISON = {4: math.inf, 7: math.nan}  # batch index -> what the loss is multiplied by
OPTIMIZERS = ("adamw-fused-tensor-lr", "sgd-fused", "adamw-foreach-tensor-lr", "adam-float-lr", "sgd-momentum")
#: captured on any torch (the fused kernel skips on the flag); the others need conditional nodes (torch 2.12+)
FUSED = ("adamw-fused-tensor-lr", "sgd-fused")


class Net(LightningModule):
    def __init__(self, optimizer: str, clip: str | None = None) -> None:
        super().__init__()
        self.kind, self.clip = optimizer, clip
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
        self.replays = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        factor = POISON.get(self.global_step if self.trainer.accumulate_grad_batches == 1 else batch_idx)
        return loss * factor if factor is not None else loss

    def configure_optimizers(self):
        params = self.parameters()
        if self.kind.startswith("sgd"):
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4, fused=self.kind == "sgd-fused")
        if self.kind == "adam-float-lr":
            return torch.optim.Adam(params, lr=1e-2, capturable=True)
        lr = torch.tensor(1e-2, device=self.device)
        opt = torch.optim.AdamW(params, lr=lr, capturable=True, fused=self.kind == "adamw-fused-tensor-lr")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(96, 16, generator=g), torch.randn(96, 1, generator=g))
        return DataLoader(data, batch_size=8)


def fit(capture: bool, optimizer: str, mode: str = "bf16", *, steps: int = 10, clip: str | None = None,
        accumulate: int = 1, ckpt: str | None = None, save: str | None = None):
    seed_everything(0)
    model = Net(optimizer, clip)
    plugin = MPPlugin(mode, capture_step=capture)
    kwargs = {}
    if clip is not None:
        kwargs.update(gradient_clip_val=0.5, gradient_clip_algorithm=clip)
    trainer = Trainer(accelerator="gpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, max_steps=steps,
                      accumulate_grad_batches=accumulate, **kwargs)
    trainer.fit(model, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    plans = [s.plan for s in plugin._steps._optimizers.values()]
    replayed = [p.captured.seen > capture_module.EAGER_STEPS and p.captured.graph is not None
                for p in plans if isinstance(p, capture_module.CapturedPlan)]
    opt = trainer.optimizers[0]
    return {
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict()["state"],
        "lr": float(opt.param_groups[0]["lr"]),
        "skipped": plugin.stats.skipped_steps,
        "steps": plugin.stats.steps,
        "replayed": replayed,
        "reason": [p.captured.reason for p in plans if isinstance(p, capture_module.CapturedPlan)]
        + [capture_module.why_not(opt, torch.device("cuda")), [type(p).__name__ for p in plans]],
    }


def assert_same(a, b):
    assert a["skipped"] == b["skipped"] and a["steps"] == b["steps"] and a["lr"] == b["lr"]
    for name in a["state"]:
        assert torch.equal(a["state"][name], b["state"][name]), name
    for index, values in a["optimizer"].items():
        for key, value in values.items():
            other = b["optimizer"][index][key]
            assert torch.equal(torch.as_tensor(value).cpu(), torch.as_tensor(other).cpu()), (index, key)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("mode", ("bf16", "fp32"))
def test_captured_equals_eager_with_poisoned_steps(optimizer, mode):
    captured, eager = fit(True, optimizer, mode), fit(False, optimizer, mode)
    if optimizer in FUSED or capture_module.conditional_nodes():
        assert captured["replayed"] == [True], captured["reason"]
    else:
        assert "no CUDA graph conditional nodes" in captured["reason"][0], captured["reason"]
    assert eager["replayed"] == [] and captured["skipped"] == 2
    assert_same(captured, eager)


@pytest.mark.parametrize("clip", ("norm", "value"))
@pytest.mark.parametrize("accumulate", (1, 2))
def test_captured_equals_eager_with_clipping_and_accumulation(clip, accumulate):
    captured = fit(True, "adamw-fused-tensor-lr", clip=clip, accumulate=accumulate, steps=6)
    eager = fit(False, "adamw-fused-tensor-lr", clip=clip, accumulate=accumulate, steps=6)
    assert captured["replayed"] == [True], captured["reason"]
    assert_same(captured, eager)


def test_captured_resume_equals_eager_resume(tmp_path):
    for capture in (True, False):
        fit(capture, "adamw-fused-tensor-lr", steps=5, save=str(tmp_path / f"{capture}.ckpt"))
    captured = fit(True, "adamw-fused-tensor-lr", steps=10, ckpt=str(tmp_path / "True.ckpt"))
    eager = fit(False, "adamw-fused-tensor-lr", steps=10, ckpt=str(tmp_path / "False.ckpt"))
    assert captured["replayed"] == [True], captured["reason"]
    assert_same(captured, eager)


def test_a_float_learning_rate_changing_every_step_gives_the_capture_up_with_its_reason():
    class FloatSchedule(Net):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, capturable=True, fused=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    seed_everything(0)
    model, plugin = FloatSchedule("adam-float-lr"), MPPlugin("bf16", capture_step=True)
    Trainer(accelerator="gpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, max_steps=12).fit(model)
    plan = next(iter(plugin._steps._optimizers.values())).plan
    assert "learning rate as a tensor" in plan.captured.reason
    assert plugin.stats.skipped_steps == 2 and plugin.stats.steps == 12


@pytest.mark.parametrize(("make", "reason"), [
    (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), "capturable=True"),
    (lambda p: torch.optim.RMSprop(p, lr=1e-2), "not one of torch's Adam, AdamW or SGD"),
    (lambda p: torch.optim.SGD(p, lr=torch.tensor(0.05, device="cuda")),
     "tensor learning rate" if capture_module.conditional_nodes() else "no CUDA graph conditional nodes"),
    (lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2), capturable=True, fused=True), "off cuda"),
])
def test_steps_that_cannot_be_captured_say_why_and_run_eagerly(make, reason, caplog):
    class Other(Net):
        def configure_optimizers(self):
            return make(self.parameters())

    seed_everything(0)
    plugin = MPPlugin("bf16", capture_step=True)
    with caplog.at_level("INFO", logger="lightning_mp.capture"):
        Trainer(accelerator="gpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, max_steps=6).fit(Other("x"))
    plan = next(iter(plugin._steps._optimizers.values())).plan
    assert not isinstance(plan, capture_module.CapturedPlan)
    assert any("not captured" in r.message and reason in r.message for r in caplog.records), caplog.text
    assert plugin.stats.skipped_steps == 1  # (batch 4 poisoned with inf; 7 is past the run)
