"""The inf/NaN step guard of the modes without a loss scale (``NonfiniteGuard``): the check, the step or the skip,
the fused protocol where a device verdict spares a sync, and that it is what the plugin uses in those modes (no
loss scaler in a check-only mode, the counts in one place)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyRegressor, make_trainer

from lightning_mp import MPPlugin
from lightning_mp.nonfinite import NonfiniteGuard
from lightning_mp.scaling import DynamicLossScaler


def _steps(guard: NonfiniteGuard, pattern: str, opt_ctor=lambda ps: torch.optim.SGD(ps, lr=0.1)):
    """One step per character: 'o' puts an inf into a gradient, '.' is clean. Returns the parameter, the optimizer and
    what the host knew of each step."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = opt_ctor([p])
    known = []
    for ch in pattern:
        opt.zero_grad()
        loss = guard.scale((p * 2.0).sum())
        loss.backward()
        if ch == "o":
            p.grad[1] = math.inf
        _, skipped = guard.step_outcome(opt)
        known.append(skipped)
        guard.update_from([skipped])
    return p, opt, known


def test_the_guard_skips_inf_steps_and_scales_nothing():
    guard = NonfiniteGuard("cpu")
    loss = torch.tensor(3.0, requires_grad=True)
    assert guard.scale(loss) is loss and guard.get_scale() == 1.0 and guard.scaling is False
    p, _, known = _steps(guard, "o..o")
    assert known == [True, False, False, True]
    assert torch.allclose(p.detach(), torch.full((4,), 1 - 2 * 0.2))  # two clean SGD steps on grad 2, lr 0.1
    assert guard.state_dict() == {}


def test_a_skipped_step_leaves_adam_untouched():
    guard = NonfiniteGuard("cpu")
    p, opt, _ = _steps(guard, ".", lambda ps: torch.optim.Adam(ps, lr=0.1))
    before = {k: v.clone() for k, v in opt.state[p].items()}
    weights = p.detach().clone()
    _steps_on = p  # the same parameter, one more (poisoned) step
    opt.zero_grad()
    (_steps_on * 2.0).sum().backward()
    p.grad[0] = math.nan
    guard.step(opt)
    guard.update()
    assert torch.equal(p.detach(), weights)
    assert all(torch.equal(v, before[k]) for k, v in opt.state[p].items())


@pytest.mark.parametrize("check_first", [False, True])
@pytest.mark.parametrize("device_verdict", [True, False])
def test_a_fused_optimizer_gets_the_verdict_where_it_spares_a_sync(check_first, device_verdict, monkeypatch):
    """Where a device verdict spares a sync (CUDA; the CPU stands in here) the fused kernel gets ``found_inf`` and no
    ``grad_scale`` (nothing to divide) and skips on the device; elsewhere the host reads the verdict and does not call
    the optimizer on a skip."""
    import lightning_mp.verdict as verdict_module

    monkeypatch.setattr(verdict_module, "DEVICE_VERDICT_TYPES", ("cuda", "cpu") if device_verdict else ("cuda",))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    seen = []
    original = opt.step

    def step(*args, **kwargs):
        seen.append((getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)))
        return original(*args, **kwargs)

    opt.step = step
    guard = NonfiniteGuard("cpu")
    for ch in ".o":
        opt.zero_grad()
        model(torch.ones(3, 4)).pow(2).mean().backward()
        if ch == "o":
            model.weight.grad[0, 0] = math.inf
        if check_first:
            guard.check_(opt)
        before = [p.detach().clone() for p in model.parameters()]
        guard.step(opt)
        assert not hasattr(opt, "found_inf")  # removed after the step
        guard.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the inf step moved nothing
    if device_verdict:
        assert [s for s, _ in seen] == [None, None] and [f.item() for _, f in seen] == [0.0, 1.0]
    else:
        assert seen == [(None, None)]  # stepped once, without the fused protocol


def test_protocol_misuse_is_a_clear_error():
    guard = NonfiniteGuard("cpu")
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.sum().backward()
    guard.check_(opt)
    with pytest.raises(RuntimeError, match="already ran"):
        guard.check_(opt)
    guard.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        guard.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        guard.check_(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        NonfiniteGuard("cpu").step(opt, closure=lambda: None)


def test_a_loss_scaler_state_is_checked_not_used():
    guard = NonfiniteGuard("cpu")
    guard.load_state_dict({})
    guard.load_state_dict(DynamicLossScaler("cpu").state_dict())
    with pytest.raises(ValueError, match="scale"):
        guard.load_state_dict({**DynamicLossScaler("cpu").state_dict(), "scale": -1.0})


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-true"])
def test_the_plugin_skips_with_the_guard_and_counts_in_one_place(mode):
    plugin = MPPlugin(mode)
    model = TinyRegressor(poison_grad=(2,), poison_value=float("nan"))
    make_trainer(plugin, max_steps=5).fit(model)
    guard = plugin._run.scaler
    assert isinstance(guard, NonfiniteGuard) and plugin.scaler is None  # no loss scaler where no loss is scaled
    assert plugin.stats.steps == 5 and plugin.stats.skipped_steps == 1


def test_a_loss_scaler_in_the_plugin_reads_the_plugins_counts():
    """fp16: the loss scaler counts nothing of its own; its counts are the plugin's (one place), also through a
    checkpoint's scaler state."""
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8)
    plugin = MPPlugin("fp16", scaler=scaler)
    model = TinyRegressor(poison_grad=(1, 3), poison_value=float("inf"))
    make_trainer(plugin, max_steps=6).fit(model)
    assert plugin.stats.skipped_steps == 2 and plugin.stats.steps == 6
    assert (scaler.steps, scaler.skipped_steps, scaler.consecutive_skips) == (6, 2, 0)
    state = scaler.state_dict()
    assert (state["steps"], state["skipped_steps"]) == (6, 2)


def test_the_old_check_only_scaler_points_to_the_guard():
    with pytest.raises(TypeError, match="NonfiniteGuard"):
        DynamicLossScaler("cpu", scaling=False)


def test_a_planned_check_of_several_dtypes_finds_an_inf_in_either():
    """True-half weights beside a guard's fp32 ones (master_weights="none"): the check is planned once for both dtypes
    (no grouping of the gradients at every step) and finds an inf or NaN in either; a parameter without a gradient
    is left out."""
    from lightning_mp.verdict import PlannedCheck, zero_flag

    half = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)) for shape in ((4, 4), (3,))]
    full = [torch.nn.Parameter(torch.zeros(5))]
    plan = PlannedCheck.of(torch.optim.SGD([*half, *full], lr=0.1))
    assert plan is not None and plan.groups is not None and len(plan.groups) == 2
    for p in (*half, *full):
        p.grad = torch.ones_like(p)
    half[1].grad = None
    for poisoned, value in ((None, 0.0), (full[0], math.inf), (half[0], math.nan)):
        if poisoned is not None:
            poisoned.grad[0] = value
        flag = zero_flag(torch.device("cpu"))
        assert plan.found_inf(flag) == {flag.device: flag} and flag.item() == (poisoned is not None)
        if poisoned is not None:
            poisoned.grad[0] = 1.0
