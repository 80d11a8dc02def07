"""Skip counting, in one place: per optimizer (:class:`OptimizerStats`, read by callbacks through :class:`StepStats`).
A loss scaler used on its own counts per scale update (:class:`SkipCounters`, kept on the device); inside the plugin
its counts are views of the plugin's (:class:`StatsCounts`)."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Optional, Union, cast

import torch
from torch import Tensor

from lightning_mp._host import HostBatches, HostCopy


class NonFiniteTrainingError(RuntimeError):
    """Raised when too many optimizer steps in a row had inf/NaN gradients and were skipped."""


#: device outcomes kept before they are folded into the counts
_DEFER_LIMIT = 64


class SkipCounters:
    """A loss scaler's ``[steps, skipped_steps, consecutive_skips, last_skipped]``, one count per scale update.

    The counts live in an int64 device tensor (no host sync to count); outcomes the host already knows are summed on
    the host, and device flags are kept and folded in a batch of a few kernels every ``_DEFER_LIMIT`` updates.
    Reading a count folds what is pending and syncs.
    """

    NAMES = ("steps", "skipped_steps", "consecutive_skips", "last_skipped")

    def __init__(self) -> None:
        self._tensor: Optional[Tensor] = None
        self._init = [0, 0, 0, 0]  # the counts before the device tensor exists (or after unpickling)
        #: outcomes the host knows that the device tensor does not hold yet: [steps, skipped, trailing skips,
        #: all skipped (0/1), last skipped]
        self._host_tail: Optional[list[int]] = None
        self._deferred: list[Tensor] = []  # device flags not yet in the tensor

    def start(self, device: torch.device) -> None:
        """Put the counts on ``device`` (with the loss scale)."""
        self._tensor = torch.tensor(self.values() if self._tensor is not None else self._init, dtype=torch.int64,
                                    device=device)

    def count_known(self, skipped: bool) -> None:
        """One update whose outcome the host knows: counted without touching the device."""
        if self._deferred:
            self._fold_deferred()  # (the order of outcomes matters for the streak)
        tail = self._host_tail
        if tail is None:
            tail = self._host_tail = [0, 0, 0, 1, 0]
        x = int(skipped)
        tail[0] += 1
        tail[1] += x
        tail[2] = tail[2] + 1 if x else 0
        tail[3] &= x
        tail[4] = x

    def defer(self, flag: Tensor) -> None:
        """One update whose outcome only the device knows, kept and folded in later with others."""
        if self._host_tail is not None:
            self._flush_host_tail()
        self._deferred.append(flag.reshape(()))
        if len(self._deferred) >= _DEFER_LIMIT:
            self._fold_deferred()

    def fold(self) -> None:
        """Bring every pending outcome into the device tensor (no sync)."""
        self._fold_deferred()
        self._flush_host_tail()

    def _fold_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        counters = self._tensor
        if not deferred or counters is None:
            return
        skipped = (torch.stack([f.to(counters.device) for f in deferred]) > 0).long()
        n = len(deferred)
        trailing = skipped.flip(0).cumprod(0).sum()  # skips at the end, in a row
        counters[0].add_(n)
        counters[1].add_(skipped.sum())
        counters[2].copy_(torch.where(trailing == n, counters[2] + n, trailing))
        counters[3].copy_(skipped[-1])

    def _flush_host_tail(self) -> None:
        tail, self._host_tail = self._host_tail, None
        if tail is None:
            return
        n, m, trailing, all_skipped, last = tail
        counters = self._tensor
        if counters is None:
            s, k, c, _ = self._init
            self._init = [s + n, k + m, c + n if all_skipped else trailing, last]
            return
        counters.add_(torch.tensor([n, m, n if all_skipped else 0, 0], dtype=torch.int64).to(counters.device))
        if not all_skipped:
            counters[2].fill_(trailing)
        counters[3].fill_(last)

    def value(self, i: int) -> int:
        """One count (syncs)."""
        self.fold()
        return int(self._tensor[i].item()) if self._tensor is not None else self._init[i]

    def values(self) -> list[int]:
        return [self.value(i) for i in range(4)]

    def tensor(self) -> Optional[Tensor]:
        """The device tensor of the counts, everything pending folded in (no sync); ``None`` before the scale."""
        self.fold()
        return self._tensor

    def load(self, counts: list[int]) -> None:
        """Set the counts (checked by the caller)."""
        self._init, self._host_tail, self._deferred = list(counts), None, []
        if self._tensor is not None:
            self._tensor.copy_(torch.tensor(counts, dtype=torch.int64))

    def __getstate__(self) -> dict[str, Any]:
        return {"_tensor": None, "_init": self.values(), "_host_tail": None, "_deferred": []}


class StatsCounts:
    """What a loss scaler inside :class:`~lightning_mp.MPPlugin` counts: nothing of its own. Its counts (``steps``,
    ``skipped_steps``, ``consecutive_skips``, ``last_skipped``) are read from the plugin's :class:`StepStats` (summed
    over optimizers; the longest streak; ``last_skipped``: :attr:`StepStats.skipped`, the last step's), so that skips
    are counted in one place; the counting calls do nothing."""

    NAMES = SkipCounters.NAMES

    def __init__(self, stats: "StepStats") -> None:
        self._stats = stats

    def start(self, device: torch.device) -> None:
        pass

    def count_known(self, skipped: bool) -> None:
        pass

    def defer(self, flag: Tensor) -> None:
        pass

    def fold(self) -> None:
        pass

    def value(self, i: int) -> int:
        return self.values()[i]

    def values(self) -> list[int]:
        stats = self._stats
        return [stats.steps, stats.skipped_steps, stats.consecutive_skips, int(stats.skipped)]

    def tensor(self) -> Optional[Tensor]:
        return None  # (the plugin's counts live on the host)

    def load(self, counts: list[int]) -> None:
        pass  # the plugin's stats load their own per-optimizer entries


#: device verdicts on their way to the host (beyond a batch not sent yet) before recording another waits for the
#: oldest (long landed by then)
_MAX_PENDING = 8


class OptimizerStats:
    """One optimizer's step counters. Verdicts only the device knows (fused optimizers) are read late: a CUDA verdict
    goes to the host with the others of its batch of ``verdict_batch`` steps (one copy a batch), so the counters
    without a wait (the divergence stop) see it up to that many steps late; a figure read (``skipped_steps``) is
    exact.

    Example::

        plugin.stats.per_optimizer[1].skipped_steps   # the second optimizer's skipped steps
    """

    def __init__(self) -> None:
        self.steps = 0
        self._skipped_steps = 0
        self._consecutive = 0
        self._last = False
        # outcomes on their way to the host, oldest first: host copies of device verdicts, or the host's answers
        # that came after one (the order of the steps is kept); the host never waits for one to record the next
        # (a CUDA verdict travels in a batch, its place standing in the queue; other verdicts as a HostCopy)
        self._pending: deque[Union[HostCopy, bool, tuple]] = deque()
        self._pool: list[HostCopy] = []  # landed copies, reused (each holds a pinned buffer and an event)
        self._batches: Optional[HostBatches] = None  # made at the first CUDA verdict
        #: CUDA verdicts sent to the host together (set by the step from ``max_consecutive_skips``)
        self.verdict_batch = 1
        #: the run's step clock (one ``[count]`` shared by the counters of one :class:`StepStats`) and its reading at
        #: this optimizer's last step (0: none since these counters were made or loaded): which optimizer stepped last
        self._clock: list[int] = [0]
        self._seq = 0

    def __getstate__(self) -> dict[str, Any]:
        # (a copy or a pickle takes the outcomes as they are now: copies still landing in this object's pinned
        # buffers would never reach the other one)
        self._settle()
        state = dict(self.__dict__)
        state["_batches"], state["_pool"] = None, []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_ring", None)  # (counters pickled before verdicts travelled in batches)
        self.__dict__.update(state)
        self.__dict__.setdefault("_batches", None)
        self.__dict__.setdefault("verdict_batch", 1)
        self.__dict__.setdefault("_clock", [0])  # (counters pickled before the step clock)
        self.__dict__.setdefault("_seq", 0)

    def record(self, skipped: Optional[bool], verdict: Optional[Tensor]) -> None:
        """One step ran: ``skipped`` when the host knows, else ``verdict`` (a device flag, non-zero: skipped)."""
        self._settle(wait=False)
        limit = _MAX_PENDING + self.verdict_batch - 1
        if len(self._pending) >= limit:  # (the oldest, long landed by now: no wait for the newest ones)
            self._settle(down_to=limit - 1)
        self.steps += 1
        self._clock[0] += 1
        self._seq = self._clock[0]
        if skipped is None and verdict is not None:
            batches = self._batches
            if batches is None and verdict.is_cuda:
                batches = self._batches = HostBatches(verdict.device, self.verdict_batch)
            if batches is not None and batches.accepts(verdict):
                self._pending.append(batches.push(verdict))  # (no device call, no event a step)
                return
            copy = self._pool.pop() if self._pool else HostCopy()
            copy.start(verdict)
            self._pending.append(copy)
        elif self._pending:
            self._pending.append(bool(skipped))
        else:
            self._apply(bool(skipped))

    def _apply(self, skipped: bool) -> None:
        self._last = skipped
        self._skipped_steps += int(skipped)
        self._consecutive = self._consecutive + 1 if skipped else 0

    def _settle(self, wait: bool = True, down_to: int = 0) -> None:
        """Take the outcomes that have reached the host (``wait``: waiting for the copies, oldest first, until at most
        ``down_to`` are left on their way)."""
        pending = self._pending
        while len(pending) > down_to:
            item = pending[0]
            if isinstance(item, bool):
                self._apply(item)
            elif isinstance(item, tuple):  # a place in a batch
                batches = cast(HostBatches, self._batches)
                if not wait and not batches.ready(item):
                    return
                self._apply(batches.take(item) != 0)
            else:
                if not wait and not item.ready():
                    return
                self._apply(bool(item.value() != 0))
                self._pool.append(item)
            pending.popleft()

    def consecutive_known(self) -> Optional[int]:
        """Skips in a row up to the last step whose outcome has reached the host, without waiting (device verdicts
        arrive a step or a few late: the divergence stop may fire that much later)."""
        self._settle(wait=False)
        return self._consecutive

    def last_skipped_known(self) -> Optional[bool]:
        """Whether the last step was skipped, if the host knows without waiting (``None``: not yet)."""
        self._settle(wait=False)
        return None if self._pending else self._last

    def skipped_steps_known(self) -> Optional[int]:
        """The skipped steps, if the host knows every outcome without waiting (``None``: a device verdict is still
        on its way)."""
        self._settle(wait=False)
        return None if self._pending else self._skipped_steps

    @property
    def skipped_steps(self) -> int:
        self._settle()
        return self._skipped_steps

    @property
    def consecutive_skips(self) -> int:
        self._settle()
        return self._consecutive

    @property
    def last_skipped(self) -> bool:
        self._settle()
        return self._last

    def state_dict(self) -> dict[str, int]:
        self._settle()
        return {"steps": self.steps, "skipped_steps": self._skipped_steps, "consecutive_skips": self._consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = {}
        for key in ("steps", "skipped_steps", "consecutive_skips"):
            value = state.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"The checkpoint's step counter {key}={value!r} is corrupted: it must be an integer >= 0."
                )
            values[key] = value
        self._pending.clear()
        self._batches = None  # (copies may still be landing in its buffers)
        self.steps, self._skipped_steps, self._consecutive = (
            values["steps"], values["skipped_steps"], values["consecutive_skips"]
        )
        self._last = self._consecutive > 0
        self._seq = 0  # (no step since the checkpoint: which optimizer stepped last is not known)


class StepStats:
    """Read-only view of the plugin's step accounting, available as ``plugin.stats``.

    Example::

        plugin = MPPlugin("fp16")
        trainer = Trainer(plugins=[plugin], max_steps=100)
        trainer.fit(model)
        plugin.stats.skipped_steps, plugin.stats.loss_scale

    Totals are over all optimizers; ``per_optimizer`` has each optimizer's own counters (the divergence stop
    counts each optimizer's streak apart). Reading the loss scale or the gradient norm copies one number to the
    host (a sync on CUDA): read them on logging steps. ``as_dict()`` reads everything at once.

    With several optimizers (a GAN), hold each LR schedule on its own optimizer's skips::

        opt_d.step(); opt_g.step()
        for opt, scheduler in ((opt_d, sched_d), (opt_g, sched_g)):
            if not plugin.stats.skipped_for(opt):
                scheduler.step()

    ``skipped`` answers for the optimizer that stepped last only (see there).

    The counters describe the whole run, as the loss scale does: they live as long as the plugin (``validate``,
    ``test`` and ``predict`` after ``fit``, a continued ``fit``, another ``Trainer`` given the same plugin keep
    them; the n-th optimizer of every ``fit`` counts on in the n-th entry) and are set only by a checkpoint loaded.
    """

    def __init__(self, scaler: Optional[Any] = None, spike: Optional[Any] = None) -> None:
        self._scaler: Optional[Any] = None
        self.set_scaler(scaler)
        self._spike = spike  # the loss-spike guard (``None``: off)
        self._grad_norm: Optional[Tensor] = None
        self.per_optimizer: list[OptimizerStats] = []
        self._clock: list[int] = [0]  # the step clock every entry of per_optimizer shares (see OptimizerStats)
        #: id(optimizer) -> (a weak reference to it, its index in per_optimizer, the clock when it was bound)
        self._bound: dict[int, tuple[Callable[[], Any], int, int]] = {}
        self._namer: Optional[Callable[[Tensor], Optional[str]]] = None
        self._fp8_layers: Optional[Callable[[], dict[str, dict[str, float]]]] = None
        self._fp8_shares: Optional[Any] = None  # an FP8ShareProbe (lightning_mp.fp8.shares), in fp8 runs

    def __getstate__(self) -> dict[str, Any]:
        # (a copy knows no optimizer: weak references do not pickle, and the copy's optimizers are other objects; its
        # steps bind the optimizers of the run that uses it, as they bind this one's)
        return {**self.__dict__, "_bound": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_clock" not in state:  # (stats pickled before the step clock)
            self._clock = [0]
            for entry in self.per_optimizer:
                entry._clock = self._clock
        self.__dict__.setdefault("_bound", {})

    def optimizer(self, index: int) -> OptimizerStats:
        """The counters of the run's ``index``-th optimizer (made at its first use, kept from one entry point to the
        next: an evaluation in between, with no optimizers, leaves them as they are)."""
        per = self.per_optimizer
        while len(per) <= index:
            entry = OptimizerStats()
            entry._clock = self._clock
            per.append(entry)
        return per[index]

    def bind_optimizer(self, optimizer: Any, index: int) -> None:
        """``optimizer`` (the torch optimizer the plugin steps) counts in the ``index``-th counters from now on, for
        :meth:`skipped_for`. Held weakly; an optimizer bound there before (an earlier run's) is no longer known."""
        try:
            ref: Callable[[], Any] = weakref.ref(optimizer)
        except TypeError:  # (an object without weak references: held as long as its binding)
            ref = lambda: optimizer  # noqa: E731
        bound = self._bound
        old = bound.get(id(optimizer))
        since = old[2] if old is not None and old[0]() is optimizer and old[1] == index else self._clock[0]
        for key, (other, other_index, _) in list(bound.items()):
            if other() is None or other_index == index or key == id(optimizer):
                del bound[key]  # (gone, the index's previous optimizer, or a stale id)
        bound[id(optimizer)] = (ref, index, since)
        self.optimizer(index)

    def _index_of(self, optimizer: Any) -> int:
        """The counters' index of ``optimizer``: the torch optimizer the plugin stepped, or a wrapper of it (Lightning's
        ``LightningOptimizer``, Fabric's ``_FabricOptimizer``: the torch optimizer at ``_optimizer``/``optimizer``)."""
        obj, name = optimizer, type(optimizer).__name__
        for _ in range(4):  # (a wrapper of a wrapper at most, and no cycle)
            binding = self._bound.get(id(obj))
            if binding is not None and binding[0]() is obj:
                _, index, since = binding
                if self.per_optimizer[index]._seq <= since:
                    raise ValueError(
                        f"stats.skipped_for({name}): this optimizer has taken no step under this plugin yet (since"
                        " the run set it up, or since a checkpoint was loaded): ask after its step."
                    )
                return index
            inner = vars(obj).get("_optimizer") if hasattr(obj, "__dict__") else None
            if inner is None:
                inner = getattr(obj, "optimizer", None)
            if inner is None or inner is obj:
                break
            obj = inner
        raise ValueError(
            f"stats.skipped_for({name}): this optimizer has not stepped under this plugin. Pass an optimizer the"
            " plugin steps: the torch optimizer, the LightningOptimizer that self.optimizers() returns, or the"
            " optimizer that fabric.setup returned."
        )

    def skipped_for(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s last step was skipped (inf/NaN gradients, or a loss spike): hold its LR scheduler
        then. With several optimizers (a GAN) ask per optimizer: another optimizer's skip says nothing about this one.

        ``optimizer``: the torch optimizer, the ``LightningOptimizer`` that ``self.optimizers()`` returns (manual
        optimization) or the optimizer that ``fabric.setup`` returned. A fused optimizer's verdict that only the device
        knows yet is read from it (a host sync, as for ``skipped``). Raises ``ValueError`` for an optimizer that has
        not stepped under this plugin (another plugin's, or one not stepped yet in this run).

        Example::

            opt_d.step()
            if not plugin.stats.skipped_for(opt_d):
                scheduler_d.step()
        """
        return self.per_optimizer[self._index_of(optimizer)].last_skipped

    def _last_stepped(self) -> Optional[OptimizerStats]:
        """The counters of the optimizer that stepped last (``None``: none stepped since they were made or loaded)."""
        latest = max(self.per_optimizer, key=lambda s: s._seq, default=None)
        return latest if latest is not None and latest._seq > 0 else None

    def set_scaler(self, scaler: Optional[Any]) -> None:
        """The loss scaler (or the step guard) of the run; a loss scaler's counts become views of these."""
        self._scaler = scaler
        counts_from = getattr(scaler, "counts_from", None)
        if callable(counts_from):
            counts_from(self)

    def set_namer(self, namer: Optional[Callable[[Tensor], Optional[str]]]) -> None:
        self._namer = namer

    def set_fp8(self, backend: Optional[Any]) -> None:
        """The run's FP8 backend (``None``: not an FP8 run): its ``layer_stats`` for :meth:`fp8_layers`, and a share
        probe on its layers for :meth:`arm_fp8_shares`."""
        from lightning_mp.fp8.shares import FP8ShareProbe  # (imports neither Transformer Engine nor torchao)

        self._fp8_layers = backend.layer_stats if backend is not None else None
        self.set_fp8_shares(FP8ShareProbe(backend) if backend is not None else None)

    def fp8_layers(self) -> dict[str, dict[str, float]]:
        """Per FP8 layer of an ``MPPlugin("fp8")`` run, the scaling its backend keeps (``FP8Backend.layer_stats``:
        scale, amax, headroom); ``{}`` in other modes. One host read."""
        return self._fp8_layers() if self._fp8_layers is not None else {}

    def set_fp8_shares(self, probe: Optional[Any]) -> None:
        """The run's :class:`~lightning_mp.fp8.shares.FP8ShareProbe` (``None``: no FP8 layers); one armed before is
        disarmed."""
        if self._fp8_shares is not None and self._fp8_shares is not probe:
            self._fp8_shares.disarm()
        self._fp8_shares = probe

    def arm_fp8_shares(self) -> bool:
        """Measure, in the next training step (its forward and backward), the share of each FP8 layer's input,
        weight and output gradient that its FP8 cast saturates or flushes to zero; read them with
        :meth:`fp8_shares`. Costs a pass over each of those tensors in that step only: arm it on the steps you log.
        Returns whether there are FP8 layers to measure (``False`` in other modes). Arming again before the read adds
        to the same counts (the micro-batches of one step)."""
        return self._fp8_shares.arm() if self._fp8_shares is not None else False

    def fp8_shares(self) -> dict[str, dict[str, float]]:
        """The shares measured since :meth:`arm_fp8_shares`, per FP8 layer: ``saturated_<tensor>`` (the share of its
        elements beyond the format's maximum once scaled, inf/NaN included) and ``underflow_<tensor>`` (the share of
        its non-zero elements the cast rounds to zero), ``<tensor>``: ``input``, ``weight``, ``grad``. One host
        read; the probe's hooks come off. ``{}`` when nothing was armed."""
        return self._fp8_shares.read() if self._fp8_shares is not None else {}

    def disarm_fp8_shares(self) -> None:
        """Take the share probe's hooks off without reading (an armed step that did not run)."""
        if self._fp8_shares is not None:
            self._fp8_shares.disarm()

    def record_grad_norm(self, norm: Tensor) -> None:
        """Keep the (unscaled) gradient norm computed by clipping; stays on the device."""
        self._grad_norm = norm.detach()

    def name_of(self, tensor: Tensor) -> Optional[str]:
        """The model's name for a tensor the optimizer steps: a parameter, or the fp32 stand-in of a half one.

        Inside a step (e.g. in ``on_before_optimizer_step``) the param groups of a true-half run hold fp32
        stand-ins for the half parameters; this names them after the model's parameters.
        """
        return self._namer(tensor) if self._namer is not None else None

    def skipped_known(self) -> Optional[bool]:
        """:attr:`skipped`, as far as the host knows without waiting (never syncs; ``None``: the verdict is still on
        the device)."""
        latest = self._last_stepped()
        if latest is not None:
            return latest.last_skipped_known()
        known = [s.last_skipped_known() for s in self.per_optimizer]  # (as a checkpoint left them)
        if any(k is True for k in known):
            return True
        return None if any(k is None for k in known) else False

    def skipped_steps_known(self) -> Optional[int]:
        """:attr:`skipped_steps`, if the host knows every outcome without waiting (never syncs; ``None``: a fused
        optimizer's verdict is still on its way from the device)."""
        total = 0
        for s in self.per_optimizer:
            known = s.skipped_steps_known()
            if known is None:
                return None
            total += known
        return total

    @property
    def skipped(self) -> bool:
        """Whether the last optimizer step, of whichever optimizer took it, was skipped (inf/NaN gradients, or a loss
        spike). With one optimizer: its last step. With several (a GAN), only the one that stepped last is answered
        for: ask :meth:`skipped_for` about each optimizer (to hold its LR scheduler, above all; a skip of one
        optimizer says nothing about another's step, and ``skipped_steps`` counts every skip). The last step is the
        last one this plugin ran, under the Trainer and Fabric alike, whatever the optimizers of earlier runs did;
        before any step since a checkpoint was loaded: whether any optimizer's last step before it was skipped."""
        return self._skipped()

    def _skipped(self) -> bool:
        latest = self._last_stepped()
        if latest is not None:
            return latest.last_skipped
        return any(s.last_skipped for s in self.per_optimizer)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far, over all optimizers (restored from checkpoints)."""
        return sum(s.skipped_steps for s in self.per_optimizer)

    @property
    def consecutive_skips(self) -> int:
        """The longest current streak of skipped steps of one optimizer (0 after clean steps)."""
        return max((s.consecutive_skips for s in self.per_optimizer), default=0)

    @property
    def steps(self) -> int:
        """Optimizer steps attempted, skipped ones included, over all optimizers."""
        return sum(s.steps for s in self.per_optimizer)

    @property
    def spike_skips(self) -> int:
        """Steps skipped by the loss-spike guard so far (counted in ``skipped_steps`` too; 0 when it is off)."""
        return 0 if self._spike is None else self._spike.spike_skips

    @property
    def loss_scale(self) -> Optional[float]:
        """The current loss scale, or ``None`` when the mode does not scale the loss."""
        return self._loss_scale()

    def _loss_scale(self) -> Optional[float]:
        scaler = self._scaler
        if scaler is None or not getattr(scaler, "scaling", False) or not scaler.is_enabled():
            return None
        return scaler.get_scale()

    @property
    def grad_norm(self) -> Optional[float]:
        """The unscaled gradient norm of the last step, when gradient clipping by norm computed it."""
        return None if self._grad_norm is None else float(self._grad_norm.item())

    def as_dict(self) -> dict[str, Any]:
        """All figures at once."""
        per = self.per_optimizer
        return {
            "steps": sum(s.steps for s in per),
            "skipped_steps": sum(s.skipped_steps for s in per),
            "consecutive_skips": max((s.consecutive_skips for s in per), default=0),
            "skipped": self._skipped(),
            "loss_scale": self._loss_scale(),
            "grad_norm": None if self._grad_norm is None else float(self._grad_norm.item()),
            "spike_skips": 0 if self._spike is None else self._spike.spike_skips,
        }

    def __repr__(self) -> str:
        return f"StepStats({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"
