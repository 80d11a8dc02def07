"""The statistics of ``python -m lightning_mp compare``: spreads, speed-up intervals, the decision, the batch probe.

Everything here works on plain numbers (milliseconds), so the rules are unit-tested on synthetic timings.

Spread of one mode's step time
    :class:`Spread`: median and interquartile range of the timed steps, from
    ``torch.utils.benchmark.utils.common.Measurement`` (the statistics ``torch.utils.benchmark`` prints). A spread
    is *noisy* when its IQR exceeds 10 % of its median (``Measurement.meets_confidence``'s threshold).

Speed-up of one mode over another
    :func:`speedup`: the modes take turns in every round (see :mod:`lightning_mp.tools.compare_engine`), so each round
    gives one paired ratio ``time(other) / time(mode)`` of the two modes' median step times in that round; load that
    comes and goes hits both sides of a pair alike. The estimate is the median of the per-round ratios, the
    interval a 95 % percentile bootstrap of that median over rounds (2,000 resamples, fixed seed: the same numbers
    give the same interval). With fewer than 3 paired rounds the steps themselves are resampled, unpaired.

The decision (:func:`decide`)
    Among the candidate modes (those that ran within the drift, skip and headroom thresholds), F is the fastest:
    the one with the largest median paired speed-up over the safest candidate. A mode is *clearly slower* than F
    when the lower end of the 95 % interval of F's speed-up over it is at least ``min_speedup`` (default 1.15: F is
    at least 15 % faster, with 95 % confidence; a smaller gain is not worth numerical risk, and a threshold well
    clear of 1 keeps the answer the same from run to run when the true difference is small). The modes that are
    not clearly slower than F tie for the lead; the tie goes to the numerically safest of them
    (:data:`SAFETY_ORDER`), then to the one with less memory. Noise therefore never makes a riskier mode win: it
    widens the intervals, which makes more modes tie, and the tie goes to the safer one.

    Confidence, when the pick is a less safe mode: *high* when it is at least ``min_speedup`` faster than every
    safer candidate at the lower end of the 95 % interval; *medium* when its point estimates clear ``min_speedup``
    and its intervals exclude 1; *low* otherwise. When the pick is the safest candidate: *high* when no other mode
    can be ``min_speedup`` faster within the intervals; *medium* when one could, but its point estimate says less;
    *low* when a faster mode's point estimate clears ``min_speedup`` but its interval does not (a sharper
    measurement might pick it).

The batch probe (:func:`batch_probe`)
    The probe mode also runs at half the batch, interleaved with the others (half, not double: a model sized to
    fill the device still fits). If a step at B takes ``r`` times as long as at B/2, the share of the step at B that
    grows with the batch (the math) is ``s = 2 (1 - 1/r)``; the rest (kernel launches, Python, optimizer
    bookkeeping on a GPU; framework overhead on a CPU) is fixed. With ``s < OVERHEAD_BOUND_SHARE`` the model is
    *overhead-bound* (on a GPU: launch-bound): no precision can make a step more than ``1 / (1 - s)`` faster, so
    precision does not matter at this size. Under the same linear model the math catches up with the overhead at a
    batch of ``B (1 - s) / s``, which the report names.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

#: a less safe mode must be at least this much faster (lower end of the 95 % interval) to win. 1.15, not 1.10: on an
#: H100 the default model's bf16-true ran 1.03-1.13x bf16 over four runs, so a 1.10 margin flipped the answer
#: between them; trading numerics for less than 15 % is not worth a changing answer
MIN_SPEEDUP = 1.15
#: relative IQR above which a mode's timings count as noisy (torch.utils.benchmark's warning threshold)
NOISY_IQR = 0.10
#: below this share of the step growing with the batch, the model is overhead-bound (launch-bound on a GPU)
OVERHEAD_BOUND_SHARE = 0.25
#: bootstrap resamples and interval
BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95

#: numerically safest first; a tie on speed goes to the earlier entry. fp32 and tf32 keep fp32 weights and
#: ranges; bf16 autocast keeps fp32 weights with fp32's range; bf16-true stores bf16 weights (fp32 masters by
#: default); fp16 modes have fp16's narrow range and need loss scaling; fp8 rounds the GEMM inputs hardest.
SAFETY_ORDER = ("fp32", "tf32", "bf16", "bf16-true", "fp16", "fp16-true", "fp8")
#: within a true-half mode: fp32 master weights (the default), the optimizer's own, compensated, stochastic, none
MASTER_ORDER = ("fp32", "optimizer", "kahan", "stochastic", "none")


#: the mode option that runs ``MPPlugin(optimizer_states="bf16")`` (``"bf16-true:bf16-states"``, ``"bf16:bf16-states"``)
BF16_STATES = "bf16-states"


def split_mode(mode: str) -> tuple[str, Optional[str]]:
    """A canonical MPPlugin mode to ``(precision, master_weights)``: ``"bf16-true:kahan"`` to
    ``("bf16-true", "kahan")``, ``"bf16"`` and ``"bf16:bf16-states"`` to ``("bf16", None)``,
    ``"bf16-true:kahan+bf16-states"`` to ``("bf16-true", "kahan")`` (see
    :func:`lightning_mp.tools.compare.parse_mode`; :func:`mode_states` reads the optimizer-state option)."""
    precision, _, options = mode.partition(":")
    master = next((o for o in options.split("+") if o and o != BF16_STATES), None)
    return precision, master


def mode_states(mode: str) -> str:
    """The ``optimizer_states`` a canonical mode runs with: ``"bf16"`` for ``"...:bf16-states"``, else ``"fp32"``."""
    return "bf16" if BF16_STATES in mode.partition(":")[2].split("+") else "fp32"


def safety_rank(mode: str) -> tuple[int, int]:
    """Sort key of a canonical mode name (``"bf16-true:kahan"``): lower is numerically safer (bf16 optimizer states
    just after the same mode's fp32 states). Unknown names (``lightning:...`` baselines) sort last."""
    precision, master = split_mode(mode)
    p = SAFETY_ORDER.index(precision) if precision in SAFETY_ORDER else len(SAFETY_ORDER)
    master = master or "fp32"
    m = MASTER_ORDER.index(master) if master in MASTER_ORDER else len(MASTER_ORDER)
    return p, 2 * m + (mode_states(mode) == "bf16")


# --------------------------------------------------------------------------------------------- spreads
@dataclass
class Spread:
    """Median and interquartile range of one mode's timed step times (milliseconds)."""

    median: float
    iqr: float
    n: int

    @property
    def rel_iqr(self) -> float:
        return self.iqr / self.median if self.median > 0 else math.inf

    @property
    def noisy(self) -> bool:
        return self.n >= 3 and self.rel_iqr > NOISY_IQR


def spread(times_ms: Sequence[float]) -> Optional[Spread]:
    """The :class:`Spread` of ``times_ms`` through ``torch.utils.benchmark``'s ``Measurement``; ``None`` if empty."""
    times = [float(t) for t in times_ms if t is not None and math.isfinite(t)]
    if not times:
        return None
    from torch.utils.benchmark.utils.common import Measurement, TaskSpec

    m = Measurement(number_per_run=1, raw_times=times, task_spec=TaskSpec(stmt="training step", setup="pass"))
    return Spread(median=m.median, iqr=m.iqr, n=len(times))


# --------------------------------------------------------------------------------------------- intervals
@dataclass
class Ratio:
    """``median`` of a ratio and its 95 % interval ``[lo, hi]``, from ``n`` paired rounds (``paired``) or steps."""

    median: float
    lo: float
    hi: float
    n: int
    paired: bool = True

    def excludes(self, threshold: float) -> bool:
        """Whether the whole interval lies at or above ``threshold``."""
        return self.lo >= threshold

    def inverse(self) -> "Ratio":
        """The same measurement the other way round: ``time(B) / time(A)`` (median and interval ends inverted)."""
        return Ratio(_reciprocal(self.median), _reciprocal(self.hi), _reciprocal(self.lo), self.n, self.paired)


def _reciprocal(x: float) -> float:
    return math.inf if x == 0 else 0.0 if math.isinf(x) else 1 / x


def _bootstrap(values: Sequence[float], rng: random.Random) -> tuple[float, float]:
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(BOOTSTRAP_SAMPLES))
    tail = (1 - CONFIDENCE) / 2
    return meds[int(tail * (BOOTSTRAP_SAMPLES - 1))], meds[int(math.ceil((1 - tail) * (BOOTSTRAP_SAMPLES - 1)))]


