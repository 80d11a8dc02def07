import logging
import warnings

import pytest
import torch
from conftest import NATIVE_BF16_CPU, TinyRegressor, make_trainer

from lightning_mp import MPPlugin, cpu, parse_precision, resolve_mode
from lightning_mp.modes import (
    ALIASES,
    FAST_BF16_ON_CPU,
    MODES,
    SLOW_BF16_ON_CPU,
    SLOW_FP16_ON_CPU,
    CpuCapability,
    PerformanceWarning,
    accepted_names,
    auto_choice,
    compute_dtype,
    slow_on_cpu,
    warn_if_slow_on_device,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fp32", "fp32"),
        ("32-true", "fp32"),
        ("32", "fp32"),
        (32, "fp32"),
        ("tf32", "tf32"),
        ("bf16", "bf16"),
        ("bf16-mixed", "bf16"),
        ("16-mixed", "fp16"),
        ("16", "fp16"),
        (16, "fp16"),
        ("FP16", "fp16"),
        ("auto", "auto"),
        ("bf16-true", "bf16-true"),
        ("16-true", "fp16-true"),
        ("transformer-engine", "fp8"),
        # dtype names (Hugging Face, NeMo) and torch dtypes: the autocast modes
        ("bfloat16", "bf16"),
        ("BFloat16", "bf16"),
        ("float16", "fp16"),
        ("float32", "fp32"),
        (torch.bfloat16, "bf16"),
        (torch.float16, "fp16"),
        (torch.float32, "fp32"),
    ],
)
def test_parse_names_and_lightning_aliases(value, expected):
    assert parse_precision(value) == expected


def test_dtype_aliases_reach_the_plugin():
    assert MPPlugin("bfloat16").mode.name == "bf16" and MPPlugin("bfloat16").precision == "bf16-mixed"
    assert MPPlugin("float16").mode.needs_scaler and MPPlugin("float32").precision == "32-true"


@pytest.mark.parametrize("bad", ["fp64", "float64", torch.float64, "half", "", "16-mix", None, 3.5, True])
def test_bad_string_names_value_and_every_accepted_name(bad):
    with pytest.raises(ValueError) as err:
        parse_precision(bad)
    message = str(err.value)
    assert repr(bad) in message
    for name in accepted_names():
        assert repr(name) in message
    assert "'bfloat16'" in message and "'float32'" in message


@pytest.mark.parametrize(
    ("level", "equivalent"),
    [("O0", "'fp32'"), ("O1", "'fp16'"), ("o2", "'fp16-true'"), ("O3", "'fp16-true' with master_weights='none'")],
)
def test_apex_opt_levels_are_refused_with_their_equivalent(level, equivalent):
    with pytest.raises(ValueError) as err:
        parse_precision(level)
    message = str(err.value)
    assert f"Unknown precision {level!r}. Accepted values: 'fp32'," in message
    assert f"Apex AMP's opt level {level!r} is not accepted; its equivalent is {equivalent}" in message


def test_compute_dtype_of_every_mode():
    expected = {
        "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
        "bf16-true": torch.bfloat16, "fp16-true": torch.float16, "fp8": torch.int8,
    }  # fmt: skip
    assert {name: compute_dtype(mode) for name, mode in MODES.items()} == expected


def test_plugin_rejects_bad_precision_at_construction():
    with pytest.raises(ValueError, match="Unknown precision 'fp64'.*'bf16'.*'16-mixed'"):
        MPPlugin("fp64")


def test_fp8_on_the_cpu_fails_before_training_and_says_why():
    with pytest.raises(ValueError, match=r"run is on the CPU\. Use precision='bf16'"):
        resolve_mode("fp8", "cpu")


def test_mode_table():
    assert MODES["fp16"].needs_scaler and not MODES["bf16"].needs_scaler
    assert MODES["bf16"].autocast_dtype is torch.bfloat16
    assert MODES["fp16"].autocast_dtype is torch.float16
    assert MODES["fp32"].autocast_dtype is None and MODES["fp32"].tf32 is False
    assert MODES["tf32"].tf32 is True
    assert {m.lightning_precision for m in MODES.values()} == {
        "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "transformer-engine"
    }
    assert MODES["bf16-true"].param_dtype is torch.bfloat16 and MODES["fp16-true"].needs_scaler
    assert set(ALIASES.values()) <= set(accepted_names())


