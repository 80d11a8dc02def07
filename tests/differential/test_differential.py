"""Drawn Lightning programs under MPPlugin against their oracles (see ``oracles.py``).

The budget: ``DIFFERENTIAL_EXAMPLES`` programs per test (default 8: the four tests take about 45 s on 2 cores),
drawn from a fixed seed (``derandomize``) so that ``make test`` tests the same programs every run;
``make test-differential`` draws ten times as many. A failure prints the shrunk program and every difference from
its oracle; a failure from a class of bug being fixed gets a named reproducer in test_found.py, and its strategy
branch may be left out meanwhile through ``programs.KNOWN_GAPS``."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings

from .oracles import (
    check_against_lightning,
    check_entry_points,
    check_same_value_writes,
    check_skip,
    lightning_problems,
    merged_entries,
    reference,
)
from .programs import Entry, Poison, Program, Write, programs
from .runner import Side, run

EXAMPLES = int(os.environ.get("DIFFERENTIAL_EXAMPLES", "8"))

SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same programs every run (a seed from the test's name)
    database=None,  # nothing written into the repository
    deadline=None,  # a program runs several Trainers: its time varies with the machine's load
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=False,
)


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    """Lightning's and the plugin's info lines, once per Trainer, would bury a failure's report."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
             "lightning.fabric.utilities.rank_zero", "lightning_mp")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def report(program: Program, problems: list[str], oracle: str) -> str:
    shown = "\n  ".join(problems[:12]) + (f"\n  ... {len(problems) - 12} more" if len(problems) > 12 else "")
    return f"{program.describe()} differs from {oracle}:\n  {shown}"


@pytest.mark.slow
@SETTINGS
@given(program=programs())
def test_a_program_trains_as_under_lightning(program: Program):
    problems = check_against_lightning(program)
    assert not problems, report(program, problems, "the same program under Lightning's plugin")


@pytest.mark.slow
@SETTINGS
@given(program=programs(poisoned=True))
def test_a_skipped_step_changes_nothing(program: Program):
    problems = check_skip(program)
    assert not problems, report(program, problems, "the same program without its poisoned step")


@pytest.mark.slow
@SETTINGS
@given(program=programs(same_value_writes=True))
def test_a_write_that_changes_no_value_changes_nothing(program: Program):
    problems = check_same_value_writes(program)
    assert not problems, report(program, problems, "the same program without its writes")


@pytest.mark.slow
@SETTINGS
@given(program=programs())
def test_validate_and_resume_change_nothing(program: Program):
    assume(merged_entries(program.entries) != program.entries)  # (a validate or a resume among the entries)
    problems = check_entry_points(program)
    assert not problems, report(program, problems, "the same program without validates, its resumes merged")


# ---------------------------------------------------------------------------------------------- the oracles' own tests
# An oracle that cannot fail proves nothing: each comparison must see what a plugin bug would leave behind.
SENSITIVITY = [
    pytest.param(Program(mode="fp32", writes=(Write("clamp", "end", 1),), entries=(Entry("fit", 3),)), id="exact"),
    pytest.param(Program(mode="bf16", batchnorm=True, writes=(Write("clamp", "end", 1),), entries=(Entry("fit", 3),)),
                 id="guards-within-noise"),
    pytest.param(Program(mode="bf16-true", writes=(Write("rows", "start", 1),), entries=(Entry("fit", 3),)),
                 id="masters-within-noise"),
]


@pytest.mark.parametrize("program", SENSITIVITY)
def test_the_lightning_oracle_sees_a_lost_write(program: Program):
    """A write the plugin lost (the reference run keeps it) is far outside the noise allowed."""
    ref = reference(program)
    theirs, noise = run(program, ref.side), [run(program, side) for side in ref.noise]
    lost = run(dataclasses.replace(program, writes=()), ref.ours)
    assert lightning_problems(program, ref, lost, theirs, noise)
    assert not lightning_problems(program, ref, run(program, ref.ours), theirs, noise)


@pytest.mark.parametrize("mode", ["fp32", "bf16-true"])
def test_the_skip_oracle_sees_a_step_that_was_not_skipped(mode: str):
    """With skipping off, the poisoned step reaches the weights: the comparison with the control must say so."""
    program = Program(mode=mode, batchnorm=True, entries=(Entry("fit", 3),), poison=Poison(window=1))
    assert check_skip(program, Side.ours(program, skip_nonfinite=False))
    assert not check_skip(program)