def speedup(
    rounds_a: Sequence[Optional[float]],
    rounds_b: Sequence[Optional[float]],
    steps_a: Sequence[float] = (),
    steps_b: Sequence[float] = (),
) -> Optional[Ratio]:
    """How many times faster mode B is than mode A: ``time(A) / time(B)``, with a 95 % bootstrap interval.

    One figure per pair of modes: ``speedup(b, a)`` is ``speedup(a, b).inverse()`` exactly (each pair is measured in
    one direction, fixed by the timings, and read in the other by inverting it: the median of the inverse ratios
    is not the inverse of their median where the rounds are even in number, so the table and the text would
    otherwise give two figures for one speed-up).

    ``rounds_a[r]`` / ``rounds_b[r]``: the median step time of each mode in round ``r`` (``None`` where a mode did
    not run). Paired by round when at least 3 rounds have both; otherwise the step times ``steps_a``/``steps_b``
    are resampled unpaired (ratio of medians), and with fewer than 3 steps on a side the interval is unbounded
    (nothing can be told apart). Two single figures without step times are taken as exact (zero-width interval).
    """
    if _direction(rounds_b, steps_b) < _direction(rounds_a, steps_a):
        other = _speedup(rounds_b, rounds_a, steps_b, steps_a)
        return other.inverse() if other is not None else None
    return _speedup(rounds_a, rounds_b, steps_a, steps_b)


