"""Half-precision weights whose updates keep their precision (``bf16-true`` / ``fp16-true``).

An update smaller than half a unit in the last place of a bf16 weight (``2**-9`` of its size) is lost when it is
written into the weight. Four ways to deal with it, chosen with ``MPPlugin(master_weights=...)``:

==============  =====================================================================  ==================
``"fp32"``      fp32 master copies: the optimizer steps the masters (its state is fp32),  2 + 4 bytes/param
                the half weights are written from them after each step
``"kahan"``     a half-precision compensation buffer per parameter holds what rounding    2 + 2 bytes/param
                the updated weight to half precision dropped, and is added back at the
                next step (about 16 significant bits for bf16)
``"stochastic"``  the updated weight is rounded to half precision stochastically:        2 bytes/param
                unbiased, so small updates survive on average
``"none"``      plain half weights, as Lightning's ``bf16-true`` (optimizer state half)   2 bytes/param
``"optimizer"``  the optimizer keeps fp32 masters itself (a fused Adam with               2 + 4 bytes/param
                ``FusedAdam(master_weights=True)``); nothing is attached here
==============  =====================================================================  ==================

Three invariants hold by construction:

1. **The model's parameters are the truth.** Before each step the masters are compared with the weights, element
   by element, on the device: a master that still rounds to its weight keeps its low bits (also where the weight
   was written with the value it had: ``Embedding(max_norm=...)`` renormalising some rows, an average swapped in
   for validation and back); an element whose weight changed gives its master its value, and a Kahan compensation
   that no longer rounds away against its weight is dropped. So a weight written by anyone, however (in place,
   through ``.data``, which a version counter does not see, ``copy_``, ``load_state_dict``, a callback that
   averages, clips or prunes), is where the next step starts. One pass over the weights and the masters a step
   (one kernel on CUDA), no host sync.
2. **Every parameter the optimizer steps has its master, whenever it joins**: masters are made at the step for
   whatever half-precision parameters the optimizer's param groups hold then (unfrozen layers, new param groups,
   a second model).
3. **Masters are invisible.** ``optimizer.param_groups`` and ``optimizer.state`` are keyed by the model's own
   parameters; only inside :meth:`MasterWeights.stepping` do the fp32 stand-ins take their places (with their
   fp32 gradients and the optimizer state), so ``toggle_optimizer``, ``requires_grad``, ``zero_grad``, callbacks
   reading ``.grad`` and checkpoints see what they would see in fp32. The optimizer's state stays fp32 when a
   checkpoint is loaded (a hook keeps torch from casting it to the half parameters' dtype).

And masters start from the exact fp32 weights where those exist: :func:`cast_module_` keeps the fp32 tensor it
replaced (until that parameter is written again), whatever runs between the cast and the first step
(``validate``, ``predict``, a second ``Trainer``).

Example (a plain loop; :class:`lightning_mp.MPPlugin` does all of this from Lightning's hooks)::

    model = MyModel()
    cast_module_(model, torch.bfloat16, keep_fp32=apply_fp32_guards(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    masters = attach_master_weights(opt, "fp32", module=model)
    for x, y in data:
        loss = F.cross_entropy(model(x.bfloat16()), y)
        loss.backward()
        masters.step(opt)        # fp32 gradients, step the fp32 masters, write the bf16 weights
        opt.zero_grad()
"""

from __future__ import annotations

import collections
import contextlib
import operator
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from lightning_mp._host import HostCopy
from lightning_mp.verdict import _GRAD, ZeroFlags, check_tensors_
from lightning_mp.settings import MasterKind, parse_master_weights

_HALF = (torch.float16, torch.bfloat16)
_DTYPE_NAMES: dict[Optional[torch.dtype], str] = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"
}
#: the stochastic-rounding generator's seed: the same on every rank, so data-parallel replicas round alike
STOCHASTIC_ROUNDING_SEED = 0x5EED

#: up to this many half parameter elements in one optimizer's layout, the fp32 masters' gradients live in one flat
#: buffer kept from step to step (views of it, made once, are the masters' gradients): no allocation a gradient a
#: step, and the inf/NaN check reads one tensor. A host cost that counts on small, launch-bound models; above this
#: size (256 MB of fp32 gradients) the buffer would raise the peak of forward and backward by 4 bytes a parameter, so
#: the gradients are allocated in the step and freed after it, as before
FLAT_GRADS_MAX_NUMEL = 1 << 26
#: layouts up to this size keep their fp32 masters in one flat buffer too (no memory added: the masters move there),
#: so following the weights is four kernels for all of them, not three a weight (a LitGPT 12 x 768: 440 launches a
#: step less). Larger ones follow weight by weight (one compiled kernel each on CUDA), where the temporary copies of
#: the flat pass (5 bytes an element) would count
FLAT_FOLLOW_MAX_NUMEL = 1 << 28

