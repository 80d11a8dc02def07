"""`python -m lightning_mp compare`: flags and their errors, --config, --model.NAME, the table, per-mode memory,
the batch probe and the interleaved engine (CPU, a few seconds in all)."""

import json
import threading
import time

import pytest
import torch
from conftest import TinyRegressor
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningDataModule, LightningModule
from lightning_mp.tools.compare import build_parser, main

TINY_LM = ["--model.width", "32", "--model.layers", "1", "--model.heads", "2", "--model.seq_len", "16",
           "--model.batch_size", "4"]
FAST = ["--steps", "6", "--warmup", "2", "--rounds", "2", "--no-progress"]


class NoLoader(LightningModule):
    def __init__(self, width: int = 4, depth: int = 1) -> None:
        super().__init__()
        self.layer = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AlwaysFails(TinyRegressor):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("broken in every mode")


class LongFailure(TinyRegressor):
    """Fails under autocast with a long message: it must reach the notes whole, never cut in the table."""

    MESSAGE = " ".join(f"word{i:03d}" for i in range(60)) + " end-of-message"

    def training_step(self, batch, batch_idx):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError(self.MESSAGE)
        return super().training_step(batch, batch_idx)


class Recorded(TinyRegressor):
    """Records its constructor arguments and what the Trainer ran with."""

    seen: list = []

    def __init__(self, width: int = 32, tag: str = "none", batch_size: int = 8, lr: float = 0.05) -> None:
        super().__init__(batch_size=batch_size, lr=lr)
        Recorded.seen.append({"width": width, "tag": tag, "batch_size": batch_size})

    def on_fit_start(self) -> None:
        Recorded.seen.append({"accumulate": self.trainer.accumulate_grad_batches,
                              "clip": self.trainer.gradient_clip_val,
                              "skips": getattr(self.trainer.precision_plugin, "max_consecutive_skips", None)})


class RegressionData(LightningDataModule):
    def __init__(self, batch_size: int = 8, n: int = 64) -> None:
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)


class MostlyOverhead(TinyRegressor):
    """A step that is 6 ms of fixed overhead and almost no math: precision cannot matter."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.006)
        return super().training_step(batch, batch_idx)


ORDER: list = []


class DropoutNet(LightningModule):
    """Dropout and a shuffled loader draw from the global RNGs: interleaving must not change what a mode draws."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        ORDER.append(threading.current_thread().name.removeprefix("compare-"))
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(128, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size, shuffle=True)


