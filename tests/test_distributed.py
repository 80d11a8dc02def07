"""DDP on the CPU (gloo, 2 processes): every rank takes the same skip decision."""

import copy
import math

import pytest
import torch
from conftest import TinyRegressor, make_trainer
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
                "losses": list(pl_module.losses),
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


def _ddp_trainer(plugin, folder, max_steps=6):
    return make_trainer(plugin, max_steps, [Dump(folder)], devices=2, strategy="ddp_fork")


def test_reduce_dtype_fp16_compresses_ddp_gradients(tmp_path):
    """reduce_dtype registers torch's compression hook: ranks stay identical, training still learns."""
    model = TinyRegressor(optimizer="adam")
    reference = copy.deepcopy(model)
    plugin = MPPlugin("bf16", reduce_dtype="fp16")
    (tmp_path / "fp16").mkdir()
    (tmp_path / "fp32").mkdir()
    _ddp_trainer(plugin, str(tmp_path / "fp16")).fit(model)
    _ddp_trainer(MPPlugin("bf16"), str(tmp_path / "fp32")).fit(reference)
    r0 = torch.load(tmp_path / "fp16" / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "fp16" / "rank1.pt", weights_only=True)
    full = torch.load(tmp_path / "fp32" / "rank0.pt", weights_only=True)
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), f"{name} differs across ranks"
        torch.testing.assert_close(r0["params"][name], full["params"][name], rtol=0, atol=2e-3)
    # the hook really ran: fp16-rounded gradients moved the weights slightly differently
    assert any(not torch.equal(r0["params"][n], full["params"][n]) for n in r0["params"])
    assert r0["stats"]["steps"] == 6 and r0["stats"]["skipped_steps"] == 0


def test_reduce_dtype_bf16_on_gloo_is_refused_before_training(tmp_path):
    model = TinyRegressor(optimizer="adam")
    with pytest.raises(Exception, match="reduce_dtype='bf16'.*needs\\s+CUDA and NCCL"):
        _ddp_trainer(MPPlugin("bf16", reduce_dtype="bf16"), str(tmp_path)).fit(model)
    assert not (tmp_path / "rank0.pt").exists()


def test_reduce_dtype_without_ddp_warns(tmp_path):
    with pytest.warns(UserWarning, match="reduce_dtype='fp16' is set, but the model is not wrapped"):
        make_trainer(MPPlugin("bf16", reduce_dtype="fp16"), max_steps=1).fit(TinyRegressor())


class AccumulationLog(Callback):
    """Under DDP with fp32 masters and accumulation: what the masters hold at the step, against its definition."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.local: dict = {}
        self.last: dict = {}
        self.checks: list = []

    def on_train_start(self, trainer, pl_module):
        self.own: dict = {}  # each micro-batch's own half gradients (on_after_backward shows the window's sum)
        for n, p in pl_module.named_parameters():
            p.register_hook(lambda g, n=n: self.own.__setitem__(n, g.detach().clone()))

    def on_after_backward(self, trainer, pl_module):
        synced = trainer.strategy.model.require_backward_grad_sync
        own, self.own = self.own, {}
        if synced:  # DDP averages this micro-batch's half gradients (in bf16: halved, then summed)
            for g in own.values():
                g.div_(trainer.world_size)
                torch.distributed.all_reduce(g)
            self.last = {n: g.float() for n, g in own.items()}
        else:
            for n, g in own.items():
                self.local[n] = self.local[n] + g.float() if n in self.local else g.float()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        masters = trainer.precision_plugin.masters
        for n, p in pl_module.named_parameters():
            local = self.local.get(n, torch.zeros_like(p, dtype=torch.float32))
            torch.distributed.all_reduce(local)
            expected = local / trainer.world_size + self.last[n]
            got = masters.master_of(p).grad
            self.checks.append(float((got - expected).abs().max() / expected.abs().max()))
        self.local, self.last = {}, {}

    def on_train_end(self, trainer, pl_module):
        torch.save({"checks": self.checks}, f"{self.folder}/acc{trainer.global_rank}.pt")


def test_fp32_masters_accumulate_in_fp32_under_ddp(tmp_path):
    """Micro-batches inside DDP's no_sync are summed in fp32 and reduced in fp32, not summed in half precision."""
    model = TinyRegressor(optimizer="adam", n=2 * 4 * 8 * 3)
    log = AccumulationLog(str(tmp_path))
    trainer = make_trainer(
        MPPlugin("bf16-true"), 3, [Dump(str(tmp_path)), log], devices=2, strategy="ddp_fork", accumulate_grad_batches=4
    )
    trainer.fit(model)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name])
    for rank in (0, 1):
        checks = torch.load(tmp_path / f"acc{rank}.pt", weights_only=True)["checks"]
        assert len(checks) == 3 * 4  # 3 steps x 4 parameters
        assert max(checks) < 1e-6, checks  # fp32 arithmetic; sums in bf16 would be off by ~1e-3


