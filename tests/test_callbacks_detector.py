"""NonFiniteDetector in a real Trainer on the CPU: the right module for an inf/NaN made in forward, in backward
only (a custom autograd function), between modules, in the loss and in a parameter gradient; actions; reads."""

import math
import pickle
import warnings

import pytest
import torch
from conftest import StepRecorder, TinyRegressor, assert_state_equal, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_mp import MPPlugin, NonFiniteTrainingError
from lightning_mp.callbacks import NonFiniteDetector


class _NaNGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a gradient that goes bad in backward only."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.nan)


class NaNGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.active = False

    def forward(self, x):
        return _NaNGradient.apply(x) if self.active else x


class NaNOutput(nn.Module):
    """tanh, with one NaN written into its output when active."""

    def __init__(self):
        super().__init__()
        self.active = False

    def forward(self, x):
        y = torch.tanh(x)
        if self.active:
            y = y.clone()
            y[0, 0] = math.nan
        return y


class Deep(TinyRegressor):
    """net1 -> relu -> grad_gate (NaN gradient on chosen batches) -> mid -> act (NaN output on chosen ones) -> net2."""

    def __init__(self, nan_forward=(), nan_backward=(), **kwargs):
        super().__init__(**kwargs)
        self.nan_forward, self.nan_backward = set(nan_forward), set(nan_backward)
        self.grad_gate = NaNGradient()
        self.mid = nn.Linear(32, 32)
        self.act = NaNOutput()

    def forward(self, x):
        index = self.batch_index if self.training else -1
        self.act.active = index in self.nan_forward
        self.grad_gate.active = index in self.nan_backward
        h = self.grad_gate(torch.relu(self.net1(x)))
        return self.net2(self.act(self.mid(h)))


def native_fp16():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))


PLUGINS = {
    "mp-bf16": lambda: (MPPlugin("bf16"), {}),
    "mp-fp16": lambda: (MPPlugin("fp16", init_scale=256.0), {}),
    "native-bf16-mixed": lambda: (None, {"precision": "bf16-mixed"}),
    "native-16-mixed": lambda: (native_fp16(), {}),
    "native-32-true": lambda: (None, {"precision": "32-true"}),
}


def fit(model, detector, plugin_name="mp-bf16", max_steps=6, callbacks=(), **kwargs):
    plugin, extra = PLUGINS[plugin_name]()
    trainer = make_trainer(plugin, max_steps=max_steps, callbacks=[detector, *callbacks], **extra, **kwargs)
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("plugin_name", list(PLUGINS))
def test_names_the_module_whose_forward_output_went_nan(plugin_name):
    detector = NonFiniteDetector()
    with pytest.raises(NonFiniteTrainingError, match=r"global step 3 .*\n  forward:  `act` \(NaNOutput\): output 0"):
        fit(Deep(nan_forward=(3,)), detector, plugin_name)
    (report,) = detector.reports
    assert (report.step, report.batch_idx, report.epoch) == (3, 3, 0)
    forward = report.forward
    assert (forward.module, forward.module_type) == ("act", "NaNOutput")
    assert (forward.tensor, forward.value) == ("output 0", "nan")
    assert forward.shape == [8, 32]
    expected_dtype = {"mp-fp16": "torch.float16", "native-16-mixed": "torch.float16", "native-32-true": "torch.float32"}
    assert forward.dtype == expected_dtype.get(plugin_name, "torch.bfloat16")
    # its input (mid's output) was finite, and the report says how large it was
    (inp,) = forward.inputs
    assert inp["shape"] == [8, 32] and 0 < inp["absmax"] < 100
    assert "produced it from finite inputs" in forward.explanation
    assert "the forward pass was already non-finite" in report.backward.explanation


