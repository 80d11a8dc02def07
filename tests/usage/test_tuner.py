"""Lightning's Tuner under MPPlugin: ``Tuner(trainer).lr_find`` / ``scale_batch_size`` and their callbacks
``LearningRateFinder`` / ``BatchSizeFinder``.

Both save a checkpoint, run trial steps, then restore the checkpoint: the weights, the optimizer state and the
plugin's entry (master weights, their rounding noise, the loss scale, the skip counters). What an experienced user
expects: the same suggestion / batch size as Lightning's own plugin of the mode, the model as it was before the
search, and a fit afterwards that trains exactly as a fresh fit of the untouched model at the chosen value would, in
every mode and with every kind of master weights.
"""

from __future__ import annotations

import copy
import math
import warnings

import lightning
import pytest
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.tuner import Tuner
from packaging.version import Version

from .conftest import assert_tensors_equal, OPT_MODES, MwMLP, mw_params, opt_plugin, opt_trainer

#: Lightning's own plugin of each mode (on the CPU Lightning runs "16-mixed" as bf16-mixed, with a warning)
TUNER_LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                   "fp16-true": "16-true"}  # fmt: skip
#: (mode, MPPlugin options): every mode, every kind of master weights, bf16 optimizer moments (their rounding noise)
TUNER_RUNS = [
    *[(mode, {}) for mode in OPT_MODES],
    ("bf16-true", {"master_weights": "kahan"}),
    ("bf16-true", {"master_weights": "stochastic"}),
    ("bf16-true", {"master_weights": "none"}),
    ("bf16", {"optimizer_states": "bf16"}),
]
TUNER_IDS = [mode + "".join(f"-{v}" for v in options.values()) for mode, options in TUNER_RUNS]
LR_FIND = dict(num_training=16, min_lr=1e-4, max_lr=1.0)
#: Lightning's release (major, minor, patch): its tuner changed in 2.5.4 and 2.6.0 (below)
TUNER_LIGHTNING_RELEASE = Version(lightning.__version__).release[:3]
#: Before Lightning 2.5.4 (#21068) the ``LearningRateFinder`` callback sets the module's lr attribute, then its
#: checkpoint restore puts the optimizer's lr back: the fit goes on at the lr it started with, with Lightning's own
#: plugin too. From 2.5.4 the suggestion is set on the optimizer after the restore.
TUNER_LR_CALLBACK_APPLIES = TUNER_LIGHTNING_RELEASE >= (2, 5, 4)


@pytest.fixture(autouse=True)
def tuner_no_full_gc(monkeypatch):
    """The batch-size finder frees CUDA memory between trials with a full ``gc.collect()`` (0.3 s each inside the
    suite); on the CPU it frees nothing the test needs."""
    import lightning.pytorch.tuner.batch_size_scaling as scaling

    monkeypatch.setattr(scaling, "garbage_collection_cuda", lambda: None)


def tuner_model(optimizer: str = "adam", **kwargs) -> MwMLP:
    kwargs.setdefault("n", 64)
    return MwMLP(lr=0.05, optimizer=optimizer, **kwargs)


def tuner_trainer(tmp_path, plugin=None, **kwargs):
    return opt_trainer(plugin, default_root_dir=tmp_path, **kwargs)




def tuner_warnings(caught) -> set[str]:
    """The warnings a user sees, less those the suite ignores (PerformanceWarning: fp16 on a CPU, on purpose) and
    torch's deprecation inside Lightning's own pytree helper."""
    return {
        str(w.message) for w in caught
        if w.category.__name__ != "PerformanceWarning" and "LeafSpec" not in str(w.message)
    }  # fmt: skip


