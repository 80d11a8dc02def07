"""`python -m lightning_mp compare`: the table, JSON, PNG, failure rows and the recommendation.

More in test_compare_stats.py (the decision rule on synthetic timings) and test_compare_cli.py (flags, errors,
--config, memory, the batch probe, interleaving).
"""

import json

import pytest
import torch
from conftest import TinyRegressor

from lightning_mp.tools.compare import ModeResult, assess, choose, main, recommendation_text

TINY_LM = '{"width": 32, "layers": 1, "heads": 2, "seq_len": 16, "batch_size": 4}'


class FailsUnderAutocast(TinyRegressor):
    """Raises inside training_step when autocast is on: stands for a mode that breaks a model."""

    def training_step(self, batch, batch_idx):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("this model does not support autocast")
        return super().training_step(batch, batch_idx)


def row(mode, step_ms, drift=0.0, skipped=0, steps=100, status="ok", round_ms=None):
    return ModeResult(mode=mode, status=status, step_ms=step_ms, loss_drift=drift, skipped_steps=skipped, steps=steps,
                      final_loss=1.0, round_ms=round_ms or [], times_ms=round_ms or [])


def test_chooser_picks_the_fastest_mode_within_thresholds():
    # single figures without spread are taken as exact: the fastest qualifying mode clearly wins
    results = [
        row("fp32", 100.0),
        row("bf16", 40.0, drift=0.01),
        row("fp16", 29.0, drift=0.02, skipped=20),  # fastest, but 20 % skipped
        row("bf16-true", 34.0, drift=-0.08),  # fast, but drifts 8 %
        row("fp8", None, status="unsupported"),
        row("tf32", 20.0, status="failed"),
        row("lightning:bf16-mixed", 10.0),  # a baseline is never the advice
    ]
    best, why = choose(results, drift_tolerance=0.05, max_skip_rate=0.10)
    assert best.mode == "bf16"
    assert "2.50x the speed of fp32" in why
    # loosen the thresholds: the faster rows qualify
    assert choose(results, drift_tolerance=0.10, max_skip_rate=0.10)[0].mode == "bf16-true"
    assert choose(results, drift_tolerance=0.10, max_skip_rate=0.25)[0].mode == "fp16"
    assert choose([row("fp32", 1.0, status="failed")])[0] is None
    text = recommendation_text(best, why)
    assert 'Trainer(plugins=[MPPlugin("bf16")])' in text and "precision: bf16" in text


def test_chooser_calls_a_difference_within_noise_a_tie_for_the_safer_mode():
    fp32 = [100, 120, 95, 130, 98, 110, 105, 125]
    bf16 = [96, 131, 90, 118, 101, 104, 99, 127]  # ~3 % faster, well inside the round-to-round noise
    best, why = choose([row("fp32", 106, round_ms=fp32), row("bf16", 102, round_ms=bf16)])
    assert best.mode == "fp32"
    assert "No mode is measurably faster than fp32" in why and "the tie goes to fp32" in why
    fast = [x * 0.6 for x in fp32]  # 1.67x in every round: a clear margin
    best, why = choose([row("fp32", 106, round_ms=fp32), row("bf16", 64, round_ms=fast)])
    assert best.mode == "bf16" and "1.67x the speed of fp32" in why and "95% interval" in why


def test_assess_measures_drift_against_fp32_and_marks_unstable():
    results = [ModeResult("fp32", final_loss=2.0, steps=10, skipped_steps=0),
               ModeResult("bf16", final_loss=2.02, steps=10, skipped_steps=0),
               ModeResult("fp16", final_loss=2.5, steps=10, skipped_steps=3)]
    assess(results, drift_tolerance=0.05, max_skip_rate=0.1)
    assert results[1].loss_drift == pytest.approx(0.01) and results[1].status == "ok"
    assert results[2].status == "unstable"
    assert "+25.0% from fp32" in results[2].reason and "3/10 steps skipped" in results[2].reason


def test_assess_flags_fp16_when_fp32_activations_lack_headroom():
    results = [ModeResult("fp32", final_loss=2.0, steps=10, skipped_steps=0, act_headroom_bits=0.4, act_absmax=5e4,
                          act_layer="blocks.0.linear2"),
               ModeResult("bf16", final_loss=2.0, steps=10, skipped_steps=0),
               ModeResult("fp16", final_loss=2.0, steps=10, skipped_steps=0)]
    assess(results, min_headroom=1.0)
    assert [r.status for r in results] == ["ok", "ok", "unstable"]
    assert "fp16 is unsafe for this model" in results[2].reason and "blocks.0.linear2" in results[2].reason
    results[2].status, results[0].act_headroom_bits = "ok", 6.0
    assess(results, min_headroom=1.0)
    assert results[2].status == "ok"


