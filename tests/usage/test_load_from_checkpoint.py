"""``LightningModule.load_from_checkpoint`` of checkpoints written under MPPlugin, in every mode and with every kind
of master weights.

``load_from_checkpoint`` builds the module from the saved hyperparameters and loads ``checkpoint["state_dict"]``;
no precision plugin takes part. The checkpoint's ``state_dict`` holds the model's weights in the dtype it trained
in, as Lightning's own plugin of the mode writes it (fp32 in mixed modes; bf16 / fp16 in true-half modes), so a
plain fp32 module loads exactly the trained weights (true-half: their half values, as from Lightning's own
``bf16-true`` checkpoint). The full fp32 values of the master weights are in the plugin's entry: a run resumed from
the checkpoint in ``fp32`` with MPPlugin (``trainer.fit(model, ckpt_path=...)``) starts from them; Lightning's own
``32-true`` starts from the ``state_dict``, as it does with its own checkpoints.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from .conftest import (
    OPT_MODES,
    MwMLP,
    MwRecordWeights,
    MwSetLR,
    mw_find_fp32_masters,
    mw_params,
    opt_plugin,
    opt_trainer,
)

LFC_LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                 "fp16-true": "16-true"}  # fmt: skip
LFC_DTYPE = {"fp32": torch.float32, "bf16": torch.float32, "fp16": torch.float32, "bf16-true": torch.bfloat16,
             "fp16-true": torch.float16}  # fmt: skip
LFC_RUNS = [*[(mode, None) for mode in OPT_MODES], ("bf16-true", "kahan"), ("bf16-true", "stochastic"),
            ("bf16-true", "none")]  # fmt: skip
LFC_IDS = [m if k is None else f"{m}-{k}" for m, k in LFC_RUNS]


class LfcNet(MwMLP):
    """MwMLP with its hyperparameters saved (``load_from_checkpoint`` rebuilds it from them)."""

    def __init__(self, lr: float = 0.05, hidden: int = 16, optimizer: str = "sgd") -> None:
        super().__init__(lr, hidden=hidden, optimizer=optimizer)
        self.save_hyperparameters()


def lfc_warnings(caught) -> set[str]:
    return {
        str(w.message) for w in caught
        if w.category.__name__ != "PerformanceWarning" and "LeafSpec" not in str(w.message)
    }  # fmt: skip


def lfc_train(tmp_path, mode: str, kind=None, lightning: bool = False):
    """Four steps with ModelCheckpoint(save_last=True); returns (model, plugin, the last checkpoint's path)."""
    options = {} if kind is None else {"master_weights": kind}
    plugin = None if lightning else opt_plugin(mode, **options)
    who = "lightning" if lightning else "ours"
    checkpoints = ModelCheckpoint(dirpath=tmp_path / who, save_last=True)
    model = LfcNet(lr=0.1, hidden=12)
    trainer = opt_trainer(plugin, precision=LFC_LIGHTNING[mode] if lightning else None, max_steps=4,
                          enable_checkpointing=True, callbacks=[checkpoints])  # fmt: skip
    trainer.fit(model)
    return model, plugin, checkpoints.last_model_path


@pytest.mark.parametrize("mode, kind", LFC_RUNS, ids=LFC_IDS)
def test_load_from_checkpoint_gives_the_trained_module(mode, kind, tmp_path):
    trained, _, path = lfc_train(tmp_path, mode, kind)
    saved = torch.load(path, weights_only=True)
    assert {v.dtype for v in saved["state_dict"].values()} == {LFC_DTYPE[mode]}  # as Lightning's plugin writes it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = LfcNet.load_from_checkpoint(path)
    assert not lfc_warnings(caught), lfc_warnings(caught)
    assert loaded.hparams.lr == 0.1 and loaded.hparams.hidden == 12 and loaded.layer.out_features == 12
    params = mw_params(loaded)
    assert all(v.dtype == torch.float32 for v in params.values())  # a plain fp32 module, as the class builds it
    for name, value in mw_params(trained).items():
        assert torch.equal(params[name], value.float()), f"{name}: not the trained weight"
    # predictions of the loaded fp32 module: the trained weights in fp32
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = LfcNet(hidden=12)
        expected.load_state_dict({k: v.float() for k, v in trained.state_dict().items()})
        assert torch.equal(loaded(x), expected(x))


@pytest.mark.parametrize("mode", OPT_MODES)
def test_checkpoint_loads_as_lightnings_own_does(mode, tmp_path):
    """The same module class, the same trained weights whichever plugin wrote the checkpoint (the weights differ
    only where the arithmetic does: master weights, and fp16 on a CPU, which Lightning runs as bf16)."""
    ours, _, our_path = lfc_train(tmp_path, mode, "none" if mode.endswith("-true") else None)
    theirs, _, their_path = lfc_train(tmp_path, mode, lightning=True)
    ours_saved = torch.load(our_path, weights_only=True)
    theirs_saved = torch.load(their_path, weights_only=True)
    assert ours_saved["hyper_parameters"] == theirs_saved["hyper_parameters"]
    for name, value in theirs_saved["state_dict"].items():
        assert ours_saved["state_dict"][name].dtype == value.dtype, name
        if mode != "fp16":
            assert torch.equal(ours_saved["state_dict"][name], value), name
    loaded_ours, loaded_theirs = LfcNet.load_from_checkpoint(our_path), LfcNet.load_from_checkpoint(their_path)
    assert type(loaded_ours) is type(loaded_theirs)
    if mode != "fp16":
        for (name, a), b in zip(loaded_ours.named_parameters(), loaded_theirs.parameters()):
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("mode, kind", [("bf16-true", "fp32"), ("bf16-true", "kahan"), ("fp16-true", "fp32")])
def test_resumed_in_fp32_the_run_starts_from_the_masters(mode, kind, tmp_path):
    """``load_from_checkpoint`` (the module), then ``fit(ckpt_path=...)`` in fp32: MPPlugin("fp32") starts from
    the masters' full fp32 values (with one warning naming both modes); Lightning's ``32-true`` from the
    ``state_dict``'s half values, as it does with its own true-half checkpoints."""
    lfc_train(tmp_path, mode, kind)
    path = tmp_path / "ours" / "last.ckpt"
    saved = torch.load(path, weights_only=True)
    for who in ("ours", "lightning"):
        model = LfcNet.load_from_checkpoint(path)
        recorder = MwRecordWeights()
        resume = opt_plugin("fp32") if who == "ours" else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt_trainer(resume, precision=None if who == "ours" else "32-true", max_steps=5,
                        callbacks=[MwSetLR(0.0), recorder]).fit(model, ckpt_path=path)  # fmt: skip
        start = recorder.start[0]
        half = {n: v.float() for n, v in saved["state_dict"].items()}
        if who == "lightning":
            assert all(torch.equal(start[n], half[n]) for n in start)
            continue
        assert any(f"written with precision={mode!r}" in m for m in lfc_warnings(caught))
        assert all(v.dtype == torch.float32 for v in start.values())
        assert any(not torch.equal(start[n], half[n]) for n in start), "the masters' low bits were not restored"
        for name, value in start.items():  # the masters round to the trained half weights
            assert torch.equal(value.to(saved["state_dict"][name].dtype), saved["state_dict"][name]), name
        if kind == "fp32":
            masters = mw_find_fp32_masters(saved)
            assert all(torch.equal(start[n], masters[n]) for n in start)


@pytest.mark.parametrize("mode", OPT_MODES)
def test_weights_only_checkpoints_hold_what_lightnings_own_hold(mode, tmp_path):
    """``save_checkpoint(weights_only=True)`` (``ModelCheckpoint(save_weights_only=True)``): the entries of
    Lightning's own plugin's, no plugin entry, and ``load_from_checkpoint`` gives the trained module; a full
    checkpoint holds Lightning's entries and the plugin's."""
    keys = {}
    for who in ("ours", "lightning"):
        model = LfcNet()
        plugin = opt_plugin(mode) if who == "ours" else None
        trainer = opt_trainer(plugin, precision=None if plugin else LFC_LIGHTNING[mode], max_steps=2)
        trainer.fit(model)
        trainer.save_checkpoint(tmp_path / f"{who}-weights.ckpt", weights_only=True)
        trainer.save_checkpoint(tmp_path / f"{who}-full.ckpt")
        weights = torch.load(tmp_path / f"{who}-weights.ckpt", weights_only=True)
        full = torch.load(tmp_path / f"{who}-full.ckpt", weights_only=True)
        keys[who] = (set(weights), set(full))
        loaded = LfcNet.load_from_checkpoint(tmp_path / f"{who}-weights.ckpt")
        assert all(torch.equal(a, b.float()) for a, b in zip(loaded.parameters(), model.parameters()))
    assert keys["ours"][0] == keys["lightning"][0]
    assert keys["ours"][1] >= keys["lightning"][1] | {"MPPlugin"}