class TunerRecorded(MwMLP):
    """Records the plugin's skip count and loss scale after every training batch, the lr finder's trial steps
    included (a module hook: the lr finder runs its trial steps with its own callback alone)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.skipped: list[int] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        plugin = self.trainer.precision_plugin
        self.skipped.append(plugin.stats.skipped_steps)
        self.scales.append(plugin.scaler.get_scale() if plugin.scaler is not None else 1.0)


# ================================================================================================================
# lr_find
# ================================================================================================================
@pytest.mark.parametrize("mode", OPT_MODES)
def test_lr_find_suggests_what_lightnings_own_plugin_suggests(mode, tmp_path):
    """SGD: Lightning's "16-true" has no master weights, and Adam's eps underflows in its fp16 state (NaN losses,
    no suggestion)."""
    results = {}
    for who in ("ours", "lightning"):
        model = tuner_model("sgd")
        start = mw_params(model)
        if who == "ours":
            trainer = tuner_trainer(tmp_path, opt_plugin(mode), max_steps=4)
        else:
            trainer = tuner_trainer(tmp_path, precision=TUNER_LIGHTNING[mode], max_steps=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            finder = Tuner(trainer).lr_find(model, **LR_FIND)
        suggestion = finder.suggestion()
        assert suggestion is not None and math.isfinite(suggestion), f"{who}: no suggestion"
        assert model.lr == suggestion  # update_attr: the module's lr attribute takes the suggestion
        assert len(finder.results["lr"]) == LR_FIND["num_training"]
        assert all(math.isfinite(loss) for loss in finder.results["loss"])
        results[who] = (suggestion, mw_params(model), tuner_warnings(caught), start)
        assert not list(tmp_path.glob(".lr_find_*.ckpt")), "the lr finder's checkpoint was left behind"

    ours, theirs = results["ours"], results["lightning"]
    # the same search over the same losses (mixed modes round alike; fp16 on a CPU is bf16 in Lightning's plugin)
    assert abs(math.log10(ours[0] / theirs[0])) <= 0.5, f"suggested lr {ours[0]:g}, Lightning's {theirs[0]:g}"
    # the model is as before the search: its start (mixed modes), the start cast to half as Lightning's (true half)
    assert_tensors_equal(ours[1], theirs[1], "weights after lr_find against Lightning's plugin")
    if mode in ("fp32", "bf16", "fp16"):
        assert_tensors_equal(ours[1], ours[3], "weights after lr_find against the start")
    assert ours[2] <= theirs[2], f"warnings Lightning's own plugin does not give: {ours[2] - theirs[2]}"


TUNER_CALLBACK_RUNS = [("fp16", {}), ("bf16-true", {}), ("bf16-true", {"master_weights": "stochastic"}),
                       ("bf16", {"optimizer_states": "bf16"})]  # fmt: skip


@pytest.mark.parametrize(
    "mode, options, how",
    [*[(m, o, "tuner") for m, o in TUNER_RUNS], *[(m, o, "callback") for m, o in TUNER_CALLBACK_RUNS]],
    ids=[*[f"{i}-tuner" for i in TUNER_IDS], "fp16-callback", "bf16-true-callback", "bf16-true-stochastic-callback",
         "bf16-bf16-callback"],
)  # fmt: skip
def test_fit_after_lr_find_trains_as_a_fresh_fit_at_the_suggested_lr(mode, options, how, tmp_path):
    """After the search the run restarts from the checkpoint it saved: master weights, their rounding noise and the
    optimizer's moments included. Tuner form: lr_find, then ``trainer.fit``; callback form: the same ``fit`` goes on
    after the search (before Lightning 2.5.4 it goes on at the lr it started with: ``TUNER_LR_CALLBACK_APPLIES``)."""
    model = tuner_model()
    fresh = copy.deepcopy(model)
    plugin = opt_plugin(mode, **options)
    if how == "tuner":
        trainer = tuner_trainer(tmp_path, plugin, max_steps=6)
        Tuner(trainer).lr_find(model, **LR_FIND)
        trainer.fit(model)
    else:
        finder = LearningRateFinder(num_training_steps=LR_FIND["num_training"], min_lr=1e-4, max_lr=1.0)
        trainer = tuner_trainer(tmp_path, plugin, max_steps=6, callbacks=[finder])
        trainer.fit(model)
        assert finder.optimal_lr is not None and model.lr == finder.optimal_lr.suggestion()
    assert model.lr != 0.05  # the suggestion was taken

    fresh.lr = model.lr if how == "tuner" or TUNER_LR_CALLBACK_APPLIES else 0.05
    fresh_plugin = opt_plugin(mode, **options)
    tuner_trainer(tmp_path, fresh_plugin, max_steps=6).fit(fresh)
    assert model.losses[-6:] == fresh.losses
    assert fresh.losses[-1] < fresh.losses[0]
    assert_tensors_equal(mw_params(model), mw_params(fresh), f"{how} then fit, against a fresh fit")
    assert plugin.stats.as_dict() == fresh_plugin.stats.as_dict()


@pytest.mark.parametrize("mode", ["fp16", "fp16-true"])
def test_lr_find_overflowing_trial_steps_leave_no_trace(mode, tmp_path):
    """Trial steps at learning rates up to 1e4 overflow: they are skipped (fp16: the scale backs off). The restore
    puts the scale and the skip counters back to the checkpoint's: the fit afterwards skips nothing and matches a
    fresh fit."""
    model = TunerRecorded(lr=0.05, optimizer="adam", n=64)
    fresh = tuner_model()
    fresh.load_state_dict(model.state_dict())
    plugin = opt_plugin(mode)
    trainer = tuner_trainer(tmp_path, plugin, max_steps=4)
    finder = Tuner(trainer).lr_find(model, num_training=24, min_lr=1e-3, max_lr=1e4, early_stop_threshold=None,
                                    update_attr=False)  # fmt: skip
    assert model.skipped[-1] > 0, "no trial step overflowed: the test needs a larger max_lr"
    assert min(model.scales) < 2.0**8
    assert finder.suggestion() is not None
    trainer.fit(model)
    assert plugin.stats.skipped_steps == 0 and plugin.stats.steps == 4
    fresh_plugin = opt_plugin(mode)
    tuner_trainer(tmp_path, fresh_plugin, max_steps=4).fit(fresh)
    assert_tensors_equal(mw_params(model), mw_params(fresh), "lr_find then fit, against a fresh fit")
    assert plugin.stats.as_dict() == fresh_plugin.stats.as_dict()


@pytest.mark.parametrize(
    "mode, options", [("fp16", {}), ("bf16-true", {}), ("bf16-true", {"master_weights": "kahan"}),
                      ("bf16-true", {"master_weights": "stochastic"})], ids=["fp16", "bf16-true", "kahan", "stochastic"]
)  # fmt: skip
def test_lr_find_between_two_fits_leaves_the_run_as_it_was(mode, options, tmp_path):
    """``fit``; ``lr_find`` on the same Trainer (its checkpoint now holds masters, noise, a grown loss scale);
    ``fit`` on: exactly the run without the search (the lr the module keeps: ``update_attr=False``)."""
    if mode == "fp16":
        options = {"init_scale": 2.0**10, "growth_interval": 2}  # the scale grows during the first fit
    results = {}
    for search in (False, True):
        model = tuner_model()
        plugin = opt_plugin(mode, **options)
        trainer = tuner_trainer(tmp_path, plugin, max_steps=4)
        trainer.fit(model)
        assert mode != "fp16" or plugin.scaler.get_scale() > 2.0**10
        before = plugin.stats.as_dict()
        if search:
            Tuner(trainer).lr_find(model, num_training=12, max_lr=100.0, early_stop_threshold=None, update_attr=False)
            assert plugin.stats.as_dict() == before
        trainer.fit_loop.epoch_loop.max_steps = 8
        trainer.fit(model)
        results[search] = (mw_params(model), plugin.stats.as_dict())
    assert_tensors_equal(results[True][0], results[False][0], "fit, lr_find, fit against fit, fit")
    assert results[True][1] == results[False][1]


def test_lr_find_under_fast_dev_run_is_skipped_as_with_lightnings_plugin(tmp_path):
    """Lightning skips the search under ``fast_dev_run`` with a warning and returns ``None``: the same here."""
    model = tuner_model()
    trainer = tuner_trainer(tmp_path, opt_plugin("bf16-true"), fast_dev_run=True)
    with pytest.warns(UserWarning, match="fast_dev_run"):
        assert Tuner(trainer).lr_find(model, **LR_FIND) is None


# ================================================================================================================
# scale_batch_size
# ================================================================================================================
BATCH_FIND = dict(init_val=2, max_trials=3, steps_per_trial=1)
#: The size found: 2, 4, 8 all fit. Before Lightning 2.6.0 (#21187) the "power" search doubles after its last trial
#: too and returns that untried size, 16, with Lightning's own plugin as well.
BATCH_FOUND = 8 if TUNER_LIGHTNING_RELEASE >= (2, 6, 0) else 16


@pytest.mark.parametrize("mode, options", TUNER_RUNS[:7], ids=TUNER_IDS[:7])
def test_scale_batch_size_finds_lightnings_size_and_the_fit_after_is_a_fresh_fit(mode, options, tmp_path):
    model = tuner_model(batch_size=2)
    fresh = copy.deepcopy(model)
    plugin = opt_plugin(mode, **options)
    trainer = tuner_trainer(tmp_path, plugin, max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = Tuner(trainer).scale_batch_size(model, **BATCH_FIND)
    ours_warned = tuner_warnings(caught)

    reference = tuner_model(batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = Tuner(tuner_trainer(tmp_path, precision=TUNER_LIGHTNING[mode], max_steps=4)).scale_batch_size(
            reference, **BATCH_FIND
        )
    assert found == theirs == model.batch_size == BATCH_FOUND
    assert ours_warned <= tuner_warnings(caught), f"warnings Lightning's plugin does not give: {ours_warned}"
    assert_tensors_equal(mw_params(model), mw_params(reference), "weights after the search, against Lightning's")

    trainer.fit(model)
    fresh.batch_size = found
    fresh_plugin = opt_plugin(mode, **options)
    tuner_trainer(tmp_path, fresh_plugin, max_steps=4).fit(fresh)
    assert_tensors_equal(mw_params(model), mw_params(fresh), "scale_batch_size then fit, against a fresh fit")
    assert plugin.stats.as_dict() == fresh_plugin.stats.as_dict()


@pytest.mark.parametrize("mode, options", [("fp16", {}), *TUNER_RUNS[3:7]], ids=["fp16", *TUNER_IDS[3:7]])
def test_batch_size_finder_callback_then_fit_is_a_fresh_fit(mode, options, tmp_path):
    model = tuner_model(batch_size=2)
    fresh = copy.deepcopy(model)
    plugin = opt_plugin(mode, **options)
    finder = BatchSizeFinder(**BATCH_FIND)
    tuner_trainer(tmp_path, plugin, max_steps=4, callbacks=[finder]).fit(model)
    assert finder.optimal_batch_size == model.batch_size == BATCH_FOUND
    fresh.batch_size = BATCH_FOUND
    fresh_plugin = opt_plugin(mode, **options)
    tuner_trainer(tmp_path, fresh_plugin, max_steps=4).fit(fresh)
    assert_tensors_equal(mw_params(model), mw_params(fresh), "BatchSizeFinder's fit against a fresh fit")
    assert plugin.stats.as_dict() == fresh_plugin.stats.as_dict()
