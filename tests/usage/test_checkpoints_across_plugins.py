"""Checkpoints between MPPlugin and Lightning's own precision plugins, and the user's checkpoint hooks.

* A checkpoint written by Lightning's own plugin of the mode, resumed with ``fit(ckpt_path=...)`` under MPPlugin
  (and the reverse): no error, no warning Lightning's plugin does not give, the run goes on from the checkpoint's
  weights, optimizer state and ``global_step``; where the arithmetic is Lightning's (``master_weights="none"`` in
  true-half modes), bit for bit as Lightning's own resume.
* ``save_checkpoint(weights_only=True)`` and ``ModelCheckpoint(save_weights_only=True)`` resumed with
  ``fit(ckpt_path=...)``: the error Lightning gives with its own plugin, word for word.
* The module's and a callback's ``on_save_checkpoint`` / ``on_load_checkpoint`` adding entries, and a module whose
  ``on_load_checkpoint`` renames a layer (a checkpoint migrated to a new model): the resume goes on as with
  Lightning's plugin, whatever the master weights' kind.
* ``torch.load(path, weights_only=True)`` reads every checkpoint MPPlugin writes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from .conftest import OPT_MODES, MwMLP, MwRecordWeights, mw_find_fp32_masters, opt_plugin, opt_trainer

XP_LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                "fp16-true": "16-true"}  # fmt: skip
#: modes whose arithmetic is Lightning's (true-half modes with master_weights="none"; on a CPU Lightning's
#: 16-mixed runs as bf16)
XP_EXACT = ("fp32", "bf16", "bf16-true", "fp16-true")


def xp_optimizer(mode: str) -> str:
    # Adam on fp16 weights (Lightning's 16-true) divides by an underflowed eps: NaN in Lightning's own run
    return "sgd" if mode == "fp16-true" else "adam"


def xp_fit(
    who: str, mode: str, steps: int, tmp_path, ckpt=None, model=None, callbacks=(), checkpointing=False, **plugin_kwargs
):
    """Fit an MwMLP with MPPlugin (``who`` "ours") or Lightning's own plugin ("lightning"); returns (model,
    trainer, plugin or None, the warnings seen, less Lightning's note on resuming mid-epoch)."""
    model = model if model is not None else MwMLP(optimizer=xp_optimizer(mode))
    plugin = opt_plugin(mode, **plugin_kwargs) if who == "ours" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = opt_trainer(plugin, precision=None if plugin else XP_LIGHTNING[mode], max_steps=steps,
                              callbacks=list(callbacks), default_root_dir=tmp_path,
                              enable_checkpointing=checkpointing)  # fmt: skip
        trainer.fit(model, ckpt_path=ckpt)
    seen = {
        str(w.message) for w in caught
        if w.category.__name__ != "PerformanceWarning" and "LeafSpec" not in str(w.message)
        and "resuming from a checkpoint that ended before the epoch ended" not in str(w.message)
    }  # fmt: skip
    return model, trainer, plugin, seen


def xp_none(mode: str) -> dict:
    return {"master_weights": "none"} if mode.endswith("-true") else {}


