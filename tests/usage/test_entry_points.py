"""User-side tests of MPPlugin's entry points: evaluation loops, inference mode inside training, embeddings,
skipped steps with BatchNorm, and torch.compile.

Everything goes through the public surface only: a real ``Trainer``, the model's weights and buffers, and
``plugin.stats``. The package's internals are being redesigned, so nothing here reads a private attribute.
Every test runs on the CPU with tiny models and a few steps.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp.guards import apply_fp32_guards, fp32_layer_norm

from .conftest import opt_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:You defined a `validation_step` but have no `val_dataloader`",  # fit gets no validation data here
    "ignore:Dynamo does not know how to trace",  # the graph-break test's subject, reported by its assertion
)

# ------------------------------------------------------------------------------------------------- modes and marks
EP_MODES = ("fp32", "tf32", "bf16", "fp16", "bf16-true", "fp16-true")
#: TF32 is a CUDA matmul/cuDNN setting: on the CPU (every test here uses accelerator="cpu") ``MPPlugin("tf32")``
#: computes exactly as fp32 (checked bit for bit when these tests were written): its cases would repeat the fp32 ones
EP_TF32_SKIP = pytest.mark.skip(reason="tf32 does not apply on the CPU: it computes exactly as fp32 (the fp32 case)")
EP_LOW_MODES = ("bf16", "fp16", "bf16-true", "fp16-true")  # modes with 16-bit activations (the guards upcast)
EP_TRUE_HALF = ("bf16-true", "fp16-true")
EP_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-true": torch.bfloat16, "fp16-true": torch.float16}

#: abs/rel tolerance of evaluation outputs against an fp32 run of the same weights (compute precision only:
#: the reference takes the very weights the mode evaluated with, upcast)
EP_TOL = {
    "fp32": 1e-5,
    "tf32": 1e-5,  # (skipped on the CPU, where it is fp32)
    "bf16": 3e-2,  # measured at most 7e-3 on these logits (|logit| < 1.2)
    "fp16": 4e-3,  # measured at most 8e-4
    "bf16-true": 3e-2,  # measured at most 6e-3
    "fp16-true": 4e-3,  # measured at most 7e-4
}


def ep_mode_params(modes=EP_MODES) -> list:
    """``modes`` as pytest params; tf32 skips on the CPU."""
    return [pytest.param(m, marks=[EP_TF32_SKIP] if m == "tf32" else [], id=m) for m in modes]


# ------------------------------------------------------------------------------------------------- helpers
def ep_plugin(mode: str, **kwargs: Any) -> MPPlugin:
    """MPPlugin(mode); fp16 modes start from a modest loss scale so clean steps of these tiny models never
    overflow (an unexpected skip would blur the step counts the tests assert)."""
    if mode in ("fp16", "fp16-true"):
        kwargs.setdefault("init_scale", 2.0**8)
    return MPPlugin(mode, **kwargs)


def ep_trainer(plugin: MPPlugin, max_steps: int = 3, callbacks=(), **kwargs: Any) -> Trainer:
    kwargs.setdefault("limit_val_batches", None)  # these tests validate
    return opt_trainer(plugin, max_steps, callbacks, **kwargs)


def ep_loader(dataset: TensorDataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)


def ep_class_data(n: int = 32, features: int = 8, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, :classes].argmax(dim=1) + (x[:, 0] > 1).long()) % classes
    return TensorDataset(x, y)


def ep_regression_data(n: int = 48, features: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def ep_float_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with floating tensors upcast to fp32 (the weights it ran with, in fp32)."""
    return {
        k: (v.detach().float() if v.is_floating_point() else v.detach()).clone() for k, v in module.state_dict().items()
    }


