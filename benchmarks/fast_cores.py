"""Pin a benchmark to the host's fastest CPU cores, and say how fast each one was.

On a shared virtual machine the cores do not run alike: a fixed piece of Python took 1.5 ms on some cores of a GPU
host and 3.1 ms on others, steadily, and a thread the scheduler moves between them changes speed by up to 2x from
one second to the next. Timings of launch-bound steps then move by ±20 % between rounds of the same code, which no
number of rounds resolves to a few percent. Probing every core the process may use with the same piece of Python
and keeping the process on the fastest ones (all threads made after the call inherit the mask) takes that noise
out; the table printed names the cores' speeds, so a result says on which it ran.

Used by ``bench_host_cost.py`` and ``phase_host_cost.py`` (``--fast-cores N``); call it before CUDA starts its
threads.
"""

from __future__ import annotations

import os
import statistics
import time


def _work() -> int:
    total, seen = 0, {}
    for i in range(20000):
        total += i * i
        seen[i & 255] = total
    return total


def probe(cpu: int, seconds: float = 0.3) -> float:
    """The median time (ms) of a fixed piece of Python on ``cpu`` (the calling thread is moved there)."""
    os.sched_setaffinity(0, {cpu})
    for _ in range(3):
        _work()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        _work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def pin_fast_cores(count: int, passes: int = 2) -> str:
    """Keep this process on the ``count`` fastest of the cores it may use (the slower of ``passes`` probes per core);
    returns a line that lists each core's time. Where the platform has no affinity call, nothing is done."""
    if not hasattr(os, "sched_getaffinity"):
        return "cores: not pinned (no sched_setaffinity here)"
    allowed = sorted(os.sched_getaffinity(0))
    if count <= 0 or (count >= len(allowed) and count > 1):
        return f"cores: not pinned ({len(allowed)} allowed, {count} asked)"
    speed = {cpu: 0.0 for cpu in allowed}
    for _ in range(passes):
        for cpu in allowed:
            speed[cpu] = max(speed[cpu], probe(cpu))
    fast = sorted(allowed, key=speed.__getitem__)[:count]
    os.sched_setaffinity(0, set(fast))
    listed = " ".join(f"{cpu}:{speed[cpu]:.2f}" for cpu in allowed)
    return f"cores (probe ms, slower of {passes}): {listed}; pinned to {sorted(fast)}"
