"""MPPlugin under Lightning's FSDP strategy.

Lightning refuses ``strategy="fsdp"`` on the CPU by a type check on the strategy object only; torch's FSDP itself
runs on the CPU with gloo. ``CPUFSDPStrategy`` (a subclass, launched by fork like ``ddp_fork``) therefore runs the
real FSDP wrapping, sharded gradients, ``ShardedGradScaler`` and FSDP's ``clip_grad_norm_`` in CI. The same
behaviour on two GPUs is run by ``tests/gpu/test_distributed_gpu.py`` and ``benchmarks/bench_distributed.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import CPUFSDPStrategy, TinyRegressor, make_trainer
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_mp import MPPlugin
from lightning_mp.master import fp32_original, fp32_values
from lightning_mp.scaling import DynamicLossScaler, ShardedDynamicLossScaler

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


class FSDPRegressor(TinyRegressor):
    """TinyRegressor whose optimizer takes the FSDP-wrapped parameters; poisons one rank's gradient shard."""

    def __init__(self, poison_rank: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.poison_rank = poison_rank

    def configure_optimizers(self):
        # fused: the optimizer skips on the device from the scaler's found_inf (torch's fused Adam runs on the CPU)
        opt = torch.optim.Adam(self.trainer.model.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _poison_grads(self) -> None:
        if self.global_rank != self.poison_rank or self.batch_index not in self.poison_grad:
            return
        for p in self.trainer.model.parameters():  # the rank's flat shard
            if p.grad is not None and p.grad.numel():
                p.grad.view(-1)[0] = self.poison_value
                return


class Dump(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        plugin = trainer.precision_plugin
        with FullyShardedDataParallel.summon_full_params(trainer.model):
            # names without the wrappers' prefix: a run may wrap more submodules than another
            params = {
                k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in pl_module.named_parameters()
            }
        torch.save(
            {
                "params": params,
                "stats": plugin.stats.as_dict(),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "adam_step": int(next(iter(trainer.optimizers[0].state.values()), {"step": -1})["step"]),
                "scaler": type(plugin.scaler).__name__ if plugin.scaler is not None else None,
                "wrapped": isinstance(trainer.model, FullyShardedDataParallel),
                "losses": list(pl_module.losses),
                "seen": dict(getattr(pl_module, "seen", {})),
            },
            f"{self.folder}/rank{trainer.global_rank}.pt",
        )


def fsdp_trainer(plugin, folder, max_steps=6, callbacks_extra=(), strategy_kwargs=None, **kwargs):
    strategy = CPUFSDPStrategy(**(strategy_kwargs or {}))
    return make_trainer(plugin, max_steps, [Dump(folder), *callbacks_extra], devices=2, strategy=strategy, **kwargs)


def load(folder):
    return [torch.load(f"{folder}/rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.parametrize(
    ("mode", "value", "clip"),
    [("fp16", math.inf, None), ("bf16", math.nan, None), ("fp16", math.nan, 1.0), ("bf16", math.inf, 1.0)],
)
def test_fsdp_inf_on_one_rank_is_skipped_by_every_rank(tmp_path, mode, value, clip):
    model = FSDPRegressor(poison_grad=(2, 3), poison_value=value)
    trainer = fsdp_trainer(MPPlugin(mode, init_scale=2.0**8), str(tmp_path), gradient_clip_val=clip)
    trainer.fit(model)
    r0, r1 = load(tmp_path)
    assert r0["wrapped"]
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), f"{name} differs across ranks"
        assert torch.isfinite(r0["params"][name]).all()
    assert r0["stats"] == r1["stats"]
    assert (r0["stats"]["steps"], r0["stats"]["skipped_steps"]) == (6, 2)
    assert r0["adam_step"] == r1["adam_step"] == 4
    assert r0["lr"] == pytest.approx(1e-2 * 0.9**4)  # the step scheduler was held on both skipped steps
    if clip is not None:
        # FSDP's clip_grad_norm_ over every shard: one norm, the same on both ranks (local shard norms differ)
        assert r0["stats"]["grad_norm"] is not None and math.isfinite(r0["stats"]["grad_norm"])
    if mode == "fp16":
        assert r0["scaler"] == "ShardedDynamicLossScaler"
        assert r0["stats"]["loss_scale"] == 2.0**6


def test_fsdp_matches_single_process_training(tmp_path):
    """Same data on both ranks: FSDP's sharded step equals the unsharded step on one process."""
    model = FSDPRegressor(poison_rank=-1)
    reference = copy.deepcopy(model)
    fsdp_trainer(MPPlugin("bf16", fp32_modules=[]), str(tmp_path), use_distributed_sampler=False).fit(model)
    r0, _ = load(tmp_path)

    class Single(TinyRegressor):
        def configure_optimizers(self):
            return FSDPRegressor.configure_optimizers(self)

    single = Single()
    single.load_state_dict(reference.state_dict())
    Trainer(
        accelerator="cpu", plugins=[MPPlugin("bf16", fp32_modules=[])], max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(single)
    for name, value in single.named_parameters():
        torch.testing.assert_close(r0["params"][name], value.detach(), rtol=1e-4, atol=1e-5)
    assert r0["losses"] == pytest.approx(single.losses, rel=1e-4)


@pytest.mark.parametrize(("mode", "kwargs"), [("bf16-true", {"master_weights": "kahan"})])
def test_fsdp_refuses_what_it_cannot_shard_before_training(tmp_path, mode, kwargs):
    # raised in each worker during set-up (the fork launcher re-raises it here with the worker's traceback)
    with pytest.raises(Exception, match=f"precision='{mode}'.*does not run under FSDP"):
        fsdp_trainer(MPPlugin(mode, **kwargs), str(tmp_path)).fit(FSDPRegressor())
    assert not (tmp_path / "rank0.pt").exists()


def test_fsdp_strategy_accepts_the_plugin_and_its_policy():
    strategy = FSDPStrategy()
    strategy.precision_plugin = MPPlugin("bf16")  # Lightning's type check: only FSDPPrecision plugins pass
    config = strategy.mixed_precision_config
    assert config.param_dtype is None and config.buffer_dtype is None  # fp32 shards; autocast computes in bf16
    assert config.reduce_dtype is None  # gradients reduced in fp32
    assert MPPlugin("bf16", reduce_dtype="bf16").mixed_precision_config.reduce_dtype is torch.bfloat16
    assert MPPlugin("fp16", reduce_dtype="fp32").mixed_precision_config.reduce_dtype is None


def test_plugin_keeps_its_own_semantics_outside_fsdp():
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    plugin = MPPlugin("bf16")
    assert _plugin_to_compute_dtype(plugin) is torch.bfloat16
    assert plugin.scaler is None and plugin.skips_nonfinite  # bf16 scales no loss (as Lightning's); steps are checked
    fp16 = MPPlugin("fp16")
    assert isinstance(fp16.scaler, DynamicLossScaler) and not isinstance(fp16.scaler, ShardedDynamicLossScaler)
    with plugin.tensor_init_context(), plugin.module_init_context():
        assert torch.get_default_dtype() is torch.float32  # not FSDPPrecision's dtype context
    out = torch.ones(2, dtype=torch.bfloat16)
    assert plugin.convert_output(out) is out


class Saver(Callback):
    """Saves a full checkpoint through the strategy at the end of step ``at`` (what ModelCheckpoint does)."""

    def __init__(self, path: str, at: int) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)


def test_fsdp_checkpoint_carries_scaler_state_and_resumes(tmp_path):
    """fp16 under FSDP: the scale after a backoff and the counters are saved and restored on resume.

    Sharded checkpoints (torch.distributed.checkpoint; the plugin's entry goes to ``meta.pt``): torch's full-state
    gather with CPU offload crashes on CPU-only FSDP, so the CPU harness cannot write ``state_dict_type="full"``.
    """
    ckpt = str(tmp_path / "step4.ckpt")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sharded = {"state_dict_type": "sharded"}
    model = FSDPRegressor(poison_grad=(2,), poison_value=math.inf)
    fsdp_trainer(
        MPPlugin("fp16", init_scale=2.0**8),
        str(tmp_path / "a"),
        callbacks_extra=[Saver(ckpt, 4)],
        strategy_kwargs=sharded,
    ).fit(model)
    saved = torch.load(f"{ckpt}/meta.pt", weights_only=True)
    entry = saved["MPPlugin"]
    assert entry["mode"] == "fp16"
    assert float(entry["scaler"]["scale"]) == 2.0**7
    resumed = FSDPRegressor(poison_rank=-1)
    fsdp_trainer(MPPlugin("fp16", init_scale=2.0**8), str(tmp_path / "b"), strategy_kwargs=sharded).fit(
        resumed, ckpt_path=ckpt
    )
    r0, r1 = load(tmp_path / "b")
    assert r0["stats"] == r1["stats"]
    assert r0["stats"]["loss_scale"] == 2.0**7  # not init_scale: the backoff survived the resume
    assert (r0["stats"]["steps"], r0["stats"]["skipped_steps"]) == (6, 1)


class NormRegressor(FSDPRegressor):
    """net1 -> LayerNorm (an FP32-guarded class) -> net2; records the weight dtypes each layer computes with."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.norm = torch.nn.LayerNorm(32)
        self.seen: dict[str, str] = {}
        for name in ("net1", "norm", "net2"):
            getattr(self, name).register_forward_pre_hook(self._record(name))

    def _record(self, name):
        def hook(module, args):
            self.seen[name] = str(module.weight.dtype)

        return hook

    def forward(self, x):
        return self.net2(self.norm(torch.relu(self.net1(x))))


def test_fsdp_param_dtype_gathers_half_weights_and_keeps_guards_fp32(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "full").mkdir()
    wrap = {"auto_wrap_policy": {torch.nn.Linear}}
    model = NormRegressor(poison_grad=(2,), poison_value=math.nan)
    reference = NormRegressor(poison_grad=(2,), poison_value=math.nan)  # not a deepcopy: its hooks would record here
    reference.load_state_dict(model.state_dict())
    plugin = MPPlugin("bf16", fsdp_param_dtype="bf16")
    fsdp_trainer(plugin, str(tmp_path / "half"), strategy_kwargs=wrap, use_distributed_sampler=False).fit(model)
    fsdp_trainer(
        MPPlugin("bf16"), str(tmp_path / "full"), strategy_kwargs=wrap, use_distributed_sampler=False
    ).fit(reference)
    half, half1 = load(tmp_path / "half")
    full, _ = load(tmp_path / "full")
    assert half["seen"] == {"net1": "torch.bfloat16", "norm": "torch.float32", "net2": "torch.bfloat16"}
    assert full["seen"] == {"net1": "torch.float32", "norm": "torch.float32", "net2": "torch.float32"}
    assert (half["stats"]["steps"], half["stats"]["skipped_steps"]) == (6, 1) and half["stats"] == half1["stats"]
    for name, value in full["params"].items():
        assert half["params"][name].dtype is torch.float32  # the shards (and the optimizer) stay fp32
        assert torch.equal(half["params"][name], half1["params"][name])
        torch.testing.assert_close(half["params"][name], value, rtol=0, atol=2e-2)
    assert half["losses"] == pytest.approx(full["losses"], rel=2e-2)


def test_fsdp_param_dtype_with_guards_needs_a_wrap_policy(tmp_path):
    with pytest.raises(Exception, match="fsdp_param_dtype='bf16'.*needs an auto_wrap_policy.*fp32_modules=\\[\\]"):
        fsdp_trainer(MPPlugin("bf16", fsdp_param_dtype="bf16"), str(tmp_path)).fit(NormRegressor())
    assert not (tmp_path / "rank0.pt").exists()


@pytest.mark.parametrize(
    ("mode", "value", "guards"),
    [("bf16-true", math.nan, ["defaults"]), ("bf16-true", math.nan, None), ("fp16-true", math.inf, None)],
    ids=["bf16-true-guarded-norm", "bf16-true-defaults", "fp16-true"],
)
def test_fsdp_true_half_uses_the_shards_as_master_weights(tmp_path, mode, value, guards):
    """bf16-true/fp16-true under FSDP: half weights computed with, fp32 shards stepped, guards in fp32, and the
    same training as one process with fp32 master weights. bf16-true's defaults run the plain LayerNorm in bf16:
    the same training up to the bf16 rounding of its gradients (FSDP's views of the flat parameter and one process's
    own tensors may sum a LayerNorm's weight gradient in another order); guarded, the same to fp32 rounding."""
    wrap = {"auto_wrap_policy": {torch.nn.Linear}}
    model = NormRegressor(poison_grad=(2,), poison_value=value)
    single = NormRegressor(poison_grad=(2,), poison_value=value)
    single.load_state_dict(model.state_dict())

    def plugin():
        return MPPlugin(mode, init_scale=2.0**8) if mode == "fp16-true" else MPPlugin(mode, fp32_modules=guards)

    fsdp_trainer(plugin(), str(tmp_path), strategy_kwargs=wrap, use_distributed_sampler=False).fit(model)
    r0, r1 = load(tmp_path)
    half = "torch.bfloat16" if mode == "bf16-true" else "torch.float16"
    native_norm = mode == "bf16-true" and guards is None
    assert r0["seen"] == {"net1": half, "norm": half if native_norm else "torch.float32", "net2": half}
    assert r0["stats"] == r1["stats"] and (r0["stats"]["steps"], r0["stats"]["skipped_steps"]) == (6, 1)
    if mode == "fp16-true":
        assert r0["scaler"] == "ShardedDynamicLossScaler" and r0["stats"]["loss_scale"] == 2.0**7

    class Single(NormRegressor):
        def configure_optimizers(self):
            return FSDPRegressor.configure_optimizers(self)

    one = Single(poison_grad=(2,), poison_value=value, poison_rank=0)  # the only rank of one process
    one.load_state_dict(single.state_dict())
    reference = plugin()
    make_trainer(reference, 6).fit(one)
    assert reference.master_weights == "fp32" and reference.masters is not None
    masters = fp32_values(reference.masters.state_dict(), dict(one.named_parameters()))
    tol = 1e-3 if native_norm else 1e-6
    for name, shard in r0["params"].items():
        assert shard.dtype is torch.float32  # the shards: fp32 master weights
        assert torch.equal(shard, r1["params"][name])
        param = dict(one.named_parameters())[name]
        # guarded: fp32 params in the run, half after it (as Lightning leaves the module), their fp32 values kept
        kept = fp32_original(param)
        expected = masters.get(name, kept if kept is not None else param.detach())
        torch.testing.assert_close(shard, expected.float(), rtol=tol, atol=tol)
    assert r0["losses"] == pytest.approx(one.losses, rel=1e-4 if native_norm else 1e-6)  # the same fp32 start


def test_fsdp_true_half_with_guards_needs_a_wrap_policy(tmp_path):
    with pytest.raises(
        Exception, match="precision='bf16-true'.*keeps the FP32-guarded modules.*needs an auto_wrap_policy"
    ):
        fsdp_trainer(MPPlugin("bf16-true", fp32_modules=["defaults"]), str(tmp_path)).fit(NormRegressor())
    assert not (tmp_path / "rank0.pt").exists()


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_fsdp_gradient_accumulation_matches_one_process(tmp_path, mode):
    """Gradient accumulation under FSDP: the poisoned step is skipped on every rank and training equals one
    process's (same data on both ranks).

    (Manual optimization is not covered: torch's FSDP asserts when backward runs inside the root module's forward,
    which is where Lightning's FSDP strategy runs ``training_step``, whatever the precision plugin.)
    """
    accumulate = 2
    kwargs = dict(poison_grad=(3,), poison_value=math.inf)
    wrap = {"auto_wrap_policy": {torch.nn.Linear}} if mode.endswith("-true") else None
    model = NormRegressor(**kwargs) if wrap else FSDPRegressor(**kwargs)
    initial = copy.deepcopy(model.state_dict())
    plugin = MPPlugin(mode, init_scale=2.0**8)
    fsdp_trainer(
        plugin, str(tmp_path), strategy_kwargs=wrap, use_distributed_sampler=False, accumulate_grad_batches=accumulate
    ).fit(model)
    r0, r1 = load(tmp_path)
    assert r0["stats"] == r1["stats"] and (r0["stats"]["steps"], r0["stats"]["skipped_steps"]) == (6, 1)
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name])
    if mode == "fp16":
        assert r0["stats"]["loss_scale"] == 2.0**7

    base = NormRegressor if wrap else FSDPRegressor

    class Single(base):
        def configure_optimizers(self):
            return FSDPRegressor.configure_optimizers(self)

    one = Single(poison_rank=0, **kwargs)
    one.load_state_dict(initial)
    single_plugin = MPPlugin(mode, init_scale=2.0**8)
    make_trainer(single_plugin, 6, accumulate_grad_batches=accumulate).fit(one)
    assert single_plugin.stats.as_dict()["skipped_steps"] == 1
    # bf16-true: the fp32 sums of two micro-batches differ by an ulp between FSDP's shard accumulation and the
    # masters' (measured 1.5e-8 after the first step); a bf16 weight that rounds the other way shows in the loss
    assert r0["losses"] == pytest.approx(one.losses, rel=5e-3 if mode == "bf16-true" else 1e-4)
    values = dict(one.named_parameters())
    if single_plugin.masters is not None:
        values.update(fp32_values(single_plugin.masters.state_dict(), values))
    atol = 5e-4 if mode == "bf16-true" else 1e-5  # (bf16-true: 5 % of one Adam step of lr 1e-2, see above)
    for name, shard in r0["params"].items():
        torch.testing.assert_close(shard, values[name].detach().float(), rtol=1e-4, atol=atol)



def test_fsdp_reduce_dtype_fp16_reduces_in_half(tmp_path):
    """reduce_dtype='fp16' under FSDP: gradients are reduce-scattered in fp16; training still matches fp32 closely."""
    (tmp_path / "half").mkdir()
    (tmp_path / "full").mkdir()
    model = FSDPRegressor(poison_rank=-1)
    initial = copy.deepcopy(model.state_dict())
    # fp32 compute: under bf16 autocast the gradients are bf16 values, which fp16 holds exactly
    fsdp_trainer(
        MPPlugin("fp32", reduce_dtype="fp16"), str(tmp_path / "half"), use_distributed_sampler=False
    ).fit(model)
    reference = FSDPRegressor(poison_rank=-1)
    reference.load_state_dict(initial)
    fsdp_trainer(MPPlugin("fp32"), str(tmp_path / "full"), use_distributed_sampler=False).fit(reference)
    half, _ = load(tmp_path / "half")
    full, _ = load(tmp_path / "full")
    for name, value in full["params"].items():
        torch.testing.assert_close(half["params"][name], value, rtol=0, atol=2e-3)
    assert any(not torch.equal(half["params"][n], full["params"][n]) for n in full["params"])  # it did reduce in fp16


def test_fsdp_half_gathers_refuse_a_guard_by_name_on_a_shared_class(tmp_path):
    """FSDP can keep modules in fp32 only by class: guarding one Linear by name would take every Linear's half
    compute away, so it is refused before training with the ways out."""
    wrap = {"auto_wrap_policy": {torch.nn.Linear}}
    plugin = MPPlugin("bf16", fsdp_param_dtype="bf16", fp32_modules=["defaults", "net2"])
    with pytest.raises(Exception, match="guarded 'net2' shares its class with the unguarded 'net1' \\(Linear\\)"):
        fsdp_trainer(plugin, str(tmp_path), strategy_kwargs=wrap).fit(NormRegressor())
    assert not (tmp_path / "rank0.pt").exists()


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_fsdp_use_orig_params_with_empty_shards(tmp_path, mode):
    """use_orig_params=True: the optimizer holds each original parameter's slice of the shard, some of them empty
    on a rank (net2.bias has one element); the check skips those and the ranks still agree."""
    model = FSDPRegressor(poison_grad=(2,), poison_value=math.inf)
    fsdp_trainer(MPPlugin(mode, init_scale=2.0**8), str(tmp_path), strategy_kwargs={"use_orig_params": True}).fit(model)
    r0, r1 = load(tmp_path)
    assert r0["stats"] == r1["stats"] and (r0["stats"]["steps"], r0["stats"]["skipped_steps"]) == (6, 1)
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name])


