"""The measuring engine of ``python -m lightning_mp compare``: every mode's real ``Trainer.fit``, taking turns.

Interleaving
    Each mode runs one real ``Trainer.fit`` (the user's model, data and Trainer settings, ``MPPlugin(mode)``) in its
    own thread, from the same initial weights and the same batches, for ``steps`` optimizer steps. The threads never
    run at the same time: a baton (a condition variable) lets exactly one run while the others wait at the start of
    an optimizer step. The scheduler hands the baton out in this order:

    1. warm-up: each mode in turn runs its first ``warmup`` steps (set-up, first allocations, kernel selection,
       optimizer state); none of them is timed;
    2. ``rounds`` rounds: in each, every mode in turn runs K more steps (K = (steps - warmup) / rounds, the
       remainder spread over the first rounds), the order rotated by one each round; these steps are timed;
    3. nothing else is left: the fits end after ``steps`` steps.

    So the numerics (losses, skipped steps, loss scale, headroom) come from an ordinary ``steps``-step run of each
    mode, and the timing from the same steps, in rounds whose pairs of modes ran seconds apart: load that comes and
    goes hits every mode of a round alike. Per round, each mode's median step time is kept; the decision compares
    modes by their per-round ratios (:mod:`lightning_mp.tools.compare_stats`).

    A step is timed from ``on_train_batch_start`` of its first micro-batch to ``on_train_batch_end`` of the batch
    that stepped the optimizer: forward, backward, unscale/check and optimizer step, under gradient accumulation
    all micro-batches. Data loading (identical in every mode) is outside. On a CUDA device the device is
    synchronised at every hand-over and steps are timed with CUDA events (their host-side time is kept too); on
    the CPU with ``time.perf_counter``. Steps on which PrecisionMonitor gathers its per-layer figures, and the step
    whose memory is counted on the CPU, are not timed.

    State that is process-wide and that a mode changes is swapped at every hand-over: the random number
    generators (torch CPU and CUDA, Python's, NumPy's), so that each mode draws exactly what it would draw alone,
    and the TF32 flags (which MPPlugin sets per mode). Automatic garbage collection is paused while the modes run
    (a young-generation collection runs after every step and at every hand-over instead), so that no collection
    lands inside a timed step.

Memory per mode
    CUDA: ``torch.cuda.max_memory_allocated`` with the peak reset at every hand-over, and the bytes each mode holds
    between its turns tracked, so a mode's peak is what it holds plus what its own steps add, never another
    mode's. CPU: there is no allocator peak to read, and the process's RSS only grows with run order, so each mode
    counts the bytes it needs on one step: weights, gradients, optimizer state and master copies (deduplicated by
    storage) plus every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``): an
    estimate of the step's peak, the same way for every mode.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class ModeResult:
    """What one mode did. ``status`` is ok / differs (a final loss lower than fp32's beyond the tolerance) /
    unstable / diverged / unsupported / failed."""

    mode: str
    status: str = "ok"
    reason: str = ""
    lightning_precision: Optional[str] = None
    #: median step time over the timed steps and its interquartile range (ms)
    step_ms: Optional[float] = None
    step_iqr_ms: Optional[float] = None
    noisy: bool = False
    #: the mode's median step time in each round (ms; None where it did not run), and every timed step
    round_ms: list[Optional[float]] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    #: CUDA: median host-side time of the same steps (ms)
    host_ms: Optional[float] = None
    #: speed-up over the reference mode (fp32): median and 95 % interval
    speedup: Optional[float] = None
    speedup_lo: Optional[float] = None
    speedup_hi: Optional[float] = None
    items_per_s: Optional[float] = None
    item_name: str = "samples"
    items_per_step: Optional[int] = None
    #: peak memory of the mode (MiB), how it was measured ("cuda" or "estimate") and its share of fp32's
    peak_mem_mib: Optional[float] = None
    memory_kind: Optional[str] = None
    mem_share: Optional[float] = None
    final_loss: Optional[float] = None
    loss_drift: Optional[float] = None
    steps: int = 0
    skipped_steps: Optional[int] = None
    loss_scale: Optional[float] = None
    losses: list[float] = field(default_factory=list)
    #: fp16 headroom (PrecisionMonitor): log2(65504 / largest |value|); the smallest over layers and logged steps
    act_headroom_bits: Optional[float] = None
    act_absmax: Optional[float] = None
    act_layer: Optional[str] = None
    grad_headroom_bits: Optional[float] = None
    grad_layer: Optional[str] = None
    grad_underflow: Optional[float] = None
    #: fp8 (delayed scaling): the FP8 layer whose tensor came closest to FP8's largest value at the last step
    #: (headroom = the format's maximum over the scaled amax; below 1 it was clipped), as "layer tensor"
    fp8_headroom: Optional[float] = None
    fp8_layer: Optional[str] = None
    #: fp8: the largest share of an FP8 layer's tensor that its cast saturated or rounded to zero, over the logged
    #: steps (PrecisionMonitor(fp8_layers=True)), and where, as "layer tensor saturated|underflow"
    fp8_lost: Optional[float] = None
    fp8_lost_layer: Optional[str] = None

    @property
    def ran(self) -> bool:
        return self.status in ("ok", "differs", "unstable")


@dataclass
class Job:
    """One participant: a mode (``role="mode"``), or the batch probe's run at a larger batch (``role="probe"``)."""

    label: str
    mode: str
    build: Callable[[], tuple[Any, Any]]  # -> (LightningModule, LightningDataModule or None), fresh each call
    role: str = "mode"
    #: called with the built (module, datamodule) before fit: the probe doubles the batch here
    adjust: Optional[Callable[[Any, Any], None]] = None
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- process state
class _Globals:
    """The process-wide state one mode changes and another must not see: RNGs and TF32 flags."""

    def __init__(self) -> None:
        self.saved: Optional[tuple] = None

    def save(self) -> None:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        try:
            import numpy

            np_state = numpy.random.get_state()
        except ImportError:  # pragma: no cover - numpy comes with the test extras
            np_state = None
        flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        self.saved = (torch.get_rng_state(), cuda, random.getstate(), np_state, flags)

    def restore(self) -> None:
        if self.saved is None:
            return
        cpu, cuda, py, np_state, flags = self.saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if np_state is not None:
            import numpy

            numpy.random.set_state(np_state)
        if (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) != flags:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


# --------------------------------------------------------------------------------------------- memory
class _CudaMemory:
    """A mode's CUDA peak while other modes hold memory too: resident bytes tracked across its turns."""

    def __init__(self) -> None:
        self.resident = 0
        self.peak = 0
        self._start = 0
        #: set at the end of the mode's warm-up: the bytes of its own tensors, which become its resident bytes (what
        #: the first CUDA work of the process allocates once, e.g. library workspaces, is nobody's), and the peaks
        #: of the warm-up are dropped
        self.rebase_to: Optional[int] = None
        self._turns: Optional[list[int]] = None  # each timed turn's peak, once rebased

    def begin(self) -> None:
        torch.cuda.synchronize()
        self._start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def end(self) -> None:
        torch.cuda.synchronize()
        now, top = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        if self._turns is not None:  # after the warm-up: the mode's own state, plus what the turn allocated on top
            self._turns.append(self.resident + top - self._start)
            self.peak = int(statistics.median(self._turns))  # (one turn's one-time allocation is not the mode's)
            return
        self.peak = max(self.peak, self.resident + top - self._start)
        self.resident += now - self._start
        if self.rebase_to is not None:
            self.resident, self.peak, self.rebase_to, self._turns = self.rebase_to, 0, None, []


def _state_tensors(module: torch.nn.Module, optimizers: list, plugin: Any) -> list[Any]:
    """What a mode holds between steps: weights, gradients, buffers, the optimizers' parameters and state, masters."""
    tensors: list[Any] = [*module.parameters(), *(p.grad for p in module.parameters()), *module.buffers()]
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []):
            tensors.extend(group["params"])
            tensors.extend(p.grad for p in group["params"])
        for state in getattr(opt, "state", {}).values():
            tensors.extend(state.values() if isinstance(state, dict) else ())
    masters = getattr(plugin, "masters", None)
    if masters is not None and hasattr(masters, "tensors"):
        tensors.extend(masters.tensors())
    return tensors


