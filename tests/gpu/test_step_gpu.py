"""The optimizer step's CUDA-only paths: fused optimizers decide skips on the device (no host verdict), CUDA
autocast leaves some guards unhooked, evaluation under inference_mode, and torch.compile graphs on the GPU.

Skipped without CUDA. Run on the GPU machine from the repository root::

    PYTHONPATH=.:tests python -m pytest -q -m gpu tests/gpu/test_step_gpu.py
"""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin, NonFiniteTrainingError
from lightning_mp.guards import apply_fp32_guards

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

MODES = ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"]


def trainer(plugin: MPPlugin, **kwargs) -> Trainer:
    kwargs.setdefault("max_steps", 6)
    return Trainer(
        accelerator="gpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def scaler_args(mode: str) -> dict:
    return {"init_scale": 2.0**8} if "fp16" in mode else {}


class BNNet(LightningModule):
    """Linear → BatchNorm → LayerNorm → Linear, fused AdamW, a step-interval scheduler; one batch poisoned."""

    def __init__(self, poison: int = 2, optimizer: str = "fused") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 1))
        self.poison = poison
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.poison:
            x = x.clone()
            x[0, 0] = float("inf")  # poisons the forward (BatchNorm statistics) and the gradients
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.log("val_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.optimizer == "fused")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def loader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(128, 32, generator=g), torch.randn(128, 1, generator=g)), batch_size=16
        )

    train_dataloader = val_dataloader = predict_dataloader = loader


