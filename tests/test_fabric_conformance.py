"""MPFabricPrecision in the place of Fabric's ``MixedPrecision`` / ``HalfPrecision``, from the user's side: a scaler set
on the plugin, the dtype Fabric's code reads of it, what ``fabric.init_module()`` creates, the exceptions raised and
the class their messages name. Runs on the CPU with a real ``Fabric``."""

from __future__ import annotations

import math
from typing import Any, Optional
from unittest.mock import Mock

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import HalfPrecision, MixedPrecision
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype
from torch import nn

from lightning_mp import MPFabricPrecision, MPPlugin

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
]

#: the dtype each mode computes in, as Fabric's code reads it (``_desired_input_dtype``)
DTYPES = {
    "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "bf16-true": torch.bfloat16, "fp16-true": torch.float16,
}
#: Fabric's own plugin of the modes it has
FABRIC_OWN = {
    "bf16": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "fp16": lambda: MixedPrecision("16-mixed", "cpu"),
    "bf16-true": lambda: HalfPrecision("bf16-true"),
    "fp16-true": lambda: HalfPrecision("16-true"),
}


def cpu_fabric(plugin: Any) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, plugins=[plugin])


def train(fabric: Fabric, model: nn.Module, steps: int, poison_at: Optional[int] = None) -> None:
    """SGD steps on random batches; the batch of step ``poison_at`` holds an inf (that step must be skipped)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    for i in range(steps):
        x = torch.randn(4, 8, generator=generator)
        if i == poison_at:
            x[0, 0] = math.inf
        fabric.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


# ---------------------------------------------------------------------------------------------- the scaler
def test_a_grad_scaler_set_on_the_plugin_scales_the_loss_and_shows_the_scale_training_uses():
    plugin = MPFabricPrecision("fp16", device="cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    plugin.scaler = scaler
    assert plugin.scaler is scaler and plugin.settings.scaler is scaler
    torch.manual_seed(0)
    train(cpu_fabric(plugin), nn.Linear(8, 1), steps=4, poison_at=2)
    # grows after each clean step, backs off at the inf: 2**10 -> 2**11 -> 2**12 -> (skipped) 2**11 -> 2**12
    assert scaler.get_scale() == plugin.stats.loss_scale == 2.0**12
    assert plugin.stats.skipped_steps == 1


def test_a_stand_in_scaler_set_on_the_plugin_scales_the_loss():
    plugin = MPFabricPrecision("fp16", device="cpu")
    plugin.scaler = Mock()
    assert isinstance(plugin.scaler, Mock)  # shown as it is (not an attribute of the double)
    plugin.scaler.scale = Mock(side_effect=lambda tensor: tensor)
    loss = Mock()
    plugin.backward(loss, None, "positional", keyword="arg")
    plugin.scaler.scale.assert_called_once_with(loss)
    loss.backward.assert_called_once_with("positional", keyword="arg")


def test_a_stand_in_scaler_set_on_the_plugin_steps_and_updates_as_fabrics_does():
    plugin = MPFabricPrecision("fp16", device="cpu")
    plugin.scaler = scaler = Mock()
    optimizer = Mock()
    plugin.optimizer_step(optimizer, keyword="arg")
    scaler.step.assert_called_once_with(optimizer, keyword="arg")
    scaler.update.assert_called_once()


@pytest.mark.parametrize("when", ["built", "set"])
def test_a_scaler_in_a_mode_without_a_loss_scale_is_a_value_error_as_fabrics(when):
    """Fabric's MixedPrecision raises ValueError, Lightning's Trainer plugin a MisconfigurationException: both hold."""
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"^MPFabricPrecision\(precision='bf16'\) got a scaler") as raised:
        if when == "built":
            MPFabricPrecision("bf16", scaler=scaler)
        else:
            plugin = MPFabricPrecision("bf16")
            plugin.scaler = scaler
    assert isinstance(raised.value, MisconfigurationException)
    if when == "set":
        assert plugin.scaler is None and plugin.settings.scaler is None  # a refused scaler changes nothing
        plugin.scaler = None  # nothing to set: as on Fabric's plugin in bf16


def test_a_mode_that_scales_the_loss_keeps_a_scaler():
    plugin = MPFabricPrecision("fp16", device="cpu")
    with pytest.raises(ValueError, match=r"^MPFabricPrecision\(precision='fp16'\) scales the loss.*loss_scale=1.0"):
        plugin.scaler = None
    assert plugin.scaler is not None


# ---------------------------------------------------------------------------------------------- the dtype
@pytest.mark.parametrize("mode", list(DTYPES))
def test_fabric_reads_the_modes_dtype(mode):
    """``_desired_input_dtype`` (Fabric's attribute) and the dtype Fabric's ThroughputMonitor looks the peak FLOPs
    up with are the mode's, and Fabric's own plugin of the mode gives the same."""
    fabric = cpu_fabric(MPFabricPrecision(mode))
    plugin = fabric.strategy.precision
    assert plugin._desired_input_dtype == _plugin_to_compute_dtype(plugin) == DTYPES[mode]
    if mode in FABRIC_OWN:
        assert _plugin_to_compute_dtype(FABRIC_OWN[mode]()) == DTYPES[mode]


def test_fabrics_mixed_precision_is_a_base_whose_methods_are_all_ours():
    """Code that dispatches on ``isinstance(plugin, MixedPrecision)`` sees the plugin; none of MixedPrecision's own
    behaviour runs in it (every method it defines is overridden)."""
    plugin = MPFabricPrecision("bf16-true", master_weights="none")
    assert isinstance(plugin, MixedPrecision)
    theirs = {name for name, value in vars(MixedPrecision).items() if callable(value)}
    assert theirs >= {"__init__", "forward_context", "backward", "optimizer_step", "state_dict", "unscale_gradients"}
    for name in theirs:
        assert getattr(MPFabricPrecision, name) is not getattr(MixedPrecision, name), name


# ---------------------------------------------------------------------------------------------- init_module
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


@pytest.mark.parametrize("mode", ["bf16-true", "fp16-true"])
def test_init_module_without_master_weights_creates_half_weights_as_half_precision(mode):
    dtype = DTYPES[mode]
    scaling = {"loss_scale": 1.0} if mode == "fp16-true" else {}  # (Fabric's 16-true scales no loss)
    fabric = cpu_fabric(MPFabricPrecision(mode, master_weights="none", **scaling))
    with fabric.init_module():
        model = Block()
        assert torch.get_default_dtype() == dtype
    assert torch.get_default_dtype() == torch.float32
    assert model.linear.weight.dtype == model.norm.weight.dtype == dtype  # (half the memory at creation)
    with fabric.init_tensor():
        assert torch.empty(2).dtype == dtype
    own = cpu_fabric(FABRIC_OWN[mode]())
    with own.init_module():
        assert nn.Linear(2, 2).weight.dtype == dtype  # as Fabric's own
    model = fabric.setup(model)
    assert model.linear.weight.dtype == dtype and model.norm.weight.dtype == torch.float32  # the FP32 guard's


@pytest.mark.parametrize(("mode", "kwargs"), [("bf16-true", {}), ("fp16-true", {"master_weights": "kahan"}),
                                              ("bf16", {}), ("fp32", {})])
def test_init_module_keeps_fp32_where_master_weights_need_the_values_or_the_mode_keeps_fp32(mode, kwargs):
    fabric = cpu_fabric(MPFabricPrecision(mode, **kwargs))
    with fabric.init_module():
        model = Block()
    assert model.linear.weight.dtype == torch.float32
    with fabric.init_tensor():  # (tensors, not weights: the mode's dtype, as Fabric's own makes them)
        assert torch.empty(2).dtype == (DTYPES[mode] if mode.endswith("-true") else torch.float32)


# ---------------------------------------------------------------------------------------------- messages
def test_messages_name_the_class_in_use():
    with pytest.warns(UserWarning, match=r"^MPFabricPrecision: spike_window=64 set, but spike_sigma=None"):
        MPFabricPrecision("bf16", spike_window=64)
    with pytest.warns(UserWarning, match=r"^MPFabricPrecision: init_scale set, but precision='bf16' does not scale"):
        MPFabricPrecision("bf16", init_scale=1024.0)
    with pytest.raises(ValueError, match=r"^MPFabricPrecision\(scaler=...\) uses the given scaler's loss scale.*"
                                         r"pass them to MPFabricPrecision\.$"):
        MPFabricPrecision("fp16", scaler=torch.amp.GradScaler("cpu"), init_scale=1024.0)

    class MyPrecision(MPFabricPrecision):
        pass

    with pytest.raises(ValueError, match=r"^MyPrecision\(precision='bf16'\) got a scaler"):
        MyPrecision("bf16", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"^MPPlugin\(precision='bf16'\) got a scaler"):
        MPPlugin("bf16", scaler=torch.amp.GradScaler("cpu"))
    assert MPFabricPrecision("fp16").settings == MPPlugin("fp16").settings  # (the class named is not a setting)
