"""A step the loop prepares (clips) and then does not take, and what a loop reads or writes between clipping and the
step, from the user's side, under Lightning Fabric and under the Trainer's manual optimization.

How users get there: LitGPT clips with ``error_if_nonfinite=True`` and a NaN gradient raises inside
``fabric.clip_gradients``; a loop catches it, zeroes the gradients and goes on; a loop reads the returned norm and
leaves the step out by its own rule (zeroing the gradients, or keeping them for the next batch); a loop clips, then
runs another backward before it steps; a Trainer ``training_step`` clips and returns without ``opt.step()``. The
oracles: the same program without the abandoned batch (a step not taken changes nothing, and the next step is the one
the clean program takes, counters included), Fabric's own plugin for the mode, and the clipped gradients themselves.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPFabricPrecision, MPPlugin

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
    pytest.mark.filterwarnings("ignore::lightning_mp.modes.PerformanceWarning"),  # fp16 on the CPU, on purpose
]

#: every mode and master-weight kind a user picks
CASES = [
    ("fp32", {}), ("bf16", {}), ("fp16", {"init_scale": 2.0**8}),
    ("bf16-true", {}), ("bf16-true", {"master_weights": "kahan"}), ("bf16-true", {"master_weights": "stochastic"}),
    ("bf16-true", {"master_weights": "none"}), ("fp16-true", {"init_scale": 2.0**8}),
]
IDS = [mode + "".join(f"-{v}" for v in kw.values() if isinstance(v, str)) for mode, kw in CASES]
#: the step whose gradients go NaN (or that the loop leaves out by its own rule)
BAD = 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def data(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 4, generator=g) for _ in range(n)]


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def fabric_run(mode: str, kw: dict, program: str, *, optimizer: str = "adam") -> tuple[torch.Tensor, tuple, list]:
    """A Fabric loop over six batches; ``program`` says what happens at batch ``BAD``:

    - ``clean``: the batch is left out before its forward (the oracle);
    - ``raise``: its loss is NaN, ``clip_gradients(error_if_nonfinite=True)`` raises, the loop zeroes and goes on;
    - ``rule``: its loss is NaN, the loop reads the returned norm, finds it not finite, zeroes and goes on;
    - ``rule-keep``: a finite batch the loop leaves out by its norm rule *without* zeroing: its gradients add to the
      next batch's (the oracle: ``keep``, the same without the clipping call);
    - ``keep``: the batch's backward runs, no clipping, no step, no zeroing.
    """
    plugin = MPFabricPrecision(mode, **kw)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = make_model()
    opt = torch.optim.Adam(raw.parameters(), lr=1e-2) if optimizer == "adam" else torch.optim.SGD(
        raw.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(raw, opt)
    norms = []
    for i, x in enumerate(data()):
        if i == BAD and program == "clean":
            continue
        loss = model(x).float().pow(2).mean()
        if i == BAD and program in ("raise", "rule"):
            loss = loss * float("nan")
        fabric.backward(loss)
        if i == BAD and program == "keep":
            continue
        try:
            norm = fabric.clip_gradients(model, opt, max_norm=1e4 if program.endswith("keep") else 0.5,
                                         error_if_nonfinite=program == "raise")
        except RuntimeError:
            opt.zero_grad()
            continue
        if i == BAD and program == "rule":
            assert not math.isfinite(float(norm))
            opt.zero_grad()
            continue
        if i == BAD and program == "rule-keep":
            continue
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    return weights(model), (plugin.stats.steps, plugin.stats.skipped_steps), norms


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
@pytest.mark.parametrize("program", ["raise", "rule"])
def test_fabric_abandoned_step_leaves_no_trace(mode, kw, program):
    """The clean batches after an abandoned NaN step train exactly as in the program that never saw that batch: not
    skipped, not counted as skipped, not stepped with the loss scale still in the gradients or with the abandoned
    batch's fp32 gradients."""
    got, counts, norms = fabric_run(mode, kw, program)
    want, want_counts, want_norms = fabric_run(mode, kw, "clean")
    assert counts == want_counts == (5, 0)
    assert norms == want_norms
    assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
