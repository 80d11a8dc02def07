"""After a true-half entry point (``fit``, ``validate``, ``test``, ``predict`` in ``bf16-true`` / ``fp16-true``) the
module is usable in its own dtype: every parameter and floating buffer has the dtype Lightning's own
``precision="bf16-true"`` / ``"16-true"`` leaves it (the FP32-guarded modules' too: LayerNorms, BatchNorm statistics,
the class weights of loss modules, ``pos_weight``, non-persistent buffers), and it runs forward and its losses in
that dtype, in a notebook, as the module Lightning trained does.

The guarded modules still ran in fp32 during the run, and their fp32 values are not lost: the next run starts from
them and a checkpoint written after the run holds them.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import apply_fp32_guards
from tests.usage.conftest import opt_plugin, opt_trainer

MA_HALF = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}
MA_LIGHTNING = {"bf16-true": "bf16-true", "fp16-true": "16-true"}
MA_ENTRY_POINTS = ("fit", "validate", "test", "predict")
#: the plugin's settings: the defaults, and no master weights with the head guarded by name (the LayerNorm is then
#: guarded in bf16-true too)
MA_SETTINGS = {"defaults": {}, "head_guarded": {"master_weights": "none", "fp32_modules": ["defaults", "head"]}}


class MaNet(LightningModule):
    """Linear -> BatchNorm -> (+ a non-persistent offset, x an fp64 gain) -> LayerNorm -> a 3-class head and a binary
    head; losses: weighted cross-entropy, weighted NLL, BCE with ``pos_weight``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 1)
        self.ce = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))
        self.nll = nn.NLLLoss(weight=torch.tensor([0.5, 1.0, 1.5]))
        self.bce = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0]))
        self.register_buffer("offset", torch.full((16,), 0.1), persistent=False)
        self.register_buffer("gain", torch.ones(16, dtype=torch.float64))
        self.in_run: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.bn(self.fc(x)) + self.offset
        h = self.norm(torch.relu(h * self.gain.to(h.dtype)))
        return self.head(h), self.aux(h).squeeze(-1)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, t = batch
        logits, aux = self(x)
        return self.ce(logits, y) + self.nll(F.log_softmax(logits, -1), y) + self.bce(aux, t)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", self.loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test", self.loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01, eps=1e-4)

    def dataloader(self) -> DataLoader:
        return DataLoader(ma_data(), batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = dataloader

    def on_train_end(self) -> None:
        self.in_run = ma_dtypes(self)


def ma_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (32,), generator=g), (x[:, 0] > 0).float())


def ma_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """The dtype of every parameter and buffer (non-persistent ones included) by name."""
    return {name: t.dtype for name, t in (*module.named_parameters(), *module.named_buffers())}


def ma_run(entry: str, model: MaNet, plugin: Any = None, precision: Optional[str] = None, callbacks=()) -> Any:
    trainer = opt_trainer(plugin, max_steps=3, precision=precision, limit_val_batches=2, callbacks=callbacks)
    getattr(trainer, entry)(model)
    return trainer


def ma_assert_usable(model: MaNet, dtype: torch.dtype) -> None:
    """The module runs forward and every loss in ``dtype``, in training (BatchNorm statistics move) and eval mode."""
    x, y, t = ma_data().tensors
    for training in (True, False):
        model.train(training)
        mean = model.bn.running_mean.clone()
        with torch.no_grad():
            logits, aux = model(x.to(dtype))
            assert logits.dtype == aux.dtype == dtype
            losses = (model.ce(logits, y), model.nll(F.log_softmax(logits, -1), y), model.bce(aux, t.to(dtype)))
        assert all(bool(v.isfinite()) for v in losses), losses
        assert torch.equal(model.bn.running_mean, mean) != training, "BatchNorm's statistics move in training only"


@pytest.mark.parametrize("settings", sorted(MA_SETTINGS))
@pytest.mark.parametrize("entry", MA_ENTRY_POINTS)
@pytest.mark.parametrize("mode", ("bf16-true", "fp16-true"))
def test_module_after_an_entry_point_is_as_lightning_leaves_it(mode: str, entry: str, settings: str) -> None:
    ours, theirs = MaNet(), MaNet()
    ma_run(entry, ours, opt_plugin(mode, **MA_SETTINGS[settings]))
    ma_run(entry, theirs, precision=MA_LIGHTNING[mode])
    assert ma_dtypes(ours) == ma_dtypes(theirs)
    assert ours.dtype == theirs.dtype == MA_HALF[mode]
    for model in (ours, theirs):
        ma_assert_usable(model, MA_HALF[mode])


@pytest.mark.parametrize("mode", ("bf16-true", "fp16-true"))
def test_guarded_modules_ran_in_fp32_and_keep_their_fp32_values(mode: str, tmp_path: Any) -> None:
    """In the run the guarded modules' weights and statistics were fp32; after it they are half, and their fp32
    values are what a checkpoint written then holds and what the next ``fit`` starts from."""
    model = MaNet()
    plugin = opt_plugin(mode, master_weights="none")  # (the LayerNorm guarded in both modes)
    trainer = ma_run("fit", model, plugin)
    guarded = ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "norm.weight", "norm.bias",
               "ce.weight", "nll.weight", "bce.pos_weight")  # fmt: skip
    assert {model.in_run[name] for name in guarded} == {torch.float32}
    assert model.in_run["fc.weight"] == MA_HALF[mode]

    class AtStart(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.values = {n: t.detach().clone() for n, t in pl_module.state_dict().items()}

    path = tmp_path / "after.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]
    now = {name: t.clone() for name, t in model.state_dict().items()}
    start = AtStart()
    ma_run("fit", model, plugin, callbacks=[start])  # a second fit of the same module
    for name in guarded:  # the fp32 values: in the checkpoint, and back in the second run
        assert now[name].dtype == MA_HALF[mode] and torch.equal(saved[name].to(MA_HALF[mode]), now[name]), name
        assert saved[name].dtype == start.values[name].dtype == torch.float32, name
        assert torch.equal(saved[name], start.values[name]), name


@pytest.mark.parametrize("mode", ("bf16-true", "fp16-true"))
def test_modules_the_user_guarded_run_in_their_dtype_after_fit(mode: str) -> None:
    """Guards the user applied before ``fit`` stay on the module; after ``fit`` its weights are half as under
    Lightning's plugin, and the guarded modules still compute in fp32 (their half weights upcast for the call)."""
    half = MA_HALF[mode]
    ours, theirs = MaNet(), MaNet()
    for model in (ours, theirs):
        apply_fp32_guards(model, ["defaults", "head"])
    ma_run("fit", ours, opt_plugin(mode))
    ma_run("fit", theirs, precision=MA_LIGHTNING[mode])
    assert ma_dtypes(ours) == ma_dtypes(theirs)
    assert {ours.in_run["head.weight"], ours.in_run["norm.weight"]} == {torch.float32}
    for model in (ours, theirs):
        ma_assert_usable(model, half)
    x = torch.randn(4, 16, dtype=half)
    with torch.no_grad():
        out = ours.head(x)
    assert out.dtype == half
    assert torch.equal(out, F.linear(x.float(), ours.head.weight.float(), ours.head.bias.float()).to(half))
