"""DynamicLossScaler on its own (no Trainer): the scale policy, counters and state dicts, on real CPU kernels."""

import math
import pickle
import re

import pytest
import torch

from lightning_mp import DynamicLossScaler
from lightning_mp.scaling import adopt_scaler


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



@pytest.mark.parametrize("known_on_the_host", [True, False])
def test_hysteresis_one_moves_the_scale_as_torchs_gradscaler(known_on_the_host):
    """hysteresis=1 (the default) runs torch's one update kernel; over a long mix of overflows, clean steps, growths,
    the floor and the cap, the scale and growth count follow torch's GradScaler clamped to the bounds, whether the
    outcome reaches update_from as the host's answer or as a device flag."""
    ours = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=2, min_scale=2.0, max_scale=256.0)
    ours.ensure_initialized(torch.device("cpu"))
    theirs = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    theirs.scale(torch.ones(()))
    pattern = "..o.......oooooo.o..o.." + "." * 12
    for ch in pattern:
        bad = ch == "o"
        ours.update_from([bad] if known_on_the_host else [torch.tensor(float(bad))])
        theirs._per_optimizer_states[0]["found_inf_per_device"] = {torch.device("cpu"): torch.tensor(float(bad))}
        theirs.update()
        theirs._scale.clamp_(2.0, 256.0)
        assert (ours.get_scale(), int(ours._growth_tracker)) == (theirs.get_scale(), int(theirs._growth_tracker))
    assert ours.get_scale() == 256.0 and ours.skipped_steps == pattern.count("o") and ours.steps == len(pattern)


def test_last_skipped_is_about_the_last_step():
    """Used as torch's GradScaler (no begin_step() calls), the last step's outcome is reported, not any earlier one."""
    scaler = DynamicLossScaler("cpu", init_scale=1024.0)
    run_steps(scaler, "o.")
    assert not scaler.last_skipped
    run_steps(scaler, "o")
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


# ---------------------------------------------------------------------------------------------------------------------
# A drop-in for torch.amp.GradScaler: what torch's own scaler does, ours does too.
# ---------------------------------------------------------------------------------------------------------------------
F32 = torch.finfo(torch.float32)


def _both(**kwargs):
    """torch's scaler and ours, built from the same GradScaler arguments (ours with torch's unbounded policy)."""
    ours = DynamicLossScaler("cpu", **kwargs, min_scale=F32.tiny, max_scale=F32.max)
    return torch.amp.GradScaler("cpu", **kwargs), ours


def test_disabled_scaler_is_torchs_disabled_scaler():
    """``GradScaler(device, enabled=use_amp)`` code keeps working with our class substituted."""
    for scaler in _both(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, enabled=False):
        assert scaler.is_enabled() is False
        loss = torch.tensor(3.0, requires_grad=True)
        assert scaler.scale(loss) is loss
        outputs = [loss, loss * 2]
        assert scaler.scale(outputs) is outputs
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.5)
        p.grad = torch.tensor([2.0, math.inf])
        scaler.unscale_(opt)  # a no-op: nothing divided, nothing checked
        assert torch.equal(p.grad, torch.tensor([2.0, math.inf]))
        scaler.step(opt)  # steps unconditionally, inf and all
        assert p[0].item() == 0.0 and p[1].item() == -math.inf
        assert scaler.step(opt, closure=lambda: 5.0) == 5.0  # arguments go to optimizer.step
        scaler.update()
        scaler.update(8.0)
        assert scaler.get_scale() == 1.0
        assert scaler.state_dict() == {}
        scaler.load_state_dict({"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1,
                                "_growth_tracker": 0})  # a no-op, as torch's
        assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
        assert pickle.loads(pickle.dumps(scaler)).is_enabled() is False