def ep_snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Bit-exact copies of every parameter and buffer (their own dtype)."""
    return {
        **{f"param:{n}": p.detach().clone() for n, p in module.named_parameters()},
        **{f"buffer:{n}": b.detach().clone() for n, b in module.named_buffers()},
    }


def ep_assert_bit_equal(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], what: str) -> None:
    assert before.keys() == after.keys()
    changed = []
    for name in before:
        a, b = before[name], after[name]
        same = a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num())
                                  and torch.equal(a.isnan(), b.isnan()))
        )
        if not same:
            changed.append(f"{name}: {a.flatten()[:3].tolist()} -> {b.flatten()[:3].tolist()}")
    assert not changed, f"{what} changed: " + "; ".join(changed)


# ================================================================================ 1. validate / test / predict
EP_KINDS = ("layernorm", "batchnorm", "softmax", "loss_module", "fp32_layer_norm")


class EpGuardedNet(LightningModule):
    """Classifier whose guarded pieces each get a Linear's (16-bit, in low modes) output as input.

    ``kinds``: which of nn.LayerNorm, nn.BatchNorm1d, nn.Softmax, an nn.CrossEntropyLoss submodule and
    :func:`lightning_mp.guards.fp32_layer_norm` it contains. Evaluation steps collect the logits (fp32 copies).
    """

    def __init__(self, kinds: tuple[str, ...] = EP_KINDS, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.kinds = tuple(kinds)
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleDict()
        for kind in self.kinds:
            if kind == "loss_module":
                continue
            self.layers[kind] = nn.Linear(width, width)
        if "layernorm" in self.kinds:
            self.ln = nn.LayerNorm(width)
        if "batchnorm" in self.kinds:
            self.bn = nn.BatchNorm1d(width)
        if "softmax" in self.kinds:
            self.sm = nn.Softmax(dim=-1)
        if "fp32_layer_norm" in self.kinds:
            self.fln_weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))
            self.fln_bias = nn.Parameter(0.1 * torch.randn(width))
        if "loss_module" in self.kinds:
            self.criterion = nn.CrossEntropyLoss()
        self.head = nn.Linear(width, classes)
        self.collected: dict[str, list[torch.Tensor]] = {"val": [], "test": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for kind in self.kinds:
            if kind == "loss_module":
                continue
            h = self.layers[kind](h)
            if kind == "layernorm":
                h = self.ln(h)
            elif kind == "batchnorm":
                h = self.bn(h)
            elif kind == "softmax":
                h = self.sm(h) * h.shape[-1]  # keep the scale near 1
            elif kind == "fp32_layer_norm":
                h = fp32_layer_norm(h, h.shape[-1], self.fln_weight, self.fln_bias)
        return self.head(h)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if "loss_module" in self.kinds:
            return self.criterion(logits, y)
        return F.cross_entropy(logits.float(), y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self(x), y)

    def _eval_step(self, stage: str, batch) -> None:
        x, y = batch
        logits = self(x)
        self.collected[stage].append(logits.detach().float().clone())
        self.log(f"{stage}_loss", self.loss(logits, y).float())

    def validation_step(self, batch, batch_idx):
        self._eval_step("val", batch)

    def test_step(self, batch, batch_idx):
        self._eval_step("test", batch)

    def predict_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return {"logits": logits, "loss": self.loss(logits, y)}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def ep_reference(model: EpGuardedNet, loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and per-batch losses of a plain fp32 copy of ``model`` with its current weights (no plugin)."""
    ref = EpGuardedNet(model.kinds)
    ref.load_state_dict(ep_float_state(model))
    ref.eval()
    logits, losses = [], []
    with torch.no_grad():
        for x, y in loader:
            out = ref(x)
            logits.append(out)
            losses.append(F.cross_entropy(out, y))
    return torch.cat(logits), torch.stack(losses)


