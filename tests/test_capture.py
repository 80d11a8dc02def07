"""The captured step's decisions on the CPU (lightning_mp/capture.py; the graph itself runs on the GPU machine:
tests/gpu/test_captured_step_gpu.py).

Why a step is not captured (each reason named), the setting, and the captured plan's bookkeeping through the real
Trainer with the CUDA graph replaced by a stand-in that runs the same operations eagerly: the device flag reaches the
counters, a skipped step restores BatchNorm's statistics and holds the scheduler, a step without every gradient runs
eagerly, new optimizer state is captured again, a float learning rate changing every step gives the capture up.
"""

from __future__ import annotations

import math
import pickle
from typing import Optional

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp import capture as capture_module
from lightning_mp.capture import CapturedPlan, CapturedStep, why_not
from lightning_mp.plans import CheckOnlyPlan

CUDA = torch.device("cuda", 0)


@pytest.fixture
def with_conditional_nodes(monkeypatch):
    monkeypatch.setattr(capture_module, "conditional_nodes", lambda: True)


@pytest.mark.parametrize(("make", "reason"), [
    (lambda p: torch.optim.AdamW(p, lr=1e-2), "made without capturable=True"),
    (lambda p: torch.optim.RMSprop(p, lr=1e-2), "RMSprop is not one of torch's Adam, AdamW or SGD"),
    (lambda p: torch.optim.LBFGS(p), "LBFGS is not one of"),
    (lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)), "SGD reads a tensor learning rate on the host"),
    (lambda p: torch.optim.Adam(p, lr=torch.tensor(0.1), capturable=True), "a hyperparameter is a tensor off cuda:0"),
    (lambda p: torch.optim.AdamW(p, lr=1e-2, capturable=True), "not all dense tensors on cuda:0"),
])
def test_why_a_step_is_not_captured(with_conditional_nodes, make, reason):
    assert reason in why_not(make([nn.Parameter(torch.zeros(3))]), CUDA)


def test_subclasses_and_step_hooks_are_not_captured(with_conditional_nodes):
    class MyAdam(torch.optim.Adam):
        pass

    params = [nn.Parameter(torch.zeros(3))]
    assert "MyAdam is not one of" in why_not(MyAdam(params, capturable=True), CUDA)
    opt = torch.optim.Adam(params, capturable=True)
    opt.register_step_post_hook(lambda *a: None)
    assert "step hooks" in why_not(opt, CUDA)


def test_on_the_cpu_the_reason_is_the_device():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=1e-2, capturable=True)
    assert why_not(opt, torch.device("cpu")) == "the device is cpu, not CUDA"


@pytest.mark.parametrize("bad", [None, "yes", 1])
def test_capture_step_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="capture_step"):
        MPPlugin("bf16", capture_step=bad)


# ------------------------------------------------------------------ the plan's bookkeeping, the graph stood in for
class StandInGraph:
    """What the captured graph does, eagerly on the CPU: the check into the flag, the step only where it is zero."""

    def __init__(self, step: CapturedStep) -> None:
        self.step = step

    def replay(self) -> None:
        s = self.step
        s.flag.copy_(s.flag_in)
        for g in s.static_grads:
            s.flag.copy_(torch.maximum(s.flag, (~torch.isfinite(g)).any().float()))
        if s.flag.item() == 0:
            held = [p.grad for p in s.params]
            for p, g in zip(s.params, s.static_grads):
                p.grad = g
            s.optimizer.step()
            for p, g in zip(s.params, held):
                p.grad = g


@pytest.fixture
def stand_in_graph(monkeypatch):
    captures = []

    def fake_capture(self, grads):
        self.static_grads = [torch.empty_like(g) for g in grads]
        self.flag_in, self.flag = torch.zeros(()), torch.zeros(())
        self.graph = StandInGraph(self)
        captures.append(self.seen)

    monkeypatch.setattr(capture_module, "why_not", lambda optimizer, device: None)
    monkeypatch.setattr(CapturedStep, "_capture", fake_capture)
    return captures


POISON = {4: math.inf, 6: math.nan}


class Net(LightningModule):
    def __init__(self, schedule: str = "tensor", unused_at: int = -1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.extra = nn.Linear(8, 1)  # used at every step but ``unused_at``
        self.schedule, self.unused_at = schedule, unused_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if batch_idx != self.unused_at:
            out = out + self.extra(x)
        loss = nn.functional.mse_loss(out, y)
        return loss * POISON[batch_idx] if batch_idx in POISON else loss

    def configure_optimizers(self):
        # (on the CPU torch refuses capturable=True; the stand-in graph needs none; a tensor lr: the single-tensor path)
        if self.schedule == "tensor":
            opt = torch.optim.AdamW(self.parameters(), lr=torch.tensor(0.01), foreach=False)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = (torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if self.schedule == "tensor"
                 else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(80, 8, generator=g), torch.randn(80, 1, generator=g)), batch_size=8)