@pytest.mark.parametrize("plugin_name", ["mp-bf16", "mp-fp16", "native-16-mixed", "native-32-true"])
def test_names_the_module_whose_backward_made_a_nan_gradient(plugin_name):
    detector = NonFiniteDetector(track_inputs=True)
    with pytest.raises(NonFiniteTrainingError, match="backward: `grad_gate` \\(NaNGradient\\)"):
        fit(Deep(nan_backward=(2,)), detector, plugin_name)
    (report,) = detector.reports
    assert report.step == 2 and report.forward is None
    backward = report.backward
    assert (backward.module, backward.module_type, backward.value) == ("grad_gate", "NaNGradient", "nan")
    assert backward.tensor == "gradient of input 0 of `grad_gate`" and backward.shape == [8, 32]
    assert "the gradient of its output was finite" in backward.explanation
    # the parameters below the bad backward got NaN gradients, those above did not
    assert report.nonfinite_params == ["net1.weight", "net1.bias"]


def test_backward_culprit_at_the_defaults_is_the_module_after_the_last_finite_gradient():
    detector = NonFiniteDetector()
    with pytest.raises(NonFiniteTrainingError, match="backward: `grad_gate` \\(NaNGradient\\)"):
        fit(Deep(nan_backward=(2,)), detector)
    backward = detector.reports[0].backward
    # grad_gate's input (relu's output) is not checked: the first bad gradient is net1's output gradient,
    # and the last finite one was grad_gate's output gradient
    assert backward.module == "grad_gate" and backward.tensor == "gradient of output 0 of `net1`"
    assert "or code between them" in backward.explanation


def test_inf_made_by_code_between_modules_is_traced_to_the_parent():
    detector = NonFiniteDetector(action="warn", track_inputs=True)
    with pytest.warns(UserWarning, match="input 0 .* is inf: the input arrived non-finite"):
        fit(TinyRegressor(poison_activation=(2,)), detector)
    forward = detector.reports[0].forward
    assert (forward.module, forward.tensor, forward.value) == ("net2", "input 0", "inf")
    assert "`TinyRegressor` (the LightningModule)" in forward.explanation
    assert forward.inputs[0]["absmax"] == math.inf

    # without input tracking: net2's output is the first non-finite value seen, its input unchecked
    detector = NonFiniteDetector(action="warn")
    with pytest.warns(UserWarning, match="some inputs were not checked"):
        fit(TinyRegressor(poison_activation=(2,)), detector)
    forward = detector.reports[0].forward
    assert (forward.module, forward.tensor) == ("net2", "output 0") and forward.inputs[0]["absmax"] is None


def test_module_filter_and_leaves():
    # watching only net1/net2: act's NaN is first seen as net2's input (no watched module produced it)
    detector = NonFiniteDetector(modules=r"^net\d$", track_inputs=True)
    with pytest.raises(NonFiniteTrainingError):
        fit(Deep(nan_forward=(1,)), detector)
    assert detector._names == ["net1", "net2"]
    assert (detector.reports[0].forward.module, detector.reports[0].forward.tensor) == ("net2", "input 0")
    containers = NonFiniteDetector(leaves_only=False)
    with pytest.raises(NonFiniteTrainingError):
        fit(Deep(nan_forward=(1,)), containers)
    assert "" in containers._names and containers.reports[0].forward.module == "act"


def test_loss_and_parameter_gradient_findings():
    detector = NonFiniteDetector(action="warn")
    with pytest.warns(UserWarning, match="the loss is inf"):
        fit(TinyRegressor(poison_loss=(1,)), detector)
    assert detector.reports[0].forward.tensor == "loss" and detector.reports[0].forward.module is None

    detector = NonFiniteDetector(action="warn")
    with pytest.warns(UserWarning, match="gradient of parameter net1.weight is NaN"):
        fit(TinyRegressor(poison_grad=(1,), poison_value=math.nan), detector)
    report = detector.reports[0]
    assert report.forward is None and report.backward.module == "net1"
    assert report.nonfinite_params == ["net1.weight"]
    assert "on_after_backward" in report.backward.explanation


def test_fp16_loss_scale_overflows_are_not_reported_unless_asked():
    # a loss scale of 2**24 overflows fp16 gradients: the scaler skips and backs off, which is not an error
    plugin = MPPlugin("fp16", init_scale=2.0**24)
    detector = NonFiniteDetector(action="raise")
    trainer = make_trainer(plugin, max_steps=6, callbacks=[detector])
    trainer.fit(TinyRegressor())
    assert plugin.stats.skipped_steps > 0 and detector.reports == []

    loud = NonFiniteDetector(action="warn", report_overflows=True)
    with pytest.warns(UserWarning, match="is inf"):
        make_trainer(MPPlugin("fp16", init_scale=2.0**24), max_steps=2, callbacks=[loud]).fit(TinyRegressor())
    assert loud.reports[0].forward is None and loud.reports[0].backward.value == "inf"