def _direction(rounds: Sequence[Optional[float]], steps: Sequence[float]) -> tuple:
    """A total order on timings: the pair's measured direction is from the lesser to the greater."""
    return tuple((0, x) if x is not None else (1, 0.0) for x in rounds), tuple(steps)


def _speedup(
    rounds_a: Sequence[Optional[float]],
    rounds_b: Sequence[Optional[float]],
    steps_a: Sequence[float],
    steps_b: Sequence[float],
) -> Optional[Ratio]:
    """:func:`speedup` in the direction given."""
    rng = random.Random(0)
    pairs = [a / b for a, b in zip(rounds_a, rounds_b) if a is not None and b is not None and b > 0]
    if len(pairs) >= 3:
        lo, hi = _bootstrap(pairs, rng)
        return Ratio(statistics.median(pairs), lo, hi, len(pairs), paired=True)
    measured = bool(steps_a) or bool(steps_b)
    steps_a = [t for t in steps_a if t is not None] or [t for t in rounds_a if t is not None]
    steps_b = [t for t in steps_b if t is not None and t > 0] or [t for t in rounds_b if t is not None and t > 0]
    if not steps_a or not steps_b:
        return None
    point = statistics.median(steps_a) / statistics.median(steps_b)
    if not measured and len(steps_a) == 1 and len(steps_b) == 1:
        return Ratio(point, point, point, 1, paired=False)  # two given figures, no spread: taken as exact
    if min(len(steps_a), len(steps_b)) < 3:
        return Ratio(point, 0.0, math.inf, min(len(steps_a), len(steps_b)), paired=False)  # too few to tell
    def resampled_median(values: Sequence[float]) -> float:
        return statistics.median(rng.choices(values, k=len(values)))

    ratios = sorted(resampled_median(steps_a) / resampled_median(steps_b) for _ in range(BOOTSTRAP_SAMPLES))
    tail = (1 - CONFIDENCE) / 2
    lo = ratios[int(tail * (BOOTSTRAP_SAMPLES - 1))]
    hi = ratios[int(math.ceil((1 - tail) * (BOOTSTRAP_SAMPLES - 1)))]
    return Ratio(point, lo, hi, min(len(steps_a), len(steps_b)), paired=False)


