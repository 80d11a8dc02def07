"""DynamicLossScaler on its own (no Trainer): the scale policy, counters and state dicts, on real CPU kernels."""

import math

import pytest
import torch

from lightning_mp import DynamicLossScaler


def run_steps(scaler: DynamicLossScaler, pattern: str, lr: float = 0.1, factor: float = 2.0):
    """Run one optimizer step per character: 'o' overflows (inf gradient), '.' is clean. Returns scales after each."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=lr)
    scales = []
    for ch in pattern:
        opt.zero_grad()
        loss = (p * factor).sum()
        if ch == "o":
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, p


def test_backoff_and_growth_like_torch():
    scaler = DynamicLossScaler("cpu", init_scale=1024.0, growth_interval=3)
    scales, _ = run_steps(scaler, "o...o")
    assert scales == [512.0, 512.0, 512.0, 1024.0, 512.0]
    assert (scaler.steps, scaler.skipped_steps, scaler.consecutive_skips) == (5, 2, 1)
    assert scaler.last_skipped


def test_hysteresis_consecutive_backs_off_after_n_overflows_in_a_row():
    scaler = DynamicLossScaler("cpu", init_scale=1024.0, hysteresis=2, growth_interval=100)
    scales, _ = run_steps(scaler, "o.o.oo.ooo")
    # an isolated overflow is absorbed; two in a row back off; the budget refills on clean steps,
    # and once spent every further overflow in the run backs off again
    assert scales == [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0, 128.0]
    assert scaler.skipped_steps == 7


def test_hysteresis_megatron_style_refills_only_on_growth():
    scaler = DynamicLossScaler("cpu", init_scale=1024.0, hysteresis=2, consecutive_hysteresis=False, growth_interval=2)
    scales, _ = run_steps(scaler, "o.o..o")
    # 1st overflow absorbed; the clean step does not refill, so the 2nd overflow backs off;
    # two clean steps grow the scale, which refills the budget, so the 3rd overflow is absorbed
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 1024.0, 1024.0]


def test_min_scale_floor_and_max_scale_cap():
    floor = DynamicLossScaler("cpu", init_scale=4.0, min_scale=2.0)
    assert run_steps(floor, "oooo")[0] == [2.0, 2.0, 2.0, 2.0]
    cap = DynamicLossScaler("cpu", init_scale=4.0, max_scale=8.0, growth_interval=1)
    assert run_steps(cap, "....")[0] == [8.0, 8.0, 8.0, 8.0]


def test_finite_growth_guard():
    scaler = DynamicLossScaler("cpu", init_scale=2.0**127, max_scale=3e38, growth_interval=1)
    # growing 2**127 by 2 is not finite in fp32: the scale stays (and the step is not skipped)
    scales, p = run_steps(scaler, "..", factor=1e-30)
    assert scales == [2.0**127, 2.0**127]
    assert scaler.skipped_steps == 0


def test_static_scale_never_moves_but_still_skips():
    scaler = DynamicLossScaler("cpu", init_scale=128.0, dynamic=False, growth_interval=1)
    scales, p = run_steps(scaler, "o.o.")
    assert scales == [128.0] * 4
    assert scaler.skipped_steps == 2
    # two clean SGD steps on grad 2 with lr 0.1
    assert torch.allclose(p.detach(), torch.full((4,), 1 - 2 * 0.2))


def test_check_only_mode_skips_without_scaling():
    scaler = DynamicLossScaler("cpu", scaling=False)
    loss = torch.tensor(3.0, requires_grad=True)
    assert scaler.scale(loss) is loss  # no multiply at all
    scales, p = run_steps(scaler, "o.")
    assert scales == [1.0, 1.0]
    assert scaler.skipped_steps == 1
    assert torch.allclose(p.detach(), torch.full((4,), 0.8))


def test_skipped_step_leaves_adam_state_untouched():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=16.0)
    for poison in (False, True):
        opt.zero_grad()
        loss = (p**2).sum() * (math.inf if poison else 1.0)
        scaler.scale(loss).backward()
        if poison:
            before = {k: v.clone() for k, v in opt.state[p].items()}
            param_before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
    assert torch.equal(p.detach(), param_before)
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[k]), k
    assert int(opt.state[p]["step"]) == 1


def test_state_dict_round_trip_and_plain_gradscaler_compatibility():
    scaler = DynamicLossScaler("cpu", init_scale=1024.0, hysteresis=3)
    run_steps(scaler, "o.o")
    state = scaler.state_dict()
    assert state["scale"] == 1024.0 and state["skipped_steps"] == 2 and state["_hysteresis_tracker"] == 2
    assert all(isinstance(v, (int, float, bool)) for v in state.values())

    fresh = DynamicLossScaler("cpu", init_scale=4.0, hysteresis=3)
    fresh.load_state_dict(state)
    assert (fresh.get_scale(), fresh.skipped_steps, fresh.steps) == (1024.0, 2, 3)
    assert run_steps(fresh, "o")[0] == [1024.0]  # tracker restored: one overflow of budget left... then 2nd
    assert run_steps(fresh, "o")[0] == [512.0]

    plain = torch.amp.GradScaler("cpu", init_scale=64.0)
    plain.scale(torch.ones(()))
    ours = DynamicLossScaler("cpu")
    ours.load_state_dict(plain.state_dict())
    assert ours.get_scale() == 64.0 and ours.skipped_steps == 0

    # and a plain GradScaler reads ours
    plain2 = torch.amp.GradScaler("cpu")
    plain2.load_state_dict(state)
    assert plain2.get_scale() == 1024.0


def test_update_makes_no_host_sync_calls(monkeypatch):
    """The scale policy and counters run on the device: update() never reads a tensor on the host."""
    scaler = DynamicLossScaler("cpu", init_scale=8.0, hysteresis=2)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    (scaler.scale((p * 2).sum()) * math.inf).backward()
    scaler.step(opt)  # torch's own sync happens here
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name: reads.append(_n))
    scaler.update()
    monkeypatch.undo()
    assert reads == []
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 8.0  # absorbed by hysteresis


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 0.0}, "init_scale=0.0"),
        ({"init_scale": -1.0}, "init_scale=-1.0"),
        ({"init_scale": math.inf}, "init_scale=inf"),
        ({"growth_factor": 1.0}, "growth_factor=1.0.*> 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor=1.0.*\(0, 1\)"),
        ({"backoff_factor": 0.0}, "backoff_factor=0.0"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"hysteresis": 0}, "hysteresis=0"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale=8.0 is larger than max_scale=4.0"),
        ({"init_scale": 2.0**30}, "init_scale=1073741824.0 lies outside"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler("cpu", **kwargs)
