"""MPPlugin's settings objects: each refuses a bad value by name, the defaults are written once, they are frozen,
every documented way of building the plugin still works, ``repr`` is unchanged, and the signature stays CLI-plain."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import DynamicLossScaler, FP8Config, MPPlugin
from lightning_mp.cli import cli_signature_problems
from lightning_mp.guards import FP32GuardSpec
from lightning_mp.modes import MODES
from lightning_mp.settings import (
    DEFAULTS,
    DistributedSettings,
    LossScaleSettings,
    MPSettings,
    SkipSettings,
)

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_CLASSES = (LossScaleSettings, SkipSettings, DistributedSettings, MPSettings)
PLUGIN_PARAMETERS = {n: p for n, p in inspect.signature(MPPlugin.__init__).parameters.items() if n != "self"}
SCALER_PARAMETERS = inspect.signature(DynamicLossScaler.__init__).parameters


# ---------------------------------------------------------------------------------------------- bad values, by name
# (settings class, keyword arguments, exception, what the message must say: the value, what is accepted, the fix)
BAD = [
    (LossScaleSettings, {"init_scale": 0.0}, ValueError, r"init_scale=0.0 is invalid: it must be a finite number > 0"),
    (LossScaleSettings, {"init_scale": -8.0}, ValueError, r"init_scale=-8.0 is invalid"),
    (LossScaleSettings, {"init_scale": math.inf}, ValueError, r"init_scale=inf is invalid"),
    (LossScaleSettings, {"init_scale": "big"}, ValueError, r"init_scale='big' is invalid"),
    (LossScaleSettings, {"init_scale": 2.0**30}, ValueError,
     r"init_scale=1073741824.0 lies outside \[min_scale=1.0, max_scale=16777216.0\]; choose an init_scale between"),
    (LossScaleSettings, {"growth_factor": 1.0}, ValueError, r"growth_factor=1.0 is invalid: .*> 1 \(e.g. 2.0\)"),
    (LossScaleSettings, {"backoff_factor": 0.0}, ValueError, r"backoff_factor=0.0 is invalid: it must lie in \(0, 1\)"),
    (LossScaleSettings, {"growth_interval": 0}, ValueError, r"growth_interval=0 is invalid: .*an integer >= 1"),
    (LossScaleSettings, {"growth_interval": 2.5}, ValueError, r"growth_interval=2.5 is invalid"),
    (LossScaleSettings, {"hysteresis": 0}, ValueError, r"hysteresis=0 is invalid: it must be an integer >= 1"),
    (LossScaleSettings, {"hysteresis": True}, ValueError, r"hysteresis=True is invalid"),
    (LossScaleSettings, {"consecutive_hysteresis": "yes"}, ValueError,
     r"consecutive_hysteresis='yes' is invalid: use true or false"),
    (LossScaleSettings, {"min_scale": 64.0, "max_scale": 8.0, "init_scale": 8.0}, ValueError,
     r"min_scale=64.0 is larger than max_scale=8.0; use min_scale <= max_scale"),
    (LossScaleSettings, {"max_scale": 1e39}, ValueError, r"max_scale=1e\+39 is invalid: .*float32"),
    (LossScaleSettings, {"loss_scale": 0}, ValueError, r"loss_scale=0 is invalid: use a finite number > 0 .*or None"),
    (LossScaleSettings, {"loss_scale": "big"}, ValueError, r"loss_scale='big' is invalid"),
    (LossScaleSettings, {"loss_scale": True}, ValueError, r"loss_scale=True is invalid"),
    (LossScaleSettings, {"loss_scale": 1e39}, ValueError, r"loss_scale=1e\+39 is invalid: .*fp32 can hold"),
    (LossScaleSettings, {"loss_scale": 128.0, "init_scale": 1024.0, "hysteresis": 2}, ValueError,
     r"loss_scale=128.0 \(a static scale\) contradicts hysteresis, init_scale.*Pass either loss_scale or"),
    (SkipSettings, {"skip_nonfinite": "yes"}, ValueError, r"skip_nonfinite='yes' is invalid: use true or false"),
    (SkipSettings, {"hold_schedulers_on_skip": 0}, ValueError, r"hold_schedulers_on_skip=0 is invalid"),
    (SkipSettings, {"release_grads_after_step": None}, ValueError, r"release_grads_after_step=None is invalid"),
    (SkipSettings, {"max_consecutive_skips": 0}, ValueError,
     r"max_consecutive_skips=0 is invalid: use an integer >= 1, or None to never stop"),
    (SkipSettings, {"max_consecutive_skips": True}, ValueError, r"max_consecutive_skips=True is invalid"),
    (SkipSettings, {"max_consecutive_skips": 2.5}, ValueError, r"max_consecutive_skips=2.5 is invalid"),
    (SkipSettings, {"spike_sigma": 0}, ValueError, r"spike_sigma=0 is invalid: use a finite number > 0 .*or None"),
    (SkipSettings, {"spike_sigma": math.inf}, ValueError, r"spike_sigma=inf is invalid"),
    (SkipSettings, {"spike_sigma": "6"}, ValueError, r"spike_sigma='6' is invalid"),
    (SkipSettings, {"spike_sigma": True}, ValueError, r"spike_sigma=True is invalid"),
    (SkipSettings, {"spike_sigma": 6.0, "spike_window": 4}, ValueError,
     r"spike_window=4 is invalid: use an integer >= 8 .*default 128"),
    (SkipSettings, {"spike_sigma": 6.0, "spike_window": 64.0}, ValueError, r"spike_window=64.0 is invalid"),
    (SkipSettings, {"spike_sigma": 6.0, "skip_nonfinite": False}, ValueError,
     r"spike_sigma=6.0 skips steps as the inf/NaN check does: it needs skip_nonfinite=True"),
    (DistributedSettings, {"reduce_dtype": "int8"}, ValueError,
     r"reduce_dtype='int8' is invalid: use one of \['bf16', 'fp16', 'fp32'\], or null for fp32"),
    (DistributedSettings, {"fsdp_param_dtype": "fp8"}, ValueError, r"fsdp_param_dtype='fp8' is invalid"),
    (MPSettings, {"precision": "fp12"}, ValueError, r"Unknown precision 'fp12'. Accepted values: 'fp32', 'tf32'"),
    (MPSettings, {"precision": 3.5}, ValueError, r"Unknown precision 3.5"),
    (MPSettings, {"tf32": 1}, ValueError, r"tf32=1 is invalid: use true, false, or null"),
    (MPSettings, {"device": 3}, ValueError, r"device=3 is invalid: use a device type such as 'cuda' or 'cpu'"),
    (MPSettings, {"fp32_modules": [3]}, ValueError, r"fp32_modules entry 3 is invalid"),
    (MPSettings, {"fp32_modules": "LayerNorm"}, ValueError, r"fp32_modules='LayerNorm' is invalid: use a list"),
    (MPSettings, {"precision": "bf16-true", "master_weights": "fp64"}, ValueError,
     r"master_weights='fp64' is invalid. Accepted values: 'fp32', 'kahan'"),
    (MPSettings, {"precision": "fp8", "fp8": {"recipe": "fastest"}}, ValueError, r"recipe.*'fastest'"),
    (MPSettings, {"precision": "fp8", "fp8": 3}, ValueError, r"fp8=3 is invalid: pass a dict"),
    # the mode's checks: a named mode is known when the settings are built
    (MPSettings, {"precision": "bf16", "master_weights": "fp32"}, ValueError,
     r"master_weights='fp32' applies to half-precision weights, but precision='bf16' keeps fp32 weights.*"
     r"Use precision='bf16-true'"),
    (MPSettings, {"precision": "auto", "master_weights": "kahan"}, ValueError,
     r"master_weights='kahan' applies to half-precision weights, but precision='auto' picks bf16 or fp16"),
    (MPSettings, {"precision": "fp16", "distributed": DistributedSettings(fsdp_param_dtype="bf16")}, ValueError,
     r"fsdp_param_dtype='bf16' applies to precision='bf16'.*not to precision='fp16'. Use fsdp_param_dtype='fp32'"),
    (MPSettings, {"precision": "fp32", "skips": SkipSettings(skip_nonfinite=False, max_consecutive_skips=5)},
     ValueError, r"max_consecutive_skips=5 counts skipped steps, but skip_nonfinite=False skips none in"
                 r" precision='fp32'. Drop one of the two"),
    (MPSettings, {"precision": "bf16", "scaler": torch.amp.GradScaler("cpu")}, MisconfigurationException,
     r"MPPlugin\(precision='bf16'\) got a scaler, but this mode does not scale the loss"),
]


def _case_id(case) -> str:
    cls, kwargs = case[0], case[1]
    return f"{cls.__name__}-" + "-".join(f"{k}={v!r}"[:30] for k, v in kwargs.items())


@pytest.mark.parametrize(("cls", "kwargs", "error", "pattern"), BAD, ids=[_case_id(c) for c in BAD])
def test_each_settings_object_refuses_a_bad_value_by_name(cls, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        cls(**kwargs)


@pytest.mark.parametrize(("cls", "kwargs", "error", "pattern"), BAD, ids=[_case_id(c) for c in BAD])
def test_the_plugin_refuses_the_same_values_when_built(cls, kwargs, error, pattern):
    flat = {}
    for name, value in kwargs.items():
        flat.update(value.arguments() if dataclasses.is_dataclass(value) else {name: value})
    with pytest.raises(error, match=pattern):
        MPPlugin(**flat)


@pytest.mark.parametrize(
    "kwargs",
    [{"init_scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 2.5},
     {"hysteresis": 0}, {"min_scale": 64.0, "max_scale": 8.0, "init_scale": 8.0}, {"init_scale": 2.0**30}],
)
def test_the_scaler_checks_as_the_settings_do(kwargs):
    with pytest.raises(ValueError) as from_settings:
        LossScaleSettings(**kwargs)
    with pytest.raises(ValueError) as from_scaler:
        DynamicLossScaler("cpu", **kwargs)
    assert str(from_scaler.value) == str(from_settings.value)


def test_a_static_scale_widens_the_bounds_it_lies_outside():
    settings = LossScaleSettings(loss_scale=2.0**30)
    arguments = settings.scaler_arguments()
    assert (arguments["init_scale"], arguments["max_scale"], settings.dynamic) == (2.0**30, 2.0**30, False)
    assert MPPlugin("fp16", loss_scale=2.0**30).scaler.get_scale() == 2.0**30


def test_warnings_the_settings_give(recwarn):
    SkipSettings(spike_window=64)
    MPSettings(precision="bf16", scaling=LossScaleSettings(init_scale=1024.0, hysteresis=2))
    MPSettings(precision="bf16", fp8={"recipe": "current"})
    messages = [str(w.message) for w in recwarn]
    assert any("spike_window=64 set, but spike_sigma=None: the loss-spike guard is off" in m for m in messages)
    assert any("hysteresis, init_scale set, but precision='bf16' does not scale the loss" in m for m in messages)
    assert any("fp8 settings are given but precision='bf16'; they apply to 'fp8'" in m for m in messages)


def test_the_defaults_warn_about_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cls in SETTINGS_CLASSES:
            cls()
        MPSettings(precision="bf16", fp8=FP8Config())  # the fp8 defaults are not "fp8 settings given"


def test_the_checks_that_need_the_mode_run_where_it_is_known():
    # auto: the mode is known at set-up only; then check_mode decides, and a switch between steps refuses only what
    # the new mode cannot run with
    settings = MPSettings.from_arguments(precision="auto", skip_nonfinite=False, max_consecutive_skips=5)
    with pytest.raises(ValueError, match="max_consecutive_skips=5 counts skipped steps"):
        settings.check_mode(MODES["bf16"])
    settings.check_mode(MODES["fp16"])  # fp16 skips whatever skip_nonfinite says
    settings.check_mode(MODES["bf16"], switch=True)
    gathers = MPSettings.from_arguments(precision="auto", fsdp_param_dtype="bf16")
    with pytest.raises(ValueError, match="fsdp_param_dtype='bf16' applies to precision='bf16'"):
        gathers.check_mode(MODES["fp16"], switch=True)


# ---------------------------------------------------------------------------------------------- defaults, once
def test_the_defaults_are_written_once():
    """The settings' fields and DynamicLossScaler's signature take DEFAULTS' very objects; MPPlugin's signature
    writes the same values out (the API reference and type checkers show them), equal in value and type."""
    non_none = {name for name, p in PLUGIN_PARAMETERS.items() if p.default is not None}
    assert non_none == set(DEFAULTS)
    for name, value in DEFAULTS.items():
        default = PLUGIN_PARAMETERS[name].default
        assert default == value and type(default) is type(value), name
    fields = {f.name: f for cls in SETTINGS_CLASSES for f in dataclasses.fields(cls)}
    for name, value in DEFAULTS.items():
        assert fields[name].default is value, name
    shared = [name for name in SCALER_PARAMETERS if name in DEFAULTS]
    assert shared == ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                      "consecutive_hysteresis", "min_scale", "max_scale"]
    for name in shared:
        assert SCALER_PARAMETERS[name].default is DEFAULTS[name], name


def test_signature_defaults_equal_the_settings_defaults():
    from_signature = MPSettings.from_arguments(**{n: p.default for n, p in PLUGIN_PARAMETERS.items()})
    assert from_signature == MPSettings() == MPSettings.defaults()
    assert sorted(MPSettings().arguments()) == sorted(PLUGIN_PARAMETERS)  # one field per argument, no more
    assert MPSettings().changed() == {} and MPPlugin().settings == MPSettings()


def _documentation() -> str:
    """The README and the documentation pages (docs/*.md), where the README's reference sections now stand."""
    return "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_the_readme_table_shows_the_defaults():
    page = (ROOT / "docs" / "plugin.md").read_text()  # the arguments table (the README's until the docs site)
    table = page[page.index("## Arguments"):page.index("## How a step runs")]
    rows = re.findall(r"^\| (`[^|]+`) \| (`[^`]*`)(?: / (`[^`]*`))?", table, flags=re.MULTILINE)
    documented = {}
    for names, *defaults in rows:
        for name, default in zip(re.findall(r"`(\w+)`", names), [d for d in defaults if d]):
            documented[name] = yaml.safe_load(default.strip("`"))
    assert set(documented) == set(PLUGIN_PARAMETERS)
    for name, value in documented.items():
        assert value == PLUGIN_PARAMETERS[name].default, name


# ---------------------------------------------------------------------------------------------- frozen
@pytest.mark.parametrize("cls", SETTINGS_CLASSES)
def test_settings_are_frozen(cls):
    settings = cls()
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings, name, getattr(settings, name))


def test_the_plugins_settings_are_read_only():
    plugin = MPPlugin("fp16", max_consecutive_skips=7, spike_sigma=6.0)
    for name in ("settings", "max_consecutive_skips", "hold_schedulers_on_skip", "release_grads_after_step",
                 "spike_sigma", "spike_window", "reduce_dtype", "fsdp_param_dtype", "fp8_config", "fp32_guards"):
        with pytest.raises(AttributeError):
            setattr(plugin, name, getattr(plugin, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plugin.settings.skips.max_consecutive_skips = 3
    assert (plugin.max_consecutive_skips, plugin.spike_sigma, plugin.spike_window) == (7, 6.0, 128)
    assert plugin.fp32_guards == FP32GuardSpec() and plugin.fp8_config == FP8Config()


# ---------------------------------------------------------------------------------------------- documented uses
def _documented_calls() -> list[str]:
    """Every ``MPPlugin(...)`` the README and the documentation pages write, with balanced parentheses."""
    text, calls, start = _documentation(), [], 0
    while (start := text.find("MPPlugin(", start)) >= 0:
        depth, end = 0, start + len("MPPlugin")
        for end in range(end, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[start:end + 1])
        start = end
    return sorted(set(calls))


#: the README's calls that it documents as refused (the troubleshooting table), and its placeholder
REFUSED_IN_README = {
    'MPPlugin("fp12")', 'MPPlugin("bf16", master_weights="fp32")', 'MPPlugin("fp8", fp8={"recipe": "fastest"})',
    "MPPlugin(hysteresis='two')", "MPPlugin(...)",
}
DOCUMENTED = [c for c in _documented_calls() if c not in REFUSED_IN_README]


def _documented_yaml() -> list[dict]:
    """MPPlugin ``init_args`` the README, the documentation pages and the example configs write."""
    written = re.findall(r"init_args: (\{.*\})", _documentation())
    found = [yaml.safe_load(m) for m in written if "precision:" in m]  # (not the GradScaler's {...})
    for path in sorted((ROOT / "examples" / "configs").glob("*.yaml")):
        for plugin in yaml.safe_load(path.read_text())["trainer"].get("plugins", []):
            if plugin["class_path"].endswith("MPPlugin"):
                found.append(plugin.get("init_args", {}))
    return [f for f in found if "precision" in f]


def test_the_readme_documents_these_calls():
    assert len(DOCUMENTED) >= 15 and REFUSED_IN_README <= set(_documented_calls())


@pytest.mark.parametrize("call", DOCUMENTED)
def test_every_call_the_readme_documents_still_builds(call):
    plugin = eval(call, {"MPPlugin": MPPlugin, "torch": torch})  # noqa: S307 - the README's own code
    assert isinstance(plugin.settings, MPSettings)
    assert MPSettings.from_arguments(**plugin.settings.arguments()) == plugin.settings


@pytest.mark.parametrize("init_args", _documented_yaml(), ids=lambda a: json.dumps(a, sort_keys=True))
def test_every_documented_config_still_builds(init_args):
    plugin = MPPlugin(**init_args)
    assert plugin.settings == MPSettings.from_arguments(**init_args)


@pytest.mark.parametrize(
    "call",
    [
        'MPPlugin("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))',
        'MPPlugin("bf16-true", master_weights="fp32", fp32_modules=["defaults", "*.router"])',
        'MPPlugin("fp16-true", loss_scale=1024.0, fp32_modules=[])',
        'MPPlugin("bf16-true", master_weights=True)',
        'MPPlugin("bf16-true", master_weights="stochastic")',
        'MPPlugin("fp16", fsdp_param_dtype="fp16", reduce_dtype="fp16")',
        'MPPlugin("fp32", tf32=True, skip_nonfinite=False, max_consecutive_skips=None)',
        'MPPlugin("tf32", release_grads_after_step=False, hold_schedulers_on_skip=False)',
        'MPPlugin("fp16", min_scale=2.0, max_scale=1024.0, init_scale=256.0, consecutive_hysteresis=False)',
        'MPPlugin("bf16", spike_sigma=3, spike_window=32)',
        'MPPlugin("auto", max_consecutive_skips=None)',
    ],
)
def test_the_docstrings_combinations_still_build(call):
    plugin = eval(call, {"MPPlugin": MPPlugin, "torch": torch})  # noqa: S307 - a literal from the list above
    assert MPSettings.from_arguments(**plugin.settings.arguments()) == plugin.settings


# ---------------------------------------------------------------------------------------------- repr
@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (lambda: MPPlugin(), "MPPlugin('bf16')"),
        (lambda: MPPlugin("bf16", init_scale=2**16, max_consecutive_skips=100), "MPPlugin('bf16')"),  # at defaults
        (lambda: MPPlugin("fp16", "cpu"), "MPPlugin('fp16')"),  # the device is not a setting of the run
        (lambda: MPPlugin("16-mixed", init_scale=1024.0, hysteresis=2),
         "MPPlugin('fp16', init_scale=1024.0, hysteresis=2)"),
        (lambda: MPPlugin("fp16-true", loss_scale=128, fp32_modules=[]),
         "MPPlugin('fp16-true', loss_scale=128, fp32_modules=[])"),
        (lambda: MPPlugin("bf16-true", master_weights=True, spike_sigma=6.0, reduce_dtype="bf16"),
         "MPPlugin('bf16-true', master_weights='fp32', reduce_dtype='bf16', spike_sigma=6.0)"),
        (lambda: MPPlugin("fp32", tf32=True, skip_nonfinite=False, max_consecutive_skips=None),
         "MPPlugin('fp32', skip_nonfinite=False, max_consecutive_skips=None, tf32=True)"),
        (lambda: MPPlugin("fp16", scaler=torch.amp.GradScaler("cpu")), "MPPlugin('fp16', scaler=<GradScaler>)"),
        (lambda: MPPlugin("auto"), "MPPlugin('auto')"),
    ],
)
def test_repr_is_unchanged(plugin, expected):
    assert repr(plugin()) == expected


def test_repr_follows_the_constructor_order_of_a_subclass():
    class Reordered(MPPlugin):
        def __init__(self, precision: str = "fp16", *, hysteresis: int = 1, init_scale: float = 2.0**16) -> None:
            super().__init__(precision, hysteresis=hysteresis, init_scale=init_scale)

    assert repr(Reordered(init_scale=1024.0, hysteresis=2)) == "Reordered('fp16', hysteresis=2, init_scale=1024.0)"


# ---------------------------------------------------------------------------------------------- Lightning CLI
PLAIN = (str, int, float, bool, type(None), dict, list)


def test_every_argument_has_a_plain_default():
    assert all(p.default is not p.empty for p in PLUGIN_PARAMETERS.values())
    assert all(isinstance(p.default, PLAIN) for p in PLUGIN_PARAMETERS.values())
    assert cli_signature_problems(MPPlugin) == []


def test_a_cli_style_round_trip():
    """init_args as YAML holds them (plain values) -> plugin -> settings -> the same settings again."""
    init_args = {
        "precision": "fp16", "init_scale": 256.0, "growth_factor": 4.0, "backoff_factor": 0.25,
        "growth_interval": 100, "hysteresis": 2, "consecutive_hysteresis": False, "min_scale": 2.0,
        "max_scale": 1024.0, "skip_nonfinite": True, "max_consecutive_skips": 7, "hold_schedulers_on_skip": False,
        "tf32": False, "release_grads_after_step": False, "fp32_modules": ["defaults", "*.router"],
        "reduce_dtype": "fp16", "fsdp_param_dtype": "fp16", "spike_sigma": 6.0, "spike_window": 64,
    }
    defaults = {n: p.default for n, p in PLUGIN_PARAMETERS.items()}
    assert json.loads(json.dumps(defaults)) == defaults  # every default survives a JSON/YAML round trip
    text = yaml.safe_dump({"class_path": "lightning_mp.MPPlugin", "init_args": {**defaults, **init_args}})
    plugin = MPPlugin(**yaml.safe_load(text)["init_args"])
    settings = plugin.settings
    assert settings == MPSettings.from_arguments(**init_args)
    assert MPSettings.from_arguments(**settings.arguments()) == settings
    assert {k: v for k, v in settings.changed().items() if k != "fp32_modules"} == {
        k: v for k, v in init_args.items() if v != defaults[k] and k != "fp32_modules"
    }
    assert settings.fp32_modules == FP32GuardSpec.from_arg(["defaults", "*.router"])
    assert (plugin.scaler.hysteresis, plugin.scaler.min_scale, plugin.scaler.get_growth_interval()) == (2, 2.0, 100)


def test_an_unknown_argument_is_refused_as_a_call_would():
    with pytest.raises(TypeError, match="unexpected keyword argument 'init_scal'"):
        MPSettings.from_arguments(init_scal=1024.0)


@pytest.mark.parametrize(
    "kwargs", [{"loss_scale": 1024.0}, {"init_scale": 8.0}, {"hysteresis": 2}, {"growth_interval": 10},
               {"min_scale": 2.0}, {"max_scale": 2.0**20}, {"backoff_factor": 0.25}, {"growth_factor": 4.0}]
)
def test_a_given_scaler_with_loss_scale_arguments_is_refused(kwargs):
    """The given scaler is used as it is: loss-scaling arguments beside it would be ignored without a word."""
    from lightning_mp import MPPlugin

    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"so {name} would be ignored"):
        MPPlugin("fp16", scaler=torch.amp.GradScaler("cpu", init_scale=8.0), **kwargs)
    MPPlugin("fp16", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))  # alone: fine


def test_the_constructors_defaults_are_the_settings_defaults():
    """Both plugins share one constructor whose defaults are written out (the API reference shows them): they are
    lightning_mp.settings.DEFAULTS, and the plugins take the same arguments."""
    import inspect

    from lightning_mp import MPFabricPrecision, MPPlugin
    from lightning_mp.settings import DEFAULTS

    trainer_side = inspect.signature(MPPlugin).parameters
    fabric_side = inspect.signature(MPFabricPrecision).parameters
    assert list(trainer_side) == list(fabric_side)
    for name, value in DEFAULTS.items():
        assert trainer_side[name].default == value, name
    assert MPPlugin().settings == MPPlugin(**{k: v for k, v in DEFAULTS.items()}).settings
