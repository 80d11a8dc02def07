"""`compare`'s statistics on synthetic timings: spreads, paired speed-ups, the decision rule, the batch probe."""

import math
import random

import pytest

from lightning_mp.tools.compare_stats import (
    Candidate,
    batch_probe,
    decide,
    safety_rank,
    speedup,
    spread,
)


def rounds(center, jitter, n=8, seed=0, load=None):
    """``n`` per-round medians around ``center`` (ms), +-``jitter`` relative, times a shared per-round ``load``."""
    rng = random.Random(seed)
    load = load or [1.0] * n
    return [center * load[r] * (1 + rng.uniform(-jitter, jitter)) for r in range(n)]


def cand(mode, center, jitter=0.02, seed=0, load=None, memory=None, n=8):
    r = rounds(center, jitter, n, seed, load)
    return Candidate(mode, r, steps=r, memory=memory)


def test_safety_order_is_documented_and_total():
    order = ["fp32", "tf32", "bf16", "bf16-true", "bf16-true:kahan", "bf16-true:stochastic", "bf16-true:none", "fp16",
             "fp16-true", "fp8", "lightning:bf16-mixed"]
    assert sorted(order, key=safety_rank) == order
    assert safety_rank("bf16-true") == safety_rank("bf16-true:fp32")  # fp32 masters are the default


def test_spread_is_torch_benchmark_measurement():
    from torch.utils.benchmark.utils.common import Measurement, TaskSpec

    times = [10.0, 11.0, 9.5, 10.2, 30.0, 10.1, 9.9]
    s = spread(times)
    m = Measurement(1, times, TaskSpec("x", "pass"))
    assert (s.median, s.iqr, s.n) == (pytest.approx(m.median), pytest.approx(m.iqr), 7)
    assert not s.noisy and spread([10.0, 15.0, 20.0, 12.0]).noisy
    assert spread([]) is None


def test_a_tie_within_noise_goes_to_the_safer_mode():
    # bf16 looks 3 % faster, inside +-15 % round-to-round noise: no reason to give up fp32's safety
    d = decide([cand("fp32", 100, 0.15, seed=1), cand("bf16", 97, 0.15, seed=2)])
    assert d.mode == "fp32" and d.fastest == "bf16" and sorted(d.tied) == ["bf16", "fp32"]
    assert d.vs_fastest["fp32"].lo < 1.10 < d.vs_fastest["fp32"].hi
    assert d.confidence in ("medium", "high")


def test_a_clear_margin_picks_the_faster_mode():
    d = decide([cand("fp32", 100, seed=1, n=24), cand("bf16", 70, seed=2, n=24)])
    assert d.mode == "bf16" and d.beaten == ["fp32"] and d.confidence == "high" and d.thin is None
    assert d.vs_pick["fp32"].median == pytest.approx(100 / 70, rel=0.05)
    assert d.vs_pick["fp32"].lo > 1.10


def test_two_fast_modes_tie_and_the_safer_of_them_wins():
    d = decide([cand("fp32", 100, seed=1), cand("bf16-true", 68, seed=3), cand("bf16", 70, seed=2)])
    assert d.fastest == "bf16-true" and d.mode == "bf16" and d.beaten == ["fp32"]
    # with a margin beyond the noise, the faster (less safe) mode wins
    d = decide([cand("fp32", 100, seed=1), cand("bf16-true", 50, seed=3), cand("bf16", 70, seed=2)])
    assert d.mode == "bf16-true" and sorted(d.beaten) == ["bf16", "fp32"]


def test_noise_never_makes_the_riskier_mode_win():
    # fp16 looks 20 % faster but the rounds scatter by +-60 %: tie, low confidence, the safer mode
    d = decide([cand("fp32", 100, 0.6, seed=4), cand("fp16", 80, 0.6, seed=5)])
    assert d.mode == "fp32" and d.confidence in ("low", "medium")


def test_paired_rounds_cancel_load_shared_by_a_round():
    load = [1.0, 3.0, 1.5, 2.5, 1.0, 2.0, 3.0, 1.2]  # another process comes and goes between rounds
    fp32, bf16 = cand("fp32", 100, 0.01, seed=1, load=load), cand("bf16", 80, 0.01, seed=2, load=load)
    ratio = speedup(fp32.rounds, bf16.rounds)
    assert ratio.paired and ratio.lo > 1.2 and ratio.hi < 1.3
    unpaired = speedup([], [], fp32.steps, bf16.steps)
    assert not unpaired.paired and unpaired.lo < 1.0  # the same numbers, unpaired, could not tell
    assert decide([fp32, bf16]).mode == "bf16"