def test_disabled_scaler_positional_arguments_and_our_extras():
    scaler = DynamicLossScaler("cpu", 2.0**10, 2.0, 0.5, 100, False)  # torch's positional order, enabled last
    assert not scaler.is_enabled()
    # a disabled scaler ignores its settings, as torch's does (torch checks growth/backoff only when enabled)
    assert not DynamicLossScaler("cpu", growth_factor=0.5, hysteresis=0, enabled=False).is_enabled()
    scales, p = run_steps(scaler, "o.")
    assert scales == [1.0, 1.0]
    assert not torch.isfinite(p).all()  # the inf step was taken
    assert (scaler.steps, scaler.skipped_steps, scaler.last_skipped) == (0, 0, False)
    assert scaler.verdicts.of(torch.optim.SGD([p], lr=0.1)) is None
    assert scaler.counters_tensor() is None and not scaler.initialized


@pytest.mark.parametrize("use_amp", [True, False])
def test_enabled_flag_in_the_usual_loop(use_amp):
    """The documented torch loop, ``enabled=use_amp``: the same parameters as torch's scaler gives."""
    results = []
    for scaler in _both(init_scale=256.0, growth_interval=2, enabled=use_amp):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 3)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        results.append((scaler.get_scale(), [t.detach().clone() for t in model.parameters()]))
    (torch_scale, torch_params), (our_scale, our_params) = results
    assert torch_scale == our_scale == (1024.0 if use_amp else 1.0)
    for a, b in zip(torch_params, our_params):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_scaler_without_cuda_disables_itself_like_torch():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = DynamicLossScaler("cuda")
    assert not scaler.is_enabled()
    scales, _ = run_steps(scaler, ".o.")
    assert scales == [1.0, 1.0, 1.0]
    assert scaler.state_dict() == {}


# --------------------------------------------------------------------------- optimizers that unscale in their step
def _record_amp_attributes(opt):
    """What GradScaler hands the optimizer: (grad_scale, found_inf) at each step, copied."""
    seen = []

    def hook(optimizer, args, kwargs):
        pair = (getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))
        seen.append(tuple(None if t is None else t.detach().clone() for t in pair))

    opt.register_step_pre_hook(hook)
    return seen


def _fused_run(scaler, opt_ctor, pattern, *, unscale_first, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = opt_ctor(model.parameters())
    seen = _record_amp_attributes(opt)
    for ch in pattern:
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).pow(2).mean()).backward()
        if ch == "o":
            model.weight.grad[0, 0] = math.inf
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # removed after the step
        scaler.update()
    return model, opt, seen


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("opt_name", ["Adam", "AdamW", "SGD"])
def test_fused_optimizer_gets_grad_scale_and_found_inf_as_from_torch(opt_name, unscale_first):
    cls = getattr(torch.optim, opt_name)
    runs = []
    for scaler in _both(init_scale=1024.0, growth_interval=2):
        runs.append(_fused_run(scaler, lambda ps: cls(ps, lr=0.01, fused=True), ".o..", unscale_first=unscale_first))
    (t_model, t_opt, t_seen), (o_model, o_opt, o_seen) = runs
    # without unscale_, the scale goes to the fused kernel (it unscales in its own pass); after unscale_, None
    expected_scales = [None] * 4 if unscale_first else [1024.0, 1024.0, 512.0, 512.0]
    assert [None if s is None else s.item() for s, _ in o_seen] == expected_scales
    assert [f.item() for _, f in o_seen] == [0.0, 1.0, 0.0, 0.0]
    for (ts, tf), (os_, of) in zip(t_seen, o_seen):
        assert (ts is None) == (os_ is None) and (ts is None or torch.equal(ts, os_))
        assert torch.equal(tf, of) and tf.shape == of.shape and tf.device == of.device
    for a, b in zip(t_model.parameters(), o_model.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)


