"""The optimizer step without a Trainer: OptimizerSteps driven by a plain loop (milliseconds), and the plan each
optimizer's steps follow, decided once (lightning_mp/step.py)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mp.nonfinite import NonfiniteGuard
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.stats import StepStats
from lightning_mp.plans import _CHECK_ONLY, _CHECK_ONLY_FUSED, _CLOSURE, _GENERAL
from lightning_mp.step import OptimizerSteps


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _steps(scaling: bool = False, max_consecutive_skips=None) -> tuple[OptimizerSteps, StepStats]:
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8) if scaling else NonfiniteGuard("cpu")
    scaler.ensure_initialized(torch.device("cpu"))
    stats = StepStats(scaler)
    return OptimizerSteps(scaler, None, stats, max_consecutive_skips=max_consecutive_skips), stats


def _loop(steps: OptimizerSteps, model: Net, opt, batches, *, clip=None, scaler_scale=None):
    losses = []
    for x, y in batches:
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model.net(x), y)
            (loss * scaler_scale() if scaler_scale else loss).backward()
            losses.append(loss.item())
            return loss

        def hooks():
            if clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                steps.record_norm(opt, norm)

        steps.begin_batch(model, [opt])
        steps.run(opt, closure, hooks)
    return losses


def _batches(n: int, poison: int | None = None) -> list:
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]
    if poison is not None:
        out[poison][0][0, 0] = float("nan")
    return out


@pytest.mark.parametrize("clip", [None, 1.0])
def test_plain_loop_skips_a_nan_step_bit_identically(clip):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps, stats = _steps()
    steps.connect(model, [opt])
    _loop(steps, model, opt, _batches(3), clip=clip)
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()} for k, v in opt.state.items()}
    _loop(steps, model, opt, _batches(1, poison=0), clip=clip)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    for key, saved in state.items():
        for name, value in saved.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt.state[key][name])), name
    assert (stats.steps, stats.skipped_steps, stats.consecutive_skips) == (4, 1, 1)
    losses = _loop(steps, model, opt, _batches(1) * 40)  # one batch, learnt
    assert stats.consecutive_skips == 0 and losses[-1] < losses[0]
    assert steps._optimizers[id(opt)].plan.kind is _CHECK_ONLY


def test_the_plan_is_decided_once_and_again_after_a_mode_switch():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, _ = _steps()
    steps.connect(model, [opt])
    _loop(steps, model, opt, _batches(2))
    assert steps._optimizers[id(opt)].plan.kind is _CHECK_ONLY
    scaling = DynamicLossScaler("cpu", init_scale=2.0**8)
    scaling.ensure_initialized(torch.device("cpu"))
    steps.scaler = scaling  # fp32 -> fp16 between steps (PrecisionSchedule)
    assert steps._optimizers[id(opt)].plan is None
    _loop(steps, model, opt, _batches(2), scaler_scale=scaling.get_scale)
    assert steps._optimizers[id(opt)].plan.kind is _GENERAL


@pytest.mark.parametrize("device_verdict", [True, False])
def test_lbfgs_and_fused_optimizers_take_their_own_plans(device_verdict, monkeypatch):
    """A fused optimizer takes the verdict on the device where that spares a sync (CUDA; here the CPU stands in),
    the host's answer elsewhere: either way a poisoned step leaves the weights and Adam's step count as they were."""
    import lightning_mp.verdict as verdict_module

    monkeypatch.setattr(verdict_module, "DEVICE_VERDICT_TYPES", ("cuda", "cpu") if device_verdict else ("cuda",))
    model = Net()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    steps, stats = _steps()
    steps.connect(model, [lbfgs])
    _loop(steps, model, lbfgs, _batches(2))
    assert steps._optimizers[id(lbfgs)].plan.kind is _CLOSURE and stats.steps == 2
    model = Net()
    fused = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    steps, stats = _steps()
    steps.connect(model, [fused])
    before = [p.detach().clone() for p in model.parameters()]
    _loop(steps, model, fused, _batches(1, poison=0))
    # (the fused kernel skips on found_inf, or the host does not call it)
    assert steps._optimizers[id(fused)].plan.kind is (_CHECK_ONLY_FUSED if device_verdict else _CHECK_ONLY)
    assert stats.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(int(s["step"]) == 0 for s in fused.state.values())  # Adam's step count held too
    _loop(steps, model, fused, _batches(2))
    assert (stats.steps, stats.skipped_steps) == (3, 1)
    assert all(int(s["step"]) == 2 for s in fused.state.values())


def test_divergence_stop_in_a_plain_loop():
    from lightning_mp.stats import NonFiniteTrainingError

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, _ = _steps(max_consecutive_skips=3)
    steps.connect(model, [opt])
    with pytest.raises(NonFiniteTrainingError, match="3 optimizer steps in a row"):
        for _ in range(3):
            _loop(steps, model, opt, _batches(1, poison=0))


def test_the_planned_check_falls_back_where_gradients_are_not_as_planned():
    """A sparse embedding gradient, a parameter group added mid-run, a NaN in either: still skipped."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    model = Net()
    model.emb, model.head = emb, head
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    steps, stats = _steps()
    steps.connect(model, [opt])
    idx = torch.tensor([1, 2, 3])

    def step(poison: bool = False) -> None:
        def closure():
            opt.zero_grad()
            out = head(emb(idx)).sum() * (float("nan") if poison else 1.0)
            out.backward()
            return out

        steps.run(opt, closure, lambda: None)

    step()
    before = emb.weight.detach().clone()
    step(poison=True)
    assert torch.equal(before, emb.weight) and stats.skipped_steps == 1
    opt.add_param_group({"params": head.parameters()})
    head_before = [p.detach().clone() for p in head.parameters()]
    step(poison=True)
    assert stats.skipped_steps == 2 and all(torch.equal(a, b) for a, b in zip(head_before, head.parameters()))
    step()
    assert stats.skipped_steps == 2 and not torch.equal(head_before[0], head.weight)


