"""MPPlugin on a CUDA GPU: real autocast dtypes, fused AdamW step skipping, host syncs, fp16 resume.

Skipped without CUDA. Run on the GPU machine from the repository root::

    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu

Imports only torch, lightning and lightning_mp (the GPU machine has no jsonargparse).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import make_trainer as make_test_trainer

from lightning_mp import MPPlugin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

#: the Trainer's accelerator; a module global so the test logic can be dry-run elsewhere
ACCELERATOR = "gpu"
DEVICE_TYPE = "cuda"

FEATURES = 32
BATCH = 16
SYNC_MESSAGE = "synchronizing CUDA operation"


def make_data(n_batches: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * BATCH, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g) / math.sqrt(FEATURES)
    y = x @ w + 0.05 * torch.randn(n_batches * BATCH, 1, generator=g)
    return TensorDataset(x, y)


class Net(LightningModule):
    """A two-layer MLP regressor; poisons chosen steps, counted by ``trainer.global_step`` (survives resume).

    Args:
        inf_loss_steps: steps whose loss is multiplied by inf.
        nan_grad_steps: steps whose ``net1.weight`` gradient gets one NaN (in ``on_after_backward``).
        scheduler: add a step-interval ``StepLR(step_size=1, gamma=0.5)``.
        record: keep per-step losses (device tensors) and activation dtypes; off for sync counting.
        batches_per_epoch: size of the (fixed, unshuffled) training set in batches.
    """

    def __init__(
        self,
        inf_loss_steps: tuple[int, ...] = (),
        nan_grad_steps: tuple[int, ...] = (),
        lr: float = 1e-2,
        scheduler: bool = False,
        record: bool = True,
        batches_per_epoch: int = 64,
    ) -> None:
        super().__init__()
        self.net1 = nn.Linear(FEATURES, 64)
        self.net2 = nn.Linear(64, 1)
        self.inf_loss_steps = set(inf_loss_steps)
        self.nan_grad_steps = set(nan_grad_steps)
        self.lr = lr
        self.use_scheduler = scheduler
        self.record = record
        self.batches_per_epoch = batches_per_epoch
        self.losses: list[torch.Tensor] = []
        self.seen_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.net1(x))
        if self.record:
            self.seen_dtypes.append(h.dtype)
        return self.net2(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        if self.trainer.global_step in self.inf_loss_steps:
            loss = loss * math.inf
        if self.record:
            self.losses.append(loss.detach())
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.nan_grad_steps:
            self.net1.weight.grad[0, 0] = math.nan

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(make_data(self.batches_per_epoch), batch_size=BATCH, shuffle=False)


class StepSnapshots(Callback):
    """Parameters, optimizer state, LR and loss scale before and after every training batch."""

    def __init__(self) -> None:
        self.before: list[dict[str, Any]] = []
        self.after: list[dict[str, Any]] = []

    @staticmethod
    def snapshot(trainer: Trainer, module: LightningModule) -> dict[str, Any]:
        opt = trainer.optimizers[0]
        plugin = trainer.precision_plugin
        return {
            "params": {k: v.detach().clone() for k, v in module.named_parameters()},
            "opt_state": copy.deepcopy(opt.state_dict()["state"]),
            "lr": opt.param_groups[0]["lr"],
            "loss_scale": plugin.stats.loss_scale if isinstance(plugin, MPPlugin) else None,
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(self.snapshot(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(self.snapshot(trainer, pl_module))


def make_trainer(plugin: Optional[MPPlugin] = None, max_steps: int = 20, callbacks=(), **kwargs: Any) -> Trainer:
    return make_test_trainer(plugin, max_steps, callbacks, **{"accelerator": ACCELERATOR, **kwargs})


def assert_nested_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_nested_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} changed"
    else:
        assert a == b, where


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Bit-identical parameters, optimizer state (exp_avg, exp_avg_sq, step) and LR."""
    for name, value in before["params"].items():
        assert torch.equal(value, after["params"][name]), f"parameter {name} changed on a skipped step"
    assert before["opt_state"], "optimizer state is empty: poison a step after the first one"
    for idx, state in before["opt_state"].items():
        assert set(state) >= {"exp_avg", "exp_avg_sq", "step"}
    assert_nested_equal(before["opt_state"], after["opt_state"], "opt_state")
    assert before["lr"] == after["lr"], "the LR scheduler stepped over a skipped step"


