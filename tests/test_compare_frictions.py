"""`python -m lightning_mp compare` as a new user meets it: a run too short to time refused up front, one figure per
speed-up in the table and the text, a slower mode called slower, the repository's own configs alone, the message
when jsonargparse is missing."""

import re
import sys
from pathlib import Path

import pytest

from lightning_mp.tools.compare import ModeResult, assess, choose, main
from lightning_mp.tools.compare_report import format_table
from lightning_mp.tools.compare_setup import InputError, make_spec
from lightning_mp.tools.compare_stats import Ratio, speedup

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `examples` is a package at the repository root, not an installed one
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------- nothing to time
@pytest.mark.parametrize(
    ("argv", "minimum"),
    [
        (["--steps", "1"], 3),
        (["--steps", "2"], 3),
        (["--steps", "2", "--rounds", "1"], 3),
        (["--steps", "3", "--warmup", "1", "--rounds", "1"], 4),  # warm-up as given: a longer run needs 4
    ],
)
def test_a_run_that_would_time_no_step_is_refused_up_front_naming_the_minimum(capsys, argv, minimum):
    code, out, err = run(capsys, *argv, "--modes", "fp32", "bf16", "--device", "cpu", "--no-progress")
    assert code == 2 and not out  # refused before anything trained
    assert err.startswith(f"error: --steps: {argv[1]}: after ") and err.count("\n") == 1, err
    assert "no step is left to time" in err and err.rstrip().endswith(f"use --steps {minimum} or more")
    code, out, _ = run(capsys, "--steps", str(minimum), *argv[2:], "--modes", "fp32", "bf16", "--device", "cpu",
                       "--no-progress", "--no-batch-probe", "--model.width", "16", "--model.layers", "1",
                       "--model.heads", "2", "--model.seq_len", "8", "--model.batch_size", "2")
    assert code == 0 and "Timing: no mode was timed" not in out and "Recommendation: fp32" in out


# --------------------------------------------------------------------------------------------- one figure
def test_speedup_one_way_is_the_inverse_of_the_other():
    fp32 = [100.0, 120.0, 95.0, 130.0, 98.0, 110.0, 105.0, 125.0]  # an even number of rounds
    bf16 = [181.0, 200.0, 160.0, 240.0, 170.0, 205.0, 190.0, 226.0]
    there, back = speedup(fp32, bf16, fp32, bf16), speedup(bf16, fp32, bf16, fp32)
    assert back.median == pytest.approx(1 / there.median, rel=1e-12)
    assert (back.lo, back.hi) == pytest.approx((1 / there.hi, 1 / there.lo), rel=1e-12)
    unpaired = speedup([None], [None], [1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0])
    assert speedup([None], [None], [2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]).median == pytest.approx(1 / unpaired.median)
    assert Ratio(2.0, 0.0, float("inf"), 2).inverse() == Ratio(0.5, 0.0, float("inf"), 2)


def _row(mode, rounds):
    return ModeResult(mode=mode, step_ms=sorted(rounds)[len(rounds) // 2], step_iqr_ms=1.0, loss_drift=0.0,
                      final_loss=1.0, skipped_steps=0, steps=len(rounds), round_ms=list(rounds), times_ms=list(rounds))


def test_the_table_and_the_text_give_one_figure_and_a_slower_mode_is_called_slower():
    fp32 = [100.0, 102.0, 99.0, 101.0, 100.0, 103.0, 98.0, 100.0]
    # bf16 about 0.9x fp32's speed in every round: measurably slower, but not by the 1.15x margin
    bf16 = [t / r for t, r in zip(fp32, [0.90, 0.88, 0.91, 0.90, 0.89, 0.92, 0.90, 0.87])]
    bf16_true = [t * 1.01 for t in reversed(fp32)]  # within noise
    results = [_row("fp32", fp32), _row("bf16", bf16), _row("bf16-true", bf16_true)]
    assess(results)
    best, why = choose(results)
    assert best.mode == "fp32"
    table, _ = format_table(results, "fp32", "fp32")
    for mode in ("bf16", "bf16-true"):
        cell = next(line for line in table.splitlines() if line.startswith(f"| {mode} |")).split("|")[3]
        in_table = re.search(r"· (\d\.\d\d)x \[(\d\.\d\d)–(\d\.\d\d)\]", cell).groups()
        in_text = re.search(rf"{mode} (\d\.\d\d)x, 95% interval (\d\.\d\d)x–(\d\.\d\d)x", why).groups()
        assert in_table == in_text, (mode, table, why)
    assert "bf16 is slower than fp32 (bf16 0.90x" in why
    assert "bf16-true ties with it within noise" in why
    assert "rule" not in why and "bf16 ties" not in why


# --------------------------------------------------------------------------------------------- the configs
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_the_repository_configs_name_their_model_alone(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = make_spec(None, "{}", None, "{}", str(config), [], "cpu")
    expected = "examples.gpt_mini" if config.name.startswith("gpt_mini") else "examples.vlm_mini"
    assert spec.name == expected
    assert any(note.startswith(f"model: {expected} (the built-in model") for note in spec.notes)
    assert spec.model_cls.__module__ == expected


def test_a_config_without_class_path_that_fits_no_builtin_still_asks_for_model(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("model:\n  hidden: 3\n")
    with pytest.raises(InputError, match="the model section has no class_path; name the class with --model"):
        make_spec(None, "{}", None, "{}", str(config), [], "cpu")


def test_the_repository_config_runs_compare_alone(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = run(capsys, "--config", "examples/configs/gpt_mini_bf16.yaml", "--modes", "fp32", "bf16",
                         "--steps", "4", "--device", "cpu", "--no-progress", "--no-batch-probe", "--model.width",
                         "16", "--model.depth", "1", "--model.heads", "2", "--model.context", "16",
                         "--data.seq_len", "16", "--data.batch_size", "2")
    assert code == 0, err
    assert out.startswith("compare: examples.gpt_mini — GPTMini(")
    assert "| fp32 (recommended) |" in out and "| bf16 |" in out


def test_a_missing_jsonargparse_names_the_cli_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # import jsonargparse raises ImportError
    monkeypatch.chdir(ROOT)
    code, out, err = run(capsys, "--config", "examples/configs/gpt_mini_bf16.yaml", "--no-progress")
    assert code == 2 and not out
    assert err == ('error: --config: reading a Lightning CLI config needs jsonargparse, which comes with the cli'
                   ' extra: pip install "lightning-mp[cli]"\n')
