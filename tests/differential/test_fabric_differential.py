"""Drawn Lightning Fabric loops under MPFabricPrecision against their oracles (see ``fabric_oracles.py``).

The budget is ``test_differential.py``'s: ``DIFFERENTIAL_EXAMPLES`` programs per test (default 8), drawn from a
fixed seed, ``make test-differential`` ten times as many. A failure prints the shrunk program and every difference
from its oracle; a class of bug found gets a named reproducer in ``test_fabric_found.py``."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given

from .fabric_oracles import check_against_fabric, check_extra_steps, check_resume, fabric_problems, fabric_reference
from .fabric_programs import FabricProgram, Step, fabric_programs
from .fabric_runner import FabricSide, run
from .test_differential import SETTINGS, _quiet  # noqa: F401 (the module's fixture: Fabric's info lines)


def report(program: FabricProgram, problems: list[str], oracle: str) -> str:
    shown = "\n  ".join(problems[:12]) + (f"\n  ... {len(problems) - 12} more" if len(problems) > 12 else "")
    return f"{program.describe()} differs from {oracle}:\n  {shown}"


@pytest.mark.slow
@SETTINGS
@given(program=fabric_programs())
def test_a_fabric_loop_trains_as_under_fabrics_own_plugin(program: FabricProgram):
    problems = check_against_fabric(program)
    assert not problems, report(program, problems, "the same loop under Fabric's own precision")


@pytest.mark.slow
@SETTINGS
@given(program=fabric_programs(extra=True))
def test_a_skipped_or_given_up_fabric_step_changes_nothing(program: FabricProgram):
    problems = check_extra_steps(program)
    assert not problems, report(program, problems, "the same loop without its poisoned and given-up steps")


@pytest.mark.slow
@SETTINGS
@given(program=fabric_programs(extra=None, resume=True))
def test_a_fabric_save_and_load_changes_nothing(program: FabricProgram):
    problems = check_resume(program)
    assert not problems, report(program, problems, "the same loop without its save and load")


# ---------------------------------------------------------------------------------------------- the oracles' own tests
# An oracle that cannot fail proves nothing: each comparison must see what a plugin bug would leave behind.
def _lost_update(program: FabricProgram) -> FabricProgram:
    """The program with its last step's gradients halved between clipping and the step: what a plugin that lost
    half of an update (or stepped a stale gradient) would leave behind."""
    last = dataclasses.replace(program.steps[-1], halve_grads=not program.steps[-1].halve_grads)
    return dataclasses.replace(program, steps=(*program.steps[:-1], last))


SENSITIVITY = [
    pytest.param(FabricProgram(mode="fp32", steps=(Step(), Step())), id="exact"),
    pytest.param(FabricProgram(mode="bf16", batchnorm=True, steps=(Step(), Step(), Step())), id="guards-within-noise"),
    pytest.param(FabricProgram(mode="bf16-true", layout="disjoint", steps=(Step(), Step(), Step())),
                 id="masters-within-noise"),
    pytest.param(FabricProgram(mode="fp16-true", steps=(Step(clip="norm"), Step(micro=2), Step())),
                 id="fp16-masters-within-noise"),
]


@pytest.mark.parametrize("program", SENSITIVITY)
def test_the_fabric_oracle_sees_a_lost_half_update(program: FabricProgram):
    """A run whose last update is half what it should be is outside the tolerance; the run itself is inside."""
    ref = fabric_reference(program)
    theirs, noise = run(program, ref.side), [run(program, side) for side in ref.noise]
    assert fabric_problems(program, ref, run(_lost_update(program), ref.ours), theirs, noise)
    assert not fabric_problems(program, ref, run(program, ref.ours), theirs, noise)


@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16-true"])
def test_the_extra_step_oracle_sees_a_step_that_was_not_skipped(mode: str):
    """With skipping off, the poisoned step reaches the weights: the comparison with the control must say so."""
    program = FabricProgram(mode=mode, steps=(Step(), Step(poison=0), Step()))
    assert check_extra_steps(program, FabricSide.ours(program, skip_nonfinite=False))
    assert not check_extra_steps(program)

