"""Failures the differential generator found, shrunk, each a named test.

A class of bug still open is marked ``@pytest.mark.xfail(strict=False, reason=...)`` (flip it to a plain test when
its fix lands). The classes below were found against earlier commits of the package and have been fixed since:
they are plain tests now, so that a regression fails (an xfail would hide it). Each docstring says what the shrunk
program observed before the fix and what its oracle expected.
"""

from __future__ import annotations

import pytest

from .oracles import check_against_lightning, check_entry_points, check_same_value_writes, check_skip
from .programs import Entry, Poison, Program, Write


def _assert_passes(problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------- step counters
def test_counters_survive_validate_after_fit():
    """fp16, fit one step, then validate: ``plugin.stats.steps`` was 0 after validate (Lightning's global_step 1):
    an evaluation entry point reset the step counters."""
    _assert_passes(check_against_lightning(
        Program(mode="fp16", entries=(Entry("fit", 1), Entry("validate")), seed=1)
    ))


# ---------------------------------------------------------------------------------------------- re-assigned buffers
def test_a_skipped_step_puts_back_a_counter_reassigned_in_forward():
    """``self.calls = self.calls + 1`` in forward, a NaN in the first step's batch: ``calls`` ended at 3 against the
    control's 2 (the skipped step's forward pass counted)."""
    _assert_passes(check_skip(Program(calls=True, poison=Poison(window=0))))


@pytest.mark.parametrize("kind", ["persistent", "non-persistent"])
def test_a_skipped_step_puts_back_an_ema_reassigned_in_forward(kind: str):
    """``self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)`` in forward, a NaN in the first step's batch: ``ema``
    ended all NaN (the skipped step's statistics kept), the control's finite."""
    _assert_passes(check_skip(Program(ema=kind, poison=Poison(window=0))))


# ---------------------------------------------------------------------------------------------- writes between steps
def test_a_data_write_reaches_the_master_weights():
    """fp16-true (fp32 masters), ``p.data[:2] = 0.25`` on l1.weight at the end of the first batch: the next step
    wrote the masters back over it (l1.weight 0.83 away from Lightning's 32-true run of the same program, whose
    rows start from 0.25): a write through ``.data`` leaves the version counter alone."""
    _assert_passes(check_against_lightning(Program(mode="fp16-true", writes=(Write("rows", "end", 0),))))


@pytest.mark.parametrize(
    "program",
    [
        pytest.param(Program(mode="fp16-true", master_weights="kahan", writes=(Write("reload", "end", 0),),
                             entries=(Entry("fit", 1),)), id="fp16-true-load_state_dict-of-its-own-state"),
        pytest.param(Program(mode="bf16-true", master_weights="kahan", writes=(Write("copy-same", "end", 0),)),
                     id="bf16-true-copy-of-the-same-values"),
    ],
)
def test_a_write_of_the_same_values_keeps_the_kahan_compensation(program: Program):
    """Kahan master weights, a write that changes no value (``model.load_state_dict(model.state_dict())``,
    ``p.copy_(p.clone())``) at the end of the first batch: the compensation was dropped (all of it differed from
    the same program without the write; bf16-true: 17 of 64 l1 weights one bf16 ulp off after the next step)."""
    _assert_passes(check_same_value_writes(program))


# ---------------------------------------------------------------------------------------------- shared weights
def test_a_weight_shared_by_a_guarded_and_an_unguarded_norm_trains_in_bf16_true():
    """bf16-true (fp32 masters: plain LayerNorm not guarded), ``ln.weight = bn.weight`` (BatchNorm guarded):
    ``RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float`` where Lightning's bf16-true
    trains the program."""
    _assert_passes(check_against_lightning(
        Program(mode="bf16-true", batchnorm=True, layernorm=True, tie="norms", entries=(Entry("fit", 1),))
    ))


# ---------------------------------------------------------------------------------------------- optimizer wrappers
@pytest.mark.parametrize("check", [check_against_lightning, check_entry_points], ids=["fit", "resume"])
def test_a_timm_style_lookahead_trains_with_master_weights(check):
    """bf16-true (fp32 masters), timm's ``Lookahead`` around Adam (a wrapper that never runs
    ``Optimizer.__init__``): ``AttributeError: 'Lookahead' object has no attribute
    '_optimizer_load_state_dict_pre_hooks'`` where Lightning's 32-true trains the program."""
    program = Program(mode="bf16-true", optimizer="lookahead-adam", entries=(Entry("fit", 1), Entry("resume", 1)))
    _assert_passes(check(program))
