"""True-half training with master weights (lightning_mp/master.py) through MPPlugin in a real Trainer on the CPU."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import TinyRegressor, assert_nested_equal, make_trainer
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp.master import (
    fp32_original,
    FP32MasterWeights,
    attach_master_weights,
    cast_module_,
    fp32_values,
    parse_master_weights,
    stochastic_round,
)

KINDS = ["fp32", "kahan", "stochastic", "none"]
HALF = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny matmuls: one thread is faster and immune to a busy machine's OpenMP contention
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def data(n: int = 64, features: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


class HalfNet(LightningModule):
    """Linear -> LayerNorm (guarded in fp32, except in bf16-true with masters) -> ReLU -> Linear; batches taken by
    the global batch index.

    Args:
        poison_loss: global batch indices whose loss is multiplied by inf.
    """

    def __init__(
        self,
        optimizer: str = "adam",
        lr: float = 0.01,
        scheduler: bool = False,
        poison_loss: tuple[int, ...] = (),
        batch_size: int = 8,
        n: int = 64,
    ) -> None:
        super().__init__()
        self.net1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.net2 = nn.Linear(32, 1)
        self.optimizer_name, self.lr, self.scheduler = optimizer, lr, scheduler
        self.poison_loss = set(poison_loss)
        self.batch_size, self.n = batch_size, n
        self.losses: list[float] = []

    @property
    def batch_index(self) -> int:
        return self.trainer.fit_loop.epoch_loop.total_batch_idx

    def forward(self, x):
        return self.net2(torch.relu(self.norm(self.net1(x))))

    def training_step(self, batch, batch_idx):
        x, y = data(self.n)  # by index: a resumed run sees the batches of an uninterrupted one
        start = (self.batch_index % (self.n // self.batch_size)) * self.batch_size
        x, y = x[start : start + self.batch_size], y[start : start + self.batch_size]
        loss = F.mse_loss(self(x.to(self.net1.weight.dtype)).float(), y.float())
        self.losses.append(float(loss.detach()))
        if self.batch_index in self.poison_loss:
            loss = loss * math.inf
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adamw_fused":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        else:
            raise ValueError(self.optimizer_name)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(*data(self.n)), batch_size=self.batch_size)


def scaler_args(mode: str) -> dict:
    return {"init_scale": 2.0**8} if mode == "fp16-true" else {}


def fit(mode: str, kind, max_steps: int, model=None, ckpt_path=None, **trainer_kwargs):
    plugin = MPPlugin(mode, master_weights=kind, **scaler_args(mode))
    trainer = make_trainer(plugin, max_steps=max_steps, **trainer_kwargs)
    model = model if model is not None else HalfNet()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, plugin, model


def state_tensors(opt) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for k, t in s.items() if isinstance(t, torch.Tensor) and k != "step"]


# --------------------------------------------------------------------------------------------- what is where
@pytest.mark.parametrize("mode", ["bf16-true", "fp16-true"])
@pytest.mark.parametrize("kind", KINDS)
def test_weights_masters_and_optimizer_state_dtypes(mode, kind):
    in_run: dict = {}

    class InTheRun(Callback):
        def on_train_end(self, trainer, pl_module):
            in_run.update({n: p.dtype for n, p in pl_module.named_parameters()})

    trainer, plugin, model = fit(mode, kind, max_steps=24, model=HalfNet(n=64), callbacks=[InTheRun()])
    half = HALF[mode]
    assert trainer.precision == {"bf16-true": "bf16-true", "fp16-true": "16-true"}[mode]
    assert plugin.master_weights == kind
    # bf16-true with masters runs a plain LayerNorm in bf16 (torch's kernel computes it in fp32; its masters keep
    # the fp32 values); fp16-true and masterless runs guard it in fp32
    norm = half if mode == "bf16-true" and kind != "none" else torch.float32
    assert in_run == {
        "net1.weight": half, "net1.bias": half, "norm.weight": norm, "norm.bias": norm,
        "net2.weight": half, "net2.bias": half,
    }
    # after the run every weight is half, as Lightning's plugin leaves the module
    assert {p.dtype for p in model.parameters()} == {half}
    opt = trainer.optimizers[0]
    stepped = opt.param_groups[0]["params"]
    # masters are invisible: the param groups hold the model's own parameters, the optimizer state is fp32
    assert all(p is q for p, q in zip(stepped, model.parameters()))
    for name, p in model.named_parameters():  # fp32 with masters; with plain half weights, the run's dtype
        want = in_run[name] if kind == "none" else torch.float32
        assert all(t.dtype == want for k, t in opt.state[p].items() if k != "step"), (kind, p.shape)
    if kind == "fp32":
        for name, p in model.named_parameters():  # the half weights are the masters rounded
            master = plugin.masters.master_of(p)
            assert (
                master.dtype == torch.float32 and torch.equal(master.to(half), p)
                if in_run[name] == half
                else master is None
            )
    assert {t.dtype for t in state_tensors(opt)} == ({half, torch.float32} if kind == "none" else {torch.float32})
    if (mode, kind) == ("fp16-true", "none"):
        return  # Adam on fp16 state: eps=1e-8 and small squared gradients underflow to 0, the run goes NaN
    first, last = sum(model.losses[:8]) / 8, sum(model.losses[-8:]) / 8
    assert last < 0.5 * first, (first, last)


# --------------------------------------------------------------------------------------------- convergence
class Regression(LightningModule):
    """Linear regression from weights 1.0: Adam's steps of ~1e-3 lie below half a bf16 ulp at 1.0 (2**-8)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 1, bias=False)
        nn.init.constant_(self.lin.weight, 1.0)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 32, generator=g)
        self.y = self.x @ (1 + 0.15 * torch.randn(32, generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.lin(x).squeeze(-1).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=32)

    def full_loss(self) -> float:
        with torch.no_grad():
            return F.mse_loss(self.lin(self.x.to(self.lin.weight.dtype)).squeeze(-1).float(), self.y).item()


@pytest.mark.slow
def test_updates_below_bf16_resolution_need_master_weights():
    losses = {}
    for name, plugin in [("fp32 training", MPPlugin("fp32"))] + [
        (kind, MPPlugin("bf16-true", master_weights=kind)) for kind in KINDS
    ]:
        model = Regression()
        initial = model.full_loss()
        make_trainer(plugin, max_steps=400).fit(model)
        losses[name] = model.full_loss()
    print("\nloss after 400 Adam steps (lr 1e-3) from", f"{initial:.4f}:", {k: f"{v:.5f}" for k, v in losses.items()})
    reference = losses["fp32 training"]
    assert reference < 0.01 * initial
    assert losses["fp32"] < 1.15 * reference
    assert losses["kahan"] < 1.15 * reference
    assert losses["stochastic"] < 1.5 * reference
    assert losses["none"] > 0.99 * initial  # every update rounded away: bf16-true without masters stalls


# --------------------------------------------------------------------------------------------- memory
class Wide(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 512)), batch_size=4)


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def test_memory_bytes_per_parameter_table():
    """Bytes a parameter holds between steps (weights, masters or compensation, Adam state), from the tensors."""
    rows = {}
    for label, plugin in [
        ("fp32", MPPlugin("fp32")),
        ("bf16 (autocast)", MPPlugin("bf16")),
        *[(f"bf16-true, master_weights={kind!r}", MPPlugin("bf16-true", master_weights=kind)) for kind in KINDS],
        ("Lightning precision='bf16-true'", None),
    ]:
        model = Wide()
        trainer = make_trainer(plugin, max_steps=2, **({} if plugin else {"precision": "bf16-true"}))
        trainer.fit(model)
        n = sum(p.numel() for p in model.parameters())
        weights = _bytes(model.parameters()) / n
        extra = _bytes(plugin.masters.tensors()) / n if plugin is not None and plugin.masters is not None else 0.0
        state = _bytes(state_tensors(trainer.optimizers[0])) / n
        rows[label] = (weights, extra, state)
    lines = ["| precision | weights | master / compensation | Adam state | total |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {w:.2f} | {e:.2f} | {s:.2f} | {w + e + s:.2f} |" for k, (w, e, s) in rows.items()]
    print("\nbytes per parameter, measured (model of", n, "parameters):\n" + "\n".join(lines))
    expected = {
        "fp32": (4, 0, 8), "bf16 (autocast)": (4, 0, 8),
        "bf16-true, master_weights='fp32'": (2, 4, 8), "bf16-true, master_weights='kahan'": (2, 2, 8),
        "bf16-true, master_weights='stochastic'": (2, 0, 8), "bf16-true, master_weights='none'": (2, 0, 4),
        "Lightning precision='bf16-true'": (2, 0, 4),
    }
    for label, row in rows.items():
        assert row == pytest.approx(expected[label], abs=0.01), label


