"""FP8 primary weights (``MPPlugin("fp8", fp8={"weights": "fp8"})``) with Transformer Engine, on real GPUs.

One GPU, through the real Trainer: the weights are FP8 tensors and the optimizer's masters start from the exact fp32
weights; a skipped step leaves FP8 weights, masters and moments bit-identical; a checkpoint holds plain tensors
(``weights_only=True`` reads it), resumes as the uninterrupted run and validates as the trained model; an optimizer
without masters is refused. Two GPUs (FSDP2, FP8 gathers; runs benchmarks/bench_distributed.py small): every rank
skips the injected steps, ranks agree, the loss curve follows one GPU within 1 %, resume equals uninterrupted.

    source .te/te_install.sh && PYTHONPATH=.:$PYTHONPATH python -m pytest -q -m gpu tests/gpu/test_fp8_weights_gpu.py
"""

import importlib.util
import math

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp.fp8.primary import is_quantized

from ._bench import small_gpt_rows

_CC = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(_CC < (8, 9), reason="FP8 needs compute capability 8.9+"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"),
]
FP8 = {"weights": "fp8", "size_rule": "off", "keep_last": 1}


class Net(LightningModule):
    def __init__(self, lr=1e-3, poison=(), optimizer="te"):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16))
        self.lr, self.poison, self.optimizer = lr, set(poison), optimizer
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch_of(self.trainer.global_step, self.device)  # (a resumed epoch restarts the loader)
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(float(loss))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y.float()))

    def on_after_backward(self):
        if self.trainer.global_step in self.poison:
            self.net[2].bias.grad.view(-1)[0] = math.inf

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        from transformer_engine.pytorch.optimizers import FusedAdam

        return FusedAdam(self.parameters(), lr=self.lr, master_weights=True)


def batch_of(step, device):
    x, y = data(1, seed=100 + step).dataset.tensors
    return x.to(device), y.to(device)


def data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * 16, 64, generator=g)
    y = torch.tanh(x @ torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) / 8)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def trainer(steps, **kwargs):
    return Trainer(
        accelerator="cuda", devices=1, plugins=[MPPlugin("fp8", fp8=FP8)], max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **kwargs,
    )  # fmt: skip


def fp8_weights(model):
    return {n: p for n, p in model.named_parameters() if is_quantized(p)}


def test_weights_are_fp8_and_masters_start_from_the_exact_fp32_weights():
    model = Net(lr=0.0)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer(1).fit(model, data())
    weights = fp8_weights(model)
    assert set(weights) == {"net.0.weight", "net.2.weight"}  # the head stays bf16 (keep_last=1)
    opt = model.trainer.optimizers[0]
    for name, param in weights.items():
        master = opt.get_unscaled_state(param, "master_param")
        assert torch.equal(master.cpu(), originals[name]), name  # not the FP8 rounding
        deq = param.dequantize().float().cpu()
        assert (deq - originals[name]).abs().max() <= originals[name].abs().max() * 2**-4, name  # a fitted scale


def test_a_skipped_step_leaves_fp8_weights_masters_and_moments_unchanged():
    class Snap(Callback):
        def __init__(self):
            self.seen = {}

        def _take(self, pl_module):
            opt = pl_module.trainer.optimizers[0]
            out = {}
            for name, p in fp8_weights(pl_module).items():
                out[name] = p._data.clone()
                for key in ("master_param", "exp_avg", "exp_avg_sq"):
                    out[f"{name}.{key}"] = opt.get_unscaled_state(p, key).clone()
            return out

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                self.seen["before"] = self._take(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.seen["after"] = self._take(pl_module)

    snap = Snap()
    model = Net(poison=(2,))
    t = trainer(5, callbacks=[snap])
    t.fit(model, data())
    assert t.precision_plugin.stats.as_dict()["skipped_steps"] == 1
    for key, before in snap.seen["before"].items():
        assert torch.equal(before, snap.seen["after"][key]), key


def test_checkpoint_holds_plain_tensors_and_resumes_as_the_uninterrupted_run(tmp_path):
    whole = Net()
    trainer(8).fit(whole, data())
    first = Net()
    t = trainer(4)
    t.fit(first, data())
    path = tmp_path / "four.ckpt"
    t.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert all(type(v) is torch.Tensor for v in ckpt["state_dict"].values())
    second = Net()
    trainer(8).fit(second, data(), ckpt_path=path)
    assert first.losses + second.losses == pytest.approx(whole.losses, rel=1e-6, abs=0)
    for (name, a), b in zip(fp8_weights(whole).items(), fp8_weights(second).values()):
        assert torch.equal(a._data, b._data), name
    # validated from the checkpoint alone: the trained model's loss
    expected = trainer(0).validate(first, data(8), verbose=False)[0]["val_loss"]
    got = trainer(0).validate(Net(), data(8), ckpt_path=path, verbose=False)[0]["val_loss"]
    assert got == pytest.approx(expected, rel=2e-2)


def test_an_optimizer_without_masters_is_refused_before_training():
    with pytest.raises(MisconfigurationException, match=r"weights.*fp8.*AdamW keeps none.*FusedAdam"):
        trainer(2).fit(Net(optimizer="adamw"), data())


# ------------------------------------------------------------------------------------------- two GPUs, FSDP2
RUNS = ["1gpu mp-fp8 fp8-weights", "fsdp2 mp-fp8 fp8-weights", "fsdp2 mp-fp8 fp8-weights resume"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    return small_gpt_rows(tmp_path_factory.mktemp("fp8_weights"), RUNS, keep_as="fp8_weights_")


@pytest.mark.parametrize("name", RUNS)
def test_fp8_weights_under_fsdp2_skip_together_and_follow_one_gpu(rows, name):
    row = rows[name]
    assert "error" not in row, row.get("error")
    assert row["skipped_per_rank"] == [[5, 8, 11]] * row["devices"], name
    # the scales agree; the newest amax-history row holds each rank's own shard amax until the next forward reduces it
    assert row["same_weights_all_ranks"] and row["same_fp8_scales_all_ranks"], name
    if row["devices"] > 1:
        assert row["loss_window_max_rel_diff"] <= 0.01, (name, row["loss_window_max_rel_diff"])
    if "resume" in name:
        assert row["resume_equal"] and row["resume_same_weights"], (row["resume_max_rel_diff"], name)
    assert row["losses"][-1] < 0.8 * row["losses"][0], name
