"""What each install brings: the plugin needs only the runtime dependencies (no jsonargparse); the CLI comes with the
``cli`` extra, and where that is missing its entry points say which extra to install.

jsonargparse is made missing two ways: ``sys.modules["jsonargparse"] = None`` in this process (the CLI's import
message), and an import hook in a fresh interpreter (training under ``MPPlugin`` and ``compare --config`` there),
since Lightning and the other tests import jsonargparse in this one.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRA = 'pip install "lightning-mp[cli]"'

# an interpreter where jsonargparse cannot be imported, whatever is installed
BLOCK_JSONARGPARSE = textwrap.dedent('''
    import importlib.abc
    import sys

    class NoJsonargparse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "jsonargparse":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoJsonargparse())
''')


def _pyproject() -> str:
    path = ROOT / "pyproject.toml"
    if not path.exists():
        pytest.skip("the repository's pyproject.toml")
    return path.read_text()


def _requirements(text: str, key: str) -> list[str]:
    found = re.search(rf"^{key} = \[(.*?)\]$", text, re.M | re.S)
    assert found, f"pyproject.toml has no {key} list"
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", found.group(1)))


def test_jsonargparse_is_in_the_cli_extra_not_in_the_runtime_dependencies():
    text = _pyproject()
    runtime = [r for r in re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1).splitlines()
               if r.strip().startswith('"')]
    assert runtime and not any("jsonargparse" in r for r in runtime)
    cli = _requirements(text, "cli")
    assert len(cli) == 1 and cli[0].startswith("jsonargparse[signatures]>=")
    # LitGPT 0.5.13 pins jsonargparse[signatures]>=4.37,<=4.41: our floor must leave room for it
    floor = tuple(int(p) for p in cli[0].split(">=")[1].split("."))
    assert floor <= (4, 41)
    # `make test` installs the test extra: it must bring the CLI (its tests skip without jsonargparse)
    assert "lightning-mp[cli]" in _requirements(text, "test")
    for extra in ("cli", "plot", "fp8"):
        assert _requirements(text, extra)


def test_readme_install_section_names_each_extra_quoted():
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("the repository's README")
    section = readme.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in ("cli", "plot", "fp8"):
        # quoted: an unquoted [...] is a glob in zsh
        assert f'pip install "lightning-mp[{extra}]"' in section
        assert f'pip install ".[{extra}]"' in section


@pytest.mark.parametrize("module", ["lightning_mp.tools.cli", "lightning_mp.cli"])
def test_cli_without_jsonargparse_names_the_extra(monkeypatch, module):
    import lightning_mp.tools

    monkeypatch.setitem(sys.modules, "jsonargparse", None)
    for name in ("lightning_mp.tools.cli", "lightning_mp.cli"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    # `from lightning_mp.tools import cli` (the old spelling's module) takes the attribute an earlier import left
    monkeypatch.delattr(lightning_mp.tools, "cli", raising=False)
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module(module)
    assert err.value.name == "jsonargparse"
    assert str(err.value).startswith("MPLightningCLI (lightning_mp.tools.cli) needs jsonargparse, which is not")
    assert str(err.value).endswith(EXTRA)


def test_a_broken_jsonargparse_is_not_reported_as_missing(monkeypatch):
    """Only jsonargparse itself missing gets the extra's message; an import failing inside it keeps its own."""
    import importlib.abc

    class BrokenInside(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "jsonargparse":
                raise ModuleNotFoundError("No module named 'yaml_backend'", name="yaml_backend")
            return None

    monkeypatch.setattr(sys, "meta_path", [BrokenInside(), *sys.meta_path])
    for name in [n for n in sys.modules if n.split(".")[0] == "jsonargparse"] + ["lightning_mp.tools.cli"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module("lightning_mp.tools.cli")
    assert err.value.name == "yaml_backend" and "lightning-mp[cli]" not in str(err.value)


def _run_blocked(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "blocked.py"
    script.write_text(BLOCK_JSONARGPARSE + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)


@pytest.mark.slow
def test_plugin_trains_without_jsonargparse(tmp_path):
    """``import lightning_mp`` and ``MPPlugin("bf16")`` through a real Trainer, jsonargparse unimportable: the same
    weights as Lightning's ``bf16-mixed`` (what ``MPPlugin("bf16")`` promises), bit for bit."""
    done = _run_blocked('''
        import json
        import sys

        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from lightning.pytorch import LightningModule, Trainer, seed_everything

        import lightning_mp
        from lightning_mp import MPPlugin

        class Net(LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

            def training_step(self, batch, batch_idx):
                x, y = batch
                return nn.functional.mse_loss(self.net(x).float(), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        def train(**precision):
            seed_everything(0, verbose=False)
            model = Net()
            x = torch.randn(32, 8)
            data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
            trainer = Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False, **precision)
            trainer.fit(model, data)
            return torch.cat([p.detach().flatten() for p in model.parameters()]), trainer

        ours, trainer = train(plugins=[MPPlugin("bf16")])
        lightnings, _ = train(precision="bf16-mixed")
        seed_everything(0, verbose=False)
        start = torch.cat([p.detach().flatten() for p in Net().parameters()])
        print(json.dumps({
            "jsonargparse_loaded": any(n.split(".")[0] == "jsonargparse" for n in sys.modules),
            "steps": trainer.precision_plugin.stats.steps,
            "moved": (ours - start).abs().max().item(),
            "same_as_lightning": torch.equal(ours, lightnings),
            "finite": bool(torch.isfinite(ours).all()),
        }))
    ''', tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["jsonargparse_loaded"] is False
    assert result["steps"] == 6 and result["finite"] and result["moved"] > 1e-3
    assert result["same_as_lightning"] is True


@pytest.mark.slow
def test_console_script_without_jsonargparse(tmp_path):
    """``compare --config`` and ``MPLightningCLI`` name the extra; ``--version`` and ``demo --help`` need nothing."""
    config = tmp_path / "train.yaml"
    config.write_text("trainer:\n  max_steps: 2\n")
    done = _run_blocked(f'''
        import sys

        from lightning_mp.__main__ import main

        def exit_code(argv):
            try:
                return main(argv)
            except SystemExit as exit:
                return exit.code

        assert exit_code(["--version"]) == 0
        assert exit_code(["demo", "--help"]) == 0
        print("compare exit", exit_code(["compare", "--config", {str(config)!r}]))
        try:
            from lightning_mp.cli import MPLightningCLI
        except ModuleNotFoundError as err:
            print("cli:", err)
    ''', tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compare exit 2" in done.stdout
    assert "--config" in done.stderr and EXTRA in done.stderr
    assert "cli: MPLightningCLI (lightning_mp.tools.cli) needs jsonargparse" in done.stdout
    assert done.stdout.rstrip().endswith(EXTRA)