def test_fabric_left_out_step_keeps_its_gradients(mode, kw):
    """A finite step left out after clipping, its gradients kept: they add to the next batch's as if clipping had
    not been called (in fp16 modes in the loss scale's units again: the next step unscales them once)."""
    got, counts, _ = fabric_run(mode, kw, "rule-keep", optimizer="sgd")
    want, want_counts, _ = fabric_run(mode, kw, "keep", optimizer="sgd")
    assert counts == want_counts == (5, 0)
    assert torch.equal(got, want), float((got - want).abs().max())


def _clip_then(mode: str, kw: dict, after: str) -> tuple[nn.Module, Any, list, list]:
    plugin = MPFabricPrecision(mode, **kw)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = make_model()
    fp32_before = [p.detach().clone() for p in raw.parameters()]  # (fp32 masters start from these exactly)
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.5))
    before = [p.detach().clone() for p in model.parameters()]
    if plugin.master_weights == "fp32":
        before = fp32_before
    fabric.backward(model(data()[0]).float().pow(2).mean() * 100)
    fabric.clip_gradients(model, opt, max_norm=0.01)
    read = [p.grad.detach().float().clone() for p in model.parameters()]
    if after == "zero":
        for p in model.parameters():
            p.grad.zero_()
    elif after == "none":
        for p in model.parameters():
            p.grad = None
    elif after == "double":
        for p in model.parameters():
            p.grad.mul_(2)
    opt.step()
    return model, plugin, before, read


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
def test_fabric_gradients_read_after_clipping_are_the_clipped_ones(mode, kw):
    """After ``fabric.clip_gradients(max_norm=0.01)`` the loop reads gradients of total norm 0.01 (not the unclipped
    ~hundreds), in every layout, and the step applies what it read (SGD, lr 0.5: the weights move by 0.5 x those)."""
    model, plugin, before, read = _clip_then(mode, kw, "read")
    total = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in read])))
    assert total == pytest.approx(0.01, rel=2e-2)
    atol = 1e-6
    if plugin.masters is not None and plugin.master_weights == "fp32":
        moved = [m.float() - b.float() for m, b in zip(plugin.masters.state_dict()["masters"].values(), before)]
    else:
        moved = [p.detach().float() - b.float() for p, b in zip(model.parameters(), before)]
        if next(model.parameters()).dtype != torch.float32:  # the half weights hold the step rounded
            atol = max(float(b.abs().max()) for b in before) * 2.0**-7
    for step, grad in zip(moved, read):
        torch.testing.assert_close(step, -0.5 * grad, rtol=2e-2, atol=atol)


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
@pytest.mark.parametrize("after", ["zero", "none", "double"])
def test_fabric_gradients_written_after_clipping_are_stepped(mode, kw, after):
    """What the loop writes into ``.grad`` between clipping and ``optimizer.step()`` is what is stepped: zeroed or
    set to ``None``, the weights (and fp32 masters) stay; doubled, they move by twice the clipped gradient."""
    model, plugin, before, read = _clip_then(mode, kw, after)
    now = [p.detach() for p in model.parameters()]
    if after in ("zero", "none"):
        for p, b in zip(now, before):
            assert torch.equal(p, b.to(p.dtype))
        if plugin.masters is not None and plugin.master_weights == "fp32":
            for m, b in zip(plugin.masters.state_dict()["masters"].values(), before):
                assert torch.equal(m, b)
        return
    atol = max(float(b.abs().max()) for b in before) * 2.0**-7 if now[0].dtype != torch.float32 else 1e-6
    for p, b, g in zip(now, before, read):
        torch.testing.assert_close(p.float() - b.float(), -0.5 * 2 * g, rtol=3e-2, atol=atol)


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
def test_fabric_clip_then_more_backward_then_step(mode, kw):
    """Clipped, then another backward before the step: the step applies the clipped gradients plus the new ones,
    checked again (the second batch's NaN is not hidden by the first clip's verdict) and unscaled once."""
    def run(poison_second: bool, clip_first: bool) -> tuple[torch.Tensor, tuple]:
        plugin = MPFabricPrecision(mode, **kw)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        raw = make_model()
        model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
        xs = data()
        fabric.backward(model(xs[0]).float().pow(2).mean())
        if clip_first:
            fabric.clip_gradients(model, opt, max_norm=1e4)  # (does not change them)
        loss = model(xs[1]).float().pow(2).mean()
        fabric.backward(loss * float("nan") if poison_second else loss)
        opt.step()
        return weights(model), (plugin.stats.steps, plugin.stats.skipped_steps)

    got, counts = run(False, True)
    want, want_counts = run(False, False)
    assert counts == want_counts == (1, 0)
    assert torch.equal(got, want)
    _, counts = run(True, True)
    assert counts == (1, 1)


