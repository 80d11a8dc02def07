"""The FP8 saturation sentinel (lightning_mp.fp8.sentinel) on the CPU.

Transformer Engine is not installed here, so the FP8 modules are plain ``nn.Linear`` layers (the hook mode watches
any module) and TE's ``FP8GlobalStateManager`` is a stand-in with the same attributes (the amax mode). The same
behaviour runs for real with TE on the GPU machine: tests/gpu/test_fault_fp8.py (an inf entering an FP8 GEMM is
skipped, for the delayed and the current recipe).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_mp.fp8.sentinel import SaturationSentinel, _ORIGINAL_REDUCE, install_amax_watch, uninstall_amax_watch
from lightning_mp.nonfinite import NonfiniteGuard


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def _flag(sentinel: SaturationSentinel) -> float:
    taken = sentinel.take()
    return 0.0 if taken is None else float(taken)


def test_hooks_find_an_inf_input_and_an_inf_output_gradient():
    model = _model()
    sentinel = SaturationSentinel()
    assert sentinel.attach([model[0], model[2]], delayed=False) == "hooks"
    model(torch.randn(4, 8)).sum().backward()
    assert _flag(sentinel) == 0.0

    x = torch.randn(4, 8)
    x[1, 3] = math.inf  # what an FP8 cast would saturate
    model(x)
    assert _flag(sentinel) >= 1.0  # both layers saw it (the inf passes the ReLU)
    assert _flag(sentinel) == 0.0  # take() resets

    out = model(torch.randn(4, 8))
    out.backward(torch.full_like(out, -math.inf))  # an inf gradient flowing back into the last layer
    assert _flag(sentinel) >= 1.0


def test_hooks_leave_evaluation_alone_and_detach_cleanly():
    model = _model()
    sentinel = SaturationSentinel()
    sentinel.attach([model[0]], delayed=False)
    bad = torch.full((2, 8), math.inf)
    with torch.no_grad():
        model(bad)  # evaluation does not step
    model.eval()
    model(bad)
    assert sentinel.take() is None
    model.train()
    sentinel.detach()
    model(bad)
    assert sentinel.take() is None and sentinel.mode is None
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


class _State:
    def __init__(self) -> None:
        self.global_amax_buffer: dict[str, list[torch.Tensor]] = {}


class FakeManager:
    """What the sentinel reads of TE's FP8GlobalStateManager (TE 2.x layout); records the reductions."""

    quantization_state = _State()
    reductions: list[tuple[bool, list[float]]] = []

    @staticmethod
    def split_key_in_buffer(key: str) -> tuple[bool, str]:
        return key.startswith("forward"), key.split("_", 1)[1]

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        rows = [
            t
            for k, ts in cls.quantization_state.global_amax_buffer.items()
            if k.startswith("forward") == forward
            for t in ts
        ]
        cls.reductions.append((forward, [float(v) for t in rows for v in t]))


@pytest.fixture
def manager():
    FakeManager.quantization_state = _State()
    FakeManager.reductions = []
    original = FakeManager.__dict__["reduce_and_update_fp8_tensors"]
    yield FakeManager
    uninstall_amax_watch()
    assert FakeManager.__dict__["reduce_and_update_fp8_tensors"] is original


def test_amax_mode_reads_te_amaxes_before_each_reduction_and_scrubs_a_poisoned_step(manager):
    history_fwd = torch.zeros(4, 3)  # amax_history of one module: rows = steps, columns = input/weight/output
    history_bwd = torch.zeros(4, 2)
    manager.quantization_state.global_amax_buffer = {"forward_k": [history_fwd[0]], "backward_k": [history_bwd[0]]}
    sentinel = SaturationSentinel(manager=manager)
    assert sentinel.attach([], delayed=True) == "amax"

    history_fwd[0] = torch.tensor([3.0, 0.5, 0.0])  # a clean forward: what TE's cast kernels record
    manager.reduce_and_update_fp8_tensors(forward=True)
    history_bwd[0] = torch.tensor([0.25, 0.0])
    manager.reduce_and_update_fp8_tensors(forward=False)
    assert manager.reductions == [(True, [3.0, 0.5, 0.0]), (False, [0.25, 0.0])]  # TE's method still runs, unchanged
    assert _flag(sentinel) == 0.0

    history_fwd[0] = torch.tensor([math.inf, 0.5, 0.0])  # an inf activation: TE would saturate it
    manager.reduce_and_update_fp8_tensors(forward=True)
    history_bwd[0] = torch.tensor([0.25, 0.0])  # a finite backward of the same poisoned step
    manager.reduce_and_update_fp8_tensors(forward=False)
    # the flag is up, and TE folds zeros (its "no data": the scale is kept) into the history, not the inf
    assert manager.reductions[2:] == [(True, [0.0, 0.0, 0.0]), (False, [0.0, 0.0])]
    assert _flag(sentinel) == 1.0

    history_fwd[0] = torch.tensor([2.0, 0.5, 0.0])  # the next step is clean again
    manager.reduce_and_update_fp8_tensors(forward=True)
    assert manager.reductions[4] == (True, [2.0, 0.5, 0.0]) and _flag(sentinel) == 0.0