# --------------------------------------------------------------------------------------------- accumulation
class OneWeight(LightningModule):
    """loss = w * c: the gradient of each micro-batch is c (divided by the accumulation count) exactly."""

    def __init__(self, cs: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.cs = cs
        self.grads: list[float] = []

    def training_step(self, batch, batch_idx):
        return (self.w * batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.tensor(self.cs)), batch_size=1)

    def on_before_optimizer_step(self, optimizer):
        # what the optimizer will apply (and clipping sees): the fp32 gradient of the master, where there is one
        stepped = list(self.trainer.precision_plugin.main_params(optimizer))[0]
        self.grads.append(float(stepped.grad.float().sum()))


def test_micro_batches_accumulate_in_fp32():
    # per micro-batch gradients 1, 2**-8, 2**-8, 2**-8 (the loss is divided by 4): in bf16, 1 + 2**-8 rounds to 1
    cs = [4.0, 2.0**-6, 2.0**-6, 2.0**-6]
    exact = 1 + 3 * 2.0**-8
    # (every kind of master weights sums micro-batches in fp32; plain half weights sum in half, as Lightning's
    # bf16-true)
    for kind, expected in [("fp32", exact), ("kahan", exact), ("stochastic", exact), ("none", 1.0)]:
        model = OneWeight(cs)
        make_trainer(MPPlugin("bf16-true", master_weights=kind), max_steps=1, accumulate_grad_batches=4).fit(model)
        assert model.grads == [expected], kind