def test_step_counters_copied_or_pickled_with_outcomes_on_their_way():
    """A copy of the counters (deepcopy, pickle) takes the outcomes recorded so far, device verdicts still on their
    way included; the original counts on unchanged."""
    import copy
    import pickle

    from lightning_mp.stats import OptimizerStats

    stats = OptimizerStats()
    for flag in (1.0, 1.0, 0.0, 1.0):
        stats.record(None, torch.tensor(flag))  # device verdicts (here CPU tensors): read later
    stats.record(True, None)  # a host-known outcome after them
    for other in (copy.deepcopy(stats), pickle.loads(pickle.dumps(stats))):
        assert (other.steps, other.skipped_steps, other.consecutive_skips) == (5, 4, 2)
        other.record(None, torch.tensor(0.0))
        assert (other.steps, other.skipped_steps, other.consecutive_skips) == (6, 4, 0)
    assert (stats.steps, stats.skipped_steps, stats.consecutive_skips, stats.last_skipped) == (5, 4, 2, True)


def test_step_counters_wait_for_the_oldest_outcome_only_when_too_many_are_on_their_way(monkeypatch):
    """With no divergence stop reading the counters each step, device verdicts pile up: recording one more then
    waits for the oldest alone (long landed), never for the newest (a wait for the whole device)."""
    from lightning_mp import stats as stats_module

    waited: list[float] = []

    class NeverReady:  # a copy that has not landed until waited for
        def start(self, tensor):
            self.v = float(tensor)

        def ready(self):
            return False

        def value(self):
            waited.append(self.v)
            return self.v

    monkeypatch.setattr(stats_module, "HostCopy", NeverReady)
    stats = stats_module.OptimizerStats()
    flags = [float(i % 2) for i in range(12)]  # device verdicts 0, 1, 0, 1, ...
    for flag in flags:
        stats.record(None, torch.tensor(flag))
    limit = stats_module._MAX_PENDING
    assert waited == flags[: len(flags) - limit]  # the oldest ones, one a step once the queue was full
    assert len(stats._pending) == limit
    assert stats.skipped_steps == sum(flags) and waited == flags  # a figure read now waits for the rest


