"""The examples: their Lightning CLIs run a few steps on the CPU from their YAML configs (what CI runs),
every config parses, and the pieces (data split, captions, weight tying) do what their docstrings say."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("jsonargparse")
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `examples` is a package at the repository root, not an installed one

from lightning_mp import MPPlugin  # noqa: E402
from lightning_mp.tools.cli import cli_signature_problems  # noqa: E402

CONFIGS = ROOT / "examples" / "configs"
MODES = ("fp32", "bf16", "fp16", "bf16-true", "fp8")
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# tiny sizes and a few steps: the CLI, the plugin and validation (sampling, caption accuracy) all run
TINY = {
    "gpt_mini": [
        "--model.width=32", "--model.depth=1", "--model.heads=2", "--model.context=32", "--model.sample_bytes=4",
        "--data.seq_len=32", "--data.batch_size=4", "--data.max_bytes=40000",
    ],
    "vlm_mini": [
        "--model.width=32", "--model.depth=1", "--model.heads=2", "--data.batch_size=8", "--model.show_captions=1",
    ],
}
# limit_val_batches=2, not 1: jsonargparse reads the int 1 of Union[int, float] as 1.0, i.e. 100% of the batches
STEPS = [
    "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
    "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]


def example(name: str):
    if name == "vlm_mini":
        pytest.importorskip("sklearn")
    return importlib.import_module(f"examples.{name}")


def config_path(name: str, mode: str) -> Path:
    return CONFIGS / f"{name}_{mode}.yaml"


def run_example(name: str, mode: str, tmp_path: Path, *extra: str):
    args = ["fit", "--config", str(config_path(name, mode)), *TINY[name], *STEPS,
            f"--trainer.logger.init_args.save_dir={tmp_path}", *extra]
    return example(name).main(args)


def test_configs_exist_for_every_mode():
    for name in ("gpt_mini", "vlm_mini"):
        for mode in MODES:
            config = yaml.safe_load((CONFIGS / f"{name}_{mode}.yaml").read_text())
            plugin = config["trainer"]["plugins"][0]
            assert plugin["class_path"] == "lightning_mp.MPPlugin" and plugin["init_args"]["precision"] == mode
            assert "precision" not in config["trainer"], "trainer.precision conflicts with the plugin"
            assert "lightning_mp.PrecisionMonitor" in [c["class_path"] for c in config["trainer"]["callbacks"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_mini", "vlm_mini"])
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_example_cli_trains_a_few_steps(name, mode, tmp_path):
    cli = run_example(name, mode, tmp_path)
    trainer = cli.trainer
    assert trainer.global_step == 3
    assert isinstance(trainer.precision_plugin, MPPlugin) and trainer.precision == LIGHTNING_PRECISION[mode]
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert math.isfinite(float(trainer.callback_metrics["val/loss"]))  # validation ran (sampling / captioning)
    if name == "vlm_mini":
        assert 0.0 <= float(trainer.callback_metrics["val/caption_acc"]) <= 1.0
    saved = yaml.safe_load((Path(trainer.log_dir) / "config.yaml").read_text())
    assert saved["trainer"]["plugins"][0]["init_args"]["precision"] == mode


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_mini", "vlm_mini"])
def test_example_fp32_config(name, tmp_path):
    cli = run_example(name, "fp32", tmp_path, "--trainer.max_steps=2", "--trainer.limit_val_batches=0")
    assert cli.trainer.global_step == 2 and cli.trainer.precision == "32-true"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_mini", "vlm_mini"])
@pytest.mark.parametrize("mode", MODES)
def test_every_config_parses(name, mode, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example(name).main(["fit", "--config", str(config_path(name, mode)), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["plugins"][0]["init_args"]["precision"] == mode
    assert printed["trainer"]["precision"] is None


@pytest.mark.parametrize("name", ["gpt_mini", "vlm_mini"])
def test_bf16_true_config(name, tmp_path):
    cli = run_example(name, "bf16-true", tmp_path, "--trainer.max_steps=2", "--trainer.limit_val_batches=0")
    assert cli.trainer.global_step == 2 and cli.trainer.precision == "bf16-true"
    assert cli.trainer.precision_plugin.master_weights == "fp32"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_mini", "vlm_mini"])
def test_fp8_config_stops_before_training_on_cpu(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_example(name, "fp8", tmp_path)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: trainer.plugins: lightning_mp.MPPlugin(precision='fp8') cannot run on cpu")
    assert "precision='bf16'" in message


@pytest.mark.slow
def test_module_entry_point_runs(tmp_path):
    """The command CI and users type: ``python -m examples.gpt_mini fit --config ...``."""
    cmd = [sys.executable, "-m", "examples.gpt_mini", "fit", "--config", str(config_path("gpt_mini", "bf16")),
           *TINY["gpt_mini"], *STEPS, "--trainer.max_steps=2", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=2" in result.stderr + result.stdout


# ------------------------------------------------------------------------------------------ the pieces
def test_constructor_arguments_are_plain_types():
    gpt = example("gpt_mini")
    classes = [gpt.GPTMini, gpt.ByteTextDataModule]
    try:
        vlm = importlib.import_module("examples.vlm_mini")
        classes += [vlm.VLMMini, vlm.DigitCaptionDataModule]
    except ImportError:
        pass
    for cls in classes:
        assert cli_signature_problems(cls) == [], cls


def test_byte_text_split_is_deterministic_and_disjoint():
    gpt = example("gpt_mini")
    a, b = gpt.ByteTextDataModule(max_bytes=50000), gpt.ByteTextDataModule(max_bytes=50000)
    a.setup("fit")
    b.setup("fit")
    assert torch.equal(a.train_data, b.train_data) and torch.equal(a.val_data, b.val_data)
    assert 0.03 < len(a.val_data) / (len(a.train_data) + len(a.val_data)) < 0.08
    text = bytes(a.train_data.tolist()) + bytes(a.val_data.tolist())
    assert b"def " in text  # real Python source
    x, y = gpt.ByteWindows(a.train_data, 16)[3]
    assert x.dtype == torch.long and torch.equal(x[1:], y[:-1]) and int(x.max()) < 256


def test_gpt_mini_ties_weights_and_is_causal():
    gpt = example("gpt_mini")
    model = gpt.GPTMini(width=32, depth=2, heads=2, context=16).eval()
    assert model.head.weight is model.embed.weight
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :10], model(y)[:, :10], atol=1e-5)  # the future does not leak back
    with pytest.raises(ValueError, match="model.context"):
        model(torch.randint(0, 256, (1, 17)))


def test_vlm_captions_and_generation():
    vlm = example("vlm_mini")
    assert vlm.caption(7) == "the digit seven"
    assert vlm.decode(vlm.encode("the digit seven")) == "the digit seven"
    assert len(vlm.encode(vlm.caption(3))) <= vlm.MAX_TOKENS
    dm = vlm.DigitCaptionDataModule(batch_size=4)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 1797 and len(dm.val_set) == int(1797 * 0.2)
    images, tokens, digits = next(iter(dm.val_dataloader()))
    assert images.shape == (4, 1, 16, 16) and tokens.shape == (4, vlm.MAX_TOKENS)
    assert vlm.decode(tokens[0].tolist()) == vlm.caption(int(digits[0]))
    for encoder in ("cnn", "vit"):
        model = vlm.VLMMini(encoder=encoder, width=32, depth=1, heads=2).eval()
        assert model.head.weight is model.embed.weight
        assert model.generate(images).shape == (4, vlm.MAX_TOKENS)