def test_accumulation_that_starts_later_sums_in_fp32():
    """GradientAccumulationScheduler turns accumulation on during training: the micro-batches still sum in fp32."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    cs = [4.0, 2.0**-6, 2.0**-6, 2.0**-6]
    model = OneWeight(cs)
    schedule = GradientAccumulationScheduler(scheduling={0: 1, 1: 4})
    make_trainer(MPPlugin("bf16-true"), max_steps=-1, max_epochs=2, callbacks=[schedule]).fit(model)
    assert len(model.grads) == 5  # four single steps, then one step over the four micro-batches
    assert model.grads[-1] == 1 + 3 * 2.0**-8  # exact: a bf16 sum would round it to 1


# --------------------------------------------------------------------------------------------- skipping
class Snapshots(Callback):
    def __init__(self) -> None:
        self.before: list[dict] = []
        self.after: list[dict] = []

    @staticmethod
    def take(trainer, module) -> dict:
        masters = trainer.precision_plugin.masters
        return {
            "params": {k: v.detach().clone() for k, v in module.named_parameters()},
            "extra": [t.detach().clone() for t in masters.tensors()] if masters is not None else [],
            "opt_state": copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(self.take(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(self.take(trainer, pl_module))


def assert_same(a: dict, b: dict) -> None:
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    assert len(a["extra"]) == len(b["extra"]) and all(torch.equal(x, y) for x, y in zip(a["extra"], b["extra"]))
    assert_nested_equal(a["opt_state"], b["opt_state"])


@pytest.mark.parametrize("kind", ["fp32", "kahan", "stochastic"])
@pytest.mark.parametrize("optimizer", ["adam", "adamw_fused"])
def test_fp16_true_skipped_steps_leave_weights_masters_and_state_untouched(kind, optimizer):
    poisoned = (2, 5)
    snaps = Snapshots()
    trainer, plugin, model = fit(
        "fp16-true", kind, max_steps=7, model=HalfNet(optimizer=optimizer, poison_loss=poisoned), callbacks=[snaps]
    )
    for i in range(7):
        if i in poisoned:
            assert_same(snaps.before[i], snaps.after[i])
        else:
            assert not torch.equal(snaps.before[i]["params"]["net1.weight"], snaps.after[i]["params"]["net1.weight"])
    assert plugin.stats.skipped_steps == 2 and plugin.stats.loss_scale == 2.0**6
    assert int(trainer.optimizers[0].state_dict()["state"][0]["step"]) == 5


# --------------------------------------------------------------------------------------------- schedulers, clipping
@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_lr_scheduler_and_clipping_act_on_the_fp32_values_the_optimizer_steps(kind):
    seen = []

    class Watch(Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]

            def pre(optimizer, args, kwargs):
                params = [p for g in optimizer.param_groups for p in g["params"]]
                seen.append({
                    "lr": optimizer.param_groups[0]["lr"],
                    "before": [p.detach().clone() for p in params],
                    "grads": [p.grad.clone() for p in params],
                })

            def post(optimizer, args, kwargs):
                seen[-1]["after"] = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]

            opt.register_step_pre_hook(pre)
            opt.register_step_post_hook(post)

    clip = 0.01
    trainer, plugin, model = fit(
        "bf16-true", kind, max_steps=4, model=HalfNet(optimizer="sgd", lr=0.5, scheduler=True),
        callbacks=[Watch()], gradient_clip_val=clip,
    )
    assert [s["lr"] for s in seen] == [0.5, 0.25, 0.125, 0.0625]
    for s in seen:
        assert {g.dtype for g in s["grads"]} == {torch.float32}
        assert torch.nn.utils.get_total_norm(s["grads"]).item() == pytest.approx(clip, rel=1e-4)
        for before, grad, after in zip(s["before"], s["grads"], s["after"]):
            assert torch.equal(after, before.add(grad, alpha=-s["lr"]))  # SGD stepped the fp32 values
    assert plugin.stats.grad_norm > clip  # the unclipped norm was larger


def test_manual_optimization_clips_unscaled_fp32_gradients():
    clip = 0.01
    norms = []

    class Manual(HalfNet):
        def __init__(self) -> None:
            super().__init__(optimizer="sgd", lr=0.1)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in opt.param_groups[0]["params"]]).item())
            opt.step()

    trainer, plugin, model = fit("fp16-true", "kahan", max_steps=3, model=Manual())
    assert norms == pytest.approx([clip] * 3, rel=1e-3)
    assert plugin.stats.skipped_steps == 0 and plugin.stats.loss_scale == 2.0**8


# --------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(("mode", "kind"), [("bf16-true", "fp32"), ("bf16-true", "kahan"),
                                            ("bf16-true", "stochastic"), ("fp16-true", "fp32")])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, mode, kind):
    poison = (2, 9) if mode == "fp16-true" else ()
    torch.manual_seed(0)
    init = HalfNet().state_dict()

    def net():
        model = HalfNet(poison_loss=poison)
        model.load_state_dict(init)
        return model

    _, whole_plugin, whole = fit(mode, kind, 14, model=net())
    trainer, _, _ = fit(mode, kind, 6, model=net())
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    _, resumed_plugin, resumed = fit(mode, kind, 14, model=net(), ckpt_path=path)

    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_nested_equal(whole_plugin.state_dict(), resumed_plugin.state_dict())
    assert resumed_plugin.stats.as_dict() == whole_plugin.stats.as_dict()

    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["state_dict"]["net1.weight"].dtype == HALF[mode]  # the module's weights: training dtype
    # (bf16-true with masters: the plain LayerNorm is bf16 with masters too; fp16-true guards it in fp32)
    native_norm = mode == "bf16-true"
    assert checkpoint["state_dict"]["norm.weight"].dtype == (HALF[mode] if native_norm else torch.float32)
    saved = checkpoint["MPPlugin"]["master_weights"]
    assert saved["kind"] == kind
    if kind == "fp32":
        assert set(saved["masters"]) == {"net1.weight", "net1.bias", "net2.weight", "net2.bias"} | (
            {"norm.weight", "norm.bias"} if native_norm else set()
        )
        assert saved["masters"]["net1.weight"].dtype == torch.float32
    elif kind == "kahan":
        assert saved["compensation"]["net1.weight"].dtype == HALF[mode]
        assert saved["compensation"]["net1.weight"].abs().sum() > 0
    else:
        assert isinstance(saved["generators"]["cpu"], torch.Tensor)
    assert {t.dtype for t in checkpoint["optimizer_states"][0]["state"][0].values() if t.dim()} == {torch.float32}


@pytest.mark.parametrize(("mode", "kwargs"), [("fp16-true", {"init_scale": 2.0**8}), ("bf16-true",
                                                  {"fp32_modules": ["defaults"]}), ("bf16", {})])
def test_a_layernorm_with_masters_resumes_where_it_is_guarded(tmp_path, mode, kwargs):
    """``bf16-true``'s defaults give its LayerNorm bf16 weights with fp32 masters; a run that guards it in fp32
    (``fp16-true``, explicit guards, a mixed mode) resumes from such a checkpoint with the masters' exact values in
    the fp32 weights (the checkpoint's own LayerNorm weights are their rounding)."""
    trainer, plugin, model = fit("bf16-true", "fp32", 4)
    assert model.norm.weight.dtype is torch.bfloat16
    masters = {n: plugin.masters.master_of(p).detach().clone() for n, p in model.named_parameters()}
    path = tmp_path / "native_norm.ckpt"
    trainer.save_checkpoint(path)

    class Restored(Callback):
        def on_train_start(self, trainer, pl_module):
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    restored = Restored()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "resumes with precision=...", "dataloader is not resumable"
        make_trainer(MPPlugin(mode, **kwargs), max_steps=5, callbacks=[restored]).fit(HalfNet(), ckpt_path=path)
    for name in ("norm.weight", "norm.bias"):
        assert restored.params[name].dtype is torch.float32
        assert torch.equal(restored.params[name], masters[name]), name


def test_resume_in_another_mode_or_kind_keeps_the_fp32_values(tmp_path):
    trainer, plugin, model = fit("bf16-true", "fp32", 4)
    path = tmp_path / "masters.ckpt"
    trainer.save_checkpoint(path)
    masters = {
        n: plugin.masters.master_of(p).detach().clone()
        for n, p in model.named_parameters()
        if p.dtype != torch.float32
    }

    # bf16 mixed precision: the fp32 weights become the masters exactly (not the bf16-rounded weights)
    class Restored(Callback):
        def on_train_start(self, trainer, pl_module):  # after the checkpoint is restored, before the first step
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            masters = trainer.precision_plugin.masters
            self.masters = copy.deepcopy(masters.state_dict()) if masters is not None else None

    restored = Restored()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "resumes with precision='bf16'", "dataloader is not resumable"
        make_trainer(MPPlugin("bf16"), max_steps=5, callbacks=[restored]).fit(HalfNet(), ckpt_path=path)
    for name, value in masters.items():
        assert torch.equal(restored.params[name], value), name

    # fp32 masters -> kahan: the compensation holds master - bf16 weight (to bf16's precision)
    restored = Restored()
    with pytest.warns(UserWarning, match="master weights are 'fp32', training resumes with master_weights='kahan'"):
        make_trainer(MPPlugin("bf16-true", master_weights="kahan"), max_steps=5, callbacks=[restored]).fit(
            HalfNet(), ckpt_path=path
        )
    kahan_value = restored.params["net1.weight"].float() + restored.masters["compensation"]["net1.weight"].float()
    torch.testing.assert_close(kahan_value, masters["net1.weight"], rtol=2**-16, atol=0)
    assert not torch.equal(restored.params["net1.weight"].float(), masters["net1.weight"])

    # a bf16 mixed-precision checkpoint resumed in bf16-true: its fp32 weights become the masters
    trainer, _, mixed = fit("bf16", None, 4)
    trainer.save_checkpoint(path)
    restored = Restored()
    with pytest.warns(
        UserWarning, match="no master weights; master_weights='fp32' starts from the checkpoint's weights"
    ):
        make_trainer(MPPlugin("bf16-true"), max_steps=5, callbacks=[restored]).fit(HalfNet(), ckpt_path=path)
    assert restored.params["net1.weight"].dtype == torch.bfloat16
    assert torch.equal(restored.masters["masters"]["net1.weight"], mixed.net1.weight)


# --------------------------------------------------------------------------------------------- arguments, API
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "bf16-true", "master_weights": "fp64"},
         "master_weights='fp64' is invalid. Accepted values: 'fp32', 'kahan', 'stochastic', 'none', 'optimizer'"),
        ({"precision": "bf16-true", "master_weights": 3}, "master_weights=3 is invalid"),
        ({"precision": "bf16", "master_weights": "kahan"},
         "master_weights='kahan' applies to half-precision weights, but precision='bf16' keeps fp32 weights"),
        ({"precision": "auto", "master_weights": "fp32"}, "master_weights='fp32' applies to half-precision weights"),
        ({"precision": "16-mixed", "master_weights": "none"}, "precision='fp16' keeps fp32 weights"),
    ],
)
def test_bad_master_weights_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MPPlugin(**kwargs)