# ------------------------------------------------------------------------------------------ the Trainer's manual loop
class ManualClip(LightningModule):
    """Manual optimization that clips and leaves out a step by its own rule (norm not finite), as a Fabric loop."""

    def __init__(self, bad: Optional[int], clean: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = make_model()
        self.bad, self.clean = bad, clean

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        if batch_idx == self.bad and self.clean:
            return
        loss = self.net(batch[0]).float().pow(2).mean()
        if batch_idx == self.bad:
            loss = loss * float("nan")
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        if batch_idx == self.bad:
            return  # left out: the next training_step zeroes the gradients
        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_run(mode: str, kw: dict, clean: bool) -> tuple[torch.Tensor, tuple]:
    plugin = MPPlugin(mode, **kw)
    model = ManualClip(BAD, clean)
    xs = torch.cat(data())
    trainer = Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(xs), batch_size=16))
    return weights(model.net), (plugin.stats.steps, plugin.stats.skipped_steps)


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
def test_trainer_manual_left_out_step_leaves_no_trace(mode, kw):
    got, counts = trainer_run(mode, kw, clean=False)
    want, want_counts = trainer_run(mode, kw, clean=True)
    assert counts == want_counts == (5, 0)
    assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
def test_fabric_forward_between_clipping_and_step_keeps_the_step(mode, kw):
    """A forward alone between clipping and the step (a metric computed in train mode) does not end the prepared
    step: an inf that clipping by value made finite still skips it, and nothing changes."""
    plugin = MPFabricPrecision(mode, **kw)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = make_model()
    model, opt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9))
    xs = data()
    fabric.backward(model(xs[0]).float().pow(2).mean())
    opt.step()
    opt.zero_grad()
    before = weights(model)
    fabric.backward(model(xs[1]).float().pow(2).mean() * float("inf"))
    fabric.clip_gradients(model, opt, clip_val=0.1)
    model(xs[2])  # (a forward whose output is not trained on)
    opt.step()
    assert torch.equal(weights(model), before)
    assert (plugin.stats.steps, plugin.stats.skipped_steps) == (2, 1)


def test_fabric_messages_name_the_fabric_plugin():
    """An error raised inside the step under Fabric names the class in use, not the Trainer's plugin."""
    plugin = MPFabricPrecision("fp16", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = make_model()
    model, opt = fabric.setup(raw, torch.optim.LBFGS(raw.parameters(), lr=0.1))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(data()[0]).float().pow(2).mean()
        fabric.backward(loss)
        return loss

    with pytest.raises(Exception, match=r"^MPFabricPrecision: LBFGS evaluates its closure"):
        opt.step(closure)


@pytest.mark.parametrize(("mode", "kw"), CASES, ids=IDS)
def test_fabric_two_optimizers_clipped_before_either_steps(mode, kw):
    """Two optimizers over disjoint parameters, both clipped, then both stepped (and, in a second program, the second
    one left out): each steps its own true gradients, unscaled once, as the fp32 run of the same loop (the loss scale
    moves once both have stepped: the second's gradients were unscaled with the first's scale)."""
    def run(precision: MPFabricPrecision, leave_out_second: bool) -> torch.Tensor:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
        raw = make_model()
        opt1 = torch.optim.SGD(raw[0].parameters(), lr=0.1, momentum=0.9)
        opt2 = torch.optim.SGD(raw[2].parameters(), lr=0.1, momentum=0.9)
        model, opt1, opt2 = fabric.setup(raw, opt1, opt2)
        for i, x in enumerate(data(4)):
            fabric.backward(model(x).float().pow(2).mean())
            fabric.clip_gradients(model, opt1, max_norm=1e4)
            fabric.clip_gradients(model, opt2, max_norm=1e4)
            opt1.step()
            if not (leave_out_second and i == 1):
                opt2.step()
            opt1.zero_grad()
            opt2.zero_grad()
        return weights(model)

    for leave_out in (False, True):
        got = run(MPFabricPrecision(mode, **kw), leave_out)
        want = run(MPFabricPrecision("fp32"), leave_out)
        tol = 0.0 if mode in ("fp32",) else 0.05
        assert float((got - want).abs().max()) <= tol, (leave_out, float((got - want).abs().max()))
