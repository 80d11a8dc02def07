"""After any Trainer entry point, in every mode, the user's module is a plain module again and the process's state is
as it was: no hook, wrapper or attribute of ours, autocast, the default dtype and TF32 flags unchanged; also when the
run ends with an exception or an interrupt (lightning_mp/patches.py)."""

from __future__ import annotations

import gc
import signal

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp.guards import apply_fp32_guards, fp32_guard_of
from lightning_mp.patches import Patches

MODES = ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"]


class Net(LightningModule):
    def __init__(self, fail_at: int | None = None, interrupt_at: int | None = None, watch: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.ln, self.l2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)
        self.fail_at, self.interrupt_at = fail_at, interrupt_at
        if watch:
            self.ln.register_forward_hook(self._watch)  # the user's own hook: must stay
            self.ln_dtypes: list[torch.dtype] = []

    def _watch(self, module, args, output):
        self.ln_dtypes.append(args[0].dtype)
        step = self.trainer.global_step if self._trainer is not None else -1
        if self.training and step == self.fail_at:
            raise ValueError("boom inside a guarded module")
        if self.training and step == self.interrupt_at:
            raise KeyboardInterrupt

    def forward(self, x):
        return self.l2(self.ln(self.l1(x)))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).float().pow(2).mean()

    validation_step = test_step = training_step

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _loader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def _trainer(plugin=None, **kwargs) -> Trainer:
    kwargs = {"plugins": [plugin]} if plugin is not None else kwargs
    return Trainer(accelerator="cpu", max_steps=3, limit_val_batches=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _process_state() -> tuple:
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.get_default_dtype(),
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.is_grad_enabled())


def _ours_left(module: nn.Module, user_hooks: dict[str, int]) -> list[str]:
    """Everything of ours still on the module: hooks beyond the user's, instance forwards, attributes."""
    left = []
    for name, sub in module.named_modules():
        hooks = len(sub._forward_pre_hooks) + len(sub._forward_hooks)
        if hooks != user_hooks.get(name, 0):
            left.append(f"{name or 'root'}: {hooks} forward hooks")
        if "forward" in sub.__dict__:
            left.append(f"{name or 'root'}: an instance forward")
        left += [f"{name or 'root'}.{k}" for k in sub.__dict__ if "lightning_mp" in k]
    if "lr_scheduler_step" in module.__dict__:
        left.append("lr_scheduler_step on the module")
    return left


def _user_hooks(module: nn.Module) -> dict[str, int]:
    return {name: len(sub._forward_pre_hooks) + len(sub._forward_hooks) for name, sub in module.named_modules()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entry", ["fit", "validate", "test", "predict"])
def test_module_plain_after_every_entry_point(mode, entry):
    model = Net()
    hooks, state = _user_hooks(model), _process_state()
    seen: list[int] = []

    class During(Callback):  # the guards are there while the entry point runs
        def on_train_batch_start(self, trainer, pl_module, *args):
            seen.append(fp32_guard_of(pl_module.ln) is not None)

        on_validation_batch_start = on_test_batch_start = on_predict_batch_start = on_train_batch_start

    trainer = Trainer(accelerator="cpu", max_steps=3, limit_val_batches=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      plugins=[MPPlugin(mode, fp32_modules=["defaults"])],  # (bf16-true's defaults leave ln native)
                      callbacks=[During()])
    getattr(trainer, entry)(model)
    assert seen and all(seen)
    assert _ours_left(model, hooks) == []
    assert _process_state() == state
    assert trainer.precision_plugin._patches.applied == []


@pytest.mark.parametrize("mode", MODES)
def test_after_fit_the_module_serves_and_trains_under_lightning(mode):
    model = Net(watch=False)
    _trainer(MPPlugin(mode)).fit(model)
    with pytest.warns(Warning):  # (deprecated in Lightning 2.7, still used)
        model.to_torchscript()  # a guarded forward cannot be scripted
    served = model.to(torch.bfloat16)(torch.randn(2, 8, dtype=torch.bfloat16))  # cast whole for serving
    assert served.dtype is torch.bfloat16
    _trainer(precision="bf16-true").fit(model)  # further training under Lightning's own plugin
    model.float()
    _trainer(precision="32-true").fit(model)


@pytest.mark.parametrize("mode", ["bf16", "bf16-true"])
def test_guards_come_back_at_the_next_entry_point(mode):
    model = Net()
    seen: list[bool] = []

    class During(Callback):
        def on_validation_batch_start(self, trainer, pl_module, *args):
            seen.append(fp32_guard_of(pl_module.ln) is not None)

    trainer = Trainer(accelerator="cpu", max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=[MPPlugin(mode, fp32_modules=["defaults"])], callbacks=[During()])
    trainer.fit(model)
    assert fp32_guard_of(model.ln) is None
    trainer.validate(model)
    assert seen == [True]  # guarded again while validate ran
    assert fp32_guard_of(model.ln) is None


@pytest.mark.parametrize("mode", MODES)
def test_undone_after_an_exception_inside_a_guarded_module(mode):
    model = Net(fail_at=1)
    hooks, state = _user_hooks(model), _process_state()
    with pytest.raises(ValueError, match="boom"):
        _trainer(MPPlugin(mode, fp32_modules=["defaults"], tf32=True)).fit(model)
    assert _ours_left(model, hooks) == []
    assert _process_state() == state


@pytest.mark.parametrize("mode", ["bf16", "bf16-true"])
def test_an_interrupt_inside_a_guard_leaves_autocast_as_it_was(mode):
    """Ctrl-C inside a guarded forward skips torch's always-call hooks; Lightning catches it and the process goes
    on. The region the guard opened must not switch CPU autocast back on later (when it is garbage-collected)."""
    model = Net(interrupt_at=1)
    hooks, state = _user_hooks(model), _process_state()
    trainer = _trainer(MPPlugin(mode))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning tears down, then exits (a notebook's kernel goes on)
            trainer.fit(model)
    finally:
        signal.signal(signal.SIGINT, handler)  # (Lightning ignores further Ctrl-C while shutting down)
    assert trainer.interrupted
    gc.collect()
    assert _process_state() == state
    assert _ours_left(model, hooks) == []
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    assert top is None  # no saved-tensor hooks of ours left in force


def test_guards_the_user_applied_stay():
    model = Net()
    apply_fp32_guards(model, ["LayerNorm"])
    _trainer(MPPlugin("bf16")).fit(model)
    assert fp32_guard_of(model.ln) is not None


def test_tf32_flags_set_for_the_run_and_restored():
    seen = []

    class Read(Callback):
        def on_train_batch_start(self, *args):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    wanted = not before[0]
    Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, plugins=[MPPlugin("fp32", tf32=wanted)], callbacks=[Read()]).fit(Net())
    assert seen and all(s == (wanted, wanted) for s in seen)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_patches_undo_newest_first_and_every_undo_runs():
    order: list[str] = []
    patches = Patches()
    patches.add("a", lambda: order.append("a"))
    patches.add("b", lambda: (_ for _ in ()).throw(OSError("stuck")))
    patches.add("c", lambda: order.append("c"))
    assert patches.applied == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match="could not undo its change to b: stuck"):
        patches.undo_all()
    assert order == ["c", "a"] and patches.applied == []