def test_lightning_alias_and_default_master_weights():
    assert MPPlugin("16-true").master_weights == "fp32"
    assert MPPlugin("bf16").master_weights is None
    assert parse_master_weights(" Kahan ") == "kahan"
    assert MPPlugin("bf16-true", master_weights=True).master_weights == "fp32"  # DESIGN.md's boolean form
    assert MPPlugin("bf16-true", master_weights=False).master_weights == "none"


def test_set_precision_refuses_to_leave_or_enter_true_half_during_training():
    class Switch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.precision_plugin.set_precision("bf16")

    with pytest.raises(ValueError, match="cannot switch from precision='bf16-true' to 'bf16' during training"):
        fit("bf16-true", None, 3, callbacks=[Switch()])

    class Enter(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.precision_plugin.set_precision("bf16-true")

    with pytest.raises(ValueError, match="cannot switch from precision='bf16' to 'bf16-true'"):
        make_trainer(MPPlugin("bf16"), max_steps=3, callbacks=[Enter()]).fit(HalfNet())


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_lbfgs_steps_the_masters(kind):
    """LBFGS evaluates its closure inside step(): it steps the fp32 stand-ins, the model evaluates at their values."""

    class WithLBFGS(HalfNet):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)

    model = WithLBFGS(n=8, batch_size=8)  # one batch, the same every step: the loss can only fall by the steps
    trainer, plugin, model = fit("bf16-true", kind, 6, model=model)
    assert plugin.stats.steps == 6 and plugin.stats.skipped_steps == 0
    # the first step too ran on the masters (no gradient existed before it): LBFGS's history is theirs, fp32
    history = trainer.optimizers[0].state_dict()["state"][0]
    assert kind != "fp32" or {t.dtype for t in (history["d"], history["prev_flat_grad"])} == {torch.float32}
    assert model.losses[-1] < 0.5 * model.losses[0]
    if kind == "fp32":
        for p in model.parameters():
            master = plugin.masters.master_of(p)
            assert master is None or torch.equal(master.to(p.dtype), p)