class Snap(Callback):
    def __init__(self) -> None:
        self.before: list[dict] = []
        self.after: list[dict] = []

    @staticmethod
    def take(trainer, module) -> dict:
        opt = trainer.optimizers[0]
        return {
            "params": {k: v.detach().clone() for k, v in module.named_parameters()},
            "buffers": {k: v.detach().clone() for k, v in module.named_buffers()},
            "state": copy.deepcopy(opt.state_dict()["state"]),
            "lr": opt.param_groups[0]["lr"],
        }

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before.append(self.take(trainer, module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append(self.take(trainer, module))


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_skipped_step_changes_nothing_on_cuda(mode, optimizer):
    """Parameters, masters, Adam state (step count), BatchNorm buffers and the LR stay put on a skipped step, also
    when a fused optimizer skips on the device and the host never learns the verdict during the step."""
    seed_everything(0)
    plugin = MPPlugin(mode, **scaler_args(mode))
    snap = Snap()
    model = BNNet(optimizer=optimizer)
    trainer(plugin, callbacks=[snap]).fit(model)
    i = model.poison
    assert same(snap.before[i], snap.after[i]), f"{mode}: the poisoned step changed state"
    assert not same(snap.before[i + 1]["params"], snap.after[i + 1]["params"])
    assert plugin.stats.skipped_steps == 1 and plugin.stats.steps == 6
    result = trainer(plugin).validate(model, verbose=False)[0]["val_loss"]
    assert math.isfinite(result)
    if plugin.masters is not None and hasattr(plugin.masters, "master_of"):
        for p in model.parameters():
            master = plugin.masters.master_of(p)
            if master is not None:
                assert torch.equal(master.to(p.dtype), p)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inference_mode", [True, False])
def test_evaluation_under_inference_mode_on_cuda(mode, inference_mode):
    seed_everything(0)
    model = BNNet(poison=-1)
    t = trainer(MPPlugin(mode, **scaler_args(mode)), inference_mode=inference_mode, max_steps=2)
    t.fit(model)
    assert math.isfinite(t.validate(model, verbose=False)[0]["val_loss"])
    preds = t.predict(model)
    assert all(torch.isfinite(p.float()).all() for p in preds)


class TwoOptimizers(LightningModule):
    """Manual optimization; the second optimizer's gradients are always NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.b(self.a(x)).float(), y.float())
        self.manual_backward(loss)
        self.b.weight.grad.fill_(float("nan"))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.a.parameters(), fused=True), torch.optim.AdamW(self.b.parameters(), fused=True)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g)), batch_size=8
        )


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_divergence_stop_per_optimizer_with_fused_optimizers_on_cuda(mode):
    """Fused optimizers: the verdict reaches the host a step late; the stop still comes, for the one optimizer."""
    seed_everything(0)
    with pytest.raises(NonFiniteTrainingError, match="optimizer 1"):
        trainer(MPPlugin(mode, max_consecutive_skips=3, **scaler_args(mode)), max_steps=20).fit(TwoOptimizers())


class Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln2(x))


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_guards_add_no_graph_breaks_on_cuda(mode):
    plugin = MPPlugin(mode)
    block = Block().cuda()
    if plugin.mode.true_half:
        plugin.convert_module(block)
    else:
        apply_fp32_guards(block)  # every default guard, also those CUDA autocast makes redundant
    dtype = plugin.mode.param_dtype or torch.float32
    x = torch.randn(4, 32, 64, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    with plugin.forward_context():
        explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16", "bf16-true"])
def test_on_cuda_only_what_autocast_leaves_in_half_is_guarded(mode):
    """CUDA autocast computes norms, softmax and losses in fp32 itself: with fp32 weights (fp32, tf32, bf16, fp16, and
    any mode a PrecisionSchedule switches to) their guards would add host time per call and nothing else, so none is
    installed; an entry the user names (a router) is guarded in every mode; true-half modes guard the norms."""
    from lightning_mp.guards import fp32_guard_of

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.router, self.loss = Block(), nn.Linear(64, 4), nn.CrossEntropyLoss()

    model = Model().cuda()
    MPPlugin(mode, fp32_modules=["defaults", "router"]).convert_module(model)
    guarded = {name for name, m in model.named_modules() if fp32_guard_of(m) is not None}
    if mode == "bf16-true":
        assert {"block.ln1", "block.ln2", "router", "loss"} <= guarded
    else:
        assert guarded == {"router"}


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_the_check_taken_on_a_side_stream_during_backward_gives_the_same_steps_and_skips(mode, monkeypatch):
    """Large models take each gradient's maximum on a side CUDA stream while backward runs (lowered size limit
    here): clean steps train exactly as with the check after backward, an inf gradient is skipped."""
    from lightning_mp import overlap

    class Net(LightningModule):
        def __init__(self, poison=None):
            super().__init__()
            torch.manual_seed(0)
            self.net, self.poison = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1)), poison

        def training_step(self, batch, batch_idx):
            out = self.net(batch[0])
            if batch_idx == self.poison:
                out = out * math.inf
            return nn.functional.mse_loss(out.float(), batch[1].float())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            return DataLoader(
                TensorDataset(torch.randn(64, 64, generator=g), torch.randn(64, 1, generator=g)), batch_size=8
            )

    def run(min_numel, poison=None):
        monkeypatch.setattr(overlap, "MIN_NUMEL", min_numel)
        monkeypatch.setattr(overlap, "MIN_NUMEL_PER_GRAD", 0)
        model, plugin = Net(poison), MPPlugin(mode)
        Trainer(accelerator="gpu", devices=1, max_steps=6, plugins=[plugin], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False).fit(model)
        return [p.detach().cpu() for p in model.parameters()], plugin.stats.skipped_steps

    taken = []
    original = overlap.OverlappedCheck.verdict
    monkeypatch.setattr(overlap.OverlappedCheck, "verdict", lambda self, opt: taken.append(1) or original(self, opt))
    overlapped, _ = run(0)
    assert len(taken) == 6
    after, _ = run(1 << 40)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, after))
    _, skipped = run(0, poison=3)
    assert skipped == 1


@pytest.mark.parametrize("master_weights", ["fp32", "kahan"])
def test_checkpoint_after_fit_and_a_second_fit_on_cuda(tmp_path, master_weights):
    """After fit, Lightning's teardown moves the model to the CPU (the masters follow it):
    ``trainer.save_checkpoint`` must still work (plain tensors), and a second fit continues from the trained
    weights."""
    seed_everything(0)
    plugin = MPPlugin("bf16-true", master_weights=master_weights)
    model = BNNet(poison=-1)
    fit = trainer(plugin)
    fit.fit(model)
    path = tmp_path / "after_fit.ckpt"
    fit.save_checkpoint(path)  # the plugin's state while the model sits on the CPU
    state = torch.load(path, weights_only=True)
    assert state["MPPlugin"]["master_weights"]["kind"] == master_weights
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    second = trainer(plugin)
    second.fit(model)
    assert plugin.stats.steps == 12 and not any(  # (the counters count both fits: they live with the plugin)
        torch.isnan(p).any() for p in model.parameters())
    assert any(not torch.equal(trained[k].cpu(), v.detach().cpu()) for k, v in model.state_dict().items())


class _Wide(LightningModule):
    """Two 1024-wide layers (2.1 M parameters: 8 MiB of fp32 masters), enough to see what stays on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))

    def training_step(self, batch, batch_idx):
        return self.net(batch).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    def train_dataloader(self):
        return DataLoader(torch.randn(64, 1024), batch_size=16)