def test_amax_mode_falls_back_to_hooks_without_te_manager():
    class NoManager:  # no classmethod to wrap
        pass

    model = _model()
    sentinel = SaturationSentinel(manager=NoManager)
    assert sentinel.attach([model[0]], delayed=True) == "hooks"
    sentinel.detach()


def test_amax_watch_is_installed_once_and_removed_with_the_last_sentinel(manager):
    a, b = SaturationSentinel(manager=manager), SaturationSentinel(manager=manager)
    a.attach([], delayed=True)
    b.attach([], delayed=True)
    assert install_amax_watch(manager) and len(_ORIGINAL_REDUCE) == 1
    a.detach()
    assert len(_ORIGINAL_REDUCE) == 1  # b still watches
    b.detach()
    assert not _ORIGINAL_REDUCE


@pytest.mark.parametrize("fused", [False, True])
def test_a_finding_added_to_the_verdict_skips_the_step(fused):
    """Verdicts.add_: finite gradients, a raised flag: the optimizer does not step."""
    model = _model()
    opt = (
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        if fused
        else torch.optim.AdamW(model.parameters(), lr=0.1)
    )
    guard = NonfiniteGuard("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    for flag, moves in ((1.0, False), (0.0, True)):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        guard.check_(opt)
        guard.verdicts.add_(opt, torch.tensor(flag))
        _, skipped = guard.step_outcome(opt)
        guard.update()
        same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert same is not moves
        assert skipped is (not moves)
    assert not opt.state or all(int(s["step"]) == 1 for s in opt.state.values())  # the skipped step left no trace


def test_a_finding_before_the_check_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonfiniteGuard("cpu")
    with pytest.raises(RuntimeError, match="must follow unscale_"):
        guard.verdicts.add_(opt, torch.tensor(1.0))


def test_amax_mode_ignores_reductions_while_the_model_evaluates(manager):
    history = torch.zeros(2, 3)
    manager.quantization_state.global_amax_buffer = {"forward_k": [history[0]]}
    model = _model()
    sentinel = SaturationSentinel(manager=manager)
    sentinel.attach([model[0]], delayed=True, root=model)
    model.eval()  # e.g. validation with fp8_in_eval and grad enabled: no optimizer step follows
    history[0] = torch.tensor([math.inf, 1.0, 0.0])
    manager.reduce_and_update_fp8_tensors(forward=True)
    assert sentinel.take() is None and manager.reductions[-1][1][0] == math.inf  # neither flagged nor scrubbed
    model.train()
    manager.reduce_and_update_fp8_tensors(forward=True)
    assert float(sentinel.take()) == 1.0
    sentinel.detach()


def test_seeding_optimizer_masters_needs_the_te_interface_and_an_unchanged_weight():
    from lightning_mp.master import cast_module_, keeps_own_masters, seed_optimizer_masters

    original = torch.tensor([1.0 + 2**-12, 2.0])

    def cast_param() -> torch.nn.Parameter:
        holder = torch.nn.Module()
        holder.p = torch.nn.Parameter(original.clone())
        cast_module_(holder, torch.bfloat16)  # remembers the fp32 value it replaced
        return holder.p

    p = cast_param()
    plain = torch.optim.AdamW([p])
    assert not keeps_own_masters(plain) and seed_optimizer_masters(plain) == 0

    class Own(torch.optim.SGD):
        master_weights = True
        store_param_remainders = False

        def initialize_state(self, param, remainders):
            self.state[param]["master_param"] = param.detach().float().clone()

        def set_scaled_state(self, param, name, value):
            self.state[param][name] = value.clone()

    opt = Own([p], lr=0.1)
    assert keeps_own_masters(opt)
    assert seed_optimizer_masters(opt) == 1
    assert torch.equal(opt.state[p]["master_param"], original)  # the exact fp32 value, not its bf16 rounding
    changed = cast_param()
    with torch.no_grad():
        changed.mul_(2)  # written since the cast: its own value is the truth
    assert seed_optimizer_masters(Own([changed], lr=0.1)) == 0
    remainders = Own([cast_param()], lr=0.1)
    remainders.store_param_remainders = True  # masters as 16 extra bits of the bf16 weight: not settable to any fp32
    assert seed_optimizer_masters(remainders) == 0