def test_yaml_sets_precision_master_weights_and_fp32_modules(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = {
        "trainer": {
            "accelerator": "cpu", "max_steps": 2, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False,
            "plugins": [{
                "class_path": "lightning_mp.MPPlugin",
                "init_args": {
                    "precision": "bf16-true", "master_weights": "kahan", "fp32_modules": ["defaults", "net2"]
                },
            }],
        },
    }
    path = tmp_path / "true.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(TinyRegressor, args=["fit", "--config", str(path)], save_config_callback=None)
    plugin = cli.trainer.precision_plugin
    assert cli.trainer.precision == "bf16-true" and plugin.master_weights == "kahan"
    # net2 ran in fp32 (its input upcast by its guard: the hidden activations stay bf16), and is bf16 after the run
    assert "net2" in plugin.fp32_guards.patterns
    assert cli.model.net1.weight.dtype == cli.model.net2.weight.dtype == torch.bfloat16
    assert set(cli.model.seen_dtypes) == {torch.bfloat16}


def test_plain_loop_without_a_trainer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    from lightning_mp.guards import apply_fp32_guards

    cast_module_(model, torch.bfloat16, keep_fp32=apply_fp32_guards(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    masters = attach_master_weights(opt, "fp32", module=model)
    assert isinstance(masters, FP32MasterWeights)
    assert attach_master_weights(opt, "none") is None
    start = masters.master_of(model[0].weight).detach().clone()
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(3):
        F.mse_loss(model(x.bfloat16()).float(), y.float()).backward()
        last = model[0].weight.grad.float()
        masters.step(opt)
        opt.zero_grad()
    master = masters.master_of(model[0].weight)
    assert not torch.equal(master, start) and torch.equal(master.to(torch.bfloat16), model[0].weight)
    assert model[0].weight.grad is None
    # a small model's masters keep their fp32 gradient buffer's views from step to step (what the last step applied)
    assert master.grad.dtype == torch.float32 and torch.equal(master.grad, last)
    assert sorted(masters.state_dict()["masters"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased_and_exact_on_representable_values(dtype):
    g = torch.Generator().manual_seed(0)
    ulp = 2.0**-7 if dtype is torch.bfloat16 else 2.0**-10
    x = torch.full((40000,), 1 + 0.3 * ulp)
    rounded = stochastic_round(x, dtype, g)
    assert set(rounded.float().unique().tolist()) == {1.0, 1 + ulp}
    assert rounded.float().mean().item() == pytest.approx(1 + 0.3 * ulp, abs=0.02 * ulp)
    negative = stochastic_round(-x, dtype, g)
    assert negative.float().mean().item() == pytest.approx(-(1 + 0.3 * ulp), abs=0.02 * ulp)
    exact = torch.tensor([0.0, 1.0, -2.5, 3.0e-5, 1024.0]).to(dtype).float()
    assert torch.equal(stochastic_round(exact, dtype, g), exact.to(dtype))


# --------------------------------------------------------------------------------------------- DDP
class DumpRanks(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        masters = trainer.precision_plugin.masters
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in pl_module.named_parameters()},
                "masters": masters.state_dict() if masters is not None else {},
            },
            f"{self.folder}/rank{trainer.global_rank}.pt",
        )


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize(("kind", "accumulate"), [("fp32", 2), ("stochastic", 1)])
def test_ddp_replicas_stay_identical(tmp_path, kind, accumulate):
    from lightning.pytorch import Trainer

    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=4, accumulate_grad_batches=accumulate,
        plugins=[MPPlugin("bf16-true", master_weights=kind)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[DumpRanks(str(tmp_path))],
    )
    trainer.fit(HalfNet(optimizer="adam"))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert_nested_equal(r0, r1)  # same weights, same masters / generator state on both ranks
    assert r0["params"]["net1.weight"].dtype == torch.bfloat16 and torch.isfinite(r0["params"]["net1.weight"]).all()
    if kind == "fp32":
        assert torch.equal(r0["masters"]["masters"]["net1.weight"].to(torch.bfloat16), r0["params"]["net1.weight"])


def test_fp32_masters_start_from_the_exact_fp32_weights():
    """The true-half cast keeps the fp32 tensors it replaces; they become the masters (not the bf16 rounding)."""
    model = TinyRegressor(optimizer="adam")
    original = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in original.values())  # not bf16-representable

    class AtStart(Callback):
        def on_train_start(self, trainer, pl_module):
            plugin = trainer.precision_plugin
            self.half = {k: v.dtype for k, v in pl_module.named_parameters()}
            self.masters = {
                k: v.clone()
                for k, v in fp32_values(plugin.masters.state_dict(), dict(pl_module.named_parameters())).items()
            }

    probe = AtStart()
    plugin = MPPlugin("bf16-true", fp32_modules=[])
    make_trainer(plugin, max_steps=1, callbacks=[probe]).fit(model)
    assert set(probe.half.values()) == {torch.bfloat16}
    for name, value in original.items():
        assert torch.equal(probe.masters[name], value), name
    assert all(fp32_original(p) is None for p in model.parameters())  # nothing kept alive once the masters exist


def test_fp16_weights_without_masters_warn_about_adam_eps(recwarn):
    """Adam's default eps=1e-8 is 0 in fp16: fp16-true with master_weights='none' says so before training."""
    with pytest.warns(UserWarning, match="eps=1e-08 is 0 in the fp16 optimizer state.*master_weights='fp32'"):
        make_trainer(MPPlugin("fp16-true", master_weights="none"), max_steps=1).fit(TinyRegressor(optimizer="adam"))

    class LargeEps(TinyRegressor):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3, eps=1e-4)

    recwarn.clear()
    make_trainer(MPPlugin("fp16-true", master_weights="none"), max_steps=1).fit(LargeEps())
    assert not [w for w in recwarn if "eps=" in str(w.message)]
    make_trainer(MPPlugin("fp16-true"), max_steps=1).fit(TinyRegressor(optimizer="adam"))  # fp32 masters: fine
    assert not [w for w in recwarn if "eps=" in str(w.message)]
