"""MPPlugin from a Lightning CLI YAML file and from the command line."""

import pytest
import yaml
from conftest import TinyRegressor

pytest.importorskip("jsonargparse")
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from lightning_mp import MPPlugin


def run_cli(args):
    return LightningCLI(TinyRegressor, args=args, save_config_callback=None)


def test_yaml_sets_every_argument(tmp_path):
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 3,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "plugins": [
                {
                    "class_path": "lightning_mp.MPPlugin",
                    "init_args": {
                        "precision": "fp16",
                        "init_scale": 256.0,
                        "hysteresis": 2,
                        "consecutive_hysteresis": False,
                        "min_scale": 2.0,
                        "max_scale": 1024.0,
                        "growth_interval": 100,
                        "growth_factor": 4.0,
                        "backoff_factor": 0.25,
                        "max_consecutive_skips": 7,
                        "hold_schedulers_on_skip": False,
                        "skip_nonfinite": True,
                        "tf32": None,
                        "release_grads_after_step": False,
                    },
                }
            ],
        },
        "model": {"poison_loss": [0, 1]},
    }
    path = tmp_path / "fp16.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = run_cli(["fit", "--config", str(path)])
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, MPPlugin) and cli.trainer.precision == "16-mixed"
    scaler = plugin.scaler
    assert (scaler.hysteresis, scaler.consecutive_hysteresis, scaler.min_scale, scaler.max_scale) == (2, False, 2.0, 1024.0)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.25, 100)
    assert (plugin.max_consecutive_skips, plugin.hold_schedulers_on_skip, plugin.release_grads_after_step) == (7, False, False)
    # two overflows in a row with hysteresis 2: one backoff by 0.25
    assert plugin.stats.loss_scale == 64.0 and plugin.stats.skipped_steps == 2


def test_command_line_form():
    cli = run_cli([
        "fit", "--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.plugins=lightning_mp.MPPlugin", "--trainer.plugins.precision=bf16-mixed",
    ])
    assert cli.trainer.precision == "bf16-mixed"
    assert cli.trainer.precision_plugin.stats.steps == 2


def test_bad_value_in_yaml_fails_before_training(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "max_steps": 2, "logger": False,
                    "plugins": [{"class_path": "lightning_mp.MPPlugin", "init_args": {"precision": "fp12"}}]},
    }))
    # jsonargparse wraps the plugin's error in its union report; our message is inside it
    with pytest.raises(ValueError, match=r"(?s)Unknown precision 'fp12'.*Accepted values: 'fp32'"):
        run_cli(["fit", "--config", str(path)])
