"""MPPlugin("fp8")'s default layout through the real Trainer on the CPU (``fp8={"weights": "auto"}``): the FP8
layers keep fp32 weights, which the optimizer steps (their own masters), every other weight is bf16 with an fp32
master in the step, and activations are bf16; with torchao's float8 as the backend — torch runs its FP8 matmuls
on the CPU, so only the GPU checks stand aside. The same layout with Transformer Engine runs on the GPU
(``tests/gpu/test_fp8_default_gpu.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp.master import FP32MasterWeights

try:
    import torchao.float8  # noqa: F401
except Exception as err:  # not installed, or built for another torch (0.18 needs torch >= 2.10)
    pytest.skip(f"torchao's float8 cannot be imported here: {err}", allow_module_level=True)

AO = {"backend": "torchao", "size_rule": "off", "keep_last": 0}


@pytest.fixture(autouse=True)
def fp8_on_cpu(monkeypatch):
    import lightning_mp.fp8.support as support
    from lightning_mp.fp8.torchao_backend import TorchAOFloat8

    monkeypatch.setattr(TorchAOFloat8, "check", lambda self, device: None)
    monkeypatch.setattr(support, "fp8_device_problem", lambda *args, **kwargs: None)


class Net(LightningModule):
    def __init__(self, poison_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)
        self.poison_at = poison_at

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        # by the restored global batch index: a resumed run sees the batches of an uninterrupted one (Lightning
        # starts a plain DataLoader's epoch again on a resume)
        index = self.trainer.fit_loop.epoch_loop.total_batch_idx % len(self.batches)
        tokens = self.batches[index]
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        return loss * float("inf") if batch_idx == self.poison_at else loss

    @property
    def batches(self) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return list(torch.randint(0, 64, (8, 8, 17), generator=g).unbind(0))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit(plugin, steps=6, model=None, **kwargs):
    seed_everything(0)
    model = model if model is not None else Net()
    kwargs.setdefault("logger", False)
    trainer = Trainer(accelerator="cpu", max_steps=steps, plugins=[plugin], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer.fit(model)
    return model, trainer


FP8_LAYERS = ("fc1", "fc2", "head")


class _Dtypes(Callback):
    """The dtypes of the embedding's and each FP8 layer's outputs in the training forwards."""

    def __init__(self) -> None:
        self.seen: dict[str, set] = {}

    def on_train_start(self, trainer, pl_module):
        for name in ("emb", *FP8_LAYERS):
            pl_module.get_submodule(name).register_forward_hook(
                lambda mod, args, out, name=name: self.seen.setdefault(name, set()).add(out.dtype)
            )


def restored(plugin, path, steps=3):
    """A fresh model fitted from the checkpoint at ``path`` up to ``steps`` (reached: it restores, steps nothing)."""
    seed_everything(0)
    model = Net()
    trainer = Trainer(accelerator="cpu", max_steps=steps, plugins=[plugin], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, ckpt_path=path)
    return model


def test_the_default_keeps_fp8_layers_fp32_and_the_rest_bf16_with_exact_fp32_masters():
    model = Net()
    fp32 = {name: p.detach().clone() for name, p in model.named_parameters()}
    dtypes = _Dtypes()
    model, trainer = fit(plugin := MPPlugin("fp8", fp8=AO), steps=0, model=model)  # set-up only
    for name in FP8_LAYERS:  # the FP8 layers quantize from their exact fp32 weights
        for pname in ("weight", "bias"):
            param = model.get_submodule(name).get_parameter(pname)
            assert param.dtype == torch.float32 and torch.equal(param, fp32[f"{name}.{pname}"])
    assert model.emb.weight.dtype == torch.bfloat16
    assert torch.equal(plugin.masters.master_of(model.emb.weight), fp32["emb.weight"])  # exact, not its rounding
    model, trainer = fit(plugin := MPPlugin("fp8", fp8=AO), steps=2, model=Net(), callbacks=[dtypes])
    assert plugin.master_weights == "fp32" and isinstance(plugin.masters, FP32MasterWeights)
    assert all(model.get_submodule(n).weight.dtype == torch.float32 for n in FP8_LAYERS)
    assert model.emb.weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32  # an FP32 guard keeps its weights fp32
    assert dtypes.seen == {name: {torch.bfloat16} for name in ("emb", *FP8_LAYERS)}  # the activations are bf16
    from lightning_mp.options import summary

    assert "fp32 weights in the FP8 layers, bf16 elsewhere, fp32 master weights" in summary(plugin)
    start = Net()  # the same seed: the values before the steps
    masters = 0
    for name, param in model.named_parameters():
        master = plugin.masters.master_of(param)
        if param.dtype == torch.bfloat16:
            assert master is not None and master.dtype == torch.float32, name
            assert torch.equal(master.to(torch.bfloat16), param.detach()), name  # the weight is its rounding
            assert not torch.equal(master, start.get_parameter(name).detach()), name  # and it trained
            masters += 1
        else:
            assert master is None, name  # fp32 weights: the optimizer steps them, no copy
            assert not torch.equal(param, start.get_parameter(name)) or name.startswith("norm"), name
    assert masters == 1 and set(fp32) == {n for n, _ in model.named_parameters()}


def test_masters_keep_what_bf16_would_round_away():
    """Updates below bf16's resolution accumulate in the masters: after a few steps at a tiny learning rate the
    weights moved under the default and stayed put without masters."""
    class Tiny(Net):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=2e-3)

    with_masters, _ = fit(MPPlugin("fp8", fp8=AO), steps=24, model=Tiny())
    without, _ = fit(MPPlugin("fp8", fp8=AO, master_weights="none"), steps=24, model=Tiny())
    start = Tiny()
    moved = (with_masters.emb.weight.float() != start.emb.weight.to(torch.bfloat16).float()).sum()
    stuck = (without.emb.weight.float() != start.emb.weight.to(torch.bfloat16).float()).sum()
    assert with_masters.emb.weight.dtype == without.emb.weight.dtype == torch.bfloat16
    assert stuck < moved


class _Unchanged(Callback):
    """Parameters, fp32 masters and optimizer state after the poisoned batch equal those before it."""

    def __init__(self, at: int) -> None:
        self.at, self.checked, self.masters = at, False, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            masters = trainer.precision_plugin.masters
            self.before = ({n: p.detach().clone() for n, p in pl_module.named_parameters()},
                           {n: masters.master_of(p).clone() for n, p in pl_module.named_parameters()
                            if masters.master_of(p) is not None},
                           copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != self.at:
            return
        params, masters, state = self.before
        plugin_masters = trainer.precision_plugin.masters
        for name, param in pl_module.named_parameters():
            assert torch.equal(param.detach(), params[name]), name
            if name in masters:
                assert torch.equal(plugin_masters.master_of(param), masters[name]), name
        after = trainer.optimizers[0].state_dict()["state"]
        for key, entry in state.items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(after[key][k]), torch.as_tensor(v)), (key, k)
        self.checked, self.masters = True, len(masters)


def test_a_poisoned_step_changes_nothing():
    plugin, check = MPPlugin("fp8", fp8=AO), _Unchanged(at=3)
    fit(plugin, steps=5, model=Net(poison_at=3), callbacks=[check])
    assert plugin.stats.skipped_steps == 1 and check.checked and check.masters == 1  # (the embedding's)


def test_master_weights_none_and_fp32_weights_are_the_other_layouts():
    model, _ = fit(plugin := MPPlugin("fp8", fp8=AO, master_weights="none"), steps=2)
    assert plugin.masters is None and plugin.master_weights == "none" and model.fc1.weight.dtype == torch.bfloat16
    model, _ = fit(plugin := MPPlugin("fp8", fp8={**AO, "weights": "fp32"}), steps=2)
    assert plugin.masters is None and plugin.master_weights is None and model.fc1.weight.dtype == torch.float32


def test_kahan_masters_with_fp8():
    model, _ = fit(plugin := MPPlugin("fp8", fp8=AO, master_weights="kahan"), steps=3)
    assert plugin.master_weights == "kahan" and model.fc1.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("weights, kind", [("fp32", "fp32"), ("fp8", "kahan")])
def test_master_weights_with_weights_that_are_not_bf16_is_refused_up_front(weights, kind):
    with pytest.raises(ValueError, match=rf"master_weights='{kind}' applies to bf16 weights, but fp8=\{{'weights':"):
        MPPlugin("fp8", fp8={"weights": weights}, master_weights=kind)


def test_resume_is_bit_identical(tmp_path):
    whole, _ = fit(MPPlugin("fp8", fp8=AO), steps=12)
    _, trainer = fit(MPPlugin("fp8", fp8=AO), steps=5)
    path = str(tmp_path / "half.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    masters = saved["MPPlugin"]["master_weights"]
    assert masters["kind"] == "fp32" and masters["masters"]["emb.weight"].dtype == torch.float32
    assert "fc1.weight" not in masters["masters"] and saved["state_dict"]["fc1.weight"].dtype == torch.float32
    seed_everything(0)
    rest = Net()
    trainer = Trainer(accelerator="cpu", max_steps=12, plugins=[MPPlugin("fp8", fp8=AO)], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(rest, ckpt_path=path)
    for (name, a), b in zip(whole.named_parameters(), rest.parameters()):
        assert torch.equal(a, b), name


def test_fabric_trains_the_same_layout():
    """MPFabricPrecision("fp8") (the same step under Lightning Fabric): bf16 weights, fp32 masters, the loss going
    down, a poisoned step skipped with the weights unchanged, the module's FP8 layers released by teardown."""
    from lightning.fabric import Fabric

    from lightning_mp import MPFabricPrecision

    plugin = MPFabricPrecision("fp8", fp8=AO)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    batches = Net().batches
    losses = []
    for step in range(12):
        tokens = batches[step % len(batches)]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if step == 6:
            loss = loss * float("inf")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 6:
            assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
        else:
            losses.append(loss.item())
    assert plugin.stats.skipped_steps == 1 and isinstance(plugin.masters, FP32MasterWeights)
    assert model.fc1.weight.dtype == torch.float32 and model.emb.weight.dtype == torch.bfloat16
    assert sum(losses[-3:]) < sum(losses[:3])
    plugin.teardown()


