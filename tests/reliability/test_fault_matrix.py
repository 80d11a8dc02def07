"""Fault injection: mode × where the fault enters × what × how the step runs.

For every cell the poisoned step changes nothing (parameters, optimizer state and LR bit-identical), the
counters and the loss scale follow the policy, and training then recovers.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import StepRecorder, TinyRegressor, assert_state_equal, make_trainer

from lightning_mp import MPPlugin

WHERE = ("loss", "grad", "activation")
WHAT = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
HOW = ("automatic", "manual", "accumulate4")
INIT_SCALE = 2.0**8
STEPS = 5
POISONED_STEP = 2


def run_cell(mode: str, where: str, what: str, how: str) -> None:
    accumulate = 4 if how == "accumulate4" else 1
    # the poisoned micro-batch is the 2nd of optimizer step POISONED_STEP's window
    poisoned_batch = POISONED_STEP * accumulate + (1 if accumulate > 1 else 0)
    model = TinyRegressor(
        optimizer="adam",
        scheduler=how != "manual",  # Lightning steps no scheduler in manual optimization
        manual=how == "manual",
        batch_size=4,
        n=4 * STEPS * accumulate,
        poison_value=WHAT[what],
        **{f"poison_{where}": (poisoned_batch,)},
    )
    plugin = MPPlugin(mode, init_scale=INIT_SCALE) if mode == "fp16" else MPPlugin(mode)
    recorder = StepRecorder()
    trainer = make_trainer(plugin, max_steps=STEPS, callbacks=[recorder], accumulate_grad_batches=accumulate)
    trainer.fit(model)

    first, last = POISONED_STEP * accumulate, POISONED_STEP * accumulate + accumulate - 1
    assert_state_equal(recorder.before[first], recorder.after[last])
    # every other step moved the weights
    for step in range(STEPS):
        if step != POISONED_STEP:
            a, b = step * accumulate, step * accumulate + accumulate - 1
            assert not torch.equal(recorder.before[a]["params"]["net1.weight"], recorder.after[b]["params"]["net1.weight"])
    stats = plugin.stats.as_dict()
    assert (stats["steps"], stats["skipped_steps"], stats["consecutive_skips"]) == (STEPS, 1, 0)
    assert stats["loss_scale"] == (INIT_SCALE / 2 if mode == "fp16" else None)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert int(next(iter(trainer.optimizers[0].state.values()))["step"]) == STEPS - 1
    assert math.isfinite(model.losses[-1])


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_fault_matrix(mode, capsys):
    cells = list(itertools.product(WHERE, WHAT, HOW))
    failures = []
    for where, what, how in cells:
        try:
            run_cell(mode, where, what, how)
        except AssertionError as err:
            failures.append(f"{mode}/{where}/{what}/{how}: {str(err).splitlines()[0]}")
    with capsys.disabled():
        print(f"\nfault matrix [{mode}]: {len(cells)} cells, {len(cells) - len(failures)} passed")
    assert not failures, "\n".join(failures)