def test_warn_folds_repeats_and_training_goes_on():
    detector = NonFiniteDetector(action="warn")
    # bf16-mixed applies the NaN step: every later step is NaN too; one warning per distinct finding
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(Deep(nan_forward=(2,)), detector, "native-bf16-mixed", max_steps=8)
    assert trainer.global_step == 8
    ours = [w for w in caught if "NonFiniteDetector" in str(w.message)]
    assert len(ours) == len(detector.reports) <= 3
    assert detector.reports[0].step == 2 and sum(r.repeats for r in detector.reports) >= 3


def test_skip_without_a_scaler_leaves_parameters_and_optimizer_state_alone():
    recorder = StepRecorder()
    detector = NonFiniteDetector(action="skip")
    model = TinyRegressor(optimizer="adam", poison_grad=(2,), poison_value=math.nan)
    with pytest.warns(UserWarning, match="NonFiniteDetector"):
        fit(model, detector, "native-bf16-mixed", max_steps=5, callbacks=[recorder])
    assert_state_equal(recorder.before[2], recorder.after[2])
    assert not torch.equal(recorder.before[3]["params"]["net1.weight"], recorder.after[3]["params"]["net1.weight"])
    assert all(math.isfinite(p.abs().sum().item()) for p in model.parameters())
    assert int(recorder.after[-1]["opt_state"][0]["step"]) == 4


class ReportCount(Callback):
    def __init__(self, detector):
        self.detector, self.counts = detector, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(len(self.detector.reports))


def test_flags_are_read_only_every_n_steps_and_name_the_first_bad_step(monkeypatch):
    # what a GPU run does: no host read on clean steps; the first non-finite batch of the window is named
    detector = NonFiniteDetector(action="warn", check_every_n_steps=4)
    detector._read_every_batch_on_cpu = False
    reads = []
    original = NonFiniteDetector._check
    monkeypatch.setattr(NonFiniteDetector, "_check", lambda self, *a, **k: reads.append(1) or original(self, *a, **k))
    counter = ReportCount(detector)
    with pytest.warns(UserWarning, match="global step 1 "):
        fit(Deep(nan_forward=(1, 2)), detector, "native-bf16-mixed", max_steps=6, callbacks=[counter])
    assert counter.counts[:4] == [0, 0, 0, 1]  # described at the read after batch 4, not before
    assert detector.reports[0].step == 1 and detector.reports[0].later_batches >= 1
    assert len(reads) == 2  # after batch 4, and at the end of fit


def test_mpplugin_host_known_skip_triggers_the_read():
    detector = NonFiniteDetector(action="warn", check_every_n_steps=100)
    detector._read_every_batch_on_cpu = False
    counter = ReportCount(detector)
    with pytest.warns(UserWarning):
        fit(Deep(nan_backward=(2,)), detector, "mp-bf16", max_steps=5, callbacks=[counter])
    assert counter.counts == [0, 0, 1, 1, 1]  # MPPlugin knew on the host that step 2 was skipped


def test_reports_when_the_plugin_stops_training():
    detector = NonFiniteDetector(action="raise", check_every_n_steps=100)
    detector._read_every_batch_on_cpu = False
    plugin = MPPlugin("fp16", init_scale=256.0, max_consecutive_skips=1)  # stops inside the step
    trainer = make_trainer(plugin, max_steps=8, callbacks=[detector])
    with pytest.raises(NonFiniteTrainingError, match="optimizer steps in a row"):
        with pytest.warns(UserWarning, match="`act`"):
            trainer.fit(Deep(nan_forward=tuple(range(2, 8))))
    assert detector.reports[0].forward.module == "act"