def run(capture: bool, *, trainer_kwargs: Optional[dict] = None, ckpt: Optional[str] = None,
        save: Optional[str] = None, max_steps: int = 10, **kwargs):
    seed_everything(0)
    model, plugin = Net(**kwargs), MPPlugin("bf16", capture_step=capture)
    trainer = Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, max_steps=max_steps,
                      **(trainer_kwargs or {}))
    trainer.fit(model, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    plan = next(iter(plugin._steps._optimizers.values())).plan
    return model, trainer.optimizers[0], plugin, plan


def assert_same_runs(a, b):
    (ma, oa, pa, _), (mb, ob, pb, _) = a, b
    for (name, x), y in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(x, y), name
    for key, state in oa.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(v, ob.state_dict()["state"][key][k]), (key, k)
    assert float(oa.param_groups[0]["lr"]) == float(ob.param_groups[0]["lr"])
    assert pa.stats.skipped_steps == pb.stats.skipped_steps and pa.stats.steps == pb.stats.steps
    assert pa.stats.skipped_steps >= 1


def test_the_captured_plan_keeps_the_eager_steps_numbers(stand_in_graph):
    captured, eager = run(True), run(False)
    assert isinstance(captured[3], CapturedPlan) and type(eager[3]) is CheckOnlyPlan
    assert stand_in_graph == [capture_module.EAGER_STEPS + 1]  # captured once, after the eager steps
    assert_same_runs(captured, eager)
    # a plugin with a captured step pickles (ddp_spawn, checkpoint callbacks): the copy captures its own later
    copied = pickle.loads(pickle.dumps(captured[2]))
    assert next(iter(copied._steps._optimizers.values())).plan.captured.graph is None


def test_a_step_without_every_gradient_runs_eagerly(stand_in_graph):
    captured, eager = run(True, unused_at=5), run(False, unused_at=5)
    assert_same_runs(captured, eager)
    assert captured[3].captured.reason is None


def test_a_float_learning_rate_changing_every_step_gives_the_capture_up(stand_in_graph, caplog):
    with caplog.at_level("INFO", logger="lightning_mp.capture"):
        captured = run(True, schedule="float")
    eager = run(False, schedule="float")
    assert "pass the learning rate as a tensor" in captured[3].captured.reason
    assert len(stand_in_graph) == capture_module.RECAPTURES + 1
    assert any("eager from now on" in r.message for r in caplog.records)
    assert_same_runs(captured, eager)


@pytest.mark.parametrize(("mode", "kwargs", "reason"), [
    ("bf16-true", {}, "master weights"),
    ("fp16", {}, "scales the loss"),
    ("bf16", {"skip_nonfinite": False}, "not checked"),
    ("bf16", {"spike_sigma": 6.0}, "spike guard"),
])
def test_plans_that_are_not_captured_say_why(mode, kwargs, reason, caplog):
    class Plain(Net):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    seed_everything(0)
    with caplog.at_level("DEBUG", logger="lightning_mp.capture"):
        Trainer(accelerator="cpu", devices=1, plugins=[MPPlugin(mode, capture_step=True, **kwargs)], logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                max_steps=3).fit(Plain())
    said = [r.message for r in caplog.records if "not captured" in r.message]
    assert len(said) == 1 and reason in said[0], said


def test_closure_optimizers_say_why(caplog):
    class WithLBFGS(Net):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)

    seed_everything(0)
    with caplog.at_level("DEBUG", logger="lightning_mp.capture"):
        Trainer(accelerator="cpu", devices=1, plugins=[MPPlugin("bf16", capture_step=True)], logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                max_steps=2).fit(WithLBFGS())
    assert any("LBFGS evaluates its closure" in r.message for r in caplog.records), caplog.text


def test_bf16_optimizer_states_name_themselves_as_the_reason(with_conditional_nodes):
    from lightning_mp.optim_states import OptimizerStates

    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=0.01, capturable=True)
    OptimizerStates("bf16").hold(opt, "MPPlugin")
    assert "optimizer_states='bf16'" in why_not(opt, CUDA)


def test_a_non_fused_optimizer_on_cuda_is_told_how_to_spare_the_host_sync(caplog):
    from types import SimpleNamespace

    from lightning_mp.plans import say_host_sync

    params = [nn.Parameter(torch.zeros(3))]
    on_cuda, on_cpu = SimpleNamespace(scale_device=CUDA), SimpleNamespace(scale_device=torch.device("cpu"))
    with caplog.at_level("INFO", logger="lightning_mp.plans"):
        say_host_sync(torch.optim.AdamW(params, lr=0.01), on_cuda)
        say_host_sync(torch.optim.RMSprop(params, lr=0.01), on_cuda)
        say_host_sync(torch.optim.AdamW(params, lr=0.01, fused=True), on_cuda)  # skips on the device: nothing said
        say_host_sync(torch.optim.AdamW(params, lr=0.01), on_cpu)  # (no queue to drain on the CPU)
    said = [r.message for r in caplog.records]
    assert len(said) == 2 and "AdamW is not fused" in said[0] and "fused=True" in said[0]
    assert "RMSprop is not fused" in said[1] and "fused=True" not in said[1]


@pytest.mark.parametrize("clip", ("norm", "value"))
@pytest.mark.parametrize("accumulate", (1, 2))
def test_the_captured_plan_with_clipping_and_accumulation(stand_in_graph, clip, accumulate):
    """Clipping by norm hands its verdict to the graph (joined with the graph's own check); by value the inf is seen
    before the clamp; accumulation steps every second batch: the same numbers as the eager plan's."""
    kwargs = {"gradient_clip_val": 0.5, "gradient_clip_algorithm": clip, "accumulate_grad_batches": accumulate}
    captured, eager = run(True, trainer_kwargs=kwargs), run(False, trainer_kwargs=kwargs)
    assert isinstance(captured[3], CapturedPlan) and stand_in_graph
    assert_same_runs(captured, eager)


def test_a_resume_captures_again_and_keeps_the_eager_numbers(stand_in_graph, tmp_path):
    """The checkpoint of a captured run resumes as the eager run's does: the resumed run's optimizer state is new, so
    the step is captured again for it."""
    for capture in (True, False):
        run(capture, max_steps=5, save=str(tmp_path / f"{capture}.ckpt"))
    stand_in_graph.clear()
    captured = run(True, ckpt=str(tmp_path / "True.ckpt"))
    eager = run(False, ckpt=str(tmp_path / "False.ckpt"))
    assert stand_in_graph, "the resumed run captured nothing"
    assert_same_runs(captured, eager)