def _storage_bytes(tensors: list[Any], cuda_only: bool = False) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors skipped)."""
    seen: set = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t.is_cuda or not cuda_only):
            key = _storage_key(t)
            if key is not None and key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _storage_key(t: torch.Tensor) -> Optional[tuple[int, str]]:
    try:
        storage = t.untyped_storage()
    except Exception:  # noqa: BLE001 - tensor subclasses without a plain storage are not counted
        return None
    ptr = storage.data_ptr()
    return (ptr, str(t.device)) if ptr else None


class _StepMemory:
    """CPU estimate of one step's peak: state bytes (weights, gradients, optimizer state, masters) + saved tensors."""

    def __init__(self) -> None:
        self.saved_bytes = 0
        self.state_bytes = 0
        self._seen: set = set()
        self._hooks: Any = None

    def start(self, module: torch.nn.Module) -> None:
        self._seen = {_storage_key(p) for p in module.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def _pack(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key is not None and key not in self._seen:
                self._seen.add(key)
                self.saved_bytes += t.untyped_storage().nbytes()
        return t

    def stop(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def count_state(self, module: torch.nn.Module, optimizers: list, plugin: Any) -> None:
        released = sum(  # gradients released right after the step exist at the peak all the same
            p.numel() * p.element_size() for p in module.parameters() if p.grad is None and p.requires_grad
        )
        self.state_bytes = _storage_bytes(_state_tensors(module, optimizers, plugin)) + released

    @property
    def mib(self) -> float:
        return (self.state_bytes + self.saved_bytes) / 2**20


# --------------------------------------------------------------------------------------------- participants
def _count_items(batch: Any) -> tuple[int, str]:
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, dict) and first:
        first = next(iter(first.values()))
    if isinstance(first, torch.Tensor):
        if first.dim() == 2 and not first.is_floating_point():
            return first.numel(), "tokens"
        return (first.shape[0] if first.dim() else 1), "samples"
    return 1, "batches"


class _Participant:
    def __init__(self, job: Job, index: int) -> None:
        self.job = job
        self.index = index
        self.result = ModeResult(mode=job.label)
        self.thread: Optional[threading.Thread] = None
        self.budget: float = 0
        self.round: Optional[int] = None  # the round being run (None: warm-up or tail, untimed)
        self.done = False
        self.steps_started = 0
        self.globals = _Globals()
        self.cuda_memory: Optional[_CudaMemory] = None
        self.step_memory: Optional[_StepMemory] = None
        self.round_times: dict[int, list[float]] = {}
        self.host_times: list[float] = []
        self._events: list[tuple[int, Any, Any, float]] = []
        self.items: Optional[int] = None
        self.item_name = "samples"
        self.headroom: dict[str, Any] = {}

    # the participant's own thread, at each hand-over
    def begin_slice(self) -> None:
        self.globals.restore()
        if self.cuda_memory is not None:
            self.cuda_memory.begin()

    def end_slice(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for r, start, end, host in self._events:
            self.round_times.setdefault(r, []).append(start.elapsed_time(end))
            self.host_times.append(host)
        self._events.clear()
        gc.collect(0)
        if self.cuda_memory is not None:
            self.cuda_memory.end()
        self.globals.save()


class _Scheduler:
    """Hands the baton to one participant at a time; the others wait at the start of their next step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn: Optional[_Participant] = None

    def give(self, p: _Participant, budget: float, round_index: Optional[int], start: Callable[[], None]) -> None:
        p.budget, p.round = budget, round_index
        with self._cond:
            self._turn = p
            self._cond.notify_all()
        if p.thread is None:
            start()
        with self._cond:
            while self._turn is not None:
                self._cond.wait()

    def wait_turn(self, p: _Participant) -> None:
        with self._cond:
            while self._turn is not p:
                self._cond.wait()
        p.begin_slice()

    def pause(self, p: _Participant) -> None:
        """In ``p``'s thread at the start of a step, its budget spent: hand the baton back and wait for the next."""
        p.end_slice()
        with self._cond:
            self._turn = None
            self._cond.notify_all()
        self.wait_turn(p)

    def finish(self, p: _Participant) -> None:
        try:
            p.end_slice()
        finally:
            p.done = True
            with self._cond:
                self._turn = None
                self._cond.notify_all()


def _make_pace(p: _Participant, scheduler: _Scheduler, device_type: str, untimed: Callable[[int], bool],
               memory_step: int, monitor: Any):
    """The callback that waits for the baton at the start of each optimizer step, times it and reads figures."""
    from lightning.pytorch import Callback

    class Pace(_PaceHooks, Callback):
        pass

    return Pace(p, scheduler, device_type, untimed, memory_step, monitor)


class _PaceHooks:
    """The hooks of :func:`_make_pace`'s callback (a Lightning ``Callback`` there; Lightning is imported when a
    comparison runs, not with this module)."""

    def __init__(self, p: _Participant, scheduler: _Scheduler, device_type: str, untimed: Callable[[int], bool],
                 memory_step: int, monitor: Any) -> None:
        self._p, self._scheduler, self._device_type = p, scheduler, device_type
        self._untimed, self._memory_step, self._monitor = untimed, memory_step, monitor
        self.losses: list[torch.Tensor] = []
        self._micro: list[torch.Tensor] = []
        self._open = False
        self._stepped = False
        self._timed = False
        self._index = -1
        self._items = 0
        self._start: Any = None
        self._t0 = 0.0
        self._memory_open = False
        self._monitor_seen: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        p = self._p
        if not self._open:  # the first micro-batch of an optimizer step
            self._open_step(pl_module)
        items, p.item_name = _count_items(batch)
        self._items += items

    def _open_step(self, pl_module) -> None:
        p = self._p
        if p.budget <= 0:
            self._scheduler.pause(p)
        p.budget -= 1
        self._open, self._stepped, self._items = True, False, 0
        self._index = p.steps_started
        p.steps_started += 1
        self._timed = p.round is not None and not self._untimed(self._index)
        if self._index == self._memory_step and p.step_memory is not None:
            p.step_memory.start(pl_module)
            self._memory_open = True
        if self._timed:
            if self._device_type == "cuda":
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            self._t0 = time.perf_counter()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._memory_open and self._p.step_memory is not None:
            self._p.step_memory.stop()  # the forward is over: every tensor saved for backward is counted
            self._memory_open = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._stepped = True
        p = self._p
        if self._index == self._memory_step and p.step_memory is not None:
            p.step_memory.count_state(pl_module, list(trainer.optimizers), trainer.precision_plugin)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        p = self._p
        if p.cuda_memory is not None and p.round is None and p.budget == 0 and self._index <= self._memory_step:
            # the last step of the warm-up turn: from here the mode is charged for its own tensors only
            own = _state_tensors(pl_module, list(trainer.optimizers), trainer.precision_plugin)
            p.cuda_memory.rebase_to = _storage_bytes(own, cuda_only=True)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._micro.append(loss.detach().float().reshape(()))
        if not self._step_over(trainer, pl_module):
            return
        if self._timed:
            self._record_time()
        self._open = False
        self._close_memory()
        if not gc.isenabled():  # between steps, never inside a timed one: the young garbage of this step
            gc.collect(1 if self._index % 10 == 9 else 0)
        if self._micro:
            self.losses.append(self._micro[0] if len(self._micro) == 1 else torch.stack(self._micro).mean())
            self._micro = []
        if p.items is None:
            p.items = self._items
        monitor = self._monitor
        if monitor is not None and monitor.last is not self._monitor_seen:
            self._monitor_seen = monitor.last
            _merge_headroom(p.headroom, monitor.last)

    def _record_time(self):
        p = self._p
        host = time.perf_counter() - self._t0
        if self._device_type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            p._events.append((p.round, self._start, end, 1000 * host))
        else:
            p.round_times.setdefault(p.round, []).append(1000 * host)

    def on_train_end(self, trainer, pl_module):
        self._close_memory()

    def on_exception(self, trainer, pl_module, exception):
        self._close_memory()

    def _close_memory(self) -> None:
        if self._memory_open and self._p.step_memory is not None:
            self._p.step_memory.stop()
        self._memory_open = False

    def _step_over(self, trainer, pl_module) -> bool:
        if self._stepped or not pl_module.automatic_optimization:
            return True
        should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        return should_accumulate is None or not should_accumulate()


def _merge_headroom(acc: dict[str, Any], figures: dict[str, float]) -> None:
    """Keep the smallest fp16 headroom over layers and logging steps (and where), and the largest underflow."""
    for key, value in figures.items():
        kind, _, layer = key.removeprefix("precision/").partition("/")
        if not layer or value is None:
            continue
        if kind in ("act_headroom", "grad_headroom"):
            value = -math.inf if math.isnan(value) else value
            if kind not in acc or value < acc[kind][0]:
                acc[kind] = (value, layer)
        elif kind == "act_absmax" and not math.isnan(value):
            acc["act_absmax"] = max(acc.get("act_absmax", 0.0), value)
        elif kind == "grad_underflow" and not math.isnan(value):
            acc["grad_underflow"] = max(acc.get("grad_underflow", 0.0), value)
        elif kind.startswith(("fp8_saturated_", "fp8_underflow_")) and not math.isnan(value):
            what, _, tensor = kind.removeprefix("fp8_").partition("_")
            if "fp8_lost" not in acc or value > acc["fp8_lost"][0]:
                acc["fp8_lost"] = (value, f"{layer} {tensor} {what}")


# --------------------------------------------------------------------------------------------- running
@dataclass
class Schedule:
    steps: int
    warmup: int
    rounds: int

    def __post_init__(self) -> None:
        self.warmup = max(0, min(self.warmup, self.steps - 1))
        self.rounds = max(1, min(self.rounds, self.steps - self.warmup))

    def per_round(self) -> list[int]:
        timed = self.steps - self.warmup
        base, extra = divmod(timed, self.rounds)
        return [base + (1 if r < extra else 0) for r in range(self.rounds)]

    def untimed(self, index: int, device_type: str, monitor_every: Optional[int]) -> bool:
        """Whether step ``index`` (0-based) of a round goes untimed: the step whose memory the CPU counts, and the
        steps on which PrecisionMonitor gathers its per-layer figures."""
        if device_type != "cuda" and index == self.memory_step:
            return True
        return monitor_every is not None and (index + 1) % monitor_every == 0

    def timed_steps(self, device_type: str, monitor_every: Optional[int]) -> list[int]:
        """The steps (0-based) each mode times: those after the warm-up that :meth:`untimed` leaves."""
        return [i for i in range(self.warmup, self.steps) if not self.untimed(i, device_type, monitor_every)]

    @property
    def memory_step(self) -> int:
        """The step whose memory the CPU counts (untimed): the last warm-up step, the second step at the latest
        (so that the optimizer state exists), or the first if the run has one step."""
        return max(0, min(max(self.warmup - 1, 1), self.steps - 1))


def run_jobs(
    jobs: list[Job],
    schedule: Schedule,
    device_type: str,
    seed: int = 0,
    initial_state: Optional[dict[str, torch.Tensor]] = None,
    trainer_kwargs: Optional[dict[str, Any]] = None,
    monitor_every: Optional[int] = None,
    progress: Optional[bool] = None,
) -> list[ModeResult]:
    """Run every job's fit in turns (see the module's docstring) and return one :class:`ModeResult` per job.

    ``monitor_every``: attach ``PrecisionMonitor(layer_stats=True)`` logging every this many steps (those steps are
    not timed); ``None``: no monitor. ``progress``: a tqdm bar on stderr (``None``: only on a terminal).
    """
    if not jobs:
        return []
    participants = [_Participant(job, i) for i, job in enumerate(jobs)]
    scheduler = _Scheduler()
    pristine = _Globals()
    pristine.save()
    for p in participants:
        p.globals.saved = pristine.saved
        if device_type == "cuda":
            p.cuda_memory = _CudaMemory()
        else:
            p.step_memory = _StepMemory()

    def untimed(index: int) -> bool:
        return schedule.untimed(index, device_type, monitor_every)

    def start(p: _Participant) -> Callable[[], None]:
        def go() -> None:
            p.thread = threading.Thread(
                target=_thread_main, name=f"compare-{p.job.label}", daemon=True,
                args=(p, scheduler, schedule, device_type, seed, initial_state, dict(trainer_kwargs or {}),
                      untimed, monitor_every),
            )
            p.thread.start()

        return go

    per_round = schedule.per_round()
    total = len(participants) * (1 + len(per_round))
    bar = _progress_bar(total, progress)
    restore_warnings = _warnings_above(bar)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if schedule.warmup:
            for p in participants:
                _turn(scheduler, p, schedule.warmup, None, start(p), bar, "warm-up")
        for r, k in enumerate(per_round):
            shift = r % len(participants)
            for p in participants[shift:] + participants[:shift]:
                _turn(scheduler, p, k, r, start(p), bar, f"round {r + 1}/{len(per_round)}")
        for p in participants:  # the rest (none in a full schedule) and the end of each fit
            _turn(scheduler, p, math.inf, None, start(p), None, "")
    finally:
        if bar is not None:
            bar.close()
        restore_warnings()
        if gc_was_enabled:
            gc.enable()
        pristine.restore()
    for p in participants:
        if p.thread is not None:
            p.thread.join()
        _summarize(p, schedule, device_type)
    gc.collect()
    return [p.result for p in participants]


def _turn(scheduler: _Scheduler, p: _Participant, budget: float, round_index: Optional[int], start, bar, what) -> None:
    if p.done:
        if bar is not None:
            bar.update(1)
        return
    if bar is not None:
        bar.set_description(f"{what} · {p.job.label}")
    scheduler.give(p, budget, round_index, start)
    if bar is not None:
        bar.update(1)


def _progress_bar(total: int, progress: Optional[bool]):
    if progress is False:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # no tqdm: no bar
        return None
    return tqdm(total=total, file=sys.stderr, leave=False, unit="turn",
                disable=None if progress is None else False)


def _warnings_above(bar: Any) -> Callable[[], None]:
    """While ``bar`` is drawn, print warnings above it (``tqdm.write``) instead of into its line; returns what puts
    Python's ``warnings.showwarning`` back (called in ``run_jobs``'s ``finally``)."""
    if bar is None or getattr(bar, "disable", False):
        return lambda: None
    import warnings

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' own signature
        bar.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)

    warnings.showwarning = show
    return lambda: setattr(warnings, "showwarning", shown)


def _thread_main(p, scheduler, schedule, device_type, seed, initial_state, trainer_kwargs, untimed, monitor_every):
    try:
        scheduler.wait_turn(p)
        _fit(p, scheduler, schedule, device_type, seed, initial_state, trainer_kwargs, untimed, monitor_every)
    except BaseException as err:  # noqa: BLE001 - anything left over still ends this mode only
        if p.result.status == "ok":
            p.result.status, p.result.reason = "failed", f"{type(err).__name__}: {err}"
    finally:
        if device_type == "cuda":
            gc.collect()  # the mode's trainer and model hold device memory through reference cycles
            torch.cuda.empty_cache()
        scheduler.finish(p)


def _fit(p, scheduler, schedule, device_type, seed, initial_state, trainer_kwargs, untimed, monitor_every) -> None:
    from lightning.pytorch import Trainer, seed_everything

    from lightning_mp import MPPlugin, NonFiniteTrainingError
    from lightning_mp.callbacks import PrecisionMonitor
    from lightning_mp.tools.compare_stats import mode_states, split_mode

    result = p.result
    mode = p.job.mode
    native = mode.startswith("lightning:")
    plugin = None
    pace = None
    try:
        seed_everything(seed, verbose=False)
        module, datamodule = p.job.build()
        if initial_state is not None:  # None: build() makes the same weights every call itself
            module.load_state_dict(initial_state)
        if p.job.adjust is not None:
            p.job.adjust(module, datamodule)
        if native:
            precision_kwargs: dict[str, Any] = {"precision": mode.split(":", 1)[1]}
        else:
            precision, master = split_mode(mode)
            kwargs = dict(p.job.plugin_kwargs)
            if master:
                kwargs["master_weights"] = master
            if mode_states(mode) != "fp32":
                kwargs["optimizer_states"] = mode_states(mode)
            plugin = MPPlugin(precision, **kwargs)
            precision_kwargs = {"plugins": [plugin]}
        # (an fp8 mode: its layers' lost shares, on the monitor's steps)
        fp8 = plugin is not None and plugin.mode is not None and plugin.mode.fp8
        monitor = (PrecisionMonitor(log_every_n_steps=monitor_every, layer_stats=True, fp8_layers=fp8)
                   if monitor_every else None)
        pace = _make_pace(p, scheduler, device_type, untimed, schedule.memory_step, monitor)
        kwargs = {**trainer_kwargs, **precision_kwargs}
        kwargs.update(
            accelerator="gpu" if device_type == "cuda" else "cpu",
            devices=1,
            max_steps=schedule.steps,
            max_epochs=-1,
            logger=_quiet_logger() if monitor is not None else False,  # PrecisionMonitor needs one; it keeps nothing
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[c for c in (monitor, pace) if c is not None],
        )
        trainer = Trainer(**kwargs)
        result.lightning_precision = str(trainer.precision)
        seed_everything(seed, verbose=False)  # the same batches in every mode
        trainer.fit(module, datamodule=datamodule)
        if plugin is not None:
            stats = plugin.stats.as_dict()
            result.skipped_steps, result.loss_scale, result.steps = (
                stats["skipped_steps"], stats["loss_scale"], stats["steps"])
            result.fp8_headroom, result.fp8_layer = tightest_fp8_layer(plugin.stats.fp8_layers())
        else:
            result.steps = trainer.global_step
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            result.loss_scale = float(scaler.get_scale()) if scaler is not None else None
            result.skipped_steps = None
    except NonFiniteTrainingError as err:
        result.status, result.reason = "diverged", str(err).split(". ")[0]
    except torch.OutOfMemoryError:
        result.status, result.reason = "failed", "out of memory"
    except NotImplementedError as err:
        result.status, result.reason = "unsupported", str(err)
    except Exception as err:  # noqa: BLE001 - one mode's failure must not stop the others
        result.status, result.reason = "failed", f"{type(err).__name__}: {err}"
    finally:
        if pace is not None:
            pace._close_memory()
            result.losses = [float(x) for x in torch.stack(pace.losses).tolist()] if pace.losses else []


def _quiet_logger() -> Any:
    from lightning.pytorch.loggers.logger import DummyLogger

    return DummyLogger()


def _summarize(p: _Participant, schedule: Schedule, device_type: str) -> None:
    from lightning_mp.tools.compare_stats import spread

    result = p.result
    n_rounds = len(schedule.per_round())
    result.round_ms = [statistics.median(p.round_times[r]) if p.round_times.get(r) else None for r in range(n_rounds)]
    result.times_ms = [t for r in range(n_rounds) for t in p.round_times.get(r, [])]
    s = spread(result.times_ms)
    if s is not None:
        result.step_ms, result.step_iqr_ms, result.noisy = s.median, s.iqr, s.noisy
    if p.host_times:
        result.host_ms = statistics.median(p.host_times)
    result.item_name = p.item_name
    result.items_per_step = p.items
    if result.step_ms and p.items:
        result.items_per_s = p.items / (result.step_ms / 1000)
    if p.cuda_memory is not None and p.cuda_memory.peak:
        result.peak_mem_mib, result.memory_kind = p.cuda_memory.peak / 2**20, "cuda"
    elif p.step_memory is not None and p.step_memory.state_bytes:
        result.peak_mem_mib, result.memory_kind = p.step_memory.mib, "estimate"
    if "act_headroom" in p.headroom:
        result.act_headroom_bits, result.act_layer = p.headroom["act_headroom"]
        result.act_absmax = p.headroom.get("act_absmax")
    if "grad_headroom" in p.headroom:
        result.grad_headroom_bits, result.grad_layer = p.headroom["grad_headroom"]
        result.grad_underflow = p.headroom.get("grad_underflow")
    if "fp8_lost" in p.headroom:
        result.fp8_lost, result.fp8_lost_layer = p.headroom["fp8_lost"]
    finite = [x for x in result.losses if math.isfinite(x)]
    if finite:
        tail = finite[-max(1, min(10, len(finite) // 5)):]
        result.final_loss = sum(tail) / len(tail)
    if result.status == "ok" and result.losses and not math.isfinite(result.losses[-1]):
        result.status, result.reason = "diverged", "the last loss is not finite"


def tightest_fp8_layer(stats: dict[str, dict[str, float]]) -> tuple[Optional[float], Optional[str]]:
    """The FP8 layer and tensor with the least headroom (:meth:`FP8Backend.layer_stats`' ``*_headroom`` figures):
    ``(headroom, "layer tensor")``, or ``(None, None)`` where the backend keeps none (stateless recipes)."""
    best: tuple[Optional[float], Optional[str]] = (None, None)
    for layer, figures in stats.items():
        for name, value in figures.items():
            if name.endswith("_headroom") and (best[0] is None or value < best[0]):
                best = (value, f"{layer} {name[: -len('_headroom')]}")
    return best
