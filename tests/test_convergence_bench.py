"""``benchmarks/convergence.py`` on the CPU with a tiny GPT-mini: the run files and their curves, the resume, the
summary, the report without matplotlib, and identical fp32 curves from identical seeds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--width", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--steps", "30",
        "--eval-every", "10", "--eval-batches", "2", "--batch-size", "8", "--log-every", "10",
        "--threads", "1"]  # one thread: tiny ops, and no waiting on a busy machine's other cores
MODES = ["fp32", "bf16", "bf16-true"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("convergence_bench", ROOT / "benchmarks" / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def first(bench, tmp_path_factory):
    """Two seeds of three modes (and tf32, unsupported on the CPU) into one run directory."""
    out = tmp_path_factory.mktemp("convergence")
    argv = TINY + ["--seeds", "0,1", "--modes", ",".join(MODES + ["tf32"]), "--out", str(out)]
    return out, argv, bench.main(argv)


def _run(out: Path, mode: str, seed: int) -> dict:
    with open(out / "runs" / f"{mode}__seed{seed}.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_each_run_is_written_with_its_curves(first):
    out, _, summary = first
    assert sorted(summary["trained"]) == sorted(f"{m}/seed{s}" for m in MODES + ["tf32"] for s in (0, 1))
    for mode in MODES:
        for seed in (0, 1):
            run = _run(out, mode, seed)
            assert (run["mode"], run["seed"], run["status"], run["diverged"]) == (mode, seed, "ok", False)
            assert [step for step, _ in run["val"]] == [0, 10, 20, 30]
            assert all(math.isfinite(loss) for _, loss in run["val"])
            assert run["val"][-1][1] == run["final_val_loss"] < run["val"][0][1]  # it learns
            assert [step for step, _ in run["train"]] == [10, 20, 30]
            assert run["skipped_steps"] == 0 and run["steps_done"] == 30
            assert run["wall_s"] > 0 and run["config"]["steps"] == 30
            assert run["corpus"]["bytes"] > 1_000_000 and len(run["corpus"]["sha256"]) == 64
    tf32 = _run(out, "tf32", 0)
    assert tf32["status"] == "unsupported" and "CPU" in tf32["reason"]


def test_a_second_invocation_resumes_without_training(bench, first):
    out, argv, _ = first
    files = sorted((out / "runs").glob("*.json"))
    before = {p.name: (p.stat().st_mtime_ns, p.read_text()) for p in files}
    again = bench.main(argv)
    assert again["trained"] == [f"tf32/seed{s}" for s in (0, 1)]  # unsupported runs are checked again, nothing trains
    assert sorted(again["already_done"]) == sorted(f"{m}/seed{s}" for m in MODES for s in (0, 1))
    for p in files:
        if not p.name.startswith("tf32"):
            assert (p.stat().st_mtime_ns, p.read_text()) == before[p.name], p.name
    with pytest.raises(SystemExit, match="another configuration"):
        bench.main(argv[:-2] + ["--lr", "0.01", "--out", str(out)])


def test_the_summary_lists_every_mode(first):
    out, _, _ = first
    summary = json.loads((out / "summary.json").read_text())
    rows = {row["mode"]: row for row in summary["rows"]}
    assert list(rows) == MODES[:1] + ["tf32"] + MODES[1:]
    for mode in MODES:
        row = rows[mode]
        assert row["seeds"] == [0, 1] and row["runs"] == 2 and row["diverged"] == 0
        assert row["final_val_loss_min"] <= row["final_val_loss_mean"] <= row["final_val_loss_max"]
        assert row["final_val_loss_std"] > 0 and row["delta_vs_fp32_sigma"] is not None
    assert rows["fp32"]["delta_vs_fp32"] == 0.0
    assert rows["tf32"]["status"] == "unsupported"
    text = (out / "summary.md").read_text()
    assert "| fp32 | 0,1 |" in text and "| bf16-true | 0,1 |" in text and "unsupported [1]" in text
    assert summary["corpus"]["sha256"][:16] in text


def test_report_alone_and_without_matplotlib(bench, first, monkeypatch, capsys):
    out, _, _ = first
    (out / "summary.md").unlink()
    bench.main(["--report", "--out", str(out)])
    assert (out / "summary.md").exists()
    try:
        import matplotlib  # noqa: F401

        assert (out / "curves.png").stat().st_size > 0
    except ImportError:
        pass
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    bench.main(["--report", "--out", str(out)])
    assert "plot skipped: matplotlib is not importable" in capsys.readouterr().out


def test_the_same_seed_gives_the_same_fp32_curves(bench, first, tmp_path):
    out, _, _ = first
    bench.main(TINY + ["--seeds", "0", "--modes", "fp32", "--out", str(tmp_path)])
    again, before = _run(tmp_path, "fp32", 0), _run(out, "fp32", 0)
    assert again["val"] == before["val"] and again["train"] == before["train"]
    assert _run(out, "fp32", 1)["val"] != before["val"]  # another seed: other weights and batches


#: the modes with Adam's moments in bf16 and the mode each differs from by ``optimizer_states="bf16"`` alone
BF16_STATES = {"bf16:bf16-states": "bf16", "bf16-true:bf16-states": "bf16-true", "fp8:bf16-states": "fp8"}


def test_the_bf16_state_modes_parse_and_add_only_optimizer_states(bench):
    from lightning_mp.tools.compare_stats import mode_states

    args = bench.parse_args(TINY + ["--modes", ",".join(BF16_STATES)])
    assert args.modes.split(",") == list(BF16_STATES)
    for mode, counterpart in BF16_STATES.items():
        precision, kwargs = bench.MODES[mode]
        assert (precision, kwargs) == (bench.MODES[counterpart][0],
                                       {**bench.MODES[counterpart][1], "optimizer_states": "bf16"})
        assert mode_states(mode) == "bf16" and mode_states(counterpart) == "fp32"  # as ``compare`` reads the name
        if precision != "fp8":
            assert "optimizer_states='bf16'" in repr(bench.MPPlugin(precision, **kwargs))
            assert "optimizer_states" not in repr(bench.MPPlugin(precision, **bench.MODES[counterpart][1]))
    assert "fp8" in bench.unsupported_reason("fp8:bf16-states", "cpu")  # recorded unsupported, as fp8 is on a CPU
    assert bench.run_path(Path("out"), "bf16-true:bf16-states", 2).name == "bf16-true_bf16-states__seed2.json"