def assert_changed(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert any(not torch.equal(v, after["params"][k]) for k, v in before["params"].items()), "a clean step did not move"
    if before["opt_state"]:
        assert after["opt_state"][0]["step"].item() == before["opt_state"][0]["step"].item() + 1


# --------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("mode", "lightning_precision", "dtype"),
    [("bf16", "bf16-mixed", torch.bfloat16), ("fp16", "16-mixed", torch.float16)],
)
def test_mixed_precision_trains_on_cuda(mode, lightning_precision, dtype):
    seed_everything(0)
    model = Net()
    plugin = MPPlugin(mode)
    trainer = make_trainer(plugin, max_steps=20, gradient_clip_val=1.0)
    trainer.fit(model)

    assert trainer.precision == lightning_precision
    assert trainer.strategy.root_device.type == DEVICE_TYPE
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights
    assert len(model.seen_dtypes) == 20 and set(model.seen_dtypes) == {dtype}
    losses = torch.stack(model.losses).float().cpu()
    assert len(losses) == 20 and torch.isfinite(losses).all()
    first, last = losses[:3].mean().item(), losses[-3:].mean().item()
    assert last < 0.5 * first, f"loss did not go down: first {first:.4f}, last {last:.4f}"
    stats = plugin.stats.as_dict()
    assert stats["steps"] == 20
    if mode == "fp16":
        assert stats["loss_scale"] is not None and stats["loss_scale"] >= 1.0
        assert stats["skipped_steps"] <= 3  # a few backoffs from 2**16 at most
    else:
        assert stats["loss_scale"] is None and stats["skipped_steps"] == 0
    assert stats["grad_norm"] is not None and math.isfinite(stats["grad_norm"])


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_inf_loss_skips_step_bit_identically(mode):
    poisoned = (3, 7)
    seed_everything(0)
    model = Net(inf_loss_steps=poisoned, scheduler=True)
    plugin = MPPlugin(mode, init_scale=2.0**10) if mode == "fp16" else MPPlugin(mode)
    snaps = StepSnapshots()
    trainer = make_trainer(plugin, max_steps=10, callbacks=[snaps], gradient_clip_val=1.0)
    trainer.fit(model)

    assert len(snaps.before) == len(snaps.after) == 10
    for step in range(10):
        if step in poisoned:
            assert_unchanged(snaps.before[step], snaps.after[step])
        else:
            assert_changed(snaps.before[step], snaps.after[step])
            assert snaps.after[step]["lr"] == pytest.approx(snaps.before[step]["lr"] * 0.5)
    assert plugin.stats.skipped_steps == len(poisoned)
    assert plugin.stats.steps == 10
    assert plugin.stats.consecutive_skips == 0
    # the LR halved once per clean step only
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** (10 - len(poisoned)))
    if mode == "fp16":
        assert snaps.before[3]["loss_scale"] == 2.0**10
        assert snaps.after[3]["loss_scale"] == 512.0
        assert snaps.after[7]["loss_scale"] == 256.0
        assert plugin.stats.loss_scale == 256.0
    else:
        assert plugin.stats.loss_scale is None


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_nan_gradient_skips_step_bit_identically(mode):
    seed_everything(0)
    model = Net(nan_grad_steps=(4,), scheduler=True)
    plugin = MPPlugin(mode, init_scale=2.0**10) if mode == "fp16" else MPPlugin(mode)
    snaps = StepSnapshots()
    trainer = make_trainer(plugin, max_steps=8, callbacks=[snaps], gradient_clip_val=1.0)
    trainer.fit(model)

    assert_unchanged(snaps.before[4], snaps.after[4])
    for step in (3, 5):
        assert_changed(snaps.before[step], snaps.after[step])
    assert plugin.stats.skipped_steps == 1
    if mode == "fp16":
        assert snaps.before[4]["loss_scale"] == 2.0**10
        assert snaps.after[4]["loss_scale"] == 512.0
        assert plugin.stats.loss_scale == 512.0