def xp_assert_same(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {name}"


# ================================================================================================================
# Lightning's checkpoints resumed by MPPlugin, and MPPlugin's by Lightning
# ================================================================================================================
@pytest.mark.parametrize("direction", ["lightning->ours", "ours->lightning"])
@pytest.mark.parametrize("mode", OPT_MODES)
def test_a_checkpoint_resumes_under_the_other_plugin_as_under_its_own(mode, direction, tmp_path):
    writer, reader = direction.split("->")

    def options(who: str) -> dict:
        return xp_none(mode) if who == "ours" else {}

    _, trainer, _, _ = xp_fit(writer, mode, 3, tmp_path, **options(writer))
    path = tmp_path / "written.ckpt"
    trainer.save_checkpoint(path)
    own, own_trainer, _, own_warned = xp_fit(writer, mode, 6, tmp_path, ckpt=path, **options(writer))
    other, other_trainer, plugin, warned = xp_fit(reader, mode, 6, tmp_path, ckpt=path, **options(reader))
    assert own_trainer.global_step == other_trainer.global_step == 6
    assert len(other.losses) == 3 and all(torch.isfinite(torch.tensor(other.losses)))
    assert warned <= own_warned | {
        "You passed `Trainer(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on CPU."
        " Using `precision='bf16-mixed'` instead."
    }, f"warnings the writer's own plugin does not give: {warned - own_warned}"
    if plugin is not None:
        assert plugin.stats.steps == 3 and plugin.stats.skipped_steps == 0
    if mode in XP_EXACT:
        xp_assert_same(other, own, f"{direction} {mode}: the resumed run against the writer's own resume")
        assert other.losses == own.losses


@pytest.mark.parametrize(
    "mode, kind", [("bf16-true", "fp32"), ("bf16-true", "kahan"), ("bf16-true", "stochastic"),
                   ("fp16-true", "fp32"), ("fp16-true", "kahan")],
)  # fmt: skip
def test_lightnings_true_half_checkpoint_resumes_with_master_weights(mode, kind, tmp_path):
    """Lightning's bf16-true / 16-true checkpoint holds no master weights: MPPlugin's start from its half weights
    (no warning: there were none to lose), with its optimizer state and ``global_step``."""
    _, trainer, _, _ = xp_fit("lightning", mode, 3, tmp_path)
    path = tmp_path / "lightning.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    recorder = MwRecordWeights()
    model, trainer, plugin, warned = xp_fit("ours", mode, 5, tmp_path, ckpt=path, callbacks=[recorder],
                                            master_weights=kind)  # fmt: skip
    assert not warned, warned
    assert trainer.global_step == 5 and plugin.stats.steps == 2 and plugin.stats.skipped_steps == 0
    for name, value in recorder.start[0].items():
        assert torch.equal(value, saved["state_dict"][name]), name
    state = saved["optimizer_states"][0]["state"]
    assert len(trainer.optimizers[0].state) == len(state) and (bool(state) or mode == "fp16-true")  # (Adam; SGD)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ================================================================================================================
# weights-only checkpoints resumed with fit(ckpt_path=...)
# ================================================================================================================
@pytest.mark.parametrize("how", ["save_checkpoint", "ModelCheckpoint"])
@pytest.mark.parametrize("mode", OPT_MODES)
def test_a_weights_only_checkpoint_cannot_resume_as_with_lightnings_plugin(mode, how, tmp_path):
    errors = {}
    for who in ("lightning", "ours"):
        callback = ModelCheckpoint(dirpath=tmp_path / who, save_weights_only=True, every_n_train_steps=2)
        _, trainer, _, _ = xp_fit(who, mode, 2, tmp_path, callbacks=[callback], checkpointing=True)
        if how == "save_checkpoint":
            path = tmp_path / f"{who}.ckpt"
            trainer.save_checkpoint(path, weights_only=True)
        else:
            path = callback.best_model_path
        assert "optimizer_states" not in torch.load(path, weights_only=True)
        with pytest.raises(KeyError) as raised:
            xp_fit(who, mode, 4, tmp_path, ckpt=path)
        errors[who] = str(raised.value)
    assert errors["ours"] == errors["lightning"]
    assert "save_weights_only" in errors["ours"]


# ================================================================================================================
# the user's checkpoint hooks
# ================================================================================================================
class XpNotes(MwMLP):
    """Adds an entry in ``on_save_checkpoint`` and reads it back in ``on_load_checkpoint``."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["notes"] = {"steps": self.global_step, "table": torch.arange(3)}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.notes = checkpoint["notes"]


class XpNotesCallback(Callback):
    def __init__(self) -> None:
        self.loaded = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["callback_notes"] = torch.full((2,), float(trainer.global_step))

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.loaded = checkpoint["callback_notes"]


@pytest.mark.parametrize("mode", OPT_MODES)
def test_entries_the_users_hooks_add_travel_with_the_plugins(mode, tmp_path):
    model = XpNotes(optimizer=xp_optimizer(mode))
    _, trainer, plugin, _ = xp_fit("ours", mode, 3, tmp_path, model=model, callbacks=[XpNotesCallback()])
    path = tmp_path / "notes.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["notes"]["steps"] == 3 and torch.equal(saved["callback_notes"], torch.full((2,), 3.0))
    assert saved["MPPlugin"]["mode"] == mode
    resumed, callback = XpNotes(optimizer=xp_optimizer(mode)), XpNotesCallback()
    _, trainer, plugin, warned = xp_fit("ours", mode, 5, tmp_path, ckpt=path, model=resumed, callbacks=[callback])
    assert not warned, warned
    assert resumed.notes["steps"] == 3 and torch.equal(callback.loaded, torch.full((2,), 3.0))
    assert trainer.global_step == 5 and plugin.stats.steps == 5


class XpRenamed(MwMLP):
    """The next version of MwMLP: ``layer`` is now ``first``; ``on_load_checkpoint`` migrates older checkpoints."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.first = self.layer
        del self.layer

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.first(x))))

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["state_dict"]
        for name in [n for n in state if n.startswith("layer.")]:
            state["first." + name[len("layer.") :]] = state.pop(name)


