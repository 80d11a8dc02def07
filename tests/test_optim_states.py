"""lightning_mp.optim_states without a Trainer: Adam's moments held in bf16 around torch's own step."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp.optim_states import OptimizerStates, adam_of, moment_bytes

BETA2 = 0.999


def held_adamw(n: int = 4096, **kwargs):
    param = torch.nn.Parameter(torch.zeros(n))
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, BETA2), **kwargs)
    states = OptimizerStates("bf16")
    return param, optimizer, states, states.hold(optimizer, host="test")


def test_rounding_to_nearest_freezes_the_second_moment_and_stochastic_rounding_does_not():
    """Gradients of scale 1, then of scale 0.1: fp32's exp_avg_sq decays; kept in bf16 and rounded to nearest (what
    torch's fused mixed-precision kernel and Transformer Engine's bf16 states do) it cannot move down by 0.1 % a step
    and stays where it was; held by OptimizerStates (stochastic rounding) it follows fp32."""
    g = torch.Generator().manual_seed(0)
    param, held, _, _ = held_adamw()
    plain_param = torch.nn.Parameter(torch.zeros(4096))
    plain = torch.optim.AdamW([plain_param], lr=1e-3, betas=(0.9, BETA2))
    nearest = torch.zeros(4096, dtype=torch.bfloat16)
    for step in range(1000):
        grad = torch.randn(4096, generator=g) * (1.0 if step < 200 else 0.1)
        param.grad, plain_param.grad = grad.clone(), grad.clone()
        held.step()
        plain.step()
        nearest = (BETA2 * nearest.float() + (1 - BETA2) * grad * grad).to(torch.bfloat16)
    fp32 = plain.state[plain_param]["exp_avg_sq"].mean().item()
    ours = held.state[param]["exp_avg_sq"]
    assert ours.dtype == torch.bfloat16
    assert ours.float().mean().item() == pytest.approx(fp32, rel=0.02)
    assert nearest.float().mean().item() > 1.8 * fp32  # frozen near its value when the gradients shrank


def test_a_step_a_fused_optimizer_skips_on_the_device_changes_nothing():
    """torch's protocol: a fused optimizer given ``found_inf`` skips in its kernel and takes its step count back. The
    moments round back to themselves, and the noise drawn for them is rewound once the verdict is known."""
    param, optimizer, states, _ = held_adamw(64, fused=True)
    for _ in range(3):
        param.grad = torch.randn_like(param)
        optimizer.step()
    before, weights, noise = copy.deepcopy(optimizer.state_dict()), param.detach().clone(), states.state_dict()
    param.grad = torch.randn_like(param)
    optimizer.found_inf = torch.ones(())  # (set by the step guard as torch's GradScaler sets it)
    optimizer.step()
    del optimizer.found_inf
    after = optimizer.state_dict()["state"][0]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert after[key].dtype == before["state"][0][key].dtype and torch.equal(after[key], before["state"][0][key])
    assert torch.equal(param, weights)
    assert torch.equal(states.state_dict()["generators"]["cpu"], noise["generators"]["cpu"])


def test_release_gives_back_a_plain_optimizer_and_hold_is_idempotent():
    param, optimizer, states, undo = held_adamw(16)
    assert states.hold(optimizer, host="test")() is None  # held already: nothing more to undo
    param.grad = torch.ones_like(param)
    optimizer.step()
    assert optimizer.state[param]["exp_avg"].dtype == torch.bfloat16
    undo()
    assert optimizer.state[param]["exp_avg"].dtype == torch.float32
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_load_state_dict_post_hooks
    optimizer.step()  # torch's own step on its own fp32 state


def test_loaded_fp32_moments_are_held_at_once_and_bf16_ones_load_into_a_plain_optimizer():
    param, optimizer, _, undo = held_adamw(16)
    plain_param = torch.nn.Parameter(torch.zeros(16))
    plain = torch.optim.AdamW([plain_param])
    plain_param.grad = torch.full_like(plain_param, 0.3)
    plain.step()
    optimizer.load_state_dict(plain.state_dict())
    assert optimizer.state[param]["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(optimizer.state[param]["exp_avg_sq"], plain.state[plain_param]["exp_avg_sq"].bfloat16())
    held_state = copy.deepcopy(optimizer.state_dict())
    plain.load_state_dict(held_state)  # torch casts to the parameters' dtype
    assert plain.state[plain_param]["exp_avg_sq"].dtype == torch.float32


def test_a_held_optimizer_pickles_and_copies_and_its_state_loads_into_a_plain_one():
    """A copy (torch's ``Optimizer.__getstate__`` leaves hooks out) holds the bf16 moments; loading its state into an
    optimizer, as torch recommends, casts them to the parameters' dtype, and that one steps on its own."""
    param, optimizer, _, _ = held_adamw(16)
    param.grad = torch.ones_like(param)
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["state"][0]["exp_avg"].dtype == torch.bfloat16
    for copied in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        p = copied.param_groups[0]["params"][0]
        assert copied.state[p]["exp_avg"].dtype == torch.bfloat16
        fresh = torch.optim.AdamW([p], lr=1e-3)
        fresh.load_state_dict(copied.state_dict())
        assert fresh.state[p]["exp_avg"].dtype == torch.float32
        p.grad = torch.ones_like(p)
        fresh.step()
        assert int(fresh.state[p]["step"]) == 2


def test_a_checkpoint_after_fit_holds_bf16_moments_and_the_live_state_is_untouched():
    param, optimizer, states, undo = held_adamw(16)
    param.grad = torch.ones_like(param)
    optimizer.step()
    undo()  # (the end of fit)
    checkpoint = {"optimizer_states": [optimizer.state_dict()]}
    states.compact_checkpoint(checkpoint["optimizer_states"])
    assert checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert optimizer.state[param]["exp_avg"].dtype == torch.float32


def test_moment_bytes_halve():
    param, optimizer, _, _ = held_adamw(1000)
    param.grad = torch.ones_like(param)
    optimizer.step()
    plain_param = torch.nn.Parameter(torch.zeros(1000))
    plain = torch.optim.Adam([plain_param])
    plain_param.grad = torch.ones_like(plain_param)
    plain.step()
    assert moment_bytes([optimizer]) == 4000 and moment_bytes([plain]) == 8000


def test_the_adam_a_wrapper_steps_is_held():
    class Wrapper(torch.optim.Optimizer):  # as SAM: a base optimizer over the same parameters
        def __init__(self, params):
            params = list(params)
            self.base_optimizer = torch.optim.Adam(params)
            super().__init__(params, {})

    wrapper = Wrapper([torch.nn.Parameter(torch.zeros(4))])
    assert adam_of(wrapper) is wrapper.base_optimizer
    assert adam_of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)) is None
    with pytest.raises(MisconfigurationException, match=r"host\(optimizer_states='bf16'\).*SGD"):
        OptimizerStates("bf16").hold(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1), host="host")
