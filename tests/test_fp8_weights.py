"""FP8 primary weights (``MPPlugin("fp8", fp8={"weights": "fp8"})``) without a GPU or Transformer Engine: the
option, the strategies that refuse it, and :mod:`lightning_mp.fp8.primary` on stand-ins for TE's tensors and
optimizer. Training with real FP8 weights is in ``tests/gpu/test_fp8_weights_gpu.py``."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import TinyRegressor, make_trainer
from test_fsdp import FSDPRegressor, fsdp_trainer
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp.fp8 import FP8Config
from lightning_mp.fp8.primary import (
    fit_delayed_scale,
    install_primary_hooks,
    is_quantized,
    remember_original,
    requantize_from_masters,
    seed_masters,
)

FP8_WEIGHTS = {"weights": "fp8"}


# ------------------------------------------------------------------------------------------- the option
def test_weights_fp8_is_an_accepted_setting():
    assert FP8Config(weights="fp8").weights == "fp8"
    assert FP8Config.from_dict({"weights": "FP8"}).weights == "fp8"
    assert MPPlugin("fp8", fp8=FP8_WEIGHTS).fp8_config.weights == "fp8"


def test_an_unknown_weights_value_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="fp8 weights='fp16' is invalid") as info:
        FP8Config(weights="fp16")
    assert all(repr(w) in str(info.value) for w in ("fp32", "bf16", "fp8"))


# ------------------------------------------------------------------------------------------- strategies, refused
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_fp8_weights_under_fsdp_is_refused_before_training(tmp_path):
    with pytest.raises(Exception, match="does not run under FSDPStrategy: FSDP \\(1\\) flattens") as info:
        fsdp_trainer(MPPlugin("fp8", fp8=FP8_WEIGHTS), str(tmp_path)).fit(FSDPRegressor())
    assert "ModelParallelStrategy" in str(info.value) and "needs an NVIDIA GPU" not in str(info.value)
    assert not (tmp_path / "rank0.pt").exists()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_fp8_weights_under_ddp_is_refused_before_training():
    trainer = make_trainer(MPPlugin("fp8", fp8=FP8_WEIGHTS), 2, devices=2, strategy="ddp_fork")
    with pytest.raises(Exception, match="does not run under DDP: every GPU holds the whole model") as info:
        trainer.fit(TinyRegressor())
    assert "needs an NVIDIA GPU" not in str(info.value)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_default_fp8_weights_under_fsdp_are_not_refused_for_the_strategy(tmp_path):
    with pytest.raises(Exception, match="precision='fp8' needs an NVIDIA GPU") as info:
        fsdp_trainer(MPPlugin("fp8", fp8={"weights": "fp32"}), str(tmp_path)).fit(FSDPRegressor())
    assert "does not run under" not in str(info.value)


# ------------------------------------------------------------------------------------------- primary.py, stand-ins
# These stand-ins mirror Transformer Engine's API (QuantizedTensor/Float8Tensor: dequantize, quantize_, _quantizer;
# FusedAdam(master_weights=True): initialize_state, set_scaled_state, get_unscaled_state). The real behaviour, with
# TE's own classes on a GPU, runs in tests/gpu/test_fp8_weights_gpu.py.
class QuantizedTensor(torch.Tensor):
    def dequantize(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).detach().clone()

    def quantize_(self, src: torch.Tensor) -> QuantizedTensor:
        with torch.no_grad():  # bf16 rounding stands in for FP8's
            self.as_subclass(torch.Tensor).copy_(src.to(torch.bfloat16).float())
        return self


class Float8Tensor(QuantizedTensor):
    def _reset_caches(self) -> None:  # TE: the cached FP8 transpose is stale after an in-place write
        self._transpose_invalid = True


class Float8Quantizer:
    def __init__(self, dtype: str = "E4M3") -> None:
        self.scale, self.dtype = torch.ones(1), dtype


class OtherQuantizer(Float8Quantizer):  # a current-scaling or block quantizer: fits its scale itself
    pass


class FakeFusedAdam(torch.optim.Optimizer):
    def __init__(self, params, master_weights: bool = True) -> None:
        super().__init__(params, {"lr": 0.1})
        self.master_weights = master_weights

    def initialize_state(self, param, store_param_remainders):
        plain = param.dequantize() if is_quantized(param) else param.detach()
        self.state[param].update(master_param=plain.float().clone(), exp_avg=torch.zeros_like(plain))

    def set_scaled_state(self, param, name, value):
        self.state[param][name] = value.detach().float().clone()

    def get_unscaled_state(self, param, name):
        return self.state[param][name]

    def step(self, closure=None):  # TE's FusedAdam counts steps per param group, from 1 at the first
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1


EXACT = torch.tensor([[1.0 + 2.0**-12, -3.0009766], [0.3333333, 250.1]])  # none of them representable in bf16


def fp8_linear(quantizer=None) -> nn.Linear:
    """A linear layer whose weight is a Float8Tensor holding EXACT rounded, the exact value remembered."""
    layer = nn.Linear(2, 2)
    rounded = EXACT.to(torch.bfloat16).float()
    assert not torch.equal(rounded, EXACT)
    layer._parameters["weight"] = torch.Tensor._make_subclass(Float8Tensor, rounded, True)
    layer.weight._quantizer = quantizer
    remember_original(layer, "weight", EXACT)
    return layer


def test_is_quantized_recognises_te_tensors_by_class_name():
    layer = fp8_linear()
    assert is_quantized(layer.weight) and not is_quantized(layer.bias) and not is_quantized(EXACT)
    assert not is_quantized(nn.Parameter(EXACT)) and not is_quantized(None)


def test_seed_masters_refuses_an_optimizer_without_masters():
    layer = fp8_linear()
    with pytest.raises(ValueError, match=r"stores 1 weight\(s\) in FP8.*but AdamW keeps none.*FusedAdam") as info:
        seed_masters(layer, [torch.optim.AdamW(layer.parameters())])
    assert "master_weights=True" in str(info.value)
    with pytest.raises(ValueError, match="FakeFusedAdam keeps none"):
        seed_masters(layer, [FakeFusedAdam(layer.parameters(), master_weights=False)])
    assert seed_masters(layer, [FakeFusedAdam(layer.parameters())]) == 1  # a refusal consumed no original
    plain = nn.Linear(2, 2)
    assert seed_masters(plain, [torch.optim.AdamW(plain.parameters()), torch.optim.SGD(plain.parameters())]) == 0


def test_seed_masters_starts_the_masters_from_the_exact_fp32_weights():
    layer = fp8_linear()
    opt = FakeFusedAdam(layer.parameters())
    assert seed_masters(layer, [opt]) == 1
    master = opt.state[layer.weight]["master_param"]
    assert type(master) is torch.Tensor and master.dtype is torch.float32
    assert torch.equal(master, EXACT) and not torch.equal(master, layer.weight.dequantize())
    assert torch.equal(opt.state[layer.weight]["exp_avg"], torch.zeros(2, 2))  # initialize_state ran first
    # every other parameter's state too, as the first step would make it (a distributed checkpoint fills only the
    # state an optimizer has): the bias's master is its own value
    assert torch.equal(opt.state[layer.bias]["master_param"], layer.bias.detach())
    assert seed_masters(layer, [opt]) == 0  # the originals are consumed
    assert torch.equal(opt.state[layer.weight]["master_param"], EXACT)


def test_requantize_from_masters_writes_each_fp8_weight_from_its_master():
    layer = fp8_linear()
    opt = FakeFusedAdam(layer.parameters())
    assert requantize_from_masters([opt]) == 0  # no masters yet: nothing to write
    seed_masters(layer, [opt])
    opt.state[layer.weight]["master_param"] = EXACT * 3  # as after a restore
    weight = layer.weight
    assert requantize_from_masters([opt]) == 1
    assert layer.weight is weight and is_quantized(layer.weight)  # written in place
    assert torch.equal(layer.weight.dequantize(), (EXACT * 3).to(torch.bfloat16).float())
    assert torch.equal(opt.state[layer.weight]["master_param"], EXACT * 3)
    assert layer.weight._transpose_invalid  # the next backward transposes the new bytes


def test_each_optimizer_step_marks_the_fp8_weights_transposes_stale():
    from lightning_mp.fp8 import FP8Training

    model = nn.Sequential(fp8_linear(), nn.ReLU(), fp8_linear(), nn.Linear(2, 2))
    fp8 = FP8Training({"weights": "fp8"})
    fp8._take(model)  # what convert/adopt end with
    for i in (0, 2):
        model[i].weight._transpose_invalid = False
    fp8.weights_updated()  # MPPlugin calls it after every optimizer step
    assert model[0].weight._transpose_invalid and model[2].weight._transpose_invalid


def test_primary_hooks_save_plain_tensors_that_weights_only_loads():
    model = nn.Sequential(fp8_linear(), nn.ReLU(), nn.Linear(2, 2))
    assert install_primary_hooks(model) == 1 and install_primary_hooks(model) == 0
    state = model.state_dict()
    assert type(state["0.weight"]) is torch.Tensor
    assert torch.equal(state["0.weight"], EXACT.to(torch.bfloat16).float())
    torch.save(state, buffer := io.BytesIO())
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    assert type(loaded["0.weight"]) is torch.Tensor
    assert is_quantized(model[0].weight)  # saving left the parameter as it was


def test_fit_delayed_scale_maps_the_largest_value_to_the_format_maximum():
    value = torch.tensor([[0.5, -7.0], [2.0, 3.0]])
    other = fp8_linear(OtherQuantizer())
    fit_delayed_scale(other.weight, value)
    assert torch.equal(other.weight._quantizer.scale, torch.ones(1))  # not delayed scaling: left alone
    fit_delayed_scale(fp8_linear(None).weight, value)  # no quantizer: nothing to do, no error
    for dtype, top in (("E4M3", 448.0), ("E5M2", 57344.0)):
        layer = fp8_linear(Float8Quantizer(dtype))
        fit_delayed_scale(layer.weight, value)
        assert torch.allclose(layer.weight._quantizer.scale, torch.tensor([top / 7.0]), rtol=1e-6, atol=0)
    zero = fp8_linear(Float8Quantizer())
    fit_delayed_scale(zero.weight, torch.zeros(2, 2))
    assert torch.equal(zero.weight._quantizer.scale, torch.ones(1))  # an all-zero weight keeps scale 1


def test_loading_a_plain_weight_fits_its_delayed_scale_first():
    model = nn.Sequential(fp8_linear(Float8Quantizer()))
    install_primary_hooks(model)
    state = {"0.weight": torch.tensor([[1.0, -16.0], [2.0, 4.0]]), "0.bias": torch.zeros(2)}
    model.load_state_dict(state)
    assert torch.equal(model[0].weight._quantizer.scale, torch.tensor([448.0 / 16.0]))
    assert is_quantized(model[0].weight) and torch.equal(model[0].weight.dequantize(), state["0.weight"])


def test_a_distributed_checkpoint_restores_the_adam_step_count_after_seeding(tmp_path):
    # torch's distributed checkpoint (FSDP2's) fills only the entries an optimizer already has, and makes them by a
    # dry step only for an optimizer with no state at all: seeding made state, so the step count must be there too
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    layer = fp8_linear()
    opt = FakeFusedAdam(layer.parameters())
    seed_masters(layer, [opt])
    for _ in range(3):
        opt.step()
    assert opt.param_groups[0]["step"] == 3
    dcp.save({"optim": get_optimizer_state_dict(layer, opt)}, checkpoint_id=str(tmp_path))

    fresh = fp8_linear()
    fresh_opt = FakeFusedAdam(fresh.parameters())
    seed_masters(fresh, [fresh_opt])  # at set-up, before the checkpoint is restored
    assert fresh_opt.param_groups[0]["step"] == 0  # as TE's FusedAdam counts: the first step makes it 1
    template = {"optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(template, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=template["optim"])
    assert fresh_opt.param_groups[0]["step"] == 3


def test_after_a_restore_the_fp8_weights_are_written_from_the_masters_once():
    from lightning_mp.fp8 import FP8Training

    model = nn.Sequential(fp8_linear(), nn.ReLU(), nn.Linear(2, 2))
    fp8 = FP8Training({"weights": "fp8"})
    fp8._take(model)
    opt = FakeFusedAdam(model.parameters())
    assert fp8.connect_optimizers([opt]) == 1  # what MPPlugin calls at set-up
    assert not fp8._requantize
    fp8.load_state_dict({"format": 1, "recipe": fp8.config.recipe_settings(), "modules": {}})  # the plugin's restore
    opt.state[model[0].weight]["master_param"] = EXACT * 3  # then the optimizer's own restore
    assert fp8._requantize  # done at the next training step (the FP8 region)
    assert fp8.requantize_weights() == 1 and not fp8._requantize
    assert torch.equal(model[0].weight.dequantize(), (EXACT * 3).to(torch.bfloat16).float())