@pytest.mark.parametrize(
    "mode, kind", [("bf16-true", "fp32"), ("bf16-true", "kahan"), ("bf16-true", "stochastic"),
                   ("fp16-true", "fp32"), ("fp16-true", "kahan"), ("bf16-true", "none")],
)  # fmt: skip
def test_a_layer_renamed_by_on_load_checkpoint_resumes_as_with_lightnings_plugin(mode, kind, tmp_path):
    """Lightning's plugin resumes a checkpoint whose keys the module's ``on_load_checkpoint`` renames; so does
    MPPlugin with every kind of master weights (the saved masters of the old names are not this model's: the
    renamed layer starts from the checkpoint's weights, the others from their exact masters)."""
    _, trainer, _, _ = xp_fit("ours", mode, 3, tmp_path, model=MwMLP(), master_weights=kind)
    path = tmp_path / "old.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    recorder = MwRecordWeights()
    model, trainer, plugin, warned = xp_fit("ours", mode, 5, tmp_path, ckpt=path, model=XpRenamed(),
                                            callbacks=[recorder], master_weights=kind)  # fmt: skip
    assert not warned, warned
    assert trainer.global_step == 5 and plugin.stats.steps == 5 and plugin.stats.skipped_steps == 0
    start = recorder.start[0]
    assert torch.equal(start["first.weight"], saved["state_dict"]["layer.weight"])
    assert torch.equal(start["out.weight"], saved["state_dict"]["out.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if kind == "fp32":  # the layer not renamed goes on from its exact master
        masters = mw_find_fp32_masters(plugin.state_dict())
        assert "layer.weight" not in masters and "first.weight" in masters
    # Lightning's own plugin, from its own checkpoint of the old model
    _, theirs, _, _ = xp_fit("lightning", mode, 3, tmp_path, model=MwMLP())
    theirs.save_checkpoint(tmp_path / "theirs.ckpt")
    _, theirs, _, _ = xp_fit("lightning", mode, 5, tmp_path, ckpt=tmp_path / "theirs.ckpt", model=XpRenamed())
    assert theirs.global_step == 5


# ================================================================================================================
# torch.load(weights_only=True) reads every checkpoint MPPlugin writes
# ================================================================================================================
XP_WRITERS = [
    *[(mode, {}) for mode in OPT_MODES],
    *[(mode, {"master_weights": kind}) for mode in ("bf16-true", "fp16-true") for kind in ("none", "kahan")],
    ("bf16-true", {"master_weights": "stochastic"}),
    ("bf16-true", {"optimizer_states": "bf16"}),
    ("fp16-true", {"master_weights": "kahan", "optimizer_states": "bf16", "spike_sigma": 6.0, "spike_window": 8}),
    ("fp16", {"spike_sigma": 6.0, "spike_window": 8}),
]


XP_WRITER_IDS = [f"{m}-{'-'.join(map(str, k.values()))}" for m, k in XP_WRITERS]


@pytest.mark.parametrize("mode, kwargs", XP_WRITERS, ids=XP_WRITER_IDS)
def test_every_checkpoint_loads_with_weights_only(mode, kwargs, tmp_path):
    model = MwMLP(optimizer="adam")
    _, trainer, _, _ = xp_fit("ours", mode, 3, tmp_path, model=model, **kwargs)
    for weights_only in (False, True):
        path = tmp_path / f"{weights_only}.ckpt"
        trainer.save_checkpoint(path, weights_only=weights_only)
        saved = torch.load(path, weights_only=True)
        assert saved["global_step"] == 3
        assert ("MPPlugin" in saved) is not weights_only
        if not weights_only:
            assert saved["MPPlugin"]["mode"] == mode
