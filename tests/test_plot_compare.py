"""benchmarks/plot_compare.py: compare's chart redrawn from the JSON of a run (the docs' chart came from an H200 run),
with the names under the bars ending at their bars, clear of their neighbours."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "results" / "compare_vlm_h200_2026-11-26.json"


def load_script():
    spec = importlib.util.spec_from_file_location("plot_compare", ROOT / "benchmarks" / "plot_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runs_modes_come_back_as_compare_held_them():
    results = load_script().load_results(str(RUN))
    assert [r.mode for r in results][:4] == ["lightning:32-true", "lightning:bf16-mixed", "lightning:16-mixed", "fp32"]
    assert all(r.step_ms and r.peak_mem_mib and len(r.losses) == 30 for r in results)


def test_the_chart_is_drawn_with_each_bar_name_ending_at_its_bar(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    original = plt.close
    plt.close = lambda fig=None: figures.append(fig)  # keep the figure to read its labels
    try:
        assert load_script().main([str(RUN), str(tmp_path / "chart.png")]) == 0
    finally:
        plt.close = original
    assert (tmp_path / "chart.png").stat().st_size > 10_000
    fig = figures[0]
    for ax in fig.axes[:2]:  # (centred, the long names ran across their neighbours' bars and names)
        labels = ax.get_xticklabels()
        assert [t.get_text() for t in labels][:2] == ["lightning:32-true", "lightning:bf16-mixed"]
        assert all(t.get_horizontalalignment() == "right" and t.get_rotation_mode() == "anchor" for t in labels)
    assert fig.axes[0].get_title() == "median step time (ms; lower is faster)"  # the run's JSON holds no IQR
    plt.close(fig)
