"""Bad configurations fail before training, with a message that names the argument and the fix.

The same table stands in the documentation's troubleshooting page (docs/troubleshooting.md).
"""

from __future__ import annotations

import math

import pytest
from conftest import TinyRegressor, make_trainer
from lightning.pytorch import Trainer

from lightning_mp import MPPlugin

# (case, MPPlugin kwargs, exception, pattern the message must match)
CONSTRUCTION = [
    ("unknown mode", {"precision": "fp12"}, ValueError, r"Unknown precision 'fp12'. Accepted values: 'fp32', 'tf32'"),
    ("mode of the wrong type", {"precision": 3.5}, ValueError, r"Unknown precision 3.5"),
    ("zero initial scale", {"init_scale": 0.0}, ValueError,
     r"init_scale=0.0 is invalid: it must be a finite number > 0"),
    ("negative initial scale", {"init_scale": -8.0}, ValueError, r"init_scale=-8.0 is invalid"),
    ("infinite initial scale", {"init_scale": math.inf}, ValueError, r"init_scale=inf is invalid"),
    ("growth factor 1", {"growth_factor": 1.0}, ValueError,
     r"growth_factor=1.0 is invalid: it must be a finite number > 1"),
    ("growth factor below 1", {"growth_factor": 0.5}, ValueError, r"growth_factor=0.5 is invalid"),
    ("backoff factor 1", {"backoff_factor": 1.0}, ValueError,
     r"backoff_factor=1.0 is invalid: it must lie in \(0, 1\)"),
    ("backoff factor 0", {"backoff_factor": 0.0}, ValueError, r"backoff_factor=0.0 is invalid"),
    ("growth interval 0", {"growth_interval": 0}, ValueError,
     r"growth_interval=0 is invalid: it must be an integer >= 1"),
    ("fractional growth interval", {"growth_interval": 2.5}, ValueError, r"growth_interval=2.5 is invalid"),
    ("hysteresis 0", {"hysteresis": 0}, ValueError, r"hysteresis=0 is invalid: it must be an integer >= 1"),
    ("min_scale above max_scale", {"min_scale": 64.0, "max_scale": 8.0, "init_scale": 8.0}, ValueError,
     r"min_scale=64.0 is larger than max_scale=8.0; use min_scale <= max_scale"),
    ("init_scale outside the bounds", {"init_scale": 2.0**30}, ValueError,
     r"init_scale=1073741824.0 lies outside \[min_scale=1.0, max_scale=16777216.0\]"),
    ("zero static loss scale", {"loss_scale": 0}, ValueError,
     r"loss_scale=0 is invalid: use a finite number > 0 .*or None"),
    ("loss scale of the wrong type", {"loss_scale": "big"}, ValueError, r"loss_scale='big' is invalid"),
    ("divergence limit 0", {"max_consecutive_skips": 0}, ValueError,
     r"max_consecutive_skips=0 is invalid: use an integer >= 1, or None to never stop"),
    ("divergence limit as a bool", {"max_consecutive_skips": True}, ValueError,
     r"max_consecutive_skips=True is invalid"),
    ("switch as a string", {"skip_nonfinite": "yes"}, ValueError,
     r"skip_nonfinite='yes' is invalid: use true or false"),
    ("switch as a number", {"hold_schedulers_on_skip": 0}, ValueError, r"hold_schedulers_on_skip=0 is invalid"),
    ("tf32 as a number", {"tf32": 1}, ValueError, r"tf32=1 is invalid: use true, false, or null"),
    ("fp8 settings of the wrong kind", {"precision": "fp8", "fp8": {"recipe": "fastest"}}, ValueError,
     r"recipe.*'fastest'"),
    ("unknown fp8 setting", {"precision": "fp8", "fp8": {"amax_len": 16}}, ValueError, r"amax_len"),
    ("bad FP32 guard entry", {"fp32_modules": [3]}, (ValueError, TypeError), r"fp32_modules"),
    ("master weights without half weights", {"precision": "bf16", "master_weights": "fp32"}, ValueError,
     r"master_weights='fp32' applies to half-precision weights.*Use precision='bf16-true'"),
    ("unknown master-weights option", {"precision": "bf16-true", "master_weights": "fp64"}, ValueError, r"fp64"),
    ("FSDP gather dtype unlike the mode's", {"precision": "fp16", "fsdp_param_dtype": "bf16"}, ValueError,
     r"fsdp_param_dtype='bf16' applies to precision='bf16'.*not to precision='fp16'"),
    ("unknown FSDP gather dtype", {"fsdp_param_dtype": "fp8"}, ValueError, r"fsdp_param_dtype='fp8' is invalid"),
    ("unknown gradient-reduction dtype", {"reduce_dtype": "int8"}, ValueError,
     r"reduce_dtype='int8' is invalid: use one of \['bf16', 'fp16', 'fp32'\], or null for fp32"),
]


@pytest.mark.parametrize(("case", "kwargs", "error", "pattern"), CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_bad_plugin_arguments_fail_at_construction(case, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        MPPlugin(**kwargs)


def test_precision_flag_and_plugin_together():
    with pytest.raises(ValueError, match=r"Received both `precision=bf16-mixed` and `plugins=.*Choose one"):
        Trainer(precision="bf16-mixed", plugins=[MPPlugin("fp16")], accelerator="cpu", logger=False)


def test_fp8_on_the_cpu_fails_before_the_first_step():
    model = TinyRegressor()
    with pytest.raises(
        ValueError,
        match=r"precision='fp8' needs an NVIDIA GPU with FP8 tensor cores.*run is on the CPU\. Use precision='bf16'",
    ):
        make_trainer(MPPlugin("fp8"), max_steps=2).fit(model)
    assert model.batches_seen == 0


def test_mode_the_hardware_cannot_run_fails_before_the_first_step(monkeypatch):
    import lightning_mp.modes as modes

    monkeypatch.setattr(modes, "bf16_supported", lambda device_type: False)
    model = TinyRegressor()
    with pytest.raises(ValueError, match=r"precision='bf16' needs hardware bf16 support.*Use precision='fp16'"):
        make_trainer(MPPlugin("bf16"), max_steps=2).fit(model)
    assert model.batches_seen == 0


def test_table_size():
    # the issue asks for at least 20 bad configurations; docs/troubleshooting.md lists the same ones
    assert len(CONSTRUCTION) + 2 >= 20


def test_scaler_arguments_do_not_apply_here_are_reported(recwarn):
    MPPlugin("bf16", growth_interval=10)
    assert any("growth_interval set, but precision='bf16' does not scale the loss" in str(w.message) for w in recwarn)