def run(capsys, *argv):
    """main(argv) -> (exit code, stdout, stderr); input errors exit through SystemExit."""
    try:
        code = main(list(argv))
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("argv, expected", [
    (["--model-args", '{"widht": 3}'],
     "error: --model-args: unknown argument 'widht' for TinyByteLM; accepted: width, layers, heads, seq_len,"
     " batch_size, lr, poison_step (did you mean 'width'?)"),
    (["--model-args", "{width: 3}"], "error: --model-args: '{width: 3}' is not valid JSON (Expecting property name"),
    (["--model-args", "[3]"], "error: --model-args: '[3]' is not a JSON object"),
    (["--model.widht", "3"], "error: --model.widht: unknown argument 'widht' for TinyByteLM"),
    (["--model.width"], "error: --model.width: needs a value"),
    (["--model.width", "x"], "error: --model.width: TinyByteLM(width='x', "),
    (["--trainer.acumulate_grad_batches", "2"],
     "error: --trainer.acumulate_grad_batches: unknown argument 'acumulate_grad_batches' for Trainer"),
    (["--data.batch_size", "3"], "error: --data.batch_size: data arguments need a data module"),
    (["--bogus"], "error: --bogus: unrecognized argument"),
    (["--model", "test_compare_cli:run"], "error: --model: 'test_compare_cli:run' is not a LightningModule class"),
    (["--model", "test_compare_cli:NoLoader", "--model-args", '{"widht": 3}'],
     "error: --model-args: unknown argument 'widht' for NoLoader; accepted: width, depth (did you mean 'width'?)"),
    (["--model", "test_compare_cli:NoLoader"],
     "error: --model: test_compare_cli:NoLoader: NoLoader has no train_dataloader(); give it one, or pass"
     " --datamodule"),
    (["--steps", "0"], "error: --steps: 0: use at least 1"),
    (["--min-speedup", "0.5"], "error: --min-speedup: 0.5: use 1 or more"),
    (["--seed"], "error: argument --seed: expected one argument"),
    (["--config", "/nonexistent/train.yaml"], "error: --config: '/nonexistent/train.yaml': cannot read it"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exits_2(capsys, argv, expected):
    code, out, err = run(capsys, *argv, "--no-progress")
    assert code == 2 and not out
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_no_mode_succeeded_exits_1(capsys):
    code, out, _ = run(capsys, "--model", "test_compare_cli:AlwaysFails", "--modes", "fp32", "bf16", *FAST)
    assert code == 1
    assert "Recommendation: none — no mode ran" in out and "broken in every mode" in out


def test_help_documents_every_flag_with_its_default():
    parser = build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.option_strings
    text = parser.format_help()
    for flag in ("--model.NAME", "--data.NAME", "--trainer.NAME", "--no-progress", "--config", "--min-speedup",
                 "--rounds", "--warmup", "--no-batch-probe", "exit status"):
        assert flag in text


# --------------------------------------------------------------------------------------------- what to train
def test_model_dot_args_and_json_args_reach_the_constructor(capsys, tmp_path):
    Recorded.seen.clear()
    out_json = tmp_path / "c.json"
    code, out, _ = run(capsys, "--model", "test_compare_cli:Recorded", "--model.width", "24", "--model.tag", "hello",
                       "--model-args", '{"batch_size": 4}', "--trainer.gradient_clip_val=0.5", "--modes", "fp32",
                       *FAST, "--json", str(out_json))
    assert code == 0
    built = [s for s in Recorded.seen if "width" in s]
    assert built and all(s == {"width": 24, "tag": "hello", "batch_size": 4} for s in built[:2])
    assert {"accumulate": 1, "clip": 0.5, "skips": 100} in Recorded.seen
    assert "Recorded(batch_size=4, width=24, tag='hello')" in out  # what ran, in the report's header
    assert json.loads(out_json.read_text())["meta"]["trainer_kwargs"] == {"gradient_clip_val": "0.5"}
    assert "kept: gradient_clip_val=0.5" in out


def test_config_yaml_brings_model_data_and_trainer_settings(capsys, tmp_path):
    Recorded.seen.clear()
    config = tmp_path / "train.yaml"
    config.write_text(
        "seed_everything: 3\n"
        "trainer:\n"
        "  accumulate_grad_batches: 2\n"
        "  gradient_clip_val: 1.0\n"
        "  max_steps: 1000\n"
        "  plugins:\n"
        "    - class_path: lightning_mp.MPPlugin\n"
        "      init_args: {precision: bf16, max_consecutive_skips: 7}\n"
        "  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
        "model:\n"
        "  class_path: test_compare_cli.Recorded\n"
        "  init_args: {width: 40, tag: from-yaml}\n"
        "data:\n"
        "  class_path: test_compare_cli.RegressionData\n"
        "  init_args: {batch_size: 4}\n"
    )
    out_json = tmp_path / "c.json"
    code, out, err = run(capsys, "--config", str(config), "--model.tag", "from-flag", "--modes", "fp32", "bf16",
                         *FAST, "--json", str(out_json))
    assert code == 0, err
    built = [s for s in Recorded.seen if "width" in s]
    assert built and built[0] == {"width": 40, "tag": "from-flag", "batch_size": 8}  # the flag wins over the file
    fits = [s for s in Recorded.seen if "accumulate" in s]
    assert {"accumulate": 2, "clip": 1.0, "skips": 7} in fits and len(fits) == 3  # fp32, bf16 and the probe
    data = json.loads(out_json.read_text())
    assert data["meta"]["seed"] == 3 and data["meta"]["plugin_kwargs"] == {"max_consecutive_skips": "7"}
    rows = {r["mode"]: r for r in data["results"]}
    assert rows["fp32"]["items_per_step"] == 8  # two micro-batches of 4 per optimizer step
    assert data["probe"]["batch"] == 4 and data["probe"]["probe_batch"] == 2  # the data module's batch_size, halved
    assert "kept: accumulate_grad_batches=2, gradient_clip_val=1.0" in out
    assert "MPPlugin settings for every mode: max_consecutive_skips=7" in out
    assert "callbacks=[LearningRateMonitor]" in out


def test_config_errors_name_the_file_and_key(capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  class_path: test_compare_cli.Recorded\n  init_args: {widht: 3}\n")
    code, _, err = run(capsys, "--config", str(config))
    assert code == 2 and err.startswith(f"error: --config {config}: model.widht: unknown argument 'widht' for Recorded")
    config.write_text("model: {width: 3}\n")
    code, _, err = run(capsys, "--config", str(config))
    assert code == 2 and "the model section has no class_path; name the class with --model" in err
    config.write_text("trainer: [1, 2]\n")
    code, _, err = run(capsys, "--config", str(config))
    assert code == 2 and "the trainer section is not a mapping" in err


# --------------------------------------------------------------------------------------------- the report
def test_the_table_never_cuts_a_note(capsys):
    code, out, _ = run(capsys, "--model", "test_compare_cli:LongFailure", "--modes", "fp32", "bf16", "fp8", *FAST)
    assert code == 0
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0] == "| format | memory | speed | stability |"
    assert all("word0" not in line for line in table)  # long texts live in the notes, not in cells
    notes = " ".join(out.split("Notes:")[1].split("\n\n")[0].split())
    assert LongFailure.MESSAGE in notes  # whole, every word intact
    assert "but the run is on the CPU. Use precision='bf16' instead." in notes  # the fp8 note, not cut mid-word
    assert "| bf16 | — | — | failed (note 1) |" in out and "| fp8 | — | — | unsupported (note 2) |" in out


@pytest.mark.slow
def test_cpu_memory_is_per_mode_and_does_not_depend_on_run_order(capsys, tmp_path):
    figures = []
    for order in (["fp32", "bf16", "bf16-true"], ["bf16-true", "bf16", "fp32"]):
        out_json = tmp_path / "m.json"
        code, _, _ = run(capsys, *TINY_LM, "--modes", *order, *FAST, "--no-batch-probe", "--json", str(out_json))
        assert code == 0
        rows = {r["mode"]: r for r in json.loads(out_json.read_text())["results"]}
        assert all(r["memory_kind"] == "estimate" for r in rows.values())
        figures.append({m: rows[m]["peak_mem_mib"] for m in rows})
    assert figures[0] == figures[1]
    assert figures[0]["bf16-true"] < figures[0]["fp32"]  # bf16 weights and gradients


def test_batch_probe_calls_an_overhead_bound_model_too_small_to_matter(capsys, tmp_path):
    out_json = tmp_path / "p.json"
    code, out, _ = run(capsys, "--model", "test_compare_cli:MostlyOverhead", "--modes", "fp32", "bf16", "--steps", "9",
                       "--warmup", "1", "--rounds", "4", "--no-progress", "--json", str(out_json))
    assert code == 0
    probe = json.loads(out_json.read_text())["probe"]
    assert probe["mode"] == "bf16" and probe["batch"] == 8 and probe["probe_batch"] == 4
    assert probe["overhead_bound"] is True
    text = " ".join(out.split())
    assert "Size: overhead-bound" in text and "This model is too small for precision to matter" in text
    assert "Recommendation: fp32" in text and "The step is mostly fixed overhead" in text


# --------------------------------------------------------------------------------------------- the engine
def test_modes_take_turns_and_draw_what_they_would_draw_alone():
    from lightning_mp.tools.compare_engine import Job, Schedule, run_jobs

    build = lambda: (DropoutNet(), None)  # noqa: E731
    torch.manual_seed(0)
    initial = DropoutNet().state_dict()
    schedule = Schedule(steps=8, warmup=2, rounds=3)
    [alone] = run_jobs([Job("fp32", "fp32", build)], schedule, "cpu", 0, initial, progress=False)
    ORDER.clear()
    together = run_jobs([Job(m, m, build) for m in ("fp32", "bf16", "fp16")], schedule, "cpu", 0, initial,
                        monitor_every=4, progress=False)
    assert together[0].losses == alone.losses  # dropout masks and shuffling as in a run of its own
    assert ORDER == (
        ["fp32"] * 2 + ["bf16"] * 2 + ["fp16"] * 2  # warm-up
        + ["fp32"] * 2 + ["bf16"] * 2 + ["fp16"] * 2  # round 1
        + ["bf16"] * 2 + ["fp16"] * 2 + ["fp32"] * 2  # round 2: the order rotates
        + ["fp16"] * 2 + ["fp32"] * 2 + ["bf16"] * 2  # round 3
    )
    assert all(len(r.round_ms) == 3 and r.step_ms for r in together)
    assert all(len(r.times_ms) == 6 - 2 for r in together)  # steps 4 and 8 gathered the monitor's figures


def test_run_mode_runs_one_mode_alone():
    from lightning_mp.tools.compare import run_mode

    result = run_mode("bf16", lambda: TinyRegressor(), None, 6, "cpu", warmup=2)
    assert result.status == "ok" and result.steps == 6 and result.step_ms > 0 and len(result.losses) == 6
    assert run_mode("fp8", TinyRegressor, None, 2, "cpu").status == "unsupported"