def test_dump_holds_the_batch_and_the_module_inputs(tmp_path):
    detector = NonFiniteDetector(action="raise", dump_dir=str(tmp_path / "dumps"))
    with pytest.raises(NonFiniteTrainingError, match="dumped the batch"):
        fit(Deep(nan_forward=(2,)), detector)
    report = detector.reports[0]
    dump = torch.load(report.dump_path, weights_only=True)
    assert dump["report"]["step"] == 2 and dump["report"]["forward"]["module"] == "act"
    x, y = dump["batch"]
    assert x.shape == (8, 16) and torch.equal(x, TinyRegressor().train_dataloader().dataset.tensors[0][16:24])
    (inp,) = dump["forward_module_inputs"]  # act's input: mid's output
    assert inp.shape == (8, 32) and torch.isfinite(inp).all()
    stats = report.forward.inputs[0]
    assert stats["max"] == pytest.approx(float(inp.float().max()), rel=1e-2) and stats["nonfinite"] == 0


def test_validation_and_clean_runs_report_nothing():
    detector = NonFiniteDetector()
    trainer = fit(Deep(), detector, "mp-bf16", max_steps=4, limit_val_batches=2, val_check_interval=2)
    assert detector.reports == [] and detector._pending == [] and detector._handles == []
    assert trainer.global_step == 4


def test_is_picklable_and_arguments_are_validated():
    pickle.dumps(NonFiniteDetector(modules="net"))
    for kwargs, fragment in [
        ({"action": "stop"}, "action='stop' is invalid: use one of 'raise', 'warn', 'skip'"),
        ({"check_every_n_steps": 0}, "check_every_n_steps=0"),
        ({"check_every_n_steps": 2.5}, "check_every_n_steps=2.5"),
        ({"modules": "(net"}, "not a valid regular expression"),
        ({"track_inputs": 1}, "track_inputs=1"),
        ({"dump_dir": ""}, "dump_dir=''"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            NonFiniteDetector(**kwargs)


def test_with_mpplugin_bf16_the_detector_only_reads(check_passes):
    """Callbacks are read-only: the plugin takes its own verdict, after every hook; the detector changes nothing."""
    import math

    from conftest import StepRecorder, TinyRegressor, assert_state_equal, make_trainer

    from lightning_mp import MPPlugin, NonFiniteDetector

    calls = check_passes
    recorder = StepRecorder()
    model = TinyRegressor(optimizer="adamw_fused", poison_grad=(2,), poison_value=math.nan)
    plugin = MPPlugin("bf16")
    detector = NonFiniteDetector(action="warn")
    with pytest.warns(UserWarning, match="gradient of parameter net1.weight"):
        make_trainer(plugin, max_steps=4, callbacks=[recorder, detector]).fit(model)
    assert len(calls) == 4  # the plugin's own check, once a step
    assert_state_equal(recorder.before[2], recorder.after[2])
    assert plugin.stats.skipped_steps == 1


def test_true_half_gradients_are_named_after_the_model_parameters():
    """With master weights the detector still names the parameter (it used to say '?')."""
    import math

    from conftest import TinyRegressor, make_trainer

    from lightning_mp import MPPlugin, NonFiniteDetector

    detector = NonFiniteDetector(action="warn")
    model = TinyRegressor(poison_grad=(1,), poison_value=math.nan)
    with pytest.warns(UserWarning, match="gradient of parameter net1.weight"):
        make_trainer(MPPlugin("bf16-true"), max_steps=3, callbacks=[detector]).fit(model)
    assert detector.reports[0].nonfinite_params == ["net1.weight"]


def test_a_nan_weight_is_named_as_the_cause_not_finite_inputs():
    import math

    from conftest import TinyRegressor, make_trainer

    from lightning_mp import MPPlugin, NonFiniteDetector

    model = TinyRegressor()
    with torch.no_grad():
        model.net1.weight[0, 0] = math.nan
    detector = NonFiniteDetector(action="warn")
    with pytest.warns(UserWarning, match=r"own weights are non-finite \(net1.weight\)"):
        make_trainer(MPPlugin("bf16"), max_steps=2, callbacks=[detector]).fit(model)
    assert "from finite inputs" not in detector.reports[0].message