class SyncCounter(Callback):
    """Counts host-device syncs (``set_sync_debug_mode("warn")``) over whole steps after ``warmup`` steps.

    The window opens at the end of step ``warmup - 1`` and closes at the end of the last step, so it covers
    ``steps`` full cycles: batch fetch and transfer, the training step, the optimizer step and the hooks.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup = warmup
        self.steps = steps
        self.count: Optional[int] = None
        self._seen = 0
        self._catcher: Optional[warnings.catch_warnings] = None
        self._log: list = []

    def _open(self) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._log = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def _close(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None
            self.count = sum(SYNC_MESSAGE in str(w.message) for w in self._log)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._seen += 1
        if self._seen == self.warmup:
            self._open()
        elif self._seen == self.warmup + self.steps:
            self._close()

    def on_train_end(self, trainer, pl_module):
        self._close()


@pytest.mark.parametrize(("mode", "native"), [("bf16", "bf16-mixed"), ("fp16", "16-mixed")])
def test_no_extra_host_syncs_over_native(mode, native):
    warmup, steps = 3, 6
    counts = {}
    for name in (native, mode):
        seed_everything(0)
        model = Net(record=False)
        counter = SyncCounter(warmup, steps)
        if name == mode:
            trainer = make_trainer(MPPlugin(mode), max_steps=warmup + steps, callbacks=[counter])
        else:
            trainer = make_trainer(None, max_steps=warmup + steps, callbacks=[counter], precision=native)
        try:
            trainer.fit(model)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert counter.count is not None
        counts[name] = counter.count
    print(f"host syncs over {steps} steps: {counts}")
    assert counts[mode] <= counts[native], f"MPPlugin({mode!r}) syncs more than precision={native!r}: {counts}"


def test_fp16_resume_matches_uninterrupted(tmp_path):
    """6 steps (overflow at step 2), checkpoint at the epoch's end, resume to 12; compare with 12 straight.

    Compared exactly (``torch.equal``, atol 0): same GPU, same process, same shapes and unshuffled data, so
    cuBLAS and the fused AdamW kernel repeat bit for bit; no ``use_deterministic_algorithms`` needed.

    The runs are bounded by ``max_epochs`` (one epoch = 6 batches), not ``max_steps``: Lightning 2.6.6 resumes a
    checkpoint written when ``max_steps`` ended the run at an epoch's end as if mid-epoch and replays batch 0,
    which would make the comparison fail for reasons unrelated to the plugin.
    """
    common = dict(inf_loss_steps=(2,), batches_per_epoch=6, record=False)

    seed_everything(0)
    straight = Net(**common)
    plugin_straight = MPPlugin("fp16", init_scale=2.0**10)
    trainer_straight = make_trainer(plugin_straight, max_steps=-1, max_epochs=2, gradient_clip_val=1.0)
    trainer_straight.fit(straight)

    seed_everything(0)
    first = Net(**common)
    plugin_first = MPPlugin("fp16", init_scale=2.0**10)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_on_train_epoch_end=True)
    make_trainer(
        plugin_first, max_steps=-1, max_epochs=1, gradient_clip_val=1.0, callbacks=[ckpt_cb], enable_checkpointing=True
    ).fit(first)
    assert plugin_first.stats.skipped_steps == 1
    assert plugin_first.stats.loss_scale == 512.0

    ckpt_path = tmp_path / "last.ckpt"
    assert ckpt_path.exists(), sorted(p.name for p in tmp_path.iterdir())
    ckpt = torch.load(ckpt_path, weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 6
    entry = ckpt["MPPlugin"]
    assert entry["mode"] == "fp16"
    assert entry["scaler"]["scale"] == 512.0
    assert entry["scaler"]["skipped_steps"] == 1
    assert entry["scaler"]["steps"] == 6

    seed_everything(1)  # a different init: everything must come from the checkpoint
    resumed = Net(**common)
    plugin_resumed = MPPlugin("fp16", init_scale=2.0**10)
    trainer = make_trainer(plugin_resumed, max_steps=-1, max_epochs=2, gradient_clip_val=1.0)
    trainer.fit(resumed, ckpt_path=str(ckpt_path))

    assert trainer_straight.global_step == 12
    assert trainer.global_step == 12
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), f"{name} differs after resume"
    assert_nested_equal(
        trainer_straight.optimizers[0].state_dict()["state"], trainer.optimizers[0].state_dict()["state"], "opt_state"
    )
    assert plugin_resumed.stats.as_dict() == plugin_straight.stats.as_dict()
    assert plugin_resumed.stats.skipped_steps == 1
    assert plugin_resumed.stats.steps == 12
    assert plugin_resumed.stats.loss_scale == 512.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_step_guard_finds_every_nonfinite_value_on_cuda(dtype, bad):
    """bf16/fp32 steps rely on the read-only check (torch._foreach_norm with ord=inf) catching NaN and inf."""
    from lightning_mp import NonfiniteGuard

    params = [torch.nn.Parameter(torch.zeros(n, device="cuda", dtype=dtype)) for n in (7, 4096 * 33, 1_000_003)]
    opt = torch.optim.SGD(params, lr=0.1)
    for target, index in [(0, 0), (1, 4096 * 33 - 1), (2, 500_000), (None, None)]:
        for p in params:
            p.grad = torch.randn_like(p) * 1e3
        if target is not None:
            params[target].grad.view(-1)[index] = bad
        guard = NonfiniteGuard("cuda")
        guard.ensure_initialized(torch.device("cuda"))
        guard.check_(opt)
        found = float(guard.verdicts.of(opt).item())
        assert found == (0.0 if target is None else 1.0), (target, index)


def test_stochastic_rounding_generator_ignores_a_step_skipped_on_the_device():
    """With fused AdamW the skip is decided on the device; the rounding noise drawn for that step is rewound.

    The generator then ends where a run whose skip was known on the host (plain AdamW) ends, and the saved
    master-weights state right after the skipped step equals the state right before it.
    """

    class States(Callback):
        def __init__(self) -> None:
            self.before: list[Any] = []
            self.after: list[Any] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before.append(trainer.precision_plugin.masters.state_dict()["generators"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after.append(trainer.precision_plugin.masters.state_dict()["generators"])

    class HalfNet(Net):
        def training_step(self, batch, batch_idx):
            x, y = batch  # bf16-true casts the batch to bf16: the fp32 loss needs an fp32 target
            return super().training_step((x, y.float()), batch_idx)

    class PlainAdamW(HalfNet):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr)

    finals = []
    for cls in (HalfNet, PlainAdamW):
        seed_everything(0)
        states = States()
        plugin = MPPlugin("bf16-true", master_weights="stochastic")
        make_trainer(plugin, max_steps=8, callbacks=[states]).fit(cls(nan_grad_steps=(4,), record=False))
        assert plugin.stats.skipped_steps == 1
        assert_nested_equal(states.before[4], states.after[4], "generators")  # the skipped step drew nothing
        key = next(iter(states.after[5]))
        assert not torch.equal(states.before[5][key], states.after[5][key])  # a clean step does
        finals.append(plugin.masters.state_dict()["generators"])
    assert_nested_equal(finals[0], finals[1], "generators")



# --------------------------------------------------------------------------------------------- guarded LayerNorm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_guarded_layer_norm_compiled_kernel_is_as_exact_as_the_upcast_path(dtype):
    """True-half: a guarded nn.LayerNorm runs torch.compile's fused fp32 kernel on the 16-bit input.

    Against an fp64 reference its output and input/weight/bias gradients are as close as the eager upcast path's
    (a LayerNorm subclass with its own forward keeps that path).
    """
    from lightning_mp import guards
    from lightning_mp.guards import apply_fp32_guards

    class UpcastLayerNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x)

    g = torch.Generator().manual_seed(0)
    width, rows = 1024, 4096
    x = (torch.randn(rows, width, generator=g) * 4 + 1).to("cuda", dtype)
    assert guards.fused_layer_norm_available(x), "needs Triton"
    w = (torch.rand(width, generator=g) + 0.5).cuda()
    b = torch.randn(width, generator=g).cuda()
    dy = torch.randn(rows, width, generator=g).to("cuda", dtype)

    def run(cls, dt=None):
        model = nn.Sequential(cls(width)).cuda()
        apply_fp32_guards(model, None)
        with torch.no_grad():
            model[0].weight.copy_(w)
            model[0].bias.copy_(b)
        if dt is not None:
            model.double()
        seen = []
        model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
        xi = (x if dt is None else x.to(dt)).clone().requires_grad_(True)
        y = model(xi)
        y.backward(dy if dt is None else dy.to(dt))
        return seen, [t.double() for t in (y, xi.grad, model[0].weight.grad, model[0].bias.grad)]

    seen_fused, fused = run(nn.LayerNorm)
    assert guards._FUSED_LAYER_NORM["failed"] is None, guards._FUSED_LAYER_NORM["failed"]
    seen_upcast, upcast = run(UpcastLayerNorm)
    _, reference = run(UpcastLayerNorm, torch.float64)
    assert seen_fused == [dtype] and seen_upcast == [torch.float32]
    for name, f, u, r in zip(("output", "input grad", "weight grad", "bias grad"), fused, upcast, reference):
        err_fused, err_upcast = (f - r).abs().max().item(), (u - r).abs().max().item()
        assert err_fused <= 1.5 * err_upcast + 1e-6, (name, err_fused, err_upcast)