def test_a_checkpoint_of_the_fp32_layout_resumes_with_its_fp32_weights_as_the_masters(tmp_path):
    """A run saved with fp8={"weights": "fp32"} (the layout before 0.2) resumed with the default: the masters take
    the checkpoint's fp32 weights exactly (not their bf16 rounding), and the model's weights are their rounding."""
    _, trainer = fit(MPPlugin("fp8", fp8={**AO, "weights": "fp32"}), steps=3)
    path = str(tmp_path / "fp32-layout.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert saved["fc1.weight"].dtype == torch.float32
    plugin = MPPlugin("fp8", fp8=AO)
    model = restored(plugin, path)
    assert model.emb.weight.dtype == torch.bfloat16
    assert torch.equal(plugin.masters.master_of(model.emb.weight), saved["emb.weight"])
    assert torch.equal(model.emb.weight, saved["emb.weight"].to(torch.bfloat16))
    assert model.fc1.weight.dtype == torch.float32 and torch.equal(model.fc1.weight, saved["fc1.weight"])


def test_validate_and_predict_after_fit_keep_the_layout_and_the_masters():
    class WithEval(Net):
        def validation_step(self, batch, batch_idx):
            tokens = self.batches[batch_idx % len(self.batches)]
            logits = self(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            self.log("val_loss", loss)

        def val_dataloader(self):
            return self.train_dataloader()

    plugin = MPPlugin("fp8", fp8=AO)
    model, trainer = fit(plugin, steps=4, model=WithEval(), limit_val_batches=2, num_sanity_val_steps=0)
    masters = {n: plugin.masters.master_of(p).clone() for n, p in model.named_parameters()
               if plugin.masters.master_of(p) is not None}
    (result,) = trainer.validate(model, verbose=False)
    assert torch.isfinite(torch.tensor(result["val_loss"]))
    assert model.fc1.weight.dtype == torch.float32 and model.emb.weight.dtype == torch.bfloat16
    assert plugin.stats.steps == 4
    for name, param in model.named_parameters():
        if name in masters:
            assert torch.equal(plugin.masters.master_of(param), masters[name]), name


def test_a_checkpoint_of_the_all_bf16_layout_resumes_with_its_fp32_masters_as_the_fp8_layers_weights(tmp_path):
    """A run saved with fp8={"weights": "bf16"} (every weight bf16, fp32 masters) resumed with the default: the FP8
    layers' fp32 weights take the checkpoint's fp32 masters exactly (not the bf16 weights)."""
    _, trainer = fit(saved_plugin := MPPlugin("fp8", fp8={**AO, "weights": "bf16"}), steps=3)
    assert trainer.lightning_module.fc1.weight.dtype == torch.bfloat16
    exact = {n: saved_plugin.masters.master_of(p).clone() for n, p in trainer.lightning_module.named_parameters()
             if saved_plugin.masters.master_of(p) is not None}
    path = str(tmp_path / "bf16-layout.ckpt")
    trainer.save_checkpoint(path)
    plugin = MPPlugin("fp8", fp8=AO)
    model = restored(plugin, path)
    assert model.fc1.weight.dtype == torch.float32
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "head.weight"):
        assert torch.equal(model.get_parameter(name), exact[name]), name
    assert torch.equal(plugin.masters.master_of(model.emb.weight), exact["emb.weight"])


def test_a_checkpoint_of_the_default_resumes_in_the_all_bf16_layout_with_exact_masters(tmp_path):
    """The other way: saved with the default, resumed with fp8={"weights": "bf16"}: the FP8 layers' fp32 weights in
    the checkpoint become their masters exactly; the weights are their bf16 rounding."""
    _, trainer = fit(MPPlugin("fp8", fp8=AO), steps=3)
    path = str(tmp_path / "default.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert saved["fc1.weight"].dtype == torch.float32 and saved["emb.weight"].dtype == torch.bfloat16
    plugin = MPPlugin("fp8", fp8={**AO, "weights": "bf16"})
    model = restored(plugin, path)
    assert model.fc1.weight.dtype == torch.bfloat16
    assert torch.equal(plugin.masters.master_of(model.fc1.weight), saved["fc1.weight"])
    assert torch.equal(model.fc1.weight, saved["fc1.weight"].to(torch.bfloat16))


class _Writes(Callback):
    """Writes the weights from outside the step at one batch's start, the ways users do: ``.data`` in place (an FP8
    layer's fp32 weight and the bf16 embedding), ``load_state_dict`` (the head), ``no_grad`` copy (fc2)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            pl_module.fc1.weight.data.fill_(0.25)
            pl_module.emb.weight.data.fill_(0.5)
            state = pl_module.head.state_dict()
            pl_module.head.load_state_dict({k: torch.full_like(v, -0.25) for k, v in state.items()})
            with torch.no_grad():
                pl_module.fc2.weight.copy_(torch.full_like(pl_module.fc2.weight, 0.125))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:  # one AdamW step (lr 3e-3) from the written values, not from the masters' old ones
            for name, value in (("fc1", 0.25), ("emb", 0.5), ("head", -0.25), ("fc2", 0.125)):
                weight = pl_module.get_submodule(name).weight.float()
                assert (weight - value).abs().max() < 0.01, name
            masters = trainer.precision_plugin.masters
            assert (masters.master_of(pl_module.emb.weight) - 0.5).abs().max() < 0.01
            self.checked = True


@pytest.mark.parametrize("fp8", [AO, {**AO, "weights": "bf16"}], ids=["default", "all-bf16"])
def test_weights_written_from_outside_the_step_are_trained_from_in_every_layout(fp8):
    writes = _Writes(at=3)
    fit(MPPlugin("fp8", fp8=fp8), steps=5, callbacks=[writes])
    assert writes.checked


def test_the_plugin_pickles_mid_fit_and_the_copy_trains_a_run_of_its_own(tmp_path):
    """A copy of the plugin pickled mid-fit (FP8 layers, masters, the monitor's FP8 figures armed) holds nothing of the
    run; the run goes on, and the copy trains a fresh model."""
    import io
    import pickle

    from lightning.pytorch.loggers import CSVLogger

    from lightning_mp import PrecisionMonitor

    class Snap(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.data = pickle.dumps(trainer.precision_plugin)
                self.steps = trainer.precision_plugin.stats.steps

    snap = Snap()
    fit(plugin := MPPlugin("fp8", fp8=AO), steps=4, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1,
        callbacks=[PrecisionMonitor(fp8_layers=True), snap])
    assert plugin.stats.steps == 4
    copied = pickle.load(io.BytesIO(snap.data))
    assert copied.stats.steps == snap.steps == 3
    model, _ = fit(copied, steps=2)
    assert copied.stats.steps == 5 and model.fc1.weight.dtype == torch.float32
