"""First-hour frictions of the command line: the console script finds models in the working directory, compare's
output options are checked before the first step (one line, exit 2), and help names the program as it was called."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).with_name("lightning-mp")
needs_script = pytest.mark.skipif(not SCRIPT.exists(), reason="the lightning-mp console script is not installed here")

MODEL = textwrap.dedent('''
    import torch
    from torch import nn
    from lightning.pytorch import LightningModule

    class SmallNet(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(64, 8))
            return torch.utils.data.DataLoader(data, batch_size=8)
''')


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@needs_script
def test_the_console_script_imports_a_model_from_the_working_directory(tmp_path):
    (tmp_path / "mycnn.py").write_text(MODEL)
    done = _run(["compare", "--model", "mycnn:SmallNet", "--modes", "fp32", "--steps", "2", "--warmup", "0",
                 "--rounds", "1", "--json", str(tmp_path / "out.json")], tmp_path)
    assert "mycnn" not in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "out.json").exists()


@pytest.mark.slow
@needs_script
def test_help_names_the_console_script(tmp_path):
    done = _run(["compare", "--help"], tmp_path)
    assert done.stdout.startswith("usage: lightning-mp compare")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_into_a_missing_folder_fails_before_training(flag, tmp_path, capsys):
    from lightning_mp.tools.compare import main

    with pytest.raises(SystemExit) as exit_:
        main(["--modes", "fp32", flag, str(tmp_path / "missing" / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag}:") and "does not exist" in err


def test_plot_without_matplotlib_fails_before_training(tmp_path, capsys, monkeypatch):
    from lightning_mp.tools.compare import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as exit_:
        main(["--modes", "fp32", "--plot", str(tmp_path / "out.png")])
    assert exit_.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err


@pytest.mark.slow
def test_version_is_instant_and_import_loads_no_torch():
    """``import lightning_mp`` (and so ``--version``) loads neither torch nor Lightning; every export still resolves."""
    code = (
        "import sys, lightning_mp\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'heavy import'\n"
        "from lightning_mp.__main__ import version_text\n"
        "print(version_text())\n"
        "assert 'torch' not in sys.modules\n"
        "assert set(lightning_mp._SOURCES) == set(lightning_mp.__all__)\n"
        "for name in lightning_mp.__all__: getattr(lightning_mp, name)\n"
        "from lightning_mp import *\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("lightning-mp ") and "torch " in done.stdout and "lightning " in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "8", "--warmup", "8"], "--warmup: 8: must be below --steps (8)"),
        (["--steps", "8", "--warmup", "2", "--rounds", "7"], "--rounds: 7: more rounds than timed steps"),
    ],
)
def test_compare_refuses_a_schedule_that_times_nothing_before_the_first_step(argv, message, capsys):
    from lightning_mp.tools import compare

    with pytest.raises(SystemExit) as exc:
        compare.main(["--modes", "fp32", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_compare_takes_modes_by_commas_or_spaces_and_a_short_run_keeps_working(capsys):
    """`--modes fp32,bf16` is the same as `--modes fp32 bf16`; `--steps 3` without --warmup/--rounds shrinks the
    defaults to fit and says the answer stands on little."""
    from lightning_mp.tools import compare

    code = compare.main(["--modes", "fp32,bf16", "--steps", "3", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| fp32" in out and "| bf16" in out
    assert "confidence: high" not in out and "little was timed" in out


def test_an_example_model_outside_a_checkout_says_where_the_examples_are(tmp_path, monkeypatch, capsys):
    """After a wheel install (here: run from a folder without the repository's examples) `--model examples.gpt_mini`
    says the examples come with the source repository, in one line, exit 2."""
    from lightning_mp.tools import compare

    monkeypatch.chdir(tmp_path)
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", os.getcwd(), root)])
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit) as exc:
        compare.main(["--model", "examples.gpt_mini", "--steps", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "examples come with the source repository" in err and "gpt-mini" in err