# ------------------------------------------------------------------------------------ bf16 optimizer state
class ShardMoments(Callback):
    """Each rank's Adam moments after every batch (its shards), to compare a skipped step's before and after."""

    def __init__(self, folder: str) -> None:
        self.folder, self.after = folder, []

    def on_train_batch_end(self, trainer, *args):
        self.after.append([{k: _local(v).clone() for k, v in s.items()} for s in trainer.optimizers[0].state.values()])

    def on_train_end(self, trainer, pl_module):
        torch.save(self.after, f"{self.folder}/moments{trainer.global_rank}.pt")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def test_fsdp_shards_hold_bf16_moments_and_a_device_skip_changes_nothing(tmp_path):
    """FSDP's flat shards with optimizer_states='bf16': each rank's moment shards are bf16; fp16's skip reaches the
    fused Adam as found_inf (a skip on the device): the shards' moments and step counts stay bit-identical."""
    model = FSDPRegressor(poison_grad=(2,))
    moments = ShardMoments(str(tmp_path))
    fsdp_trainer(MPPlugin("fp16", init_scale=2.0**8, optimizer_states="bf16"), str(tmp_path),
                 callbacks_extra=[moments]).fit(model)  # fmt: skip
    r0, r1 = load(tmp_path)
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    assert (r0["stats"]["skipped_steps"], r0["adam_step"]) == (1, 5)
    for rank in (0, 1):
        after = torch.load(tmp_path / f"moments{rank}.pt", weights_only=True)
        assert {v.dtype for s in after[-1] for k, v in s.items() if k.startswith("exp_avg")} == {torch.bfloat16}
        for before, skipped in zip(after[1], after[2]):
            for key in before:
                assert torch.equal(before[key], skipped[key]), key


class FSDP2Regressor(TinyRegressor):
    """TinyRegressor sharded with FSDP2 (``fully_shard`` in ``configure_model``): DTensor parameters and moments."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net1, self.net2):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class DTensorMoments(Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        state = list(trainer.optimizers[0].state.values())
        torch.save({"kinds": sorted({type(s["exp_avg"]).__name__ for s in state}),
                    "local": sorted({str(_local(s[k]).dtype) for s in state for k in ("exp_avg", "exp_avg_sq")}),
                    "losses": list(pl_module.losses)}, f"{self.folder}/rank{trainer.global_rank}.pt")  # fmt: skip


@pytest.mark.slow
def test_fsdp2_dtensor_moments_are_held_in_bf16(tmp_path):
    from conftest import ForkModelParallel

    strategy = ForkModelParallel(data_parallel_size=2, tensor_parallel_size=1)
    make_trainer(MPPlugin("bf16", optimizer_states="bf16"), 6, [DTensorMoments(str(tmp_path))], devices=2,
                 strategy=strategy).fit(FSDP2Regressor())  # fmt: skip
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert seen["kinds"] == ["DTensor"] and seen["local"] == ["torch.bfloat16"]
        assert all(math.isfinite(loss) for loss in seen["losses"])
