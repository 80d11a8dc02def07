"""`compare` in a terminal: its texts wrap at the terminal's width, a table wider than the terminal becomes one
block a mode, warnings print above the progress bar and not into it, and the CPU's kind is named in the header."""

from __future__ import annotations

import warnings

import pytest

from lightning_mp.tools import compare_report as report
from lightning_mp.tools.compare import _device_name
from lightning_mp.tools.compare_engine import ModeResult, _warnings_above

LONG = "word " * 80


def _row(mode, ms):
    return ModeResult(mode=mode, step_ms=ms, step_iqr_ms=1.0, loss_drift=0.0, final_loss=1.0, skipped_steps=0,
                      steps=30, speedup=100.0 / ms, speedup_lo=90.0 / ms, speedup_hi=110.0 / ms,
                      act_headroom_bits=13.0, grad_headroom_bits=20.1, peak_mem_mib=21.3, mem_share=1.0)


def test_texts_wrap_at_a_narrower_terminals_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    assert report.terminal_width() == 59
    assert max(map(len, report.wrap(LONG, indent="  ").splitlines())) <= 59
    monkeypatch.setenv("COLUMNS", "300")  # a wide terminal: texts at the report's own width, as the docs show it
    assert report.terminal_width() == 299
    assert report.WIDTH - 5 < max(map(len, report.wrap(LONG).splitlines())) <= report.WIDTH
    monkeypatch.delenv("COLUMNS")  # a file or a pipe (pytest's capture): the report's own width
    assert report.terminal_width() is None
    assert report.WIDTH - 5 < max(map(len, report.wrap(LONG).splitlines())) <= report.WIDTH


def test_a_table_wider_than_the_terminal_is_one_block_a_mode():
    rows = [_row("fp32", 100.0), _row("bf16", 80.0)]
    table, _ = report.format_table(rows, "fp32", "bf16")
    assert table.startswith("| format | memory | speed | stability |")  # no width: Markdown, as in a file
    assert report.format_table(rows, "fp32", "bf16", width=400)[0] == table  # it fits: the table
    blocks, _ = report.format_table(rows, "fp32", "bf16", width=60)
    assert "|" not in blocks and max(map(len, blocks.splitlines())) <= 60
    first, second = blocks.split("\n\n")
    assert first.splitlines()[0] == "fp32" and second.splitlines()[0] == "bf16 (recommended)"
    assert second.splitlines()[1].startswith("  memory     21.3 MiB")
    assert second.splitlines()[2].startswith("  speed      80.0 ms (IQR 1.00) · 1.25x [1.12–1.38]")
    assert "stability  ok · drift +0.00 % · skipped 0/30 · fp16\n             headroom act 13.0 b" in blocks


class FakeBar:
    disable = False

    def __init__(self):
        self.written = []

    def write(self, text, file=None):
        self.written.append(text)


def test_warnings_print_above_the_progress_bar_and_the_hook_comes_off():
    shown = warnings.showwarning
    bar = FakeBar()
    restore = _warnings_above(bar)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a model's own warning", UserWarning, stacklevel=1)
    finally:
        restore()
    assert len(bar.written) == 1 and "test_compare_terminal.py:" in bar.written[0]
    assert "UserWarning: a model's own warning" in bar.written[0]
    assert warnings.showwarning is shown
    assert _warnings_above(None)() is None  # no bar (a pipe, --no-progress): warnings as they are


def test_the_header_names_the_cpus_kind(monkeypatch):
    from lightning_mp import cpu

    assert _device_name("cpu").endswith("threads; AVX512, AVX512-BF16)")  # (conftest's CPU)
    avx2 = cpu.CpuCapability("AVX2", bf16=False, how="no AVX512-BF16 or AMX")
    monkeypatch.setattr(cpu, "cpu_capability", lambda: avx2)
    assert _device_name("cpu").endswith("threads; AVX2, no AVX512-BF16 or AMX)")


@pytest.mark.parametrize("columns", ["50", "200"])
def test_the_stacked_form_is_what_compare_prints_in_a_narrow_terminal(monkeypatch, capsys, columns):
    from lightning_mp.tools.compare import main

    monkeypatch.setenv("COLUMNS", columns)
    code = main(["--modes", "fp32", "--steps", "4", "--warmup", "1", "--rounds", "1", "--device", "cpu",
                 "--no-progress", "--no-batch-probe", "--model.width", "16", "--model.layers", "1",
                 "--model.heads", "2", "--model.seq_len", "8", "--model.batch_size", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert max(len(line) for line in out.splitlines() if not line.startswith("compare: ")) < int(columns), out
    assert ("| fp32 (recommended) |" in out) == (columns == "200")
