"""FP8 under FSDP and FSDP2: what runs without Transformer Engine (refusals, ``prepare_fp8``, state names, the
saturation verdict agreeing across ranks). Training in FP8 under FSDP/FSDP2 for real is in
``tests/gpu/test_fp8_sharded_gpu.py`` (two GPUs, Transformer Engine)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from test_fsdp import FSDPRegressor, fsdp_trainer, load
from test_model_parallel import Sharded, trainer_for
from torch import nn

from lightning_mp import MPPlugin, prepare_fp8
from lightning_mp.fp8.runtime import fp8_scaling_state, load_fp8_scaling_state, named_modules_unwrapped

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


# ------------------------------------------------------------------------------------------- set-up and refusals
def test_fp8_under_fsdp_is_no_longer_refused_for_the_strategy(tmp_path):
    # on the CPU the device is what refuses it, before training, with the usual advice
    with pytest.raises(Exception, match="precision='fp8' needs an NVIDIA GPU") as info:
        fsdp_trainer(MPPlugin("fp8"), str(tmp_path)).fit(FSDPRegressor())
    assert "does not run under FSDP" not in str(info.value)
    assert not (tmp_path / "rank0.pt").exists()


def test_fp8_under_fsdp2_without_prepare_fp8_says_how(tmp_path):
    with pytest.raises(Exception, match=r"sharded .*fully_shard.* Call lightning_mp.prepare_fp8\(self\)"):
        trainer_for(MPPlugin("fp8"), str(tmp_path)).fit(Sharded())


class HandWrapped(FSDPRegressor):
    """FSDP units wrapped by hand in configure_model (Lightning's FSDP strategy then wraps nothing more)."""

    def configure_model(self):
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not isinstance(self.net1, FullyShardedDataParallel):
            self.net1 = FullyShardedDataParallel(self.net1, device_id=torch.device("cpu"))


def test_fp8_under_fsdp_with_units_wrapped_in_configure_model_says_how(tmp_path):
    with pytest.raises(Exception, match=r"FSDP units wrapped in configure_model.*Call lightning_mp.prepare_fp8"):
        fsdp_trainer(MPPlugin("fp8"), str(tmp_path)).fit(HandWrapped())


class PreparedSharded(Sharded):
    """The FSDP2 model with ``prepare_fp8`` before ``fully_shard`` (or after it, with ``late=True``)."""

    def __init__(self, late: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.late = late

    def configure_model(self):
        if not self.late:
            prepare_fp8(self)
        super().configure_model()
        if self.late:
            prepare_fp8(self)


def test_prepare_fp8_converts_in_configure_model_under_fp8(tmp_path):
    # it runs the plugin's conversion (checks first): on the CPU that is the device refusal, from configure_model
    with pytest.raises(Exception, match="precision='fp8' needs an NVIDIA GPU") as info:
        trainer_for(MPPlugin("fp8"), str(tmp_path)).fit(PreparedSharded())
    assert "in prepare_fp8" in str(info.value)  # the worker's traceback: raised inside configure_model


def test_prepare_fp8_after_fully_shard_is_refused(tmp_path):
    with pytest.raises(Exception, match="fully_shard or FSDP wrapping already ran.*Call prepare_fp8\\(self\\) first"):
        trainer_for(MPPlugin("fp8"), str(tmp_path)).fit(PreparedSharded(late=True))


class _TELinear(nn.Linear):
    """Stands in for a Transformer Engine linear layer (found by its module and class name)."""


_TELinear.__module__, _TELinear.__name__ = "transformer_engine.pytorch.module.linear", "Linear"


class ShardedWithTELayers(Sharded):
    """Transformer Engine layers, sharded, then prepare_fp8 again: configure_model running a second time (validate
    after fit) or a model built from TE modules."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net1 = _TELinear(16, 32)

    def configure_model(self):
        super().configure_model()
        prepare_fp8(self)


def test_prepare_fp8_leaves_a_sharded_model_with_te_layers_to_the_plugin(tmp_path):
    # no "already ran" error: the plugin adopts the model at set-up (and checks the device, here the CPU)
    with pytest.raises(Exception, match="precision='fp8' needs an NVIDIA GPU") as info:
        trainer_for(MPPlugin("fp8"), str(tmp_path)).fit(ShardedWithTELayers())
    assert "already ran" not in str(info.value) and "in adopt" in str(info.value)


@pytest.mark.parametrize("plugins", [[MPPlugin("bf16")], None])
def test_prepare_fp8_does_nothing_under_other_precisions(tmp_path, plugins):
    """The same LightningModule runs in bf16 (or without MPPlugin) by the Trainer flag alone."""
    torch.manual_seed(0)
    if plugins is None:
        from conftest import ForkModelParallel, make_trainer

        strategy = ForkModelParallel(data_parallel_size=2, tensor_parallel_size=1)
        trainer = make_trainer(None, 3, [], devices=2, strategy=strategy)
        trainer.fit(PreparedSharded())
        return
    trainer_for(plugins[0], str(tmp_path)).fit(PreparedSharded())
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["stats"]["steps"] == 5 and set(r0["params"]) == {"net1.weight", "net1.bias", "net2.weight", "net2.bias"}


def test_prepare_fp8_needs_the_trainer():
    with pytest.raises(MisconfigurationException, match="configure_model"):
        prepare_fp8(Sharded())


def test_prepare_fp8_returns_the_module_unchanged_without_fp8():
    module = Sharded()
    module._trainer = Trainer(plugins=[MPPlugin("bf16")], logger=False, enable_checkpointing=False)
    assert prepare_fp8(module) is module and prepare_fp8(module, module.net1) is module.net1
    assert type(module.net1) is nn.Linear


# ------------------------------------------------------------------------------------------- FP8 state names
class DelayedScaling:
    """Stands in for Transformer Engine's recipe class (checked by name); the GPU tests use TE's own."""


class _Meta:
    def __init__(self, scale: float) -> None:
        self.scale = torch.full((3,), scale)
        self.amax_history = torch.full((4, 3), scale * 10)


class FakeTELinear(nn.Linear):
    """The fp8_meta layout of a Transformer Engine module (what fp8_scaling_state reads and writes)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.fp8_meta = {"scaling_fwd": _Meta(1.0), "scaling_bwd": _Meta(1.0), "recipe": DelayedScaling()}

    def init_fp8_meta_tensors(self, recipe=None) -> None:
        pass


def _net() -> nn.Module:
    return nn.Sequential(nn.Sequential(FakeTELinear(), nn.ReLU()), FakeTELinear())


def test_fp8_state_names_leave_out_the_wrappers_fsdp_and_checkpointing_add():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = _net()
    wrapped[0] = checkpoint_wrapper(wrapped[0])  # names gain "_checkpoint_wrapped_module", as FSDP's units do theirs
    wrapped[0]._checkpoint_wrapped_module[0].fp8_meta["scaling_fwd"] = _Meta(2.0)
    assert "0._checkpoint_wrapped_module.0" in dict(wrapped.named_modules())
    names = named_modules_unwrapped(wrapped)
    assert names["0.0"] is wrapped[0]._checkpoint_wrapped_module[0]
    fake_fsdp = nn.Module()
    fake_fsdp._fsdp_wrapped_module = _net()  # the name part FSDP's units insert
    assert "0.0" in named_modules_unwrapped(fake_fsdp)

    state = fp8_scaling_state(wrapped)
    assert set(state) == {"0.0", "1"} and float(state["0.0"]["scale_fwd"][0]) == 2.0
    plain = _net()  # the same model on one device, without wrappers: the saved state loads by name
    assert sorted(load_fp8_scaling_state(plain, state, DelayedScaling())) == ["0.0", "1"]
    assert torch.equal(plain[0][0].fp8_meta["scaling_fwd"].scale, torch.full((3,), 2.0))
    assert torch.equal(plain[0][0].fp8_meta["scaling_fwd"].amax_history, torch.full((4, 3), 20.0))


# ------------------------------------------------------------------------------------------- verdicts agree
class SaturateOnOneRank(Callback):
    """Stands in for the FP8 saturation sentinel (a device flag per step): raised on rank 1 at batch 2 only."""

    def on_train_start(self, trainer, pl_module):
        steps = trainer.precision_plugin._steps

        def flag():
            hit = trainer.global_rank == 1 and trainer.fit_loop.total_batch_idx == 2
            return torch.tensor(1.0 if hit else 0.0)

        steps.saturation = flag


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_a_saturation_flag_on_one_rank_skips_the_step_on_every_rank(tmp_path, strategy):
    """FSDP's verdict is reduced inside unscale_, before the FP8 flag joins it: the flag is reduced too."""
    if strategy == "fsdp":
        fsdp_trainer(MPPlugin("bf16"), str(tmp_path), callbacks_extra=[SaturateOnOneRank()]).fit(FSDPRegressor())
        r0, r1 = load(str(tmp_path))
        steps = 6
    else:
        trainer = trainer_for(MPPlugin("bf16"), str(tmp_path))
        trainer.callbacks.append(SaturateOnOneRank())
        trainer.fit(Sharded())
        r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
        steps = 5
    assert r0["stats"] == r1["stats"]
    assert (r0["stats"]["steps"], r0["stats"]["skipped_steps"]) == (steps, 1)
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name])


# ------------------------------------------------------------------------------------------- FSDP's configuration
def test_fp8_fsdp_config_keeps_fp32_shards_and_gathers_bf16_on_request():
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy()
    strategy.precision_plugin = MPPlugin("fp8")  # Lightning's type check passes: MPPlugin is an FSDPPrecision
    config = strategy.mixed_precision_config
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (None, None, None)  # fp32 throughout
    config = MPPlugin("fp8", fsdp_param_dtype="bf16").mixed_precision_config
    assert (config.param_dtype, config.reduce_dtype) == (torch.bfloat16, torch.float32)  # bf16 gathers, fp32 grads
    assert MPPlugin("fp8", reduce_dtype="bf16").mixed_precision_config.reduce_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="fsdp_param_dtype='fp16' applies to precision='fp16'.*not to precision='fp8'"):
        MPPlugin("fp8", fsdp_param_dtype="fp16")