class RankInit(TinyRegressor):
    """Weights initialised differently on each rank (as without a common seed): DDP broadcasts rank 0's."""

    def configure_model(self):
        torch.manual_seed(1000 + self.global_rank)
        with torch.no_grad():
            self.net1.weight.normal_()


class MasterDump(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        from lightning_mp.master import fp32_values

        masters = fp32_values(trainer.precision_plugin.masters.state_dict(), dict(pl_module.named_parameters()))
        torch.save({k: v.clone() for k, v in masters.items()}, f"{self.folder}/masters{trainer.global_rank}.pt")


def test_fp32_masters_agree_across_ranks_when_ranks_initialised_differently(tmp_path):
    """The masters start from each rank's fp32 weights only where they match what DDP broadcast; rank 0's win."""
    trainer = make_trainer(
        MPPlugin("bf16-true"), 4, [Dump(str(tmp_path)), MasterDump(str(tmp_path))], devices=2, strategy="ddp_fork"
    )
    trainer.fit(RankInit(optimizer="adam"))
    m0 = torch.load(tmp_path / "masters0.pt", weights_only=True)
    m1 = torch.load(tmp_path / "masters1.pt", weights_only=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for name in m0:
        assert torch.equal(m0[name], m1[name]), name
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name


def test_deepspeed_is_refused_with_the_way_out():
    """DeepSpeed scales the loss itself: MPPlugin says so at set-up instead of failing somewhere inside it."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    model = TinyRegressor()
    strategy = object.__new__(DeepSpeedStrategy)  # the class itself needs deepspeed installed to be built
    model._trainer = SimpleNamespace(strategy=strategy)
    with pytest.raises(Exception, match="MPPlugin does not drive DeepSpeed.*precision='bf16-mixed'"):
        MPPlugin("bf16").convert_module(model)


class MomentsDump(Callback):
    """Each rank's parameters and Adam moments at the end of fit, before the plugin's teardown."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        state = trainer.optimizers[0].state
        torch.save({"params": {k: v.detach().clone() for k, v in pl_module.named_parameters()},
                    "moments": [{k: s[k].clone() for k in ("exp_avg", "exp_avg_sq", "step")} for s in state.values()],
                    "losses": list(pl_module.losses)}, f"{self.folder}/rank{trainer.global_rank}.pt")  # fmt: skip


@pytest.mark.parametrize("mode", ["bf16", "bf16-true"])
def test_bf16_moments_stay_equal_across_ranks(tmp_path, mode):
    """optimizer_states='bf16' under DDP: every rank rounds its moments with the same noise, so the replicas stay
    equal, also past a step skipped for an inf on one rank."""
    model = OneRankPoison(optimizer="adam", poison_grad=(2,))
    plugin = MPPlugin(mode, optimizer_states="bf16")
    make_trainer(plugin, 6, [MomentsDump(str(tmp_path))], devices=2, strategy="ddp_fork").fit(model)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
    for ours, theirs in zip(ranks[0]["moments"], ranks[1]["moments"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours[key].dtype == torch.bfloat16 and torch.equal(ours[key], theirs[key]), key
        assert int(ours["step"]) == int(theirs["step"]) == 5  # six batches, one skipped