@pytest.mark.parametrize("master_weights", ["fp32", "kahan"])
def test_the_gpu_memory_is_freed_after_fit_as_with_lightning(master_weights):
    """Lightning's teardown moves the model and the optimizer state to the CPU, which frees the GPU; the masters (and
    the planned step's gradient buffer) follow: what stays allocated after ``fit`` is what Lightning's own
    ``bf16-true`` leaves, and the next fit trains on the GPU with the masters' values."""

    def leftover(plugin: MPPlugin | None) -> tuple[int, LightningModule]:
        gc.collect()  # (what earlier tests left for the collector must not be freed inside the measurement)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        seed_everything(0)
        model = _Wide()
        if plugin is None:  # Lightning's own bf16-true
            Trainer(accelerator="gpu", devices=1, precision="bf16-true", max_steps=6, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
        else:
            trainer(plugin).fit(model)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, model

    lightning_left, _ = leftover(None)
    plugin = MPPlugin("bf16-true", master_weights=master_weights)
    ours_left, model = leftover(plugin)
    assert ours_left <= lightning_left + (1 << 20), (ours_left, lightning_left)  # 8 MiB of masters would show
    held = [e.held for e in plugin.masters._entries.values()]
    assert held and all(t.device.type == "cpu" for t in held)
    if master_weights == "fp32":
        values = {n: plugin.masters.master_of(p).detach().clone() for n, p in model.named_parameters()}
        assert all(v.device.type == "cpu" and v.dtype is torch.float32 for v in values.values())
    trainer(plugin).fit(model)  # the next fit: the masters go back to the GPU with the model, and train
    assert all(t.device.type == "cpu" for t in (e.held for e in plugin.masters._entries.values()))
    # (both fits: the counters live with the plugin)
    assert plugin.stats.steps == 12 and all(torch.isfinite(p).all() for p in model.parameters())
    if master_weights == "fp32":
        moved = [n for n, p in model.named_parameters() if not torch.equal(plugin.masters.master_of(p), values[n])]
        assert moved  # the second fit stepped the masters


def test_host_batches_return_device_flags_in_order_without_events():
    """Device flags sent to pinned memory a batch at a time: values land in order, a batch not sent yet is never
    ready (sent early where a value is needed now), a NaN on the device is waited out (it cannot mark a value as
    landed), buffers are reused once read, and a copy behind a long kernel chain is waited for."""
    from lightning_mp._host import HostBatches

    batches = HostBatches(torch.device("cuda"), 4)
    assert not batches.accepts(torch.zeros((), device="cuda", dtype=torch.bool))
    values = [0.0, 1.0, float("nan"), 3.0]
    entries = [batches.push(torch.tensor(v, device="cuda")) for v in values[:3]]
    torch.cuda.synchronize()
    assert not any(batches.ready(e) for e in entries)  # held: the batch goes when full
    entries.append(batches.push(torch.tensor(values[3], device="cuda")))
    torch.cuda.synchronize()
    assert [batches.ready(e) for e in entries] == [True, True, False, True]
    taken = [batches.take(e) for e in entries]
    assert taken[:2] == [0.0, 1.0] and math.isnan(taken[2]) and taken[3] == 3.0
    assert not any(batches.ready(e) for e in entries)  # read: NaN again, reused
    big = torch.full((1 << 24,), 2.0, device="cuda")
    for _ in range(20):  # queued behind a long kernel chain: not landed until the device gets there
        big = big * 1.0
    late = batches.push(big.sum() / (1 << 24))
    assert late[0] is entries[0][0]
    assert batches.take(late) == 2.0  # sent early, then waited for where the copy has not landed


class EveryThird(BNNet):
    """Every third batch poisoned: many device verdicts in flight over the run, in batches."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step % 3 == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    def loader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(640, 32, generator=g), torch.randn(640, 1, generator=g)),
                          batch_size=16)

    train_dataloader = loader


@pytest.mark.parametrize("limit", [2, None])
@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_skips_counted_from_device_verdicts_over_many_steps(mode, limit):
    """A fused optimizer's verdicts reach the host a batch at a time (a batch of one with a divergence limit of 2, of
    eight without a limit): 40 steps, every third skipped, counted exactly (fp16 also backs its scale off on those
    steps), and no stop (never more than one skip in a row)."""
    seed_everything(0)
    plugin = MPPlugin(mode, max_consecutive_skips=limit, **scaler_args(mode))
    trainer(plugin, max_steps=40).fit(EveryThird())
    assert plugin.stats.steps == 40
    assert plugin.stats.skipped_steps == len([s for s in range(40) if s % 3 == 1])
    assert plugin.stats.consecutive_skips == 0


def test_step_counters_copied_with_device_verdicts_still_in_flight():
    """A deepcopy or pickle of the counters while device verdicts are still on their way (queued behind a long kernel
    chain) takes their outcomes: copies landing in the original's pinned slots never reach the copy's."""
    import pickle

    from lightning_mp.stats import OptimizerStats


    def flags() -> list[torch.Tensor]:
        big = torch.full((1 << 26,), 1.0, device="cuda")
        for _ in range(300):  # tens of milliseconds of device work queued
            big = big * 1.0
        zero = (big.sum() * 0).reshape(())  # 0.0, known only once the chain has run
        return [zero + 1, zero + 1, zero, zero + 1, zero]

    warm = OptimizerStats()  # (the kernels' first launches load them, which waits for the device: done once here)
    for flag in flags():
        warm.record(None, flag)
    assert warm.skipped_steps == 3
    torch.cuda.synchronize()
    for batch in (1, 8):  # sent one by one, or still held in a batch not sent
        stats = OptimizerStats()
        stats.verdict_batch = batch
        for flag in flags():
            stats.record(None, flag)
        assert len(stats._pending) == 5 and not stats._batches.ready(stats._pending[0])  # all still on their way
        for other in (copy.deepcopy(stats), pickle.loads(pickle.dumps(stats))):
            assert (other.steps, other.skipped_steps, other.consecutive_skips) == (5, 3, 0)
        assert (stats.steps, stats.skipped_steps, stats.consecutive_skips) == (5, 3, 0)


def test_divergence_stop_fires_within_a_verdict_batch_of_its_limit():
    """Every step poisoned, fused optimizer: the stop reads device verdicts that come a batch at a time (a quarter of
    the limit: 2 for a limit of 8), so it fires at most that many steps after the limit, never before it."""
    seed_everything(0)

    class AlwaysNaN(EveryThird):
        def training_step(self, batch, batch_idx):
            x, y = batch
            x = x.clone()
            x[0, 0] = float("nan")
            return nn.functional.mse_loss(self.net(x).float(), y.float())

    plugin = MPPlugin("bf16", max_consecutive_skips=8)
    with pytest.raises(NonFiniteTrainingError, match="max_consecutive_skips=8"):
        trainer(plugin, max_steps=40).fit(AlwaysNaN())
    assert 8 <= plugin.stats.steps <= 8 + 2 + 1
