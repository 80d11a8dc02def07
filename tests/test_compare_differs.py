"""compare's stability column says what it found: a final loss further above fp32's than the tolerance is
'unstable'; one as far below it 'differs' (another path, not a better one, and not picked), with the cause named
for FP8's delayed scaling."""

from __future__ import annotations

from lightning_mp.tools.compare import assess, candidates
from lightning_mp.tools.compare_engine import ModeResult


def _row(mode: str, loss: float) -> ModeResult:
    return ModeResult(mode=mode, final_loss=loss, steps=30, skipped_steps=0, step_ms=10.0, times_ms=[10.0] * 30,
                      round_ms=[10.0] * 3)


def test_a_lower_loss_differs_and_a_higher_one_is_unstable():
    rows = [_row("fp32", 3.0), _row("bf16", 3.005), _row("fp8", 2.75), _row("fp16", 3.3)]
    assess(rows, drift_tolerance=0.05)
    status = {r.mode: r.status for r in rows}
    assert status == {"fp32": "ok", "bf16": "ok", "fp8": "differs", "fp16": "unstable"}
    fp8 = rows[2]
    assert "-8.3%" in fp8.reason and "delayed scaling" in fp8.reason and "'recipe': 'current'" in fp8.reason
    assert "delayed scaling" not in rows[3].reason
    assert fp8.ran  # its figures stay in the table
    assert {r.mode for r in candidates(rows, drift_tolerance=0.05)} == {"fp32", "bf16"}
