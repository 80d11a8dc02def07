"""A loss scaler's outcomes known only on the device are counted in batches (a few kernels for many steps), and the
counters read exactly as if each step had been counted at once, also interleaved with host-known outcomes, across
a checkpoint and past the batch size."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.stats import _DEFER_LIMIT


def _reference(outcomes: list[bool]) -> list[int]:
    steps = skipped = consecutive = last = 0
    for x in outcomes:
        steps, skipped = steps + 1, skipped + int(x)
        consecutive = consecutive + 1 if x else 0
        last = int(x)
    return [steps, skipped, consecutive, last]


def _counters(scaler: DynamicLossScaler) -> list[int]:
    return [scaler.steps, scaler.skipped_steps, scaler.consecutive_skips, int(scaler.last_skipped)]


@pytest.mark.parametrize("seed", range(4))
def test_deferred_counts_equal_counting_each_step(seed):
    rng = random.Random(seed)
    scaler = DynamicLossScaler("cpu", growth_interval=10**6)
    scaler.ensure_initialized(torch.device("cpu"))
    outcomes: list[bool] = []
    for step in range(3 * _DEFER_LIMIT + 7):
        skipped = rng.random() < (0.9 if 40 <= step < 150 else 0.1)  # a long streak across a fold
        outcomes.append(skipped)
        if rng.random() < 0.2:
            scaler.update_from([skipped])  # the host knows (a non-fused optimizer)
        else:
            scaler.update_from([torch.tensor(float(skipped))])  # the device knows (a fused optimizer)
        if rng.random() < 0.05:
            assert _counters(scaler) == _reference(outcomes)  # reading folds what is pending
    assert _counters(scaler) == _reference(outcomes)
    restored = DynamicLossScaler("cpu", growth_interval=10**6)
    restored.ensure_initialized(torch.device("cpu"))
    restored.load_state_dict(scaler.state_dict())
    assert _counters(restored) == _reference(outcomes)


def test_a_device_outcome_costs_no_counter_kernels_until_the_fold(monkeypatch):
    scaler = DynamicLossScaler("cpu", growth_interval=10**6)
    scaler.ensure_initialized(torch.device("cpu"))
    folds = []
    skips = scaler.skips
    original = skips._fold_deferred
    monkeypatch.setattr(skips, "_fold_deferred", lambda: folds.append(len(skips._deferred)) or original())
    for _ in range(_DEFER_LIMIT):
        scaler.update_from([torch.tensor(0.0)])
    assert [n for n in folds if n] == [_DEFER_LIMIT]  # one fold for the whole batch
    assert scaler.steps == _DEFER_LIMIT and scaler.skipped_steps == 0