#: fp32 values of parameters cast to half by :func:`cast_module_`, with the stamp the cast left: param -> (fp32, stamp)
_FP32_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: the tensors among those that :func:`downcast_kept_` cast at the end of a run (the FP32-guarded modules')
_KEPT_AFTER_RUN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def stamp(param: Tensor) -> tuple[int, int]:
    """What changes whenever a tensor's values may have changed: its storage and its version counter (host ints)."""
    return param.data_ptr(), param._version


def fp32_original(param: Tensor) -> Optional[Tensor]:
    """The fp32 value ``param`` had before :func:`cast_module_` cast it, if it has not been written since."""
    entry = _FP32_ORIGINALS.get(param)
    if entry is None:
        return None
    value, cast_stamp = entry
    if cast_stamp != stamp(param):
        # moved (``model.to(device)`` replaces the storage) or written since: compare values, once
        if value.shape != param.shape or not bool(value.to(param.device, param.dtype).eq(param.detach()).all()):
            del _FP32_ORIGINALS[param]  # written since: its own value is the truth
            return None
        _FP32_ORIGINALS[param] = (value, stamp(param))
    return value


def forget_fp32_original(param: Tensor) -> None:
    _FP32_ORIGINALS.pop(param, None)


def _follow_weight(master: Tensor, weight: Tensor) -> None:
    torch.where(master.to(weight.dtype).eq(weight), master, weight, out=master)


def _follow_weight_compiled(master: Tensor, weight: Tensor) -> None:
    master.copy_(torch.where(master.to(weight.dtype) == weight, master, weight.float()))


#: weights with at least this many elements on CUDA are followed by one compiled kernel (reads 6 bytes an element,
#: writes 4) instead of three eager ones; below it a compiled call's host time outweighs the traffic it saves
COMPILED_FOLLOW_MIN_NUMEL = 1 << 22
_COMPILED_FOLLOW: dict[str, Any] = {"fn": None, "failed": None}


def follow_weight_(master: Tensor, weight: Tensor) -> None:
    """An fp32 master follows its half weight: where the weight is no longer the master rounded (written since),
    the master takes the weight's value; elsewhere it keeps its low bits. On the device, no host sync."""
    if (master.is_cuda and master.numel() >= COMPILED_FOLLOW_MIN_NUMEL and _COMPILED_FOLLOW["failed"] is None
            and master.is_contiguous() and weight.is_contiguous()):
        try:
            fn = _COMPILED_FOLLOW["fn"]
            if fn is None:
                # (emulate_precision_casts: the cast to half is rounded as eager rounds it, not kept in fp32)
                fn = _COMPILED_FOLLOW["fn"] = torch.compile(
                    _follow_weight_compiled, fullgraph=True, dynamic=True, options={"emulate_precision_casts": True}
                )
            fn(master.view(-1), weight.view(-1))
            return
        except Exception as exc:  # no Triton, a compiler error: the eager kernels compute the same values
            _COMPILED_FOLLOW["failed"] = exc
    _follow_weight(master, weight)


def cast_module_(module: nn.Module, dtype: torch.dtype, *, keep_fp32: Iterable[str] = ()) -> int:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place, except inside ``keep_fp32``.

    ``keep_fp32`` names submodules (e.g. the FP32 guards from :func:`lightning_mp.guards.apply_fp32_guards`)
    whose parameters and buffers (BatchNorm running statistics included) stay fp32. A tensor such a submodule
    shares with a module outside them (an LM head tied to the embedding, with the head guarded) is cast with the
    rest: the unguarded module computes with it in ``dtype``, so the activations stay half, and the guard upcasts
    it for the guarded module's own compute. Parameter objects are kept (``param.data`` is replaced), so ties and
    optimizers made before or after see the same objects; the fp32 tensors replaced are remembered (not copied)
    so master weights made later start from them (:func:`fp32_original`). Idempotent. Returns the number of
    tensors cast.
    """
    kept_modules, keep_ids = _kept(module, keep_fp32)
    cast = _upcast(module, kept_modules, keep_ids)
    done: dict[int, Tensor] = {}  # buffers cast: a buffer two modules hold stays one tensor
    with torch.no_grad():
        for sub in module.modules():
            if id(sub) in kept_modules:
                continue
            for param in sub.parameters(recurse=False):
                if param.is_floating_point() and id(param) not in keep_ids and param.dtype != dtype:
                    original = param.data
                    param.data = original.to(dtype)
                    if param.grad is not None:
                        param.grad = None  # a gradient of the old dtype cannot stay on the cast parameter
                    if original.dtype == torch.float32 and dtype in _HALF:
                        _FP32_ORIGINALS[param] = (original, stamp(param))
                    cast += 1
            for key, buf in sub._buffers.items():
                if buf is not None and buf.is_floating_point() and id(buf) not in keep_ids and buf.dtype != dtype:
                    sub._buffers[key] = _cast_once(buf, dtype, done)
                    cast += 1
            if hasattr(sub, "_dtype") and isinstance(getattr(sub, "_dtype"), torch.dtype):
                # LightningModule.dtype reports the training dtype, as Lightning's HalfPrecision
                setattr(sub, "_dtype", dtype)
    return cast


def upcast_kept_(module: nn.Module, keep_fp32: Iterable[str]) -> int:
    """The FP32-guarded submodules' 16-bit parameters and buffers become fp32 (a model the user cast to half, or
    one :func:`downcast_kept_` left half after a run: those get back the exact fp32 values they had).

    Tensors shared with modules outside ``keep_fp32`` keep their dtype (see :func:`cast_module_`). In place
    (``param.data`` replaced, parameter objects kept); returns the number of tensors cast.
    """
    return _upcast(module, *_kept(module, keep_fp32))


def downcast_kept_(module: nn.Module, dtype: torch.dtype, keep_fp32: Iterable[str]) -> int:
    """The end of a true-half run: what :func:`cast_module_` kept fp32 becomes ``dtype`` too, so the module is what
    Lightning's ``precision="bf16-true"``/``"16-true"`` leaves (every floating parameter and buffer half: it runs
    in its own dtype, guards or not). The fp32 tensors replaced are remembered (not copied): the next run's
    :func:`upcast_kept_` gives them back exactly, unless they are written in between. Returns the number cast."""
    cast = 0
    done: dict[int, Tensor] = {}
    with torch.no_grad():
        for sub, key, tensor in _kept_tensors(module, *_kept(module, keep_fp32)):
            if not tensor.is_floating_point() or tensor.dtype == dtype:
                continue
            if key is None:  # a parameter
                original = tensor.data
                tensor.data = original.to(dtype)
                if tensor.grad is not None:
                    tensor.grad = tensor.grad.to(dtype)  # as Lightning's plugin leaves it: in the weight's dtype
                _remember(tensor, original, dtype)
            else:
                sub._buffers[key] = half = _cast_once(tensor, dtype, done)
                _remember(half, tensor, dtype)
            cast += 1
    return cast


def _remember(tensor: Tensor, original: Tensor, dtype: torch.dtype) -> None:
    if original.dtype == torch.float32 and dtype in _HALF:
        _FP32_ORIGINALS[tensor] = (original, stamp(tensor))
        _KEPT_AFTER_RUN[tensor] = True


def fp32_state_dict_(state: dict[str, Any], module: nn.Module) -> int:
    """The entries of ``state`` (``module.state_dict()``) whose tensors :func:`downcast_kept_` cast to half at the
    end of a run get their fp32 values back, where those still hold: a checkpoint written after a true-half run
    holds the guarded modules' fp32 weights, as one written during it does, so a resume from it goes on bit for
    bit. Returns the number of entries replaced."""
    replaced = 0
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if name in state and tensor in _KEPT_AFTER_RUN:
            original = fp32_original(tensor)
            if original is not None:
                state[name] = original
                replaced += 1
    return replaced


def _kept(module: nn.Module, keep_fp32: Iterable[str]) -> tuple[set[int], set[int]]:
    """The ids of the modules inside the submodules ``keep_fp32`` names, and of the tensors they keep fp32: the
    parameters and buffers those modules hold that no module outside them holds too."""
    kept_modules: set[int] = set()
    for name in keep_fp32:
        kept_modules.update(id(m) for m in module.get_submodule(name).modules())
    inside: set[int] = set()
    outside: set[int] = set()
    for sub in module.modules():
        held = inside if id(sub) in kept_modules else outside
        held.update(id(t) for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None)
    return kept_modules, inside - outside


def _upcast(module: nn.Module, kept_modules: set[int], keep_ids: set[int]) -> int:
    cast = 0
    done: dict[int, Tensor] = {}
    with torch.no_grad():
        for sub, key, tensor in _kept_tensors(module, kept_modules, keep_ids):
            if tensor.dtype not in _HALF:
                continue
            if key is None:  # a parameter
                tensor.data = _fp32_value(tensor)
                if tensor.grad is not None:
                    tensor.grad = None
            else:
                if id(tensor) not in done:
                    done[id(tensor)] = _fp32_value(tensor)
                sub._buffers[key] = done[id(tensor)]
            cast += 1
    return cast


def _kept_tensors(
    module: nn.Module, kept_modules: set[int], keep_ids: set[int]
) -> Iterator[tuple[nn.Module, Optional[str], Tensor]]:
    """The tensors the FP32 guards keep (:func:`_kept`): ``(module, None, parameter)`` and ``(module, name, buffer)``,
    module by module (one walk for the casts both ways)."""
    for sub in module.modules():
        if id(sub) not in kept_modules:
            continue
        for param in sub.parameters(recurse=False):
            if id(param) in keep_ids:
                yield sub, None, param
        for key, buf in list(sub._buffers.items()):
            if buf is not None and id(buf) in keep_ids:
                yield sub, key, buf


def _cast_once(buf: Tensor, dtype: torch.dtype, done: dict[int, Tensor]) -> Tensor:
    """``buf`` cast to ``dtype``; the same tensor for every module that holds it (``done``: id -> cast)."""
    if id(buf) not in done:
        done[id(buf)] = buf.to(dtype)
    return done[id(buf)]


def _fp32_value(tensor: Tensor) -> Tensor:
    """``tensor`` in fp32: the exact fp32 values it was cast from where they are remembered and still hold."""
    original = fp32_original(tensor)
    forget_fp32_original(tensor)
    _KEPT_AFTER_RUN.pop(tensor, None)
    return original.to(tensor.device) if original is not None else tensor.detach().float()


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: Optional[torch.Generator] = None) -> Tensor:
    """Round fp32 ``x`` to ``dtype`` (bf16 or fp16) up or down at random, in proportion to the distance.

    Unbiased: ``E[stochastic_round(x)] == x`` for values inside the range of ``dtype``. Values that ``dtype``
    represents exactly come back unchanged.
    """
    x = x.float()
    if dtype is torch.bfloat16:
        # bf16 is the top half of fp32: add 16 random low bits, then truncate (carry = round away from zero)
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
        return (x.view(torch.int32) + noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
    if dtype is not torch.float16:
        raise ValueError(
            f"stochastic_round: dtype={dtype} is not a 16-bit float (use torch.bfloat16 or torch.float16)."
        )
    nearest = x.to(dtype)
    near32 = nearest.float()
    toward = torch.where(near32 > x, torch.full_like(nearest, -float("inf")), torch.full_like(nearest, float("inf")))
    other = torch.nextafter(nearest, toward)
    gap = (other.float() - near32).abs()
    p_other = torch.where(gap > 0, (x - near32).abs() / gap, torch.zeros_like(x))
    # (fp32 named: a manual optimization step runs where true-half modes make the default dtype half)
    draw = torch.rand(x.shape, dtype=torch.float32, device=x.device, generator=generator)
    return torch.where(draw < p_other, other, nearest)


@dataclass
class _Entry:
    """What the masters keep for one half-precision parameter."""

    param: Tensor
    #: the fp32 master (``"fp32"``), the compensation buffer (``"kahan"``), or ``None`` (``"stochastic"``); the
    #: kinds that keep one keep it for every entry (their ``_new_held``), and ``cast`` it to ``Tensor`` where read
    held: Optional[Tensor]
    #: the parameter's stamp when the masters last wrote (or read) it
    stamp: tuple[int, int]
    #: micro-batch gradients summed in fp32 (gradient accumulation), until the step takes them
    acc: Optional[Tensor] = None
    #: whether what is held stands for the weight exactly as it was set (made from the fp32 value the weight was cast
    #: from, or from the weight itself), not stepped nor written since: then it tells a loaded checkpoint's weights
    #: at their own precision (:meth:`MasterWeights._as_set`)
    exact: bool = False


@dataclass
class StepRecord:
    """One half parameter inside a step: where it sits in its param group, and its fp32 stand-in."""

    group: list
    index: int
    param: Tensor
    standin: nn.Parameter
    #: the half gradient object and its version when the fp32 gradient was last taken from or written to it
    grad_seen: Optional[tuple[int, int]] = None


@dataclass
class StepRecords:
    """The half parameters of one optimizer in one step (see :meth:`MasterWeights.gather`)."""

    optimizer: Optimizer
    #: the layout's records (the same list step after step), or those of the parameters the step takes
    records: list[StepRecord]
    #: the optimizer's :class:`_Layout`, which the records come from
    layout: "_Layout"
    #: with ``gather(check=True)``: 1.0 if a gradient the step would apply holds an inf/NaN (``None``: not checked)
    found: Optional[Tensor] = None
    #: whether each fp32 gradient is its half gradient as backward left it (no fp32 sum of earlier micro-batches
    #: added, every gradient dense): then a figure taken from the half gradients holds for the fp32 ones
    plain: bool = False
    #: the records' half gradients and their versions at the gather: their ``grad_seen``, filled only where something
    #: reads them (:meth:`seen`: hooks that may write the gradients)
    unseen: Optional[tuple[list[Optional[Tensor]], list[Optional[int]]]] = None
    #: how the stand-ins stand in (:meth:`MasterWeights.swap_in`): ``""`` not, ``"items"`` record by record,
    #: ``"lists"`` the layout's whole lists and state dicts
    swap: str = ""

    def seen(self) -> list[StepRecord]:
        """The records, each with the ``grad_seen`` of the gather."""
        if self.unseen is not None:
            grads, versions = self.unseen
            for r, grad, version in zip(self.records, grads, versions):
                r.grad_seen = None if grad is None else (id(grad), cast(int, version))
            self.unseen = None
        return self.records

    def swap_in(self) -> None:
        """The stand-ins take the parameters' places, with their optimizer state: the layout's whole lists and state
        dict where the step takes every parameter, else record by record."""
        if self.swap:
            return
        if self.records is self.layout.records and self.layout.swap_in(self.optimizer):
            self.swap = "lists"
            return
        for r in self.records:
            r.group[r.index] = r.standin
        for state in _states_of(self.optimizer):
            if state:  # (empty before the optimizer's first step)
                pop = state.pop
                for r in self.records:
                    moved = pop(r.param, None)  # (no entry made: the state is a defaultdict)
                    if moved is not None:
                        state[r.standin] = moved
        self.swap = "items"

    def swap_out(self) -> None:
        if not self.swap:
            return
        if self.swap == "lists":
            self.layout.swap_out(self.optimizer)
            self.swap = ""
            return
        for r in self.records:
            r.group[r.index] = r.param
        for state in _states_of(self.optimizer):
            if state:
                pop = state.pop
                for r in self.records:
                    moved = pop(r.standin, None)
                    if moved is not None:
                        state[r.param] = moved
        self.swap = ""


class MasterWeights:
    """What keeps the precision of updates to half-precision parameters (see the module docstring).

    Subclasses: :class:`FP32MasterWeights`, :class:`KahanCompensation`, :class:`StochasticRounding`. One step:
    :meth:`gather` (fp32 gradients on fp32 stand-ins), unscaling/checks/clipping on the stand-ins,
    :meth:`stepping` (the stand-ins take the parameters' places while the optimizer steps), :meth:`write_back`.
    :meth:`step` does all of it for a plain loop. The kinds share the step and differ in their stand-ins
    (:meth:`_standin`, :meth:`_refresh`: the fp32 masters themselves, or fp32 values made for the step) and in how
    the weights are written (:meth:`_write_step`, :meth:`_end_step`).
    """

    kind: str = ""
    #: whether the stand-ins are what the kind holds (the fp32 masters), with their values kept between steps: then
    #: every step takes every half parameter of the optimizer (one without a gradient stands in unmoved)
    _standins_held = False

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}  # id(half param) -> entry
        self._names: dict[int, str] = {}  # id(half param) -> name in the module (checkpoints)
        #: the steps under way (gathered, not written back): id(optimizer) -> (id(stand-in) -> half param)
        self._stepping: dict[int, dict[int, Tensor]] = {}
        self.dtype: Optional[torch.dtype] = None
        #: changes whenever an entry is made or dropped (a layout made before is stale)
        self._generation = 0
        #: whether fp32 sums of earlier micro-batches may be pending (``carry_grads_``)
        self._carrying = False
        #: optimizer -> its :class:`_Layout` (made at its first step; again when stale)
        self._layouts: "weakref.WeakKeyDictionary[Optimizer, _Layout]" = weakref.WeakKeyDictionary()
        self._flags = ZeroFlags()  # the gather's verdict flags (``check=True``)

    def __getstate__(self) -> dict[str, Any]:
        # layouts are made again at the next step (they are keyed weakly by optimizer, which pickle cannot carry)
        state = dict(self.__dict__)
        state["_layouts"], state["_flags"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._layouts = weakref.WeakKeyDictionary()
        self._flags = ZeroFlags()

    # ------------------------------------------------------------------ set-up
    def attach(self, optimizer: Optimizer, module: Optional[nn.Module] = None) -> int:
        """Take charge of ``optimizer``'s half-precision parameters (nothing in it changes); returns how many.

        Parameters added later (``add_param_group``, unfrozen layers) are taken at the step they first join.
        """
        if module is not None:
            self.name_parameters(module)
        _keep_state_fp32_on_load(optimizer)  # (idempotent; again after a run's end took the hooks off)
        count = 0
        for param in _half_params(optimizer):
            self._entry(param)
            count += 1
        _upcast_eager_state(optimizer)
        return count

    def name_parameters(self, module: nn.Module) -> None:
        """Name the parameters (for checkpoints) after ``module``'s ``named_parameters``."""
        self._names.update(
            {id(p): n for n, p in module.named_parameters(remove_duplicate=False) if id(p) not in self._names}
        )

    def forget_others(self, keep: Iterable[Tensor]) -> None:
        """Drop what is kept for parameters not in ``keep`` (a model the Trainer no longer trains)."""
        ids = {id(p) for p in keep}
        for pid in [pid for pid in self._entries if pid not in ids]:
            del self._entries[pid]
            self._generation += 1

    def _entry(self, param: Tensor) -> _Entry:
        entry = self._entries.get(id(param))
        if entry is None or entry.param is not param:
            if self.dtype is None:
                self.dtype = param.dtype
            elif param.dtype != self.dtype:
                raise ValueError(
                    f"master weights: parameters of two half dtypes ({self.dtype} and {param.dtype}) in one run;"
                    " cast the model to one dtype."
                )
            original = fp32_original(param)
            entry = _Entry(param, self._new_held(param, original), stamp(param), exact=True)
            forget_fp32_original(param)
            self._entries[id(param)] = entry
            self._generation += 1
        elif entry.stamp != stamp(param):
            # written by someone else since our last write: the parameter is the truth
            self._rederive(entry)
            entry.stamp, entry.exact = stamp(param), False
        return entry

    def _new_held(self, param: Tensor, original: Optional[Tensor]) -> Optional[Tensor]:
        return None

    def _rederive(self, entry: _Entry) -> None:
        """The parameter was written from outside: start its master (or compensation) from its value."""
        self._resync([entry])

    def _resync(self, entries: Sequence[_Entry]) -> None:
        """Reconcile what is held with the weights, element by element, on the device (see the module docstring):
        whatever wrote a weight, however, the weight is the truth. Nothing to do where only the weights are kept."""

    def _fp32_value(self, entry: _Entry) -> Tensor:
        """The fp32 value the optimizer steps for this parameter (a new tensor unless the master itself)."""
        return entry.param.detach().float()

    def follow_written(self, pending: Sequence[StepRecords], written: StepRecords) -> None:
        """Another optimizer's step just wrote weights that prepared steps (``pending``) hold stand-ins of: a weight
        two optimizers hold, both prepared before either stepped (a Fabric loop that clips both first). Those
        stand-ins take the fp32 values the written step left, so its update is not overwritten. (fp32 masters need
        nothing: both optimizers step the one master.)"""
        if isinstance(self, FP32MasterWeights):
            return
        ids = {id(r.param) for r in written.records}
        with torch.no_grad():
            for records in pending:
                for r in records.records:
                    entry = self._entries.get(id(r.param)) if id(r.param) in ids else None
                    if entry is not None:
                        r.standin.data = self._fp32_value(entry)

    @staticmethod
    def _as_set(entry: _Entry) -> bool:
        """Whether what ``entry`` holds is the weight as it was set from outside, at that value's own precision (see
        :attr:`_Entry.exact`; the weight not written since). A checkpoint restored into an fp32 model before the cast:
        the fp32 value of each weight the checkpoint holds, also one saved with more than half precision."""
        return entry.exact and entry.stamp == stamp(entry.param)

    def _known(self, entry: _Entry) -> Tensor:
        """The weight's value as precisely as it is known, in fp32 (a new tensor): what is held where that is the
        weight as set (:meth:`_as_set`), else the half weight."""
        return self._fp32_value(entry) if self._as_set(entry) else entry.param.detach().float()

    # ------------------------------------------------------------------ gradient accumulation
    def carry_grads_(self, params: Iterable[Tensor]) -> None:
        """Before a backward that would add into existing half gradients: move them into fp32 sums.

        Micro-batches of gradient accumulation then sum in fp32; the step adds the last micro-batch's gradient.
        """
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for param in params:
            grad = param.grad
            if grad is None or param.dtype not in _HALF:
                continue
            entry = self._entry(param)
            self._carrying = True
            if entry.acc is None or grad.is_sparse or entry.acc.is_sparse:
                entry.acc = grad.float() if entry.acc is None else entry.acc + grad.float()
            else:
                dst.append(entry.acc)
                src.append(grad)
            param.grad = None
        if dst:
            torch._foreach_add_(dst, src)

    def drop_sums(self) -> None:
        """Forget the fp32 sums carried so far (a window that never stepped: Lightning zeroed its gradients)."""
        if not self._carrying:  # (none carried since the last step took them)
            return
        for entry in self._entries.values():
            entry.acc = None
        self._carrying = False

    def to_(self, device: torch.device) -> None:
        """Keep what the masters hold on ``device``: the CPU when the run ends (Lightning's teardown moves the model and
        the optimizer state there and frees the GPU), the model's device at the next set-up. The values do not change;
        fp32 sums of a window that never stepped are dropped."""
        with torch.no_grad():
            for entry in self._entries.values():
                held = entry.held
                if held is not None and held.device != device:
                    held.data = held.data.to(device)  # (the same object: a master is a Parameter)
        self.drop_sums()
        self._layouts = weakref.WeakKeyDictionary()  # (their stand-ins, aliases and flat buffers stay where they were)

    @property
    def carrying(self) -> bool:
        """Whether fp32 sums of earlier micro-batches may be pending."""
        return self._carrying

    def show_sums(self, params: Iterable[Tensor]) -> list[tuple[Tensor, Tensor, Tensor, int]]:
        """For hooks that read the gradients right after a backward (``on_after_backward``): each half gradient
        shows the window's sum so far (the fp32 sum carried plus this micro-batch's, rounded), as it would without
        master weights. Returns what :meth:`hide_sums` puts back."""
        shown: list[tuple[Tensor, Tensor, Tensor, int]] = []
        with torch.no_grad():
            for param in params:
                grad, entry = param.grad, self._entries.get(id(param))
                if grad is None or entry is None or entry.param is not param or entry.acc is None:
                    continue
                if grad.is_sparse or entry.acc.is_sparse:
                    continue
                total = (entry.acc + grad).to(grad.dtype)
                param.grad = total
                shown.append((param, grad, total, total._version))
        return shown

    def hide_sums(self, shown: list[tuple[Tensor, Tensor, Tensor, int]]) -> None:
        """After those hooks: each half gradient is this micro-batch's own again; one a hook wrote into, replaced or
        set to ``None`` is the window's whole sum so far (its fp32 sum dropped), as it would be without masters."""
        for param, grad, total, version in shown:
            if param.grad is total and total._version == version:
                param.grad = grad
            else:
                self._entries[id(param)].acc = None

    def pending_sums(self) -> list[Tensor]:
        """The fp32 sums carried so far (to be reduced across ranks under DDP's ``no_sync``)."""
        return [e.acc for e in self._entries.values() if e.acc is not None]

    # ------------------------------------------------------------------ the step
    def gather(
        self, optimizer: Optimizer, *, check: bool = False, every: bool = False, taken: bool = False
    ) -> StepRecords:
        """fp32 stand-ins, with fp32 gradients, for ``optimizer``'s half parameters that have a gradient (``every``:
        for all of them, those without a gradient with none yet: an optimizer that evaluates the closure itself, such
        as LBFGS, makes the gradients inside its step).

        The half gradients stay where they are (hooks read them); the fp32 gradient is the half one plus any
        sum carried from earlier micro-batches. Masters are made for parameters that joined since the last step
        and follow the weights where those were written from outside. ``check``: also find inf/NaN in every
        gradient the step would apply (the fp32 ones and those of the other parameters) into ``found``, in one
        multi-tensor kernel (not for sparse gradients, tensor subclasses or several devices: ``found`` stays
        ``None``); ``taken``: figures of the half gradients were taken already (during backward): where they hold
        for the fp32 gradients (``plain``) the pass is left out.

        One routine for every kind and case, on the optimizer's :class:`_Layout` (made once, while it fits): in the
        common case (dense gradients, no sums pending) a handful of passes over lists in C and one multi-tensor copy,
        no Python a parameter; else the fp32 gradients are taken record by record (:meth:`_Layout.record_grads`).
        """
        layout = self._layout(optimizer)
        grads = list(map(_GRAD, layout.half))
        dense = not self._carrying and _all_dense(grads)
        picked = None if dense or every or self._standins_held else layout.picked(grads)
        with torch.no_grad():
            layout.follow_requires_grad()
            self._refresh(layout, picked)
            g32 = layout.dense_grads(grads) if dense else layout.record_grads(grads, picked)
        if self._carrying:
            self._carrying = any(e.acc is not None for e in self._entries.values())
        self._stepping[id(optimizer)] = layout.param_of
        out = layout.step_records(optimizer, grads, picked, dense)
        out.plain = dense
        if check and not (taken and dense):
            out.found = layout.check(g32, dense, self._flags)
        return out

    def _layout(self, optimizer: Optimizer) -> "_Layout":
        """``optimizer``'s layout, made again where it no longer fits (a param group or parameter added or replaced,
        an entry made or dropped, a parameter's storage replaced)."""
        layout = self._layouts.get(optimizer)
        if layout is None or not layout.current(optimizer, self._generation):
            layout = _Layout.build(optimizer, self._entry, self._standin)
            layout.generation = self._generation  # (entries it made moved the generation)
            for entry in layout.entries:  # (stepped from now on: what they hold is no longer the weights as set)
                entry.exact = False
            self._made(layout, [other for opt, other in self._layouts.items() if opt is not optimizer])
            self._layouts[optimizer] = layout
        return layout

    def _standin(self, entry: _Entry) -> nn.Parameter:
        """``entry``'s fp32 stand-in, made with the layout. Here it holds no value between steps: each gather gives
        it the fp32 value (:meth:`_refresh`), the write-back takes it away (these kinds keep no fp32 copy)."""
        return nn.Parameter(torch.empty(0, dtype=torch.float32, device=entry.param.device),
                            requires_grad=entry.param.requires_grad)

    def _made(self, layout: "_Layout", others: list["_Layout"]) -> None:
        """What a kind adds to a new layout (nothing where the stand-ins keep no value between steps); ``others``: the
        other optimizers' layouts."""

    def _refresh(self, layout: "_Layout", picked: Optional[list[int]]) -> None:
        """The stand-ins of the parameters the step takes (``picked``; ``None``: all) get their values: what is held
        follows the weights (:meth:`_resync`), then each stand-in takes its fp32 value (:meth:`_fp32_value`)."""
        entries = layout.entries if picked is None else [layout.entries[i] for i in picked]
        standins = layout.standins if picked is None else [layout.standins[i] for i in picked]
        self._resync(entries)
        for standin, entry in zip(standins, entries):
            standin.data = self._fp32_value(entry)

    @staticmethod
    def expose(records: StepRecords) -> None:
        """Write the fp32 gradients into the half ones, so hooks see the gradient the step will apply."""
        with torch.no_grad():
            for r in records.seen():
                g32 = r.standin.grad
                if g32 is None:  # a hook set the half gradient to None (take_rewritten): nothing to show
                    continue
                grad = r.param.grad
                if grad is None:
                    r.param.grad = g32.to(r.param.dtype)
                else:
                    grad.copy_(g32)
                r.grad_seen = _grad_stamp(r.param)

    @staticmethod
    def take_rewritten(records: StepRecords) -> int:
        """After hooks: half gradients that a hook replaced or wrote into become the fp32 gradients.

        Returns how many.
        """
        unseen = records.unseen
        if unseen is not None:  # (no hook has read the records one by one: compare whole lists, in C)
            grads = list(map(_RECORD_GRAD, records.records))
            versions = [None if g is None else g._version for g in grads]
            if versions == unseen[1] and all(map(operator.is_, grads, unseen[0])):
                return 0  # nothing written since the gather
            if all(g is g0 and g is not None for g, g0 in zip(grads, unseen[0])):  # written in place only
                fp32_grads = list(map(_STANDIN_GRAD, records.records))
                moved = [i for i, (v, v0) in enumerate(zip(versions, unseen[1])) if v != v0]
                fit = [(fp32_grads[i], grads[i]) for i in moved]
                if all(a is not None and a.shape == b.shape and a.device == b.device for a, b in fit):
                    with torch.no_grad():
                        torch._foreach_copy_([fp32_grads[i] for i in moved], [grads[i] for i in moved])
                    records.unseen = (grads, versions)
                    return len(moved)
        changed = 0
        into: list[Tensor] = []  # fp32 gradients there, of the same shape: one multi-tensor copy (clipping wrote all)
        taken: list[Tensor] = []
        with torch.no_grad():
            for r in records.seen():
                now = _grad_stamp(r.param)
                if now != r.grad_seen:
                    grad, g32 = r.param.grad, r.standin.grad
                    if grad is not None and g32 is not None and g32.shape == grad.shape and g32.device == grad.device:
                        into.append(g32)
                        taken.append(grad)
                    else:
                        r.standin.grad = None if grad is None else grad.to(torch.float32)
                    r.grad_seen = now
                    changed += 1
            if into:
                torch._foreach_copy_(into, taken)
        return changed

    @staticmethod
    def swap_in(records: StepRecords) -> None:
        """The fp32 stand-ins take the parameters' places in the param groups, with their optimizer state."""
        records.swap_in()

    @staticmethod
    def swap_out(records: StepRecords) -> None:
        """The parameters get their places and their optimizer state back."""
        records.swap_out()

    @contextlib.contextmanager
    def stepping(self, records: StepRecords) -> Iterator[None]:
        """While the optimizer steps: the fp32 stand-ins take the parameters' places and optimizer state."""
        self.swap_in(records)
        try:
            yield
        finally:
            self.swap_out(records)

    def write_back(self, records: StepRecords, *, skipped: Optional[bool], found_inf: Optional[Tensor] = None) -> None:
        """After the step: write the half weights (nothing changes on a skipped step).

        Args:
            skipped: ``True``/``False`` when known on the host; ``None`` when only the device knows (fused
                optimizers): then ``found_inf`` (non-zero: skipped) decides on the device.
        """
        if skipped is not True:
            with torch.no_grad():
                self._write_step(records, None if skipped is False else found_inf)
        self._end_step(records)
        self._stepping.pop(id(records.optimizer), None)

    def _write_step(self, records: StepRecords, skip_flag: Optional[Tensor]) -> None:
        todo = [r for r in records.records if r.standin.grad is not None]
        if todo:
            self._write(todo, skip_flag)

    def _write(self, records: list[StepRecord], skip_flag: Optional[Tensor]) -> None:
        raise NotImplementedError

    def _end_step(self, records: StepRecords) -> None:
        """After the write-back: the stand-ins' gradients and values go (these kinds keep no fp32 copy between
        steps); the parameters' stamps are taken again (the write bumped their versions)."""
        for r in records.records:
            standin = r.standin
            standin.grad = None
            standin.data = torch.empty(0, dtype=torch.float32, device=standin.device)
            entry = self._entries.get(id(r.param))
            if entry is not None:
                entry.stamp = stamp(r.param)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """One step of a plain training loop: :meth:`gather`, the optimizer's step on the stand-ins, write back."""
        records = self.gather(optimizer)
        with self.stepping(records):
            out = optimizer.step(*args, **kwargs)
        self.write_back(records, skipped=False)
        return out

    # ------------------------------------------------------------------ reading
    def named_params(self) -> dict[str, Tensor]:
        return {self._name(pid): e.param for pid, e in self._entries.items()}

    def _name(self, pid: int) -> str:
        name = self._names.get(pid)
        if name is None:
            name = self._names[pid] = f"param.{len(self._names)}"
        return name

    def param_of(self, tensor: Tensor) -> Optional[Tensor]:
        """The model parameter an fp32 stand-in stands for (inside a step), or ``tensor`` if it is one of ours."""
        for standins in self._stepping.values():  # the steps under way
            param = standins.get(id(tensor))
            if param is not None:
                return param
        entry = self._entries.get(id(tensor))
        return entry.param if entry is not None and entry.param is tensor else None

    def tensors(self) -> list[Tensor]:
        """The tensors held besides the model's own weights (masters or compensation buffers)."""
        return [e.held for e in self._entries.values() if e.held is not None]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors, strings and dicts (``torch.load(weights_only=True)`` reads them)."""
        self._refresh_all()
        return {"kind": self.kind, "dtype": _DTYPE_NAMES.get(self.dtype, str(self.dtype))}

    def _refresh_all(self) -> None:
        self._resync(list(self._entries.values()))
        for entry in self._entries.values():
            entry.stamp = stamp(entry.param)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, keeping only what still fits the model's weights.

        The checkpoint's weights are the truth, parameter by parameter: where a weight is what its saved master
        rounds to, every element (an ordinary resume), the master goes on exactly; where it is not (its weights were
        replaced after the masters were saved: an average written into the checkpoint, an edit, another model's
        weights) the master (or compensation) is derived from the weight, at the precision it was restored with (an
        fp32 value restored into the fp32 model before the cast counts in full, not rounded to half precision; a
        Kahan compensation also needs the weights it was saved with, by their fingerprint). A state of another kind
        is converted through the fp32 values.

        Raises:
            ValueError: when the state is corrupted or names parameters this model does not have.
        """
        if not isinstance(state, dict) or "kind" not in state:
            raise ValueError(f"master-weights state {type(state).__name__} without a 'kind': it is corrupted.")
        if state["kind"] == self.kind:
            self._load_own(state)
        else:
            self.load_fp32_values(fp32_values(state, self.named_params()))

    def _load_own(self, state: dict[str, Any]) -> None:
        pass

    def load_fp32_values(self, values: dict[str, Tensor]) -> int:
        """Take fp32 values of the weights by parameter name where they round to the weights; returns how many.

        For a checkpoint of another kind or of a mixed-precision run. Names not given keep their state.
        """
        return 0

    def _entry_by_name(self) -> dict[str, _Entry]:
        return {self._name(pid): e for pid, e in self._entries.items()}


def _check_names(params: dict[str, Tensor], saved: Any, what: str) -> None:
    """A checkpoint's per-parameter tensors (``saved``, its part ``what``) against the model's ``params`` by name."""
    if not isinstance(saved, dict):
        raise ValueError(
            f"master-weights state: '{what}' is a {type(saved).__name__}, not a dict: it is corrupted."
        )
    unknown = sorted(set(saved) - set(params))
    if unknown:
        raise ValueError(
            f"master-weights state does not fit this model: {what} for unknown parameters {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''}."
            " The checkpoint was written for another model or optimizer set-up."
        )
    for name, tensor in saved.items():
        if not isinstance(tensor, Tensor) or tensor.shape != params[name].shape:
            got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(
                f"master-weights state: {what} of {name!r} is {got}, the parameter is {tuple(params[name].shape)}."
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"master-weights state: {what} of {name!r} holds inf/NaN: the checkpoint is corrupted."
            )


def _upcast_eager_state(optimizer: Optimizer) -> None:
    """State an optimizer made in its constructor from the half parameters (Adagrad's ``sum``) becomes fp32, as the
    state every other optimizer makes at its first step from the fp32 stand-ins: in fp16 an eps-sized accumulator
    underflows, and 0/0 makes the weights NaN. Also the state of the optimizers ``optimizer`` wraps."""
    for state in _states_of(optimizer):
        for param, values in state.items():
            if isinstance(param, Tensor) and param.dtype in _HALF and isinstance(values, dict):
                for key, value in values.items():
                    if isinstance(value, Tensor) and value.dtype == param.dtype and value.shape == param.shape:
                        values[key] = value.float()


#: optimizer -> the optimizers it wraps (found once per optimizer: the swaps read it on every step)
_WRAPPED: "weakref.WeakKeyDictionary[Any, tuple[Any, ...]]" = weakref.WeakKeyDictionary()


def wrapped_optimizers(optimizer: Optimizer) -> tuple[Optimizer, ...]:
    """The optimizers ``optimizer`` wraps over the same parameters (SAM's ``base_optimizer``, Lookahead's
    ``_base_optimizer``), and those they wrap in turn, found once.

    Found among the attributes: torch optimizers, and objects typed by duck as Lightning accepts them (a
    ``param_groups`` list and a ``state`` dict), so a wrapper that is no ``Optimizer`` subclass is looked through
    too."""
    inner = _WRAPPED.get(optimizer)
    if inner is None:
        inner = tuple(_wrapped(optimizer, {id(optimizer)}))
        try:
            _WRAPPED[optimizer] = inner
        except TypeError:  # (an object without weak references: found again at each call)
            pass
    return inner


def _wrapped(optimizer: Any, seen: set[int]) -> Iterator[Any]:
    for value in list(getattr(optimizer, "__dict__", {}).values()):
        if id(value) in seen or not _is_optimizer(value):
            continue
        seen.add(id(value))
        yield value
        yield from _wrapped(value, seen)


def _is_optimizer(value: Any) -> bool:
    if isinstance(value, Optimizer):
        return True
    if isinstance(value, (Tensor, nn.Module, dict, list, tuple, str, int, float)) or value is None:
        return False  # (the common attributes, answered without a look at theirs)
    return isinstance(getattr(value, "param_groups", None), list) and isinstance(getattr(value, "state", None), dict)


def _states_of(optimizer: Optimizer) -> list[dict]:
    """The state of ``optimizer`` and of the optimizers it wraps: all are keyed by the parameters, so all follow a
    swap (read each time: ``load_state_dict`` replaces an optimizer's state dict). Each dict once, also where a
    wrapper's ``state`` is its base optimizer's."""
    own = getattr(optimizer, "state", None)
    states = [own] if isinstance(own, dict) else []
    for inner in wrapped_optimizers(optimizer):
        state = getattr(inner, "state", None)
        if isinstance(state, dict) and not any(state is s for s in states):
            states.append(state)
    return states


def _grad_stamp(param: Tensor) -> Optional[tuple[int, int]]:
    grad = param.grad
    return None if grad is None else (id(grad), grad._version)


def _half_params(optimizer: Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, Tensor) and param.dtype in _HALF:
                yield param


#: the optimizers whose ``load_state_dict`` keeps fp32 state for half parameters (hooked once each), with the handles
#: of their two hooks
_KEEPS_FP32: "weakref.WeakKeyDictionary[Optimizer, tuple[Any, Any]]" = weakref.WeakKeyDictionary()
#: what torch's ``Optimizer.load_state_dict`` reads its hooks from (``Optimizer.__init__`` makes them; a wrapper that
#: never runs it, as timm's Lookahead, has none)
_LOAD_HOOKS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def _keep_state_fp32_on_load(optimizer: Optimizer) -> None:
    """Loading an optimizer state casts it to each parameter's dtype: keep it fp32 for the half parameters.

    The cast is torch's ``Optimizer.load_state_dict``: its load hooks are taken on every optimizer of the chain
    (``optimizer`` and those it wraps) that can run it, which is every one that holds torch's hook dicts. One
    without them (a wrapper that never ran ``Optimizer.__init__``, or no ``Optimizer`` at all) cannot run torch's
    cast on itself: its ``load_state_dict`` hands the state to the optimizers it wraps, which are hooked, or loads
    it without a cast.

    Idempotent. A run of ``MPPlugin`` takes the hooks off again at its end (:func:`release_fp32_state_loading`,
    listed in :mod:`lightning_mp.patches`): afterwards the optimizer loads a state as torch's does.
    """
    for owner in (optimizer, *wrapped_optimizers(optimizer)):
        if isinstance(owner, Optimizer) and owner not in _KEEPS_FP32 and all(
            isinstance(getattr(owner, "__dict__", {}).get(name), dict) for name in _LOAD_HOOKS
        ):
            _KEEPS_FP32[owner] = _hook_fp32_load(owner)


def release_fp32_state_loading(optimizers: Iterable[Optimizer]) -> None:
    """Undo :func:`_keep_state_fp32_on_load` on ``optimizers`` and the optimizers they wrap: their
    ``load_state_dict`` casts the state to each parameter's dtype again, as torch's."""
    for optimizer in optimizers:
        for owner in (optimizer, *wrapped_optimizers(optimizer)):
            handles = _KEEPS_FP32.pop(owner, None) if isinstance(owner, Optimizer) else None
            for handle in handles or ():
                handle.remove()


def _hook_fp32_load(optimizer: Optimizer) -> tuple[Any, Any]:
    swaps: list[tuple[list, int, Tensor, Tensor]] = []

    def before_load(opt: Optimizer, state_dict: dict) -> None:
        for group in opt.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                if isinstance(param, Tensor) and param.dtype in _HALF:
                    # an fp32 stand-in that allocates nothing: only its dtype and device are read
                    stand_in = torch.empty((), dtype=torch.float32, device=param.device).expand(param.shape)
                    params[i] = stand_in
                    swaps.append((params, i, param, stand_in))

    def after_load(opt: Optimizer) -> None:
        # (every state of the chain: param groups shared with a wrapped optimizer were swapped for it too)
        states = _states_of(opt)
        while swaps:
            params, i, param, stand_in = swaps.pop()
            params[i] = param
            for state in states:
                if stand_in in state:
                    state[param] = state.pop(stand_in)

    return (
        optimizer.register_load_state_dict_pre_hook(before_load),
        optimizer.register_load_state_dict_post_hook(after_load),
    )


class _StateMirror:
    """An optimizer's state keyed by the fp32 stand-ins, beside its own (keyed by the parameters): the same
    per-parameter state dicts under the other keys. A step that takes every parameter of the optimizer's layout swaps
    the optimizer's ``state`` for it and back (two attribute writes) where a swap key by key would hash every
    parameter twice a step; either dict is made again from the other where something changed it (the first step's new
    entries, a loaded state, an entry replaced or removed)."""

    def __init__(self, standin_of: dict[int, Tensor], param_of: dict[int, Tensor]) -> None:
        self._standin_of, self._param_of = standin_of, param_of
        self._own: Optional[defaultdict] = None  # the optimizer's own state dict, as the mirror last saw it
        self._alt: Optional[defaultdict] = None  # the stand-ins' state dict
        self._keys: list[int] = []  # ids of the own dict's keys and of the values (the same in both dicts)
        self._values: list[int] = []

    def standins_keyed(self, own: defaultdict) -> defaultdict:
        """The state to step the stand-ins with, for the optimizer's state ``own``."""
        alt = self._alt
        if own is not self._own or alt is None or list(map(id, own.values())) != self._values \
                or list(map(id, own)) != self._keys:
            alt = self._alt = _rekeyed(defaultdict(dict), own, self._standin_of)
            self._own = own
            self._note(own)
        return alt

    def params_keyed(self, alt: defaultdict) -> defaultdict:
        """The optimizer's own state after a step that used ``alt`` (its entries follow where the step changed them)."""
        own = self._own
        if alt is not self._alt or own is None or list(map(id, alt.values())) != self._values:
            if own is None or alt is not self._alt:
                own = defaultdict(dict)
            own.clear()  # (the same object: whoever holds the optimizer's state dict keeps it)
            self._own = _rekeyed(own, alt, self._param_of)
            self._alt = alt
            self._note(own)
        return own

    def _note(self, own: dict) -> None:
        self._keys, self._values = list(map(id, own)), list(map(id, own.values()))


def _rekeyed(into: defaultdict, state: dict, keys: dict[int, Tensor]) -> defaultdict:
    """``into`` filled with ``state``'s entries, each under ``keys[id(key)]`` where there is one (else its own key)."""
    for key, value in state.items():
        into[keys.get(id(key), key)] = value
    return into


_VERSION = operator.attrgetter("_version")
#: a record's half gradient and its stand-in's fp32 gradient
_RECORD_GRAD, _STANDIN_GRAD = operator.attrgetter("param.grad"), operator.attrgetter("standin.grad")
_SET_GRAD = cast(Any, Tensor.grad).__set__
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_LAYOUT = operator.attrgetter("layout")
_DENSE_TYPES, _STRIDED, _PLAIN = {Tensor}, {torch.strided}, (Tensor, nn.Parameter)


def _all_dense(grads: list[Optional[Tensor]]) -> bool:
    """Whether every gradient is a plain dense tensor (two passes in C: the common case of a step)."""
    return set(map(type, grads)) == _DENSE_TYPES and set(map(_LAYOUT, grads)) == _STRIDED


@dataclass
class _Layout:
    """One optimizer's half parameters as :meth:`MasterWeights.gather` takes them, made at its first step and kept
    while the parameter set, the entries and the parameters' storages stay: in param-group order, with their
    entries, their fp32 stand-ins and step records (both reused step after step), each param group's list with the
    stand-ins in the half parameters' places, and the state mirror. Where the stand-ins are the fp32 masters
    (:class:`FP32MasterWeights`) also aliases of the weights and masters for the write-back and, in small layouts,
    flat buffers (:meth:`flatten`)."""

    half: list[Tensor]
    entries: list[_Entry]
    records: list[StepRecord]
    standins: list[nn.Parameter]  # the records' stand-ins, in the order of ``half``
    param_of: dict[int, Tensor]  # id(stand-in) -> half param
    others: list[Tensor]  # the optimizer's other parameters: their gradients join the check
    #: each param group's params list, a copy of it, and the same with the stand-ins in the half parameters' places
    groups: list[tuple[list, list, list]]
    mirror: _StateMirror
    #: whether the optimizer wraps others (SAM's ``base_optimizer``): their state follows key by key
    wraps: bool
    device: Optional[torch.device]  # the half parameters' one device (``None``: several, or none)
    total: int  # their elements
    #: their storages when made, where every one is a plain strided tensor (``None``: not; no aliases, no flat buffers)
    ptrs: Optional[list[int]]
    generation: int = -1  # the masters' generation of entries it was made for
    requires_grad: list[bool] = field(default_factory=list)  # the stand-ins' flags, as last set
    #: the write-back's aliases (:meth:`alias`): the weights' ``.data`` (written without a version bump), the masters'
    dst: Optional[list[Tensor]] = None
    src: Optional[list[Tensor]] = None
    #: small layouts (:data:`FLAT_GRADS_MAX_NUMEL`): the fp32 gradients' flat buffer and its views, one a parameter
    #: (kept on the masters as their ``.grad`` from step to step)
    flat: Optional[Tensor] = None
    views: Optional[list[Tensor]] = None
    #: with ``flat``: the masters' own flat buffer (their ``.data`` are views of it), and the weights as flat views
    mflat: Optional[Tensor] = None
    flat_half: Optional[list[Tensor]] = None
    #: with ``flat`` but not ``mflat`` (masters another optimizer's layout steps too, which stay where they are): the
    #: masters as flat views of their own storages, and the elements of each
    mviews: Optional[list[Tensor]] = None
    sizes: Optional[list[int]] = None

    @classmethod
    def build(
        cls, optimizer: Optimizer, entry_of: Callable[[Tensor], _Entry], standin_of: Callable[[_Entry], nn.Parameter]
    ) -> "_Layout":
        """The layout of ``optimizer``'s param groups now: each half parameter's entry and stand-in, as given."""
        half, entries, records, others, groups = [], [], [], [], []
        for group in optimizer.param_groups:
            params = group["params"]
            stepped = list(params)
            for i, param in enumerate(params):
                if not (isinstance(param, Tensor) and param.dtype in _HALF):
                    others.append(param)
                    continue
                entry = entry_of(param)
                standin = stepped[i] = standin_of(entry)
                half.append(param)
                entries.append(entry)
                records.append(StepRecord(params, i, param, standin))
            groups.append((params, list(params), stepped))
        standins = [r.standin for r in records]
        param_of = {id(s): p for s, p in zip(standins, half)}
        devices = {p.device for p in half}
        plain = all(type(p) in _PLAIN and p.layout is torch.strided for p in half)
        return cls(
            half=half, entries=entries, records=records, standins=standins, param_of=param_of, others=others,
            groups=groups, mirror=_StateMirror({id(p): s for p, s in zip(half, standins)}, param_of),
            wraps=bool(wrapped_optimizers(optimizer)), device=devices.pop() if len(devices) == 1 else None,
            total=sum(p.numel() for p in half), ptrs=[p.data_ptr() for p in half] if plain else None,
        )

    def current(self, optimizer: Optimizer, generation: int) -> bool:
        """Whether the layout still fits: the same entries, param group lists and parameters, and storages."""
        return self.generation == generation and self.fits(optimizer) and (
            self.ptrs is None or list(map(Tensor.data_ptr, self.half)) == self.ptrs
        )

    def fits(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s param groups still hold the lists and parameters this layout was made for."""
        groups = optimizer.param_groups
        if len(groups) != len(self.groups):
            return False
        for group, (params, own, _) in zip(groups, self.groups):
            if group["params"] is not params or len(params) != len(own) or not all(map(operator.is_, params, own)):
                return False
        return True

    def flatten(self, *, masters: bool = True) -> None:
        """Layouts of contiguous parameters on one device: up to :data:`FLAT_GRADS_MAX_NUMEL` elements the fp32
        gradients in one flat buffer kept from step to step (views of it, made once, are the stand-ins' gradients: no
        allocation a step, and the check reads one tensor), and up to :data:`FLAT_FOLLOW_MAX_NUMEL` the stand-ins'
        values in another (their ``.data`` become views of
        it: following the weights is four kernels for all of them; with ``masters=False`` their storages stay, and
        following reads them through flat views, :attr:`mviews`). For stand-ins that keep their values between steps
        (the fp32 masters): the kinds that keep no fp32 copy keep no fp32 gradients either."""
        half, device = self.half, self.device
        if (self.ptrs is None or device is None or self.total > FLAT_FOLLOW_MAX_NUMEL
                or not all(p.is_contiguous() for p in half)):  # (a view is contiguous)
            return
        sizes = [p.numel() for p in half]
        if self.total <= FLAT_GRADS_MAX_NUMEL:
            self.flat = torch.empty(self.total, dtype=torch.float32, device=device)
            self.views = [v.view(p.shape) for v, p in zip(self.flat.split(sizes), half)]
        if any(s.device != device for s in self.standins):
            return  # a master on another device: no flat masters
        if not masters:
            if all(s.is_contiguous() for s in self.standins):
                self.mviews, self.sizes = [s.detach().view(-1) for s in self.standins], sizes
                self.flat_half = [p.detach().view(-1) for p in half]
            return
        mflat = torch.empty(self.total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for standin, piece, p in zip(self.standins, mflat.split(sizes), half):
                piece = piece.view(p.shape)
                piece.copy_(standin.detach())
                standin.data = piece  # (the same Parameter objects)
        self.mflat, self.flat_half = mflat, [p.detach().view(-1) for p in half]

    def alias(self) -> None:
        """The write-back's aliases, where the storages are watched (:attr:`ptrs`): taken after :meth:`flatten`,
        which moves the stand-ins' values."""
        if self.ptrs is not None:
            self.dst, self.src = [p.data for p in self.half], [s.data for s in self.standins]

    # ------------------------------------------------------------------ a step
    def follow_requires_grad(self) -> None:
        """The stand-ins' ``requires_grad`` as the parameters' (frozen and unfrozen layers)."""
        requires_grad = list(map(_REQUIRES_GRAD, self.half))
        if requires_grad != self.requires_grad:
            for standin, flag in zip(self.standins, requires_grad):
                standin.requires_grad_(flag)
            self.requires_grad = requires_grad

    def picked(self, grads: list[Optional[Tensor]]) -> Optional[list[int]]:
        """The half parameters a step takes: those with a gradient or an fp32 sum (``None``: all of them)."""
        entries = self.entries
        picked = [i for i, grad in enumerate(grads) if grad is not None or entries[i].acc is not None]
        return None if len(picked) == len(grads) else picked

    def dense_grads(self, grads: list[Tensor]) -> list[Tensor]:
        """The common case's fp32 gradients: every half gradient dense, no sums pending. One multi-tensor copy into
        the flat buffer's views (small layouts; they stay on the stand-ins from step to step), else into gradients
        allocated for the step (freed after it)."""
        views = self.views
        g32 = views if views is not None else [torch.empty_like(grad, dtype=torch.float32) for grad in grads]
        torch._foreach_copy_(g32, grads)
        if views is None or not all(map(operator.is_, map(_GRAD, self.standins), g32)):
            # (every step where a master is in two optimizers' layouts: each step gives it its own gradient)
            collections.deque(map(_SET_GRAD, self.standins, g32), maxlen=0)
        return g32

    def record_grads(self, grads: list[Optional[Tensor]], picked: Optional[list[int]]) -> list[Optional[Tensor]]:
        """The fp32 gradients record by record, where the common case does not hold (``picked``: the records the
        step takes; ``None``: all): a parameter without a gradient has its fp32 sum or none, a sum of earlier
        micro-batches takes the half gradient, a sparse gradient is cast; the dense ones in one multi-tensor copy."""
        views, dst, src, out = self.views, [], [], []
        for i in range(len(grads)) if picked is None else picked:
            entry, grad = self.entries[i], grads[i]
            acc, entry.acc = entry.acc, None
            if grad is None:
                g32 = acc  # (None: no gradient (yet))
            elif acc is not None:
                g32 = acc.add_(grad)
            elif grad.is_sparse or grad.layout is not torch.strided:
                g32 = grad.to(torch.float32)
            else:
                g32 = views[i] if views is not None and type(grad) is Tensor else torch.empty_like(
                    grad, dtype=torch.float32
                )
                dst.append(g32)
                src.append(grad)
            self.standins[i].grad = g32
            out.append(g32)
        if dst:
            torch._foreach_copy_(dst, src)
        return out

    def step_records(
        self, optimizer: Optimizer, grads: list[Optional[Tensor]], picked: Optional[list[int]], dense: bool
    ) -> StepRecords:
        """The step's records (the layout's own list where the step takes every parameter), with the half gradients'
        versions for ``grad_seen``."""
        records = self.records
        if picked is not None:
            records, grads = [records[i] for i in picked], [grads[i] for i in picked]
        versions = list(map(_VERSION, grads)) if dense else [None if g is None else g._version for g in grads]
        return StepRecords(optimizer, records, self, unseen=(grads, versions))

    def check(self, g32: Sequence[Optional[Tensor]], dense: bool, flags: ZeroFlags) -> Optional[Tensor]:
        """1.0 where a gradient the step would apply (``g32`` and the other parameters') holds an inf/NaN, in one
        multi-tensor kernel; ``None`` where that is not possible here (a sparse gradient or one of a tensor subclass,
        several devices): the step checks them itself."""
        if dense:
            checked = [self.flat] if self.flat is not None else cast(list[Tensor], list(g32))
            numel = self.total
        else:
            checked = [g for g in g32 if g is not None]
            if any(type(g) is not Tensor or g.is_sparse for g in checked):
                return None
            numel = sum(g.numel() for g in checked)
        if self.device is None and self.half:
            return None  # several devices
        others = self._other_grads()
        if others is None:
            return None
        per_dtype = {torch.float32: checked} if checked else {}
        for grad in others:
            per_dtype.setdefault(grad.dtype, []).append(grad)
            numel += grad.numel()
        device = self.device if self.device is not None else others[0].device if others else None
        if device is None or not per_dtype:
            return None  # no gradient at all
        found = flags.take(device)
        check_tensors_(per_dtype, numel, found)
        return found

    def _other_grads(self) -> Optional[list[Tensor]]:
        """The other parameters' gradients, for the check (``None``: one it cannot take: sparse, of a tensor
        subclass, or on another device)."""
        grads = [g for g in (getattr(p, "grad", None) for p in self.others) if g is not None]
        device = self.device if self.device is not None else grads[0].device if grads else None
        if any(type(g) is not Tensor or g.is_sparse or g.device != device for g in grads):
            return None
        return grads

    def swap_in(self, optimizer: Optimizer) -> bool:
        """The stand-ins and their state take the parameters' places: each param group's list is rewritten in place
        (an optimizer may hold the list itself: LBFGS), the state dict swapped whole. ``False``: not possible here,
        nothing done (a param group's list changed since the gather, the state is not torch's dict, or the optimizer
        wraps another whose state would have to follow)."""
        if self.wraps or type(optimizer.state) is not defaultdict or not self.fits(optimizer):
            return False
        for params, _, stepped in self.groups:
            params[:] = stepped
        optimizer.state = self.mirror.standins_keyed(optimizer.state)
        return True

    def swap_out(self, optimizer: Optimizer) -> None:
        for params, own, _ in self.groups:
            params[:] = own
        optimizer.state = self.mirror.params_keyed(optimizer.state)


class FP32MasterWeights(MasterWeights):
    """fp32 master copies that the optimizer steps; half weights are written from them after each step.

    The masters are the stand-ins, kept from step to step: every step takes all of an optimizer's half parameters
    (one without a gradient stands in unmoved), so the layout's lists and state swap whole, and the weights are
    written back through aliases in one multi-tensor copy. Small layouts keep the fp32 gradients and the masters in
    flat buffers (:meth:`_Layout.flatten`): following the weights is four kernels, the check reads one tensor.
    """

    kind = "fp32"
    _standins_held = True

    def to_(self, device: torch.device) -> None:
        for entry in self._entries.values():
            cast(nn.Parameter, entry.held).grad = None  # (the layouts' gradient views: their buffer goes too)
        super().to_(device)

    def _made(self, layout: _Layout, others: list[_Layout]) -> None:
        # a master another optimizer steps too (a weight in two optimizers: an encoder shared by two heads) keeps its
        # storage: the other layout's aliases (the write-back's, its flat masters) read it, and both optimizers must
        # step the one master. Such a layout leaves its masters where they are (followed through flat views), so the
        # storage of a master never moves while two layouts hold it
        held = {id(s) for other in others for s in other.standins}
        layout.flatten(masters=not any(id(s) in held for s in layout.standins))
        layout.alias()

    def _refresh(self, layout: _Layout, picked: Optional[list[int]]) -> None:
        self._resync_layout(layout)  # (the masters are the stand-ins; every step takes all of them)

    def _write_step(self, records: StepRecords, skip_flag: Optional[Tensor]) -> None:
        # (on a step skipped on the device the masters did not move: the copy writes the same values; a master
        # without a gradient did not move either, and its weight is its rounding already)
        layout = records.layout
        if layout.dst is None:
            super()._write_step(records, skip_flag)
        elif layout.dst:
            torch._foreach_copy_(layout.dst, cast(list, layout.src))

    def _end_step(self, records: StepRecords) -> None:
        """The step's fp32 gradients go, but for the flat buffer's views, kept on the masters from step to step.
        (The weights were written through ``.data``: their version counters, and so the entries' stamps, are
        unchanged.)"""
        standins, views = records.layout.standins, records.layout.views
        if views is None:
            for standin in standins:
                standin.grad = None
        elif not all(map(operator.is_, map(_GRAD, standins), views)):
            for standin, view in zip(standins, views):
                if standin.grad is not view:
                    standin.grad = None

    def _new_held(self, param: Tensor, original: Optional[Tensor]) -> Tensor:
        if original is not None:
            # the original itself becomes the master (no copy where it already sits on the device)
            value = original.to(device=param.device, dtype=torch.float32)
        else:
            value = param.detach().to(torch.float32, copy=True)
        return nn.Parameter(value, requires_grad=param.requires_grad)

    def _resync(self, entries: Sequence[_Entry]) -> None:
        with torch.no_grad():
            for entry in entries:
                weight, master = entry.param.detach(), cast(Tensor, entry.held).detach()
                # (after fit, Lightning's teardown moves the model to the CPU; the masters stay where they are)
                weight = weight if weight.device == master.device else weight.to(master.device)
                follow_weight_(master, weight)

    def _resync_layout(self, layout: _Layout) -> None:
        """:meth:`_resync` for a layout: with its masters in one flat buffer, four kernels for all of them; with
        masters another layout keeps (:attr:`_Layout.mviews`), a copy of them in one buffer and one copy back."""
        if layout.flat_half is None:
            self._resync(layout.entries)
            return
        weights = torch.cat(layout.flat_half)  # (one kernel: a copy of the weights cast would be one per weight)
        masters = layout.mflat if layout.mflat is not None else torch.cat(cast(list, layout.mviews))
        torch.where(masters.to(weights.dtype).eq(weights), masters, weights, out=masters)
        if layout.mflat is None:
            torch._foreach_copy_(cast(list, layout.mviews), masters.split(cast(list, layout.sizes)))

    def _known(self, entry: _Entry) -> Tensor:
        held = cast(Tensor, entry.held).detach()
        return held.clone() if self._as_set(entry) else entry.param.detach().to(held.device, torch.float32)

    def _standin(self, entry: _Entry) -> nn.Parameter:
        held = cast(nn.Parameter, entry.held)  # the fp32 kind's masters are Parameters (_new_held)
        held.requires_grad_(entry.param.requires_grad)
        return held

    def master_of(self, param: nn.Parameter) -> Optional[Tensor]:
        """The fp32 master of a model parameter (``None`` if it has none, e.g. inside an FP32 guard)."""
        entry = self._entries.get(id(param))
        if entry is None or entry.param is not param:
            return None
        self._resync([entry])
        entry.stamp = stamp(param)
        return entry.held

    def _write(self, records: list[StepRecord], skip_flag: Optional[Tensor]) -> None:
        # on a step skipped on the device the masters did not move: the copy writes the same values
        torch._foreach_copy_([r.param.data for r in records], [r.standin.data for r in records])

    def broadcast_(self, src: int = 0) -> None:
        """Give every rank ``src``'s masters (DDP broadcasts rank 0's weights when it wraps the model)."""
        for entry in self._entries.values():
            torch.distributed.broadcast(cast(Tensor, entry.held).data, src=src)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["masters"] = {self._name(pid): cast(Tensor, e.held).detach() for pid, e in self._entries.items()}
        return state

    def _load_own(self, state: dict[str, Any]) -> None:
        saved: Any = state.get("masters")  # checked by _check_names
        _check_names(self.named_params(), saved, "masters")
        self.load_fp32_values(saved)

    def load_fp32_values(self, values: dict[str, Tensor]) -> int:
        def take(held: Tensor, param: Tensor, value: Tensor, known: Tensor, fits: bool) -> None:
            held.copy_(value if fits else known)

        return _take_fp32_values(self._entry_by_name(), values, self._known, take)


class KahanCompensation(MasterWeights):
    """Half weights plus a half-precision buffer holding each weight's rounding error, added back at the next step."""

    kind = "kahan"

    def _new_held(self, param: Tensor, original: Optional[Tensor]) -> Tensor:
        comp = torch.zeros_like(param, memory_format=torch.preserve_format)
        if original is not None:
            comp.copy_(original.to(param.device, torch.float32) - param.detach().float())
            _no_tie_(param.detach(), comp)  # (what rounding dropped, rounded onto half an ulp: kept just below)
        return comp

    def _resync(self, entries: Sequence[_Entry]) -> None:
        # a compensation that no longer rounds away against its weight belongs to a value the weight no longer has
        # (written since): it goes. Where it still does it is kept (a weight written with the value it had; a write
        # that moved a value by less than its compensation's half ulp, which leaves an error below the weight's own)
        with torch.no_grad():
            for entry in entries:
                weight, comp = entry.param.detach(), cast(Tensor, entry.held)
                back = weight.float().add_(comp.float()).to(weight.dtype)
                comp.masked_fill_(back.ne(weight), 0)

    def _fp32_value(self, entry: _Entry) -> Tensor:
        return entry.param.detach().float().add_(cast(Tensor, entry.held))

    def _write(self, records: list[StepRecord], skip_flag: Optional[Tensor]) -> None:
        params = [r.param for r in records]
        values = [r.standin.detach() for r in records]
        comps = [cast(Tensor, self._entries[id(p)].held) for p in params]
        if skip_flag is None:
            torch._foreach_copy_(params, values)  # the value rounded to half precision
            torch._foreach_sub_(values, params)  # exact in fp32: the value and its rounding are within an ulp
            torch._foreach_copy_(comps, values)
            for param, comp in zip(params, comps):
                _no_tie_(param, comp)
            return
        skip = skip_flag.reshape(()).ne(0)  # skipped on the device: keep both as they were
        for param, value, comp in zip(params, values, comps):
            new = value.to(param.dtype)
            err = value.sub(new).to(param.dtype)
            param.copy_(torch.where(skip, param, new))
            comp.copy_(torch.where(skip, comp, err))
            _no_tie_(param, comp)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["compensation"] = {self._name(pid): e.held for pid, e in self._entries.items()}
        # which weights each compensation belongs to: a weight edited in the checkpoint drops its compensation
        state["weights_fingerprint"] = {self._name(pid): _fingerprint(e.param) for pid, e in self._entries.items()}
        return state

    def _load_own(self, state: dict[str, Any]) -> None:
        saved: Any = state.get("compensation")  # checked by _check_names
        _check_names(self.named_params(), saved, "compensation")
        prints = state.get("weights_fingerprint") or {}
        with torch.no_grad():
            for name, entry in self._entry_by_name().items():
                if name in saved:
                    fits = _fits_fingerprint(entry.param, prints.get(name))
                    held, as_set = cast(Tensor, entry.held), self._as_set(entry)
                    # the weights as set, where known (see _as_set), hold what rounding dropped from values saved
                    # with more than half precision (an fp32 average in the checkpoint's weights): then that
                    # remainder is theirs; the saved compensation is theirs where the weights are half values and
                    # the ones it was saved with
                    if fits and not (as_set and bool(held.ne(0).any())):
                        held.copy_(saved[name])
                    elif not as_set:
                        held.zero_()
                    entry.stamp, entry.exact = stamp(entry.param), False

    def load_fp32_values(self, values: dict[str, Tensor]) -> int:
        def take(held: Tensor, param: Tensor, value: Tensor, known: Tensor, fits: bool) -> None:
            held.copy_((value if fits else known) - param.detach().to(held.device, torch.float32))
            _no_tie_(param.detach().to(held.device), held)

        return _take_fp32_values(self._entry_by_name(), values, self._known, take)


def _take_fp32_values(
    entries: dict[str, _Entry],
    values: dict[str, Tensor],
    known: Callable[[_Entry], Tensor],
    take: Callable[[Tensor, Tensor, Tensor, Tensor, bool], None],
) -> int:
    """:meth:`MasterWeights.load_fp32_values` for the kinds that hold a tensor a parameter: where the weight
    (``known(entry)``: as precisely as it is known, :meth:`MasterWeights._known`) is what the value rounds to, every
    element, the value (an ordinary resume: the exact fp32 masters go on); elsewhere the weight was set after the
    value was saved (an average or an edit in the checkpoint's weights, other weights loaded) and is the truth, at
    its own precision (an element an average left where it was is the average's too). ``take(held, param, value,
    known, fits)`` writes what is held; returns how many values were taken."""
    taken = 0
    with torch.no_grad():
        for name, entry in entries.items():
            value = values.get(name)
            if value is None:
                continue
            held = cast(Tensor, entry.held)
            value = value.to(held.device, torch.float32)
            now = known(entry).to(held.device)
            # (an fp32 weight finer than half precision never equals a rounded value)
            fits = bool(value.to(entry.param.dtype).float().eq(now).all())
            take(held, entry.param, value, now, fits)
            taken += fits
            entry.stamp, entry.exact = stamp(entry.param), False
    return taken


def _fingerprint(param: Tensor) -> Tensor:
    """Two float64 sums (of the values and their squares) that tell a weight from an edited one."""
    values = param.detach().double()
    return torch.stack((values.sum(), values.square().sum())).cpu()


def _fits_fingerprint(param: Tensor, saved: Any) -> bool:
    """Whether ``param`` is the weight a saved fingerprint was taken of (no fingerprint saved: taken to be)."""
    return not isinstance(saved, Tensor) or torch.equal(_fingerprint(param), saved.cpu())


def _no_tie_(param: Tensor, comp: Tensor) -> None:
    """A compensation rounded (to half precision) onto exactly half an ulp of its weight makes ``weight + comp`` a
    tie, which rounds to the even neighbour: a step that changes nothing would move the weight. Pull such a
    compensation one step toward zero, so the weight plus compensation always rounds back to the weight."""
    back = (param.float() + comp.float()).to(param.dtype)
    comp.copy_(torch.where(back.ne(param), torch.nextafter(comp, torch.zeros_like(comp)), comp))


class NoiseGenerators:
    """The stochastic-rounding noise's generators, one a device, seeded with ``seed`` (alike on every rank, so
    data-parallel replicas round alike) and saved in checkpoints. A step a fused optimizer may have skipped on the
    device (:meth:`before_noise` with its flag) is rewound once its verdict reaches the host (:meth:`settle`: at the
    next step, or a save). Used by the stochastic-rounding master weights and by ``optimizer_states="bf16"``."""

    def __init__(self, seed: int = STOCHASTIC_ROUNDING_SEED) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        # the generators' states before the noise of a step that may have been skipped, and its verdict on the way
        self._pending: Optional[dict[str, Tensor]] = None
        self._verdict = HostCopy()

    def __getstate__(self) -> dict[str, Any]:  # (pickled mid-fit: a verdict on its way is not)
        state = dict(self.__dict__)
        state["_verdict"], state["_pending"] = HostCopy(), None
        return state

    def generator(self, device: torch.device) -> torch.Generator:
        """The noise's generator on ``device``."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def before_noise(self, found_inf: Optional[Tensor]) -> None:
        """Noise is about to be drawn for a step skipped on the device where ``found_inf`` is non-zero (``None``: a
        step the host knows was taken): remember the generators, to rewind them if it was skipped."""
        self.settle()
        if found_inf is not None:
            self._pending = {key: g.get_state() for key, g in self._generators.items()}
            self._verdict.start(found_inf.reshape(()).ne(0))

    def settle(self) -> None:
        """Rewind the generators past a step that turned out to be skipped on the device."""
        states, self._pending = self._pending, None
        if states is None or not self._verdict.value():
            return
        for key in list(self._generators):
            if key in states:
                self._generators[key].set_state(states[key])
            else:
                del self._generators[key]  # created by the skipped step: starts afresh from the seed

    def state_dict(self) -> dict[str, Any]:
        """The seed and the generators' states (plain tensors)."""
        self.settle()
        return {"seed": self.seed, "generators": {key: g.get_state() for key, g in self._generators.items()}}

    def load_state_dict(self, state: dict[str, Any], corrupted: str) -> None:
        """Take a checkpoint's seed and generators' states (``corrupted``: the error's message when ``generators`` is
        not a dict); a CUDA generator's state is left where there is no CUDA."""
        self._pending = None
        generators = state.get("generators", {})
        if not isinstance(generators, dict):
            raise ValueError(corrupted)
        self.seed = int(state.get("seed", self.seed))
        for key in set(self._generators) - set(generators):  # (none saved yet: the noise starts afresh from the seed)
            del self._generators[key]
        for key, gen_state in generators.items():
            device = torch.device(key)
            if device.type == "cuda" and not torch.cuda.is_available():
                continue
            self.generator(device).set_state(gen_state)


class StochasticRounding(MasterWeights):
    """Half weights only; each updated weight is rounded to half precision stochastically."""

    kind = "stochastic"

    def __init__(self, seed: int = STOCHASTIC_ROUNDING_SEED) -> None:
        super().__init__()
        self.noise = NoiseGenerators(seed)

    @property
    def seed(self) -> int:
        return self.noise.seed

    def generator(self, device: torch.device) -> torch.Generator:
        """The rounding noise's generator on ``device`` (seeded with ``seed``; saved in checkpoints)."""
        return self.noise.generator(device)

    def _write(self, records: list[StepRecord], skip_flag: Optional[Tensor]) -> None:
        # skipped on the device: the stand-in still holds the old weight exactly, which rounds to itself, but the
        # noise drawn for it must not count: rewound once the verdict reaches the host
        self.noise.before_noise(skip_flag)
        for r in records:
            r.param.copy_(stochastic_round(r.standin.detach(), r.param.dtype, self.generator(r.param.device)))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(self.noise.state_dict())
        return state

    def _load_own(self, state: dict[str, Any]) -> None:
        self.noise.load_state_dict(state, "master-weights state: 'generators' is not a dict: it is corrupted.")
        for entry in self._entries.values():
            entry.stamp = stamp(entry.param)


def fp32_values(state: dict[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The fp32 weights a master-weights state stands for, by parameter name (``params``: the current weights)."""
    kind = state.get("kind")
    if kind == "fp32" and isinstance(state.get("masters"), dict):
        return dict(state["masters"])
    if kind == "kahan" and isinstance(state.get("compensation"), dict):
        # a compensation belongs to the weights it was saved with: not to weights written since (an average or an
        # edit in the checkpoint's weights), which its fingerprint tells
        prints = state.get("weights_fingerprint")
        prints = prints if isinstance(prints, dict) else {}
        return {
            name: params[name].detach().float() + comp.to(params[name].device, torch.float32)
            for name, comp in state["compensation"].items()
            if name in params and isinstance(comp, Tensor) and comp.shape == params[name].shape
            and _fits_fingerprint(params[name], prints.get(name))
        }
    return {}


#: the parts of a master-weights state keyed by parameter name (the kinds' ``state_dict``)
_PER_PARAMETER = ("masters", "compensation", "weights_fingerprint")


def without_parameters(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A master-weights state less the entries of ``names`` (in each part keyed by parameter name)."""
    if not names:
        return state
    return {
        key: {n: v for n, v in value.items() if n not in names} if key in _PER_PARAMETER else value
        for key, value in state.items()
    }


_KINDS = {"fp32": FP32MasterWeights, "kahan": KahanCompensation, "stochastic": StochasticRounding}


def make_master_weights(kind: str) -> Optional[MasterWeights]:
    """A new, empty :class:`MasterWeights` of ``kind`` (``None`` for ``"none"`` and ``"optimizer"``)."""
    kind = parse_master_weights(kind)
    return _KINDS[kind]() if kind in _KINDS else None


def attach_master_weights(
    optimizers: Union[Optimizer, Sequence[Optimizer]],
    kind: str = "fp32",
    *,
    module: Optional[nn.Module] = None,
    existing: Optional[MasterWeights] = None,
) -> Optional[MasterWeights]:
    """Keep the precision of ``optimizers``' half-precision parameters' updates (the optimizers do not change).

    ``module`` names the parameters (for checkpoints). ``existing`` (of the same kind) is reused, so masters made
    earlier for the same parameters keep their low bits. Returns ``None`` for ``"none"`` and ``"optimizer"``.

    Example::

        masters = attach_master_weights(optimizer, "kahan", module=model)
    """
    kind = parse_master_weights(kind)
    if not cast(MasterKind, MasterKind.of(kind)).ours:
        return None
    masters = existing if existing is not None and existing.kind == kind else _KINDS[kind]()
    # (one optimizer: a torch optimizer, or one typed by duck as Lightning accepts it)
    single = isinstance(optimizers, Optimizer) or hasattr(optimizers, "param_groups")
    for optimizer in [optimizers] if single else cast(Sequence[Optimizer], optimizers):
        masters.attach(cast(Optimizer, optimizer), module)
    return masters


def keeps_own_masters(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` keeps fp32 master weights of half-precision parameters itself.

    Fused Adam implementations that keep fp32 masters (``FusedAdam(master_weights=True)``) say so with a
    ``master_weights`` attribute; a LightningOptimizer is looked through.
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return getattr(optimizer, "master_weights", False) is True


def seed_optimizer_masters(optimizer: Optimizer) -> int:
    """Start the masters of an optimizer that keeps its own (:func:`keeps_own_masters`) from the exact fp32 weights.

    Uses the fp32 values :func:`cast_module_` replaced, where the parameter still holds them cast, and Transformer
    Engine's ``FusedAdam`` API (``initialize_state``/``set_scaled_state``); optimizers without it, or storing its
    masters as 16-bit remainders of the half weights, start from the half weights (returns 0). Returns how many
    masters were seeded.
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    init = getattr(optimizer, "initialize_state", None)
    set_state = getattr(optimizer, "set_scaled_state", None)
    if not (callable(init) and callable(set_state)) or getattr(optimizer, "store_param_remainders", False):
        return 0
    seeded = 0
    for param in _half_params(optimizer):
        value = fp32_original(param)
        if value is None:
            continue  # no fp32 original, or the weight changed since it was cast: its own value is the truth
        if not optimizer.state.get(param):
            init(param, False)
        set_state(param, "master_param", value.to(device=param.device, dtype=torch.float32))
        forget_fp32_original(param)
        seeded += 1
    return seeded