# --------------------------------------------------------------------------------------------- decision
@dataclass
class Candidate:
    """One mode the decision may pick: its timings and memory."""

    mode: str
    rounds: Sequence[Optional[float]]  # median step time per round (ms); None where it did not run
    steps: Sequence[float] = ()  # every timed step (ms)
    memory: Optional[float] = None  # peak MiB
    median: Optional[float] = None  # median step time (ms); from ``steps`` or ``rounds`` when None

    def __post_init__(self) -> None:
        if self.median is None:
            values = [t for t in (self.steps or self.rounds) if t is not None]
            self.median = statistics.median(values) if values else None

    @property
    def rank(self) -> tuple[int, int]:
        return safety_rank(self.mode)


@dataclass
class Decision:
    """The pick and how sure it is."""

    mode: Optional[str]
    confidence: str = "n/a"  # high / medium / low / n/a
    fastest: Optional[str] = None
    tied: list[str] = field(default_factory=list)  # modes that tie with the fastest (the pick among them)
    beaten: list[str] = field(default_factory=list)  # candidates clearly slower than the fastest
    #: speed-up of the fastest over each candidate: time(candidate) / time(fastest)
    vs_fastest: dict[str, Ratio] = field(default_factory=dict)
    #: speed-up of the pick over each safer candidate
    vs_pick: dict[str, Ratio] = field(default_factory=dict)
    min_speedup: float = MIN_SPEEDUP
    reason: str = ""
    #: why the confidence was capped by how little was timed (``None``: not capped)
    thin: Optional[str] = None

    @property
    def tie(self) -> bool:
        return len(self.tied) > 1


def decide(candidates: Sequence[Candidate], min_speedup: float = MIN_SPEEDUP) -> Decision:
    """Pick the safest mode that is not clearly slower than the fastest (see the module's docstring)."""
    timed = [c for c in candidates if c.median is not None]
    if not timed:
        return Decision(None, reason="no mode ran within the thresholds", min_speedup=min_speedup)
    # the fastest by its paired speed-up over the safest candidate (the same pairing the intervals use)
    safest = min(timed, key=lambda c: c.rank)
    gain = {c.mode: speedup(safest.rounds, c.rounds, safest.steps, c.steps) for c in timed if c is not safest}
    fastest = max(timed, key=lambda c: (g.median if (g := gain.get(c.mode)) else 1.0, _neg(c.rank)))
    decision = Decision(None, fastest=fastest.mode, min_speedup=min_speedup)
    for c in timed:
        ratio = speedup(c.rounds, fastest.rounds, c.steps, fastest.steps) if c is not fastest else None
        if ratio is not None:
            decision.vs_fastest[c.mode] = ratio
        if ratio is not None and ratio.excludes(min_speedup):
            decision.beaten.append(c.mode)
        else:
            decision.tied.append(c.mode)
    tied = [c for c in timed if c.mode in decision.tied]
    pick = min(tied, key=lambda c: (c.rank, c.memory if c.memory is not None else math.inf, c.median))
    decision.mode = pick.mode
    safer = [c for c in timed if c.rank < pick.rank]
    for c in safer:
        ratio = speedup(c.rounds, pick.rounds, c.steps, pick.steps)
        if ratio is not None:
            decision.vs_pick[c.mode] = ratio
    decision.confidence = _confidence(decision, pick, min_speedup)
    _cap_by_data(decision, timed)
    return decision


#: the least timed data a "high" confidence stands on: rounds (the spread between rounds is what the intervals are
#: made of) and timed steps a mode; one round caps it at "low" (its interval comes from steps of one run alone)
HIGH_CONFIDENCE_MIN_ROUNDS = 3
HIGH_CONFIDENCE_MIN_STEPS = 20
_LEVELS = ("low", "medium", "high")