#: a CPU of the common kind: AVX2, bf16 only in software (laptops, many cloud instances)
SLOW_BF16_CPU = CpuCapability("AVX2", bf16=False, how="no AVX512-BF16 or AMX")


def test_auto_on_a_cpu_with_native_bf16_is_bf16_and_says_why_in_one_line(caplog):
    assert resolve_mode("auto", "cpu").name == "bf16"  # (conftest: the suite's CPU has native bf16)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        make_trainer(MPPlugin("auto"), max_steps=1).fit(TinyRegressor())
    lines = [r.getMessage() for r in caplog.records if "'auto'" in r.getMessage()]
    assert len(lines) == 1, lines  # one choice, one line: the set-up line names the mode and who chose it
    assert lines[0].startswith("lightning_mp: using bf16 mixed precision (chosen by 'auto', autocast bf16,")
    assert lines[0].endswith(f" on cpu, because the CPU (AVX512, AVX512-BF16) has native bf16: {FAST_BF16_ON_CPU}")


def test_auto_on_a_cpu_without_native_bf16_is_fp32_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "cpu_capability", lambda: SLOW_BF16_CPU)
    assert auto_choice("cpu")[0] == "fp32" and resolve_mode("auto", "cpu").name == "fp32"
    plugin = MPPlugin("auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            trainer = make_trainer(plugin, max_steps=2)
            trainer.fit(TinyRegressor())
    assert not [w for w in caught if issubclass(w.category, PerformanceWarning)]  # auto's own choice: no warning
    assert plugin.mode.name == "fp32" and trainer.precision == "32-true" and trainer.global_step == 2
    lines = [r.getMessage() for r in caplog.records if "'auto'" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("lightning_mp: using fp32 precision (chosen by 'auto', fp32 weights and compute,")
    assert lines[0].endswith(
        f" on cpu, because the CPU (AVX2, no AVX512-BF16 or AMX) has no native bf16: {SLOW_BF16_ON_CPU}"
    )


def test_the_cpu_decision_is_a_function_of_the_capability():
    native = CpuCapability("AVX512", bf16=True, how="AMX")
    assert [auto_choice("cpu", c)[0] for c in (native, SLOW_BF16_CPU)] == ["bf16", "fp32"]
    assert [cpu.cpu_mode(c) for c in (native, SLOW_BF16_CPU)] == ["bf16", "fp32"]
    assert slow_on_cpu(MODES["bf16"], native) is None and slow_on_cpu(MODES["bf16-true"], native) is None
    assert slow_on_cpu(MODES["bf16"], SLOW_BF16_CPU) == slow_on_cpu(MODES["bf16-true"], SLOW_BF16_CPU)
    assert slow_on_cpu(MODES["bf16"], SLOW_BF16_CPU) == SLOW_BF16_ON_CPU
    assert slow_on_cpu(MODES["fp16"], native) == SLOW_FP16_ON_CPU  # no AVX512-FP16 or AMX-FP16
    assert slow_on_cpu(MODES["fp16"], CpuCapability("AVX512", bf16=True, fp16=True)) is None
    assert all(slow_on_cpu(MODES[m], c) is None for m in ("fp32", "tf32") for c in (native, SLOW_BF16_CPU))


@pytest.mark.parametrize(
    ("mode", "kind", "instead", "penalty"),
    [
        ("fp16", NATIVE_BF16_CPU, "'bf16'", SLOW_FP16_ON_CPU),
        ("fp16-true", NATIVE_BF16_CPU, "'bf16-true'", SLOW_FP16_ON_CPU),
        ("16-mixed", NATIVE_BF16_CPU, "'bf16'", SLOW_FP16_ON_CPU),
        ("fp16", SLOW_BF16_CPU, "'fp32'", SLOW_FP16_ON_CPU),
        ("fp16-true", SLOW_BF16_CPU, "'fp32'", SLOW_FP16_ON_CPU),
        ("bf16", SLOW_BF16_CPU, "'fp32'", SLOW_BF16_ON_CPU),
        ("bf16-true", SLOW_BF16_CPU, "'fp32'", SLOW_BF16_ON_CPU),
    ],
    ids=lambda v: v.isa if isinstance(v, CpuCapability) else None,
)
def test_a_slow_mode_on_the_cpu_warns_once_at_set_up_with_the_measured_penalty(monkeypatch, mode, kind, instead,
                                                                               penalty):
    monkeypatch.setattr(cpu, "cpu_capability", lambda: kind)
    model = TinyRegressor()
    trainer = make_trainer(MPPlugin(mode), max_steps=3)
    with pytest.warns(PerformanceWarning) as record:
        trainer.fit(model)
    ours = [str(w.message) for w in record if issubclass(w.category, PerformanceWarning)]
    assert len(ours) == 1, ours  # at set-up, not per step
    name = parse_precision(mode)
    native = "fp16" if penalty is SLOW_FP16_ON_CPU else "bf16"
    head = f"MPPlugin(precision={name!r}) runs on a CPU without native {native} ({kind.describe()}):"
    assert ours[0].startswith(head)
    assert f": {penalty}. Use precision={instead} on this CPU (" in ours[0]  # one wording of the penalty
    assert trainer.global_step == 3 and trainer.precision_plugin.stats.steps == 3  # a warning: training goes on


@pytest.mark.parametrize("mode", ["bf16", "bf16-true", "fp32", "auto"])
def test_modes_that_suit_a_cpu_with_native_bf16_do_not_warn(mode):
    trainer = make_trainer(MPPlugin(mode), max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyRegressor())
    assert not [w for w in caught if issubclass(w.category, PerformanceWarning)]
    assert trainer.global_step == 2
    assert warn_if_slow_on_device(MODES["fp16"], "cuda") is None  # fp16 is fast on GPUs
    assert warn_if_slow_on_device(MODES["fp32"], "cpu", SLOW_BF16_CPU) is None


def test_fp8_on_the_cpu_names_the_cpus_mode(monkeypatch):
    from lightning_mp.fp8.support import fp8_device_problem

    assert fp8_device_problem("cpu").endswith("but the run is on the CPU. Use precision='bf16' instead.")
    monkeypatch.setattr(cpu, "cpu_capability", lambda: SLOW_BF16_CPU)
    assert fp8_device_problem("cpu").endswith("but the run is on the CPU. Use precision='fp32' instead.")


@pytest.mark.parametrize(
    ("bad", "close"),
    [("bf-16", "bf16"), ("BF16_true", "bf16-true"), ("fp61", "fp16"), ("bfloat", "bfloat16"), ("16-mix", "16-mixed")],
)
def test_a_misspelled_mode_gets_a_did_you_mean(bad, close):
    with pytest.raises(ValueError) as err:
        MPPlugin(bad)
    message = str(err.value)
    assert message.startswith(f"Unknown precision {bad!r}. Accepted values: 'fp32', 'tf32', 'bf16',")
    assert message.endswith(f" Did you mean {close!r}?")


@pytest.mark.parametrize("bad", ["double", "fp64", "float64"])  # fp64 is no typo of fp16: another bit width
def test_a_value_far_from_every_name_gets_no_guess(bad):
    with pytest.raises(ValueError) as err:
        parse_precision(bad)
    assert "Did you mean" not in str(err.value)
    with pytest.raises(ValueError) as err:
        parse_precision("O2")  # Apex's opt level: its own hint, no guess
    assert "Did you mean" not in str(err.value) and "its equivalent is 'fp16-true'" in str(err.value)


def test_unsupported_hardware_says_why_and_what_instead(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ValueError, match="bf16.*compute capability 8.0.*Use precision='fp16'"):
        resolve_mode("bf16", "cuda")
    assert resolve_mode("auto", "cuda").name == "fp16"
    with pytest.raises(ValueError, match="'mps'.*precision='fp32'"):
        resolve_mode("fp16", "mps")