def test_device_verdicts_reach_the_counters_a_batch_at_a_time():
    """Verdicts sent to the host a batch at a time (one copy a batch; on the CPU the same logic with immediate copies):
    the counters read without waiting (the divergence stop) see a batch once it has gone, a figure read now sends the
    open batch early and is exact, a copy of the counters takes what is still held, and buffers are reused."""
    import copy
    import pickle

    from lightning_mp._host import HostBatches
    from lightning_mp.stats import OptimizerStats

    batches = HostBatches(torch.device("cpu"), 4)
    entries = [batches.push(torch.tensor(v)) for v in (0.0, 1.0, 1.0)]
    assert not any(batches.ready(e) for e in entries)  # held, not sent: a batch goes when full
    entries.append(batches.push(torch.tensor(1.0)))
    assert all(batches.ready(e) for e in entries)
    assert [batches.take(e) for e in entries] == [0.0, 1.0, 1.0, 1.0]
    assert not batches.ready(entries[0])  # every value taken: the buffer is free (NaN) and reused
    late = batches.push(torch.tensor(1.0))
    assert late[0] is entries[0][0] and not batches.ready(late)
    assert batches.take(late) == 1.0  # the open batch is sent early where a value is needed now
    with pytest.raises(ValueError, match="size=0"):
        HostBatches(torch.device("cpu"), 0)

    stats = OptimizerStats()
    stats.verdict_batch = 4
    stats._batches = HostBatches(torch.device("cpu"), 4)  # (made at the first CUDA verdict on a GPU)
    flags = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    for flag in flags:
        stats.record(None, torch.tensor(flag))
    assert stats.consecutive_known() == 0  # the first batch went: 1, 1, 1, 0 — the last two are held
    assert len(stats._pending) == 2
    for other in (copy.deepcopy(stats), pickle.loads(pickle.dumps(stats))):
        assert (other.steps, other.skipped_steps, other.consecutive_skips) == (6, 5, 2)
    assert (stats.steps, stats.skipped_steps, stats.consecutive_skips, stats.last_skipped) == (6, 5, 2, True)


@pytest.mark.parametrize("limit, batch", [(None, 8), (100, 8), (12, 3), (3, 1), (1, 1)])
def test_verdict_batch_follows_the_divergence_limit(limit, batch):
    """The divergence stop sees device verdicts up to a batch late: the batch is at most a quarter of its limit."""
    steps, _ = _steps(max_consecutive_skips=limit)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps.connect(model, [opt])
    assert steps._state(opt).stats.verdict_batch == batch
    late = torch.optim.SGD(model.parameters(), lr=0.1)  # an optimizer made outside configure_optimizers
    assert steps._state(late).stats.verdict_batch == batch


def test_step_counters_pickled_before_verdict_batches_still_load():
    """Counters pickled by the release that sent a verdict a step (a ``_ring`` attribute, no batch size) load and
    count on."""
    import pickle

    from lightning_mp.stats import OptimizerStats

    stats = OptimizerStats()
    stats.record(True, None)
    old = dict(stats.__dict__)
    del old["_batches"], old["verdict_batch"]
    old["_ring"] = None
    restored = OptimizerStats.__new__(OptimizerStats)
    restored.__setstate__(old)
    restored.record(None, torch.tensor(1.0))
    assert (restored.steps, restored.skipped_steps, restored.consecutive_skips) == (2, 2, 2)
    assert pickle.loads(pickle.dumps(restored)).skipped_steps == 2