def _cap_by_data(decision: Decision, timed: Sequence[Candidate]) -> None:
    """Confidence no higher than the amount of timing allows (a 6-step run is not a high-confidence answer)."""
    rounds = min(sum(1 for r in c.rounds if r is not None) for c in timed)
    steps = min(len(c.steps) if c.steps else 0 for c in timed)
    if rounds < 2:
        cap = "low"
    elif rounds < HIGH_CONFIDENCE_MIN_ROUNDS or (steps and steps < HIGH_CONFIDENCE_MIN_STEPS):
        cap = "medium"
    else:
        return
    if decision.confidence in _LEVELS and _LEVELS.index(decision.confidence) > _LEVELS.index(cap):
        decision.confidence = cap
    # (said also where the confidence was that low already: it is one of the reasons)
    timed_steps = f"{steps} timed step{'s' if steps != 1 else ''} a mode" if steps else "few timed steps"
    decision.thin = (f"{timed_steps} in {rounds} round{'s' if rounds != 1 else ''} (high needs"
                     f" {HIGH_CONFIDENCE_MIN_ROUNDS} rounds and {HIGH_CONFIDENCE_MIN_STEPS} steps)")


def _neg(rank: tuple[int, int]) -> tuple[int, int]:
    return -rank[0], -rank[1]


def _confidence(decision: Decision, pick: Candidate, min_speedup: float) -> str:
    if not decision.vs_pick:  # the pick is the safest candidate
        if pick.mode == decision.fastest:
            # could a mode that ties with it be faster by the margin after all?
            close = [r for m, r in decision.vs_fastest.items() if m in decision.tied and r.lo * min_speedup <= 1.0]
            return "medium" if close else "high"
        lead = decision.vs_fastest.get(pick.mode)  # how much faster the (riskier) fastest mode looked
        if lead is None or lead.hi < min_speedup:
            return "high"
        return "medium" if lead.median < min_speedup else "low"
    ratios = list(decision.vs_pick.values())  # the pick's speed-up over each safer mode
    if all(r.lo >= min_speedup for r in ratios):
        return "high"
    if all(r.median >= min_speedup and r.lo > 1.0 for r in ratios):
        return "medium"
    return "low"


# --------------------------------------------------------------------------------------------- batch probe
@dataclass
class Probe:
    """The same mode's step time at the batch ``batch`` and at the smaller ``probe_batch`` (half of it)."""

    mode: str
    batch: int
    probe_batch: int
    growth: Optional[Ratio]  # time(batch) / time(probe_batch)
    item_name: str = "samples"

    @property
    def math_share(self) -> Optional[float]:
        """The share of a step at ``batch`` that grows with the batch (0..1), from the median growth.

        With ``t(b) = overhead + c * b``: ``c = (t(B) - t(h)) / (B - h)`` and the share is ``c * B / t(B)``.
        """
        if self.growth is None or self.growth.median <= 0 or self.batch <= self.probe_batch:
            return None
        share = (1 - 1 / self.growth.median) * self.batch / (self.batch - self.probe_batch)
        return min(1.0, max(0.0, share))

    @property
    def overhead_bound(self) -> Optional[bool]:
        share = self.math_share
        return None if share is None else share < OVERHEAD_BOUND_SHARE

    @property
    def batch_to_matter(self) -> Optional[int]:
        """The batch at which the math would take as long as the fixed overhead, as a power of two (at least twice
        the batch); ``None`` when that is beyond 64 times the batch."""
        share = self.math_share
        if share is None or share <= 1 / 65:
            return None
        target = self.batch * (1 - share) / share
        return max(2 * self.batch, 2 ** math.ceil(math.log2(max(1.0, target))))


def batch_probe(mode: str, batch: int, probe_batch: int, rounds_b: Sequence[Optional[float]],
                rounds_probe: Sequence[Optional[float]], steps_b: Sequence[float] = (),
                steps_probe: Sequence[float] = (), item_name: str = "samples") -> Probe:
    """:class:`Probe` from the per-round median step times at ``batch`` and at ``probe_batch``."""
    return Probe(mode, batch, probe_batch, speedup(rounds_b, rounds_probe, steps_b, steps_probe), item_name)