def test_speedup_intervals_are_reproducible_and_honest_about_too_little_data():
    a, b = rounds(100, 0.1, seed=1), rounds(90, 0.1, seed=2)
    assert speedup(a, b) == speedup(a, b)
    few = speedup([100.0], [90.0], [100.0, 101.0], [90.0])
    assert few.lo == 0.0 and math.isinf(few.hi)  # measured, but too few steps: nothing can be told apart
    exact = speedup([100.0], [50.0])  # two given figures: taken as they are
    assert (exact.median, exact.lo, exact.hi) == (2.0, 2.0, 2.0)
    d = decide([Candidate("fp32", [100.0], [100.0]), Candidate("bf16", [50.0], [50.0])])
    assert d.mode == "fp32"  # one timed step each: a tie, not a win


def test_equal_safety_ties_go_to_less_memory():
    d = decide([cand("bf16-true", 70, seed=1, memory=900), cand("bf16-true:fp32", 70, seed=2, memory=600)])
    assert d.mode == "bf16-true:fp32"


def test_batch_probe_tells_overhead_bound_from_compute_bound():
    # t(b) = overhead + c * b at B = 16 and B/2 = 8: a 10 ms overhead and 0.05 ms per sample is overhead-bound
    small = [10 + 0.05 * 8] * 6
    big = [10 + 0.05 * 16] * 6
    probe = batch_probe("fp32", 16, 8, big, small)
    assert probe.overhead_bound and probe.math_share == pytest.approx(0.8 / 10.8, rel=1e-3)
    assert probe.batch_to_matter == 256  # 16 * (10 / 0.8) = 200 -> the next power of two
    probe = batch_probe("fp32", 16, 8, [1 + 2 * 16] * 6, [1 + 2 * 8] * 6)
    assert probe.overhead_bound is False and probe.math_share > 0.9
    flat = batch_probe("fp32", 16, 8, [10.0] * 6, [10.0] * 6)
    assert flat.overhead_bound and flat.batch_to_matter is None  # nothing grows: no batch would do


@pytest.mark.parametrize("n, expected", [(1, "low"), (2, "medium"), (6, "medium"), (19, "medium"), (20, "high")])
def test_confidence_is_capped_by_how_little_was_timed(n, expected):
    """A clear 30 % margin is still no high-confidence answer on a handful of timed steps: one round gives low, fewer
    than 3 rounds or 20 timed steps a mode give medium at most, and the decision says why."""
    d = decide([cand("fp32", 100, seed=1, n=n), cand("bf16", 70, seed=2, n=n)])
    levels = ["low", "medium", "high"]
    assert levels.index(d.confidence) <= levels.index(expected)
    if n >= 6:  # enough rounds for the margin to show: the pick is the faster mode, and only the cap holds it back
        assert d.mode == "bf16" and d.confidence == expected
        assert (d.thin is None) is (expected == "high")
    if d.thin:
        assert f"{n} timed step" in d.thin


def test_the_tightest_fp8_layer_is_the_least_headroom_over_layers_and_tensors():
    from lightning_mp.tools.compare_engine import tightest_fp8_layer

    stats = {
        "blocks.0.fc1": {"input_scale": 2.0, "input_amax": 10.0, "input_headroom": 22.4, "grad_headroom": 3.5},
        "blocks.1.fc2": {"input_headroom": 1.7, "weight_headroom": 0.8, "grad_amax": 1e-3},
    }
    assert tightest_fp8_layer(stats) == (0.8, "blocks.1.fc2 weight")
    assert tightest_fp8_layer({}) == (None, None)
    assert tightest_fp8_layer({"head": {"input_amax": 3.0}}) == (None, None)  # torchao: amaxes only


def test_the_fp8_row_names_its_tightest_layer_and_says_clipped():
    from lightning_mp.tools.compare_engine import ModeResult
    from lightning_mp.tools.compare_report import format_table

    rows = [ModeResult("fp32", step_ms=10.0, steps=5, skipped_steps=0),
            ModeResult("fp8", step_ms=5.0, steps=5, skipped_steps=0, loss_drift=0.001, fp8_headroom=0.8,
                       fp8_layer="blocks.1.fc2 weight"),
            ModeResult("fp8:current", step_ms=5.0, steps=5, skipped_steps=0, fp8_headroom=5.25, fp8_layer="x grad")]
    table, _ = format_table(rows, reference="fp32")
    assert "tightest FP8 layer blocks.1.fc2 weight: headroom 0.8x (clipped)" in table
    assert "tightest FP8 layer x grad: headroom 5.25x ·" in table or "headroom 5.25x |" in table
    assert table.count("tightest FP8 layer") == 2