def ep_check_eval_outputs(mode: str, trainer: Trainer, model: EpGuardedNet, loader: DataLoader, when: str) -> None:
    """validate, test and predict with ``trainer``; each output finite and close to the fp32 reference."""
    tol = EP_TOL[mode]
    for stage in ("val", "test"):
        model.collected[stage].clear()
        run = trainer.validate if stage == "val" else trainer.test
        results = run(model, dataloaders=loader, verbose=False)
        ref_logits, ref_losses = ep_reference(model, loader)
        got = torch.cat(model.collected[stage])
        assert got.shape == ref_logits.shape
        assert torch.isfinite(got).all(), f"{mode} {stage} ({when}): non-finite logits"
        torch.testing.assert_close(got, ref_logits, atol=tol, rtol=tol, msg=lambda m: f"{mode} {stage} ({when}): {m}")
        loss = results[0][f"{stage}_loss"]
        assert math.isfinite(loss), f"{mode} {stage} ({when}): loss {loss}"
        assert loss == pytest.approx(ref_losses.mean().item(), abs=tol, rel=tol), f"{mode} {stage} ({when})"
    predictions = trainer.predict(model, dataloaders=loader)
    ref_logits, ref_losses = ep_reference(model, loader)
    logits = torch.cat([p["logits"].float() for p in predictions])
    losses = torch.stack([p["loss"].float() for p in predictions])
    if mode in EP_TRUE_HALF:
        assert predictions[0]["logits"].dtype == EP_HALF[mode]  # true-half: the model's own dtype comes out
    assert torch.isfinite(logits).all() and torch.isfinite(losses).all(), f"{mode} predict ({when})"
    torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=tol, msg=lambda m: f"{mode} predict ({when}): {m}")
    torch.testing.assert_close(
        losses, ref_losses, atol=tol, rtol=tol, msg=lambda m: f"{mode} predict loss ({when}): {m}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("inference_mode", [True, False], ids=["inference_mode", "no_inference_mode"])
@pytest.mark.parametrize("mode", ep_mode_params())
def test_evaluation_loops_before_and_after_fit(mode: str, inference_mode: bool) -> None:
    """validate/test/predict on a model with every guarded kind, before fit and after a 3-step fit, agree with an
    fp32 run of the same weights."""
    model = EpGuardedNet()
    plugin = ep_plugin(mode)
    trainer = ep_trainer(plugin, max_steps=3, inference_mode=inference_mode)
    loader = ep_loader(ep_class_data(n=16, seed=1))

    ep_check_eval_outputs(mode, trainer, model, loader, "before fit")
    before_fit = ep_snapshot(model)
    trainer.fit(model, train_dataloaders=ep_loader(ep_class_data(n=24)))
    assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    after_fit = ep_snapshot(model)
    params = [k for k in before_fit if k.startswith("param:")]
    assert any(not torch.equal(before_fit[k], after_fit[k]) for k in params), "fit did nothing"
    assert not torch.equal(before_fit["buffer:bn.running_mean"], after_fit["buffer:bn.running_mean"])
    ep_check_eval_outputs(mode, trainer, model, loader, "after fit")


@pytest.mark.slow
@pytest.mark.parametrize("kind", EP_KINDS)
@pytest.mark.parametrize("mode", ("fp32", *EP_LOW_MODES))
def test_evaluation_loops_per_guarded_kind(mode: str, kind: str) -> None:
    """Each guarded kind alone, under Lightning's default inference_mode=True: validate, test and predict run and
    agree with fp32."""
    model = EpGuardedNet((kind,))
    trainer = ep_trainer(ep_plugin(mode))  # inference_mode=True: Lightning's default
    ep_check_eval_outputs(mode, trainer, model, ep_loader(ep_class_data(n=16, seed=1)), "before fit")


# ================================================================================ 2. teacher under inference_mode
class EpDistill(LightningModule):
    """A student mimics a frozen teacher (a submodule, so the plugin guards and casts it too) whose forward runs
    under ``torch.inference_mode()`` inside ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(
            nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4), nn.Softmax(dim=-1)
        )
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.teacher.eval()
        with torch.inference_mode():
            probs = self.teacher(x)
        target = probs.clone().float()  # a normal tensor: inference tensors cannot be saved for backward
        log_probs = F.log_softmax(self.student(x).float(), dim=-1)
        loss = F.kl_div(log_probs, target, reduction="batchmean")
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.student.parameters(), lr=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ep_mode_params())
def test_teacher_under_inference_mode_in_training_step(mode: str) -> None:
    model = EpDistill()
    teacher_before = ep_snapshot(model.teacher)
    plugin = ep_plugin(mode)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(3 * torch.randn(64, 8, generator=g))
    trainer = ep_trainer(plugin, max_steps=20)
    trainer.fit(model, train_dataloaders=ep_loader(data, batch_size=16))

    assert len(model.losses) == 20 and all(math.isfinite(v) for v in model.losses), model.losses
    assert plugin.stats.steps == 20 and plugin.stats.skipped_steps == 0
    first, last = sum(model.losses[:4]) / 4, sum(model.losses[-4:]) / 4
    assert last < 0.6 * first, f"the student did not learn: {first:.4f} -> {last:.4f}"
    teacher_after = ep_snapshot(model.teacher)
    for key, value in teacher_before.items():  # unchanged (true-half: the plugin's cast to half, nothing more)
        expected = value.to(teacher_after[key].dtype)
        assert torch.equal(teacher_after[key], expected), f"the frozen teacher's {key} changed"


# ================================================================================ 3. embeddings
class EpEmbeddingNet(LightningModule):
    """nn.Embedding -> nn.Linear over the vocabulary: learns token -> (3 * token + 1) % vocab."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.out(self.emb(tokens)).float(), targets)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=5e-2)


def ep_token_data(vocab: int = 32) -> TensorDataset:
    tokens = torch.arange(vocab).repeat(2)
    return TensorDataset(tokens, (3 * tokens + 1) % vocab)


def ep_fit_embedding(mode: str, fp32_modules: Optional[list]) -> tuple[EpEmbeddingNet, MPPlugin]:
    model = EpEmbeddingNet()
    plugin = ep_plugin(mode, fp32_modules=fp32_modules)
    ep_trainer(plugin, max_steps=10).fit(model, train_dataloaders=ep_loader(ep_token_data(), batch_size=16))
    return model, plugin


def ep_assert_embedding_trained(mode: str, model: EpEmbeddingNet, plugin: MPPlugin) -> None:
    assert len(model.losses) == 10 and all(math.isfinite(v) for v in model.losses), model.losses
    assert plugin.stats.steps == 10 and plugin.stats.skipped_steps == 0
    # 10 Adam steps on 32 tokens: the loss starts near ln(32) = 3.47 and falls well below it
    assert model.losses[0] > 3.0 and max(model.losses[-2:]) < 0.6 * model.losses[0], model.losses


@pytest.mark.slow
@pytest.mark.parametrize("mode", ep_mode_params())
def test_guarded_embedding_trains(mode: str) -> None:
    """fp32_modules=["defaults", "Embedding"]: the Embedding runs in fp32 and the model trains in every mode; after a
    true-half run its weights are half, as Lightning's plugin leaves every weight."""
    model, plugin = ep_fit_embedding(mode, ["defaults", "Embedding"])
    ep_assert_embedding_trained(mode, model, plugin)
    if mode in EP_TRUE_HALF:
        assert model.emb.weight.dtype == model.out.weight.dtype == EP_HALF[mode]
    else:
        assert model.emb.weight.dtype == torch.float32


@pytest.mark.parametrize("mode", ep_mode_params())
def test_plain_embedding_trains_with_default_guards(mode: str) -> None:
    model, plugin = ep_fit_embedding(mode, None)
    ep_assert_embedding_trained(mode, model, plugin)
    expected = EP_HALF[mode] if mode in EP_TRUE_HALF else torch.float32
    assert model.emb.weight.dtype == expected and model.out.weight.dtype == expected


# ================================================================================ 4. skipped steps and BatchNorm
class EpBatchNormNet(LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Linear regression; batch ``poison_batch`` gets one inf input element."""

    def __init__(self, poison_batch: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 1)
        self.poison_batch = poison_batch
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == self.poison_batch:
            x = x.clone()
            x[0, 0] = math.inf
        loss = F.mse_loss(self(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y.float()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


class EpStateRecorder(Callback):
    """Every parameter and buffer of the model at the start and the end of each training batch."""

    def __init__(self) -> None:
        self.start: dict[int, dict[str, torch.Tensor]] = {}
        self.end: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start[batch_idx] = ep_snapshot(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end[batch_idx] = ep_snapshot(pl_module)


def ep_fit_poisoned(mode: str, poison_batch: int, accumulate: int, batches: int = 6):
    model = EpBatchNormNet(poison_batch)
    plugin = ep_plugin(mode)
    recorder = EpStateRecorder()
    trainer = ep_trainer(
        plugin, max_steps=batches // accumulate, callbacks=[recorder], accumulate_grad_batches=accumulate
    )
    trainer.fit(model, train_dataloaders=ep_loader(ep_regression_data(n=8 * batches)))
    assert sorted(recorder.end) == list(range(batches))
    return model, plugin, recorder, trainer


def ep_assert_clean_after_skip(
    mode: str, model: EpBatchNormNet, plugin: MPPlugin, trainer: Trainer, steps: int
) -> None:
    assert plugin.stats.steps == steps
    assert plugin.stats.skipped_steps == 1, plugin.stats.as_dict()
    assert plugin.stats.consecutive_skips == 0 and not plugin.stats.skipped  # later steps were clean
    # fp16 modes (init_scale 2**8) back off once on the skipped step; the others do not scale the loss
    assert plugin.stats.loss_scale == (2.0**7 if mode in ("fp16", "fp16-true") else None)
    for name, buf in model.bn.named_buffers():
        assert torch.isfinite(buf.float()).all(), f"bn.{name} holds inf/NaN: {buf}"
    result = trainer.validate(model, dataloaders=ep_loader(ep_regression_data(n=16, seed=1)), verbose=False)
    assert math.isfinite(result[0]["val_loss"]), f"{mode}: validation loss {result[0]['val_loss']}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ep_mode_params())
def test_skipped_step_leaves_batchnorm_untouched(mode: str) -> None:
    poison = 2
    model, plugin, rec, trainer = ep_fit_poisoned(mode, poison_batch=poison, accumulate=1)
    # the recorder sees changes: a clean step moves the parameters and the running statistics
    clean_before, clean_after = rec.start[1], rec.end[1]
    assert not torch.equal(clean_before["param:inp.weight"], clean_after["param:inp.weight"])
    assert not torch.equal(clean_before["buffer:bn.running_mean"], clean_after["buffer:bn.running_mean"])
    assert int(clean_after["buffer:bn.num_batches_tracked"]) == 2
    ep_assert_bit_equal(rec.start[poison], rec.end[poison], f"{mode}: state over the skipped step")
    ep_assert_clean_after_skip(mode, model, plugin, trainer, steps=6)


@pytest.mark.parametrize("mode", ep_mode_params())
def test_skipped_accumulation_window_leaves_batchnorm_untouched(mode: str) -> None:
    """accumulate_grad_batches=2, the first micro-batch (2) of the window (2, 3) poisoned: after the window's
    skipped step every parameter and buffer equals what it was before the window began."""
    model, plugin, rec, trainer = ep_fit_poisoned(mode, poison_batch=2, accumulate=2)
    assert not torch.equal(rec.start[0]["param:inp.weight"], rec.end[1]["param:inp.weight"])  # window 0 stepped
    ep_assert_bit_equal(rec.start[2], rec.end[3], f"{mode}: state over the skipped accumulation window")
    ep_assert_clean_after_skip(mode, model, plugin, trainer, steps=3)


# ================================================================================ 5. torch.compile
class EpBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm -> attention (an nn.Softmax module) -> LayerNorm -> MLP."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = self.softmax(q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def ep_explain(block: nn.Module, plugin: MPPlugin, x: torch.Tensor):
    torch._dynamo.reset()
    with plugin.forward_context():
        return torch._dynamo.explain(block)(x)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ep_mode_params())
def test_default_guards_add_no_graph_breaks(mode: str) -> None:
    plugin = MPPlugin(mode)
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    plain_block = EpBlock().to(EP_HALF[mode]) if mode in EP_TRUE_HALF else EpBlock()
    try:
        plain = ep_explain(plain_block, plugin, plugin.convert_input(x))
    except Exception as err:  # pragma: no cover - a platform without a working dynamo
        pytest.skip(f"torch._dynamo cannot trace on this machine: {type(err).__name__}: {err}")
    assert plain.graph_break_count == 0 and plain.graph_count == 1, "the unguarded block must compile as one graph"

    block = EpBlock()
    if mode in EP_TRUE_HALF:
        returned = plugin.convert_module(block)  # guards and half weights (guarded modules stay fp32), in place
        assert returned is block
        # (bf16-true's defaults run a plain LayerNorm in bf16, with master weights; fp16-true guards it in fp32)
        norm_dtype = EP_HALF[mode] if EP_HALF[mode] is torch.bfloat16 else torch.float32
        assert block.qkv.weight.dtype == EP_HALF[mode] and block.ln1.weight.dtype == norm_dtype
    else:
        guarded = apply_fp32_guards(block)
        assert set(guarded) == {"ln1", "softmax", "ln2"}
    explanation = ep_explain(block, plugin, plugin.convert_input(x))
    reasons = "; ".join(str(r.reason).splitlines()[0] for r in explanation.break_reasons[:3])
    assert explanation.graph_break_count == 0, f"{explanation.graph_break_count} graph breaks: {reasons}"


def test_explain_detects_graph_breaks() -> None:
    """The graph-break test's instrument: explain counts a break where there is one, and none in the plain block."""

    def with_break(x: torch.Tensor) -> torch.Tensor:
        x = torch.sin(x)
        torch._dynamo.graph_break()
        return torch.cos(x)

    torch._dynamo.reset()
    try:
        broken = torch._dynamo.explain(with_break)(torch.randn(4))
    except Exception as err:  # pragma: no cover - a platform without a working dynamo
        pytest.skip(f"torch._dynamo cannot trace on this machine: {type(err).__name__}: {err}")
    assert broken.graph_break_count == 1
    plain = ep_explain(EpBlock(), MPPlugin("bf16"), torch.randn(2, 5, 16))
    assert plain.graph_break_count == 0 and plain.graph_count == 1


class EpCompiledNet(LightningModule):
    """A LightningModule that compiles a submodule (with a guarded LayerNorm) in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        # backend "eager": dynamo traces the guarded module as with inductor, without minutes of C++ compiling
        self.body = torch.compile(
            nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1)), backend="eager"
        )
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.body(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("mode", ("bf16", "bf16-true"))
def test_fit_with_compiled_submodule(mode: str) -> None:
    torch._dynamo.reset()
    model = EpCompiledNet()
    plugin = ep_plugin(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's recompilation notes
        ep_trainer(plugin, max_steps=3).fit(model, train_dataloaders=ep_loader(ep_regression_data(n=24)))
    assert len(model.losses) == 3 and all(math.isfinite(v) for v in model.losses), model.losses
    assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    for name, param in model.named_parameters():
        assert torch.isfinite(param.float()).all(), name