def test_fused_adam_skips_on_the_device_and_steps_like_unfused_adam():
    """An inf step leaves parameters and state (step count included) as they were; a clean step is the unfused
    optimizer's step on the unscaled gradients."""
    scaler = DynamicLossScaler("cpu", init_scale=2.0**12)
    torch.manual_seed(0)
    fused_model = torch.nn.Linear(4, 2)
    plain_model = torch.nn.Linear(4, 2)
    plain_model.load_state_dict(fused_model.state_dict())
    fused = torch.optim.Adam(fused_model.parameters(), lr=0.01, fused=True)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01, foreach=False)
    x = torch.randn(3, 4)
    for ch in ".o.":
        fused.zero_grad()
        plain.zero_grad()
        scaler.scale(fused_model(x).pow(2).mean()).backward()
        plain_model(x).pow(2).mean().backward()
        if ch == "o":
            fused_model.bias.grad[0] = math.nan
            before = [p.detach().clone() for p in fused_model.parameters()]
            state_before = [{k: v.clone() for k, v in fused.state[p].items()} for p in fused_model.parameters()]
        scaler.step(fused)
        scaler.update()
        if ch == "o":
            assert all(torch.equal(a, b) for a, b in zip(before, fused_model.parameters()))
            for p, saved in zip(fused_model.parameters(), state_before):
                assert fused.state[p].keys() == saved.keys() and int(fused.state[p]["step"]) == 1
                for k, v in fused.state[p].items():
                    assert torch.equal(v, saved[k]), k
        else:
            plain.step()
    assert scaler.skipped_steps == 1
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fused.state[a]["exp_avg"], plain.state[b]["exp_avg"], rtol=1e-6, atol=1e-9)
        assert int(fused.state[a]["step"]) == int(plain.state[b]["step"]) == 2


# ------------------------------------------------------------------------- values the device tensors cannot hold
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hysteresis": 2**40}, r"hysteresis=1099511627776 .*integer >= 1 and <= 2147483647 \(the hysteresis .*int32"),
        ({"growth_interval": 2**40}, r"growth_interval=1099511627776 .*integer >= 1 and <= 2147483647 \(.*int32"),
        ({"max_scale": 1e39}, r"max_scale=1e\+39 .*float32.*\[1\.1754943508222875e-38, 3\.4028234663852886e\+38\]"),
        ({"init_scale": 1e39}, r"init_scale=1e\+39 .*float32.*\[1\.1754943508222875e-38, 3\.4028234663852886e\+38\]"),
        ({"init_scale": 1e39, "max_scale": 1e39}, r"init_scale=1e\+39 .*float32"),
        ({"min_scale": 1e-50}, r"min_scale=1e-50 .*float32.*\[1\.1754943508222875e-38, 3\.4028234663852886e\+38\]"),
        ({"min_scale": 1e39}, r"min_scale=1e\+39 .*float32"),
    ],
)
def test_values_beyond_the_device_tensors_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler("cpu", **kwargs)


def test_values_at_the_limits_of_the_device_tensors_work():
    scaler = DynamicLossScaler(
        "cpu", init_scale=2.0**100, min_scale=F32.tiny, max_scale=F32.max, hysteresis=2**31 - 1,
        growth_interval=2**31 - 1,
    )
    scales, _ = run_steps(scaler, ".o.", factor=1e-30)
    assert scales == [2.0**100] * 3  # the overflow is absorbed by hysteresis, growth is far away
    floor = DynamicLossScaler("cpu", init_scale=F32.tiny * 4, min_scale=F32.tiny, max_scale=F32.max)
    assert run_steps(floor, "ooo")[0] == [F32.tiny * 2, F32.tiny, F32.tiny]


# --------------------------------------------------------------------------------- checkpoints that cannot be right
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scale", math.nan),
        ("scale", math.inf),
        ("scale", -1.0),
        ("scale", 0.0),
        ("scale", 1e39),
        ("scale", "1024"),
        ("growth_factor", math.nan),
        ("backoff_factor", 1.5),
        ("growth_interval", 0),
        ("growth_interval", 2.5),
        ("_growth_tracker", -1),
        ("_growth_tracker", 0.5),
        ("steps", -1),
        ("skipped_steps", 2.5),
        ("consecutive_skips", -3),
        ("consecutive_skips", math.nan),
        ("last_skipped", 2),
        ("_hysteresis_tracker", 1.5),
        ("_hysteresis_tracker", 2**40),
    ],
)
def test_load_state_dict_refuses_corrupt_values(field, value):
    source = DynamicLossScaler("cpu", init_scale=64.0, hysteresis=2)
    run_steps(source, "o.")
    state = source.state_dict()
    state[field] = value
    target = DynamicLossScaler("cpu", init_scale=8.0, hysteresis=2)
    run_steps(target, ".")
    before = target.state_dict()
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        target.load_state_dict(state)
    assert target.state_dict() == before  # nothing was half-loaded