def test_compare_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    code = main(["--model-args", TINY_LM, "--modes", "fp32", "bf16", "fp8", "--steps", "8", "--warmup", "2",
                 "--rounds", "3", "--no-progress", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| format | memory | speed | stability |" in printed
    assert "Recommendation:" in printed and "(confidence: " in printed
    assert "class_path: lightning_mp.MPPlugin" in printed
    assert "Timing: " in printed and "Size: " in printed
    data = json.loads(out_json.read_text())
    rows = {r["mode"]: r for r in data["results"]}
    assert rows["fp32"]["status"] in ("ok", "unstable") and rows["fp32"]["steps"] == 8
    assert rows["bf16"]["step_ms"] > 0 and rows["bf16"]["loss_drift"] is not None
    assert len(rows["bf16"]["round_ms"]) == 3 and len(rows["bf16"]["times_ms"]) >= 3
    assert rows["bf16"]["memory_kind"] == "estimate" and rows["bf16"]["mem_share"] > 0
    assert rows["fp32"]["act_headroom_bits"] > 0 and rows["fp32"]["act_layer"]
    assert len(rows["bf16"]["losses"]) == 8
    assert rows["fp8"]["status"] == "unsupported"
    assert data["recommendation"]["mode"] in ("fp32", "bf16")
    assert data["meta"]["steps_per_round"] == [2, 2, 2] and data["probe"]["batch"] == 4
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_mode_is_reported_and_the_others_run(capsys):
    assert main(["--model", "test_compare:FailsUnderAutocast", "--modes", "bf16", "fp32", "--steps", "3",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    bf16_row = next(line for line in printed.splitlines() if line.startswith("| bf16 |"))
    fp32_row = next(line for line in printed.splitlines() if line.startswith("| fp32 (recommended) |"))
    assert "| failed (note 1) |" in bf16_row
    assert " 1. bf16 failed: RuntimeError: this model does not support autocast." in printed
    assert "| ok · reference" in fp32_row
    assert "Recommendation: fp32" in printed


def test_bad_arguments_are_clear(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "nowhere"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --model: 'nowhere': use 'package.module:ClassName'")
    with pytest.raises(SystemExit):
        main(["--modes", "fp12"])
    assert capsys.readouterr().err.startswith("error: --modes: Unknown precision 'fp12'")


def test_lightning_native_baseline_row(capsys):
    assert main(["--model-args", TINY_LM, "--modes", "fp32", "lightning:bf16-mixed", "--steps", "4", "--no-progress",
                 "--no-batch-probe"]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("| lightning:bf16-mixed |"))
    assert "| ok · drift" in line
    assert "Recommendation: fp32" in printed  # a baseline is never the advice


def test_mode_spelling_with_master_weights():
    from lightning_mp.tools.compare import parse_mode, split_mode

    assert parse_mode("bf16-true:kahan") == "bf16-true:kahan"
    assert parse_mode("BF16-TRUE:Stochastic") == "bf16-true:stochastic"
    assert parse_mode("16-true:none") == "fp16-true:none"  # Lightning's alias, canonical name back
    assert parse_mode("bf16-true:true") == "bf16-true:fp32" and parse_mode("bf16-true:false") == "bf16-true:none"
    assert parse_mode("bf16-mixed") == "bf16" and parse_mode("lightning:bf16-true") == "lightning:bf16-true"
    assert split_mode("bf16-true:kahan") == ("bf16-true", "kahan") and split_mode("bf16") == ("bf16", None)
    with pytest.raises(ValueError, match=r"unknown master-weight option 'kahn'.*'fp32', 'kahan', 'stochastic', 'none'"):
        parse_mode("bf16-true:kahn")
    with pytest.raises(ValueError, match=r"applies to half-precision weights only.*'bf16-true:kahan'"):
        parse_mode("bf16:kahan")
    with pytest.raises(ValueError, match="Unknown precision 'bf17-true'"):
        parse_mode("bf17-true:kahan")


def test_master_weight_modes_reach_the_plugin(monkeypatch, capsys):
    import lightning_mp

    seen = []

    class Recording(lightning_mp.MPPlugin):
        def __init__(self, precision="bf16", **kwargs):
            seen.append((precision, kwargs.get("master_weights")))
            super().__init__(precision, **kwargs)

    monkeypatch.setattr(lightning_mp, "MPPlugin", Recording)
    assert main(["--model-args", TINY_LM, "--modes", "bf16-true", "bf16-true:kahan", "bf16-true:stochastic",
                 "bf16-true:none", "--steps", "3", "--no-progress", "--no-batch-probe"]) == 0
    assert seen == [("bf16-true", None), ("bf16-true", "kahan"), ("bf16-true", "stochastic"), ("bf16-true", "none")]
    printed = capsys.readouterr().out
    for mode in ("bf16-true", "bf16-true:kahan", "bf16-true:stochastic", "bf16-true:none"):
        line = next(x for x in printed.splitlines() if x.startswith(f"| {mode} |") or x.startswith(f"| {mode} ("))
        assert "| ok" in line or "| unstable" in line


def test_master_weight_mode_errors_and_recommendation(capsys):
    with pytest.raises(SystemExit):
        main(["--modes", "bf16-true:kahn"])
    assert "error: --modes: mode 'bf16-true:kahn': unknown master-weight option 'kahn'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--modes", "fp16:none"])
    assert "applies to half-precision weights only" in capsys.readouterr().err
    text = recommendation_text(row("bf16-true:kahan", 10.0), "fastest")
    assert 'Trainer(plugins=[MPPlugin("bf16-true", master_weights="kahan")])' in text
    assert "            precision: bf16-true\n            master_weights: kahan\n" in text


def test_bf16_states_modes_reach_the_plugin_and_show_their_memory(monkeypatch, tmp_path):
    """``<mode>:bf16-states`` runs MPPlugin(optimizer_states="bf16"): the table shows each mode with and without."""
    from lightning_mp.tools.compare import parse_mode, split_mode
    from lightning_mp.tools.compare_stats import mode_states, safety_rank

    assert parse_mode("bf16:BF16-States") == "bf16:bf16-states"
    canonical = "fp16-true:kahan+bf16-states"
    assert parse_mode("16-true:kahan+bf16-states") == parse_mode("fp16-true:bf16-states+kahan") == canonical
    assert split_mode("bf16-true:kahan+bf16-states") == ("bf16-true", "kahan")
    assert split_mode("bf16:bf16-states") == ("bf16", None)
    assert (mode_states("bf16-true:bf16-states"), mode_states("bf16-true:kahan")) == ("bf16", "fp32")
    assert safety_rank("bf16-true") < safety_rank("bf16-true:bf16-states") < safety_rank("bf16-true:kahan")
    with pytest.raises(ValueError, match=r"'bf16-states' holds the moments.*master_weights='none'"):
        parse_mode("bf16-true:none+bf16-states")
    text = recommendation_text(row("bf16-true:bf16-states", 10.0), "fastest")
    assert 'MPPlugin("bf16-true", optimizer_states="bf16")' in text and "optimizer_states: bf16\n" in text

    import lightning_mp

    seen = []

    class Recording(lightning_mp.MPPlugin):
        def __init__(self, precision="bf16", **kwargs):
            seen.append((precision, kwargs.get("optimizer_states")))
            super().__init__(precision, **kwargs)

    monkeypatch.setattr(lightning_mp, "MPPlugin", Recording)
    out = tmp_path / "m.json"
    assert main(["--model-args", TINY_LM, "--modes", "bf16-true", "bf16-true:bf16-states", "--steps", "3",
                 "--no-progress", "--no-batch-probe", "--json", str(out)]) == 0
    assert seen == [("bf16-true", None), ("bf16-true", "bf16")]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["bf16-true:bf16-states"]["status"] in ("ok", "unstable")
    assert rows["bf16-true:bf16-states"]["peak_mem_mib"] < rows["bf16-true"]["peak_mem_mib"]


def test_the_plot_and_the_table_name_the_same_mode_faster(tmp_path, monkeypatch):
    """The plot's speed panel shows the table's figure (the paired speed-up over the reference, with its interval),
    not the median step times, which can rank two modes the other way round when the rounds are noisy."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from lightning_mp.tools import compare_report
    from lightning_mp.tools.compare_engine import ModeResult

    # bf16's median step is longer than fp32's, but its paired speed-up over fp32 is above 1: the table says faster
    rows = [
        ModeResult("fp32", step_ms=10.0, step_iqr_ms=4.0, peak_mem_mib=100.0, losses=[1.0, 0.9]),
        ModeResult("bf16", step_ms=10.4, step_iqr_ms=4.0, speedup=1.08, speedup_lo=1.01, speedup_hi=1.2,
                   peak_mem_mib=80.0, losses=[1.0, 0.9]),
    ]
    bars = []
    original = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, h, *a, **k: bars.append((list(x), list(h))) or original(self, x, h, *a, **k))
    compare_report.write_plot(rows, str(tmp_path / "plot.png"))
    names, heights = bars[0]
    assert names == ["fp32", "bf16"] and heights == [1.0, 1.08]  # higher is faster, as in the table
    assert (tmp_path / "plot.png").stat().st_size > 0