def test_load_state_dict_refuses_a_corrupt_plain_gradscaler_state():
    plain = torch.amp.GradScaler("cpu").state_dict()
    plain["scale"] = math.nan
    with pytest.raises(ValueError, match="scale=nan"):
        DynamicLossScaler("cpu").load_state_dict(plain)


def test_load_state_dict_accepts_what_a_run_can_produce():
    source = DynamicLossScaler("cpu", init_scale=64.0, hysteresis=2)
    run_steps(source, "ooo")  # overflows past the hysteresis budget: the tracker goes below 0
    state = source.state_dict()
    assert state["_hysteresis_tracker"] == -1
    state["steps"] = 3.0  # an integral float (e.g. from a YAML/JSON round trip) is an integer
    target = DynamicLossScaler("cpu", hysteresis=2)
    target.load_state_dict(state)
    assert (target.get_scale(), target.steps, target.skipped_steps) == (16.0, 3, 3)
    assert run_steps(target, "o")[0] == [8.0]  # still no budget left: backs off at once, as the source would
    with pytest.raises(KeyError, match="empty"):
        target.load_state_dict({})  # a disabled scaler's state: torch raises too


# ------------------------------------------------------------------------------------- the scale policy on its own
def test_scale_policy_on_its_own():
    from lightning_mp.scaling import ScalePolicy

    policy = ScalePolicy(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=2,
                         consecutive_hysteresis=True, min_scale=1.0, max_scale=8.0)
    scale, growth, budget = torch.tensor(4.0), torch.tensor(0, dtype=torch.int32), torch.tensor(2, dtype=torch.int32)
    history = []
    for found_inf in (1, 1, 0, 0, 0, 0, 1):
        policy.update_(scale, growth, budget, torch.tensor(bool(found_inf)))
        history.append((scale.item(), int(growth), int(budget)))
    assert history == [(4.0, 0, 1), (2.0, 0, 0), (2.0, 1, 2), (4.0, 0, 2), (4.0, 1, 2), (8.0, 0, 2), (8.0, 0, 1)]


def test_adopting_torchs_scaler_keeps_enabled_settings_and_state():
    off = adopt_scaler(torch.amp.GradScaler("cpu", enabled=False))
    assert isinstance(off, DynamicLossScaler) and not off.is_enabled()
    on = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=7)
    on.scale(torch.ones(()))
    ours = adopt_scaler(on)
    assert ours.is_enabled() and ours.get_scale() == 64.0 and ours.get_growth_interval() == 7
    assert type(on) is torch.amp.GradScaler and ours.twin is on  # composition: the given scaler is not changed


def test_a_given_gradscaler_shows_the_scale_training_moves():
    """The user's GradScaler shares the adopted scaler's scale and growth count: get_scale() and state_dict() follow."""
    given = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    ours = adopt_scaler(given)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for bad in (False, True, False, False):
        ours.scale((p * (float("inf") if bad else 1.0)).sum()).backward()
        ours.step(opt)
        ours.update()
        opt.zero_grad()
    assert ours.get_scale() == given.get_scale() == 8.0  # 8 -> 4 (overflow) -> 4 -> 8 (two clean steps)
    assert given.state_dict() == {k: v for k, v in ours.state_dict().items() if k in given.state_dict()}
    assert type(given) is torch.amp.GradScaler and not hasattr(given, "skips")
